"""The compiled accelerators only: every piece of metadata lives in pyproject.toml.

Both extensions are optional: where one does not compile the package installs anyway.

- ``arrow_outputs._speedups`` (C, the Python headers only): the codec's walks; without it
  the package runs their pure-Python twin, ``arrow_outputs._pyspeedups``.
- ``arrow_outputs._arrowbridge`` (C++, against the pyarrow being built with): hands the C
  decode walk a batch's buffers without pyarrow's export; without it (or when pyarrow later
  changes version) the walk reads pyarrow's export instead, for the same result.

CI sets ``ARROW_OUTPUTS_REQUIRE_SPEEDUPS=1`` so that a failed compile fails the build instead
of falling back quietly.
"""

import glob
import os
import sys

from setuptools import Extension, setup

REQUIRED = os.environ.get("ARROW_OUTPUTS_REQUIRE_SPEEDUPS") == "1"


def _arrow_library(directory: str, name: str) -> str | None:
    """The path of pyarrow's bundled ``lib<name>`` under its soname (libarrow.so.2600): the
    wheel ships no unversioned link name to link with ``-l``."""
    pattern = f"lib{name}.*.dylib" if sys.platform == "darwin" else f"lib{name}.so.*"
    found = sorted(glob.glob(os.path.join(directory, pattern)), key=len)
    return found[0] if found else None


def _arrow_view() -> list[Extension]:
    try:
        import pyarrow
    except ImportError:
        if REQUIRED:
            raise
        return []
    directory = os.path.dirname(pyarrow.__file__)
    libraries = [_arrow_library(directory, name) for name in ("arrow", "arrow_python")]
    if None in libraries or not sys.platform.startswith(("linux", "darwin")):
        if REQUIRED:
            raise RuntimeError(f"pyarrow's C++ libraries not found in {directory}")
        return []
    return [
        Extension(
            "arrow_outputs._arrowbridge",
            ["arrow_outputs/_arrowbridge.cc"],
            language="c++",
            optional=not REQUIRED,
            # -isystem: warnings are for this module's code, not for Arrow's headers.
            extra_compile_args=[
                "-std=c++20",
                "-Wall",
                "-Wextra",
                "-isystem",
                pyarrow.get_include(),
            ],
            # No rpath: the module loads only into a process whose pyarrow has already
            # loaded these very libraries (arrow_outputs._accel imports pyarrow first), never
            # a second copy from wherever it was built.
            extra_link_args=libraries,
        )
    ]


setup(
    ext_modules=[
        Extension(
            "arrow_outputs._speedups",
            ["arrow_outputs/_speedups.c"],
            optional=not REQUIRED,
            extra_compile_args=["-Wall", "-Wextra", "-O3"],
        ),
        *_arrow_view(),
    ]
)
