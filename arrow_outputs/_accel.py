"""Which implementation of the codec's walks over Python objects runs: C or pure Python.

The record-batch codec imports only this module and calls ``_accel.flatten_int_lists(...)``
and so on through it, so :func:`set_pure_python` takes effect at once, everywhere.

- ``arrow_outputs._speedups`` (C) is used when it was compiled at install time;
  ``arrow_outputs._pyspeedups`` (its specification) otherwise.
- ``ARROW_OUTPUTS_PURE_PYTHON=1`` in the environment, read once at import, starts on the
  pure-Python path even where C is available (any value but "" and "0" counts).
- Both give the same answer for every input (``tests/test_speedups.py`` runs both), so the
  choice changes speed only, never results or error messages.

Examples
--------
>>> from arrow_outputs import _accel
>>> was = _accel.accelerated()
>>> _accel.set_pure_python(True)
>>> _accel.accelerated(), _accel.index_in_order(["a"], {"a": 0})
(False, True)
>>> _accel.set_pure_python(not was)
"""

from __future__ import annotations

import os
from types import ModuleType

from arrow_outputs import _pyspeedups
from arrow_outputs.errors import UnsupportedValueError

__all__ = [
    "AVAILABLE",
    "accelerated",
    "flatten_int_lists",
    "index_in_order",
    "mask_rows",
    "set_pure_python",
    "split_int_lists",
    "str_list",
    "utf8_array",
]

_compiled: ModuleType | None
try:
    # `import a.b as c`, not `from a import b`: only the former reports a missing module
    # as ModuleNotFoundError with its name.
    import arrow_outputs._speedups as _compiled
except ModuleNotFoundError as e:
    # Only "not built" falls back: a module that exists but fails to load is a broken build,
    # and hiding it would turn a bug into a silent slowdown.
    if e.name != "arrow_outputs._speedups":
        raise
    _compiled = None

#: Whether the compiled module was built and imported (whichever path is in use now).
AVAILABLE: bool = _compiled is not None

# The five walks, rebound by set_pure_python; typed by the specification's signatures.
flatten_int_lists = _pyspeedups.flatten_int_lists
utf8_array = _pyspeedups.utf8_array
index_in_order = _pyspeedups.index_in_order
str_list = _pyspeedups.str_list
split_int_lists = _pyspeedups.split_int_lists
mask_rows = _pyspeedups.mask_rows
_using_c = False


def set_pure_python(flag: bool) -> None:
    """Run the pure-Python path (``True``) or the compiled one (``False``) from now on.

    Raises
    ------
    UnsupportedValueError
        For ``False`` when the compiled module is not available (:data:`AVAILABLE`).
    """
    global flatten_int_lists, utf8_array, index_in_order, str_list, split_int_lists, mask_rows
    global _using_c
    impl = _pyspeedups
    if not flag:
        if _compiled is None:
            raise UnsupportedValueError(
                "arrow_outputs._accel.set_pure_python(False)",
                "the compiled module arrow_outputs._speedups (built by pip with a C compiler)",
                "none: this install has the pure-Python path only; reinstall from source "
                "with a C compiler to build it",
            )
        impl = _compiled
    flatten_int_lists = impl.flatten_int_lists
    utf8_array = impl.utf8_array
    index_in_order = impl.index_in_order
    str_list = impl.str_list
    split_int_lists = impl.split_int_lists
    mask_rows = impl.mask_rows
    _using_c = not flag


def accelerated() -> bool:
    """Whether the compiled path is in use now."""
    return _using_c


set_pure_python(not AVAILABLE or os.environ.get("ARROW_OUTPUTS_PURE_PYTHON", "") not in ("", "0"))
