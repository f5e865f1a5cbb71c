"""Small shared checks: array coercion, dtype and offsets validation, value descriptions."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from . import _accel
from ._torch import is_tensor, tensor_dtype_name, tensor_to_numpy
from .errors import DTypeError, FieldTypeError, OffsetsError, ShapeError

INT32_MAX = 2**31 - 1


def describe(x: Any) -> str:
    """A short description of a value for error messages: its kind, dtype and shape."""
    if isinstance(x, np.ndarray):
        return f"a numpy {x.dtype} array of shape {tuple(x.shape)}"
    if is_tensor(x):
        return f"a torch {tensor_dtype_name(x)} tensor of shape {tuple(x.shape)}"
    if x is None:
        return "None"
    text = repr(x)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(x).__name__} {text}"


# numpy's dtype.name is computed in Python on every access; this is on the per-step path.
_DTYPE_NAMES = {
    np.dtype(name): name
    for name in (
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "bool",
    )
}


def dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is not None:
        return name
    # A byte-swapped dtype's name is its native twin's ("int64" for ">i8"), whose bytes Arrow
    # would read in the wrong order: its code (">i8") is no allowed dtype, so it is refused.
    return dtype.name if dtype.isnative else dtype.str


def host_array(x: Any, field: str) -> tuple[np.ndarray, str]:
    """numpy view of a numpy array or host tensor, and its dtype name (``bfloat16`` kept;
    a byte-swapped dtype named by its code, such as ``">i8"``, so that checks refuse it)."""
    if isinstance(x, np.ndarray):
        return x, _DTYPE_NAMES.get(x.dtype) or dtype_name(x.dtype)
    if is_tensor(x):
        return tensor_to_numpy(x, field), tensor_dtype_name(x)
    raise FieldTypeError(field, "a numpy array or a torch tensor", describe(x))


def row_label(field: str, i: int, keys: Sequence[Any] | None = None) -> str:
    """``field['req-7']`` for dicts keyed by request id, else ``field[7]``. Build it only when
    raising: it is per row."""
    return f"{field}[{keys[i]!r}]" if keys is not None else f"{field}[{i}]"


def check_dtype(dtype: str, allowed: Sequence[str], field: str) -> None:
    if dtype not in allowed:
        raise DTypeError(field, " or ".join(allowed), dtype)


def check_ndim(a: np.ndarray, ndim: int, field: str) -> None:
    if a.ndim != ndim:
        raise ShapeError(field, f"a {ndim}-D array", f"shape {tuple(a.shape)}")


def contiguous(a: np.ndarray) -> np.ndarray:
    """C-contiguous ``a``: itself when it already is (zero-copy), else one copy."""
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def offsets_from_list(values: Any, field: str, *, last: int, what: str) -> np.ndarray:
    """Validate Python-list offsets (``cu_num_generated_tokens``) and make int32 offsets.

    They must start at 0, never decrease, and end at ``last`` (the number of ``what``).
    """
    # One C walk when built; it gives up on anything wrong, and the checks below name it.
    fast = _accel.int_offsets(values, last) if _accel.accelerated() else None
    if fast is not None:
        return np.frombuffer(fast, dtype=np.int32)
    if not isinstance(values, (list, tuple)):
        raise FieldTypeError(field, "a list of ints or None", describe(values))
    if list(map(type, values)).count(int) != len(values):
        bad = next(v for v in values if type(v) is not int)
        raise FieldTypeError(field, "a list of ints", f"{describe(bad)} among them")
    try:
        arr = np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise FieldTypeError(field, "a list of ints", describe(values)) from e
    check_offsets(arr, field, last=last, what=what)
    return arr.astype(np.int32)


def check_offsets(arr: np.ndarray, field: str, *, last: int, what: str) -> None:
    # One C walk when built (valid offsets, the usual case); the checks below name the fault.
    if not (_accel.accelerated() and _accel.offsets_ok(arr, last)):
        _check_offsets(arr, field, last=last, what=what)
    if last > INT32_MAX:
        raise OffsetsError(field, f"at most {INT32_MAX} {what}", str(last))


def _check_offsets(arr: np.ndarray, field: str, *, last: int, what: str) -> None:
    if arr.ndim != 1 or len(arr) == 0:
        raise OffsetsError(field, "a 1-D sequence of at least one offset", describe(arr))
    if arr[0] != 0:
        raise OffsetsError(field, "offsets starting at 0", f"offsets starting at {arr[0]}")
    if arr[-1] != last:
        raise OffsetsError(
            field,
            f"{len(arr)} offsets ending at {last} (the number of {what})",
            f"{len(arr)} ending at {arr[-1]}",
        )
    check_monotonic(arr, field)


def check_monotonic(offsets: np.ndarray, field: str, *, limit: int | None = None) -> None:
    """Offsets never decrease (and, with ``limit``, stay within ``0..limit``)."""
    if len(offsets) > 1:
        # Neighbours compared, not np.diff's differences: half the cost, and no int64
        # wraparound to misjudge.
        down = offsets[1:] < offsets[:-1]
        if down.any():
            i = int(np.argmax(down))
            raise OffsetsError(
                field,
                "non-decreasing offsets",
                f"{offsets[i]} followed by {offsets[i + 1]} at index {i}",
            )
    if limit is not None and len(offsets) and (offsets[0] < 0 or offsets[-1] > limit):
        raise OffsetsError(
            field, f"offsets within 0..{limit}", f"offsets from {offsets[0]} to {offsets[-1]}"
        )


@lru_cache(maxsize=64)
def arange_offsets(n: int, step: int = 1) -> np.ndarray:
    """``[0, step, 2*step, ..., n*step]`` as read-only int32; cached (steps reuse sizes)."""
    if n * step > INT32_MAX:
        raise OffsetsError("offsets", f"at most {INT32_MAX} values", str(n * step))
    out = np.arange(0, (n + 1) * step, step, dtype=np.int32) if step else np.zeros(n + 1, np.int32)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=64)
def _arange_bytes(n: int, step: int) -> bytes:
    return arange_offsets(n, step).tobytes()


def is_arange(offsets: np.ndarray, step: int = 1) -> bool:
    """True when ``offsets`` is ``base + [0, step, 2*step, ...]``."""
    n = len(offsets) - 1
    if n <= 0:
        return True
    if offsets.dtype == np.int32 and offsets[0] == 0 and 0 <= n * step <= INT32_MAX:
        # Comparing bytes with a cached sequence is ~30x cheaper than np.diff on small arrays.
        return offsets.tobytes() == _arange_bytes(n, step)
    d = np.diff(offsets)
    return bool(d[0] == step and (d == step).all())
