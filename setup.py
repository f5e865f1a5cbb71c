"""The C accelerator only: every piece of metadata lives in pyproject.toml.

``arrow_outputs._speedups`` is optional: where it does not compile (no C compiler, a
big-endian machine) the package installs anyway and runs its pure-Python twin,
``arrow_outputs._pyspeedups``. CI sets ``ARROW_OUTPUTS_REQUIRE_SPEEDUPS=1`` so that a failed
compile fails the build instead of falling back quietly.
"""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "arrow_outputs._speedups",
            ["arrow_outputs/_speedups.c"],
            optional=os.environ.get("ARROW_OUTPUTS_REQUIRE_SPEEDUPS") != "1",
            extra_compile_args=["-Wall", "-Wextra", "-O3"],
        )
    ]
)
