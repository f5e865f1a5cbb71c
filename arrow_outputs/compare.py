"""Deep comparison of model-runner outputs: equal or not, and where they first differ.

``ModelRunnerOutput``'s own ``==`` cannot compare outputs that hold numpy arrays or torch
tensors (their ``==`` is elementwise). The functions here walk two outputs (or any of the
data-model structures, or plain data) side by side and report the first difference with
its path, such as ``logprobs.logprob_token_ids[2, 0]``.

* ``first_difference`` returns a one-line description of the first difference, or
  ``None`` when the two are equal.
* ``outputs_equal`` returns whether they are equal.
* ``assert_outputs_equal`` raises an ``AssertionError`` carrying that description.

Notes
-----
**What is compared.** Structures are duck typed: the classes of this package and vLLM's
own classes (or any look-alike) match when their class *names* and field *names* match,
whatever module they come from. The fields of dataclasses, NamedTuples and msgspec
Structs are walked in the first object's order; an object of a plain class named like a
data-model class (``ModelRunnerOutput``, ``LogprobsLists``, ...) that has all of that
class's fields is walked by those field names.

* Arrays (numpy arrays and torch tensors, bfloat16 included) must have the same shape.
  In strict mode they must also be of the same library and dtype and hold the same bits:
  every element is compared as its bit pattern, so a NaN equals only a NaN with the same
  payload and ``-0.0`` differs from ``0.0``. The device of a tensor is not compared.
* Mappings must have the same key set (in any order); values are then compared key by key
  (path ``field['req-1']``). The concrete mapping class is not compared, in either mode:
  a ``dict`` equals a ``MappingProxyType`` or ``OrderedDict`` with the same items, since
  decoding gives plain dicts and key order is not part of the value.
* Lists, tuples and other sequences are compared item by item (path ``field[3]``), sets
  and frozensets by their items (with ``==``, so the kinds of set items are not checked).
* Numbers: strict mode compares type and bits (a Python float by its IEEE bits, a numpy
  scalar by its bytes). ``bool`` and ``numpy.bool_`` are not numbers: they never equal
  ``0`` or ``1``, in either mode.
* Any other object (a connector's own payload, a record decoded from one) is compared
  with ``==``, in both modes: its own ``__eq__`` decides what it equals.

**Strict and loose.** ``strict=True`` (the default) is the check for a lossless round
trip: besides the values, the kinds must match. So ``list`` differs from ``tuple``,
``set`` from ``frozenset``, a numpy array from a torch tensor, ``int`` from
``numpy.int64``, ``float`` from ``numpy.float64``, ``bool`` from ``numpy.bool_``, ``str``
from a ``str`` subclass, and arrays must share their dtype.

``strict=False`` compares values: numbers by value across ``int``, ``float`` and numpy
scalar types (any NaN equals any NaN, ``-0.0`` equals ``0.0``), ``bool`` with
``numpy.bool_``, lists with tuples item by item, sets with frozensets, and numpy arrays
with torch tensors of any numeric dtype by their values (bfloat16 included). Shapes, key
sets, lengths and structure names must still match.

**Limits.** Nesting deeper than 100 levels (or a cycle) is not followed: it is reported
as a difference rather than claimed equal. Values longer than about 60 characters are cut
short in messages.

Examples
--------
>>> import numpy as np
>>> from arrow_outputs import LogprobsLists, ModelRunnerOutput
>>> def step(ids):
...     lists = LogprobsLists(np.array([[7, 1]], ids), np.zeros((1, 2), np.float32), np.ones(1))
...     return ModelRunnerOutput(["r"], {"r": 0}, [[7]], lists)
>>> first_difference(step(np.int64), step(np.int64)) is None
True
>>> first_difference(step(np.int64), step(np.int32))
'logprobs.logprob_token_ids: dtype int64 vs int32'
>>> outputs_equal(step(np.int64), step(np.int32), strict=False)
True
"""

from __future__ import annotations

import cmath
import dataclasses
import math
import struct
import sys
from collections.abc import Mapping, Sequence, Set
from typing import Any

import numpy as np

from ._torch import is_tensor, tensor_dtype_name
from .outputs import (
    AuxRequestOutput,
    CUDAGraphStat,
    DraftTokenIds,
    ECConnectorOutput,
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    SamplerOutput,
    SamplingMaskLists,
)

__all__ = ["assert_outputs_equal", "first_difference", "outputs_equal"]

_MAX_DEPTH = 100
"""Nesting deeper than this is reported as a difference instead of being followed."""

_MAX_VALUE_CHARS = 60
"""Values longer than this (as text) are cut short in messages."""

_MAX_PATH_CHARS = 120
"""Paths longer than this lose their middle in messages."""


def _class_fields(cls: type) -> tuple[str, ...]:
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return tuple(cls._fields)  # type: ignore[attr-defined]  # NamedTuple


# Field names of the data-model classes, by class name: an object of a plain class with
# one of these names and all of its fields is walked like the dataclass or NamedTuple.
_KNOWN_FIELDS: dict[str, tuple[str, ...]] = {
    cls.__name__: _class_fields(cls)
    for cls in (
        AuxRequestOutput,
        CUDAGraphStat,
        DraftTokenIds,
        ECConnectorOutput,
        KVConnectorOutput,
        LogprobsLists,
        LogprobsTensors,
        ModelRunnerOutput,
        SamplerOutput,
        SamplingMaskLists,
    )
}


def first_difference(a: Any, b: Any, *, strict: bool = True) -> str | None:
    """Describe the first difference between two outputs, or return ``None``.

    Parameters
    ----------
    a, b : object
        Two ``ModelRunnerOutput`` objects, two of the structures they hold
        (``LogprobsLists``, ``LogprobsTensors``, ``SamplingMaskLists``,
        ``KVConnectorOutput``, ``ECConnectorOutput``, ``CUDAGraphStat``,
        ``AuxRequestOutput``), or any plain data, arrays and tensors. This package's
        classes and vLLM's match by class name and field names.
    strict : bool, default True
        Whether the kinds must match too (``list`` vs ``tuple``, ``int`` vs
        ``numpy.int64``, numpy vs torch, dtypes) and floats must match bit for bit. With
        ``False``, numbers, arrays and sequences are compared by value. See the module
        documentation for the full rules.

    Returns
    -------
    str or None
        ``None`` when ``a`` and ``b`` are equal; otherwise one line
        ``"<path>: <what differs>"``, where the path names the field, key, item or
        array element (it is left out when ``a`` and ``b`` themselves differ in kind or
        value). Values longer than about 60 characters are cut short.

    Examples
    --------
    >>> import numpy as np
    >>> from arrow_outputs import KVConnectorOutput, ModelRunnerOutput
    >>> a = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[1], [2, 7]])
    >>> b = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[1], [2, 8]])
    >>> first_difference(a, b)
    'sampled_token_ids[1][1]: 7 vs 8'
    >>> first_difference(KVConnectorOutput({"a"}), KVConnectorOutput(frozenset({"a"})))
    'finished_sending: set vs frozenset'
    >>> first_difference({"r": [1, 2]}, {"r": (1, 2)}, strict=False) is None
    True
    >>> first_difference(np.array([0.0]), np.array([-0.0]))
    '[0]: 0.0 vs -0.0'
    >>> first_difference(np.array([0.0]), np.array([-0.0]), strict=False) is None
    True
    """
    return _diff(a, b, "", strict, 0)


def outputs_equal(a: Any, b: Any, *, strict: bool = True) -> bool:
    """Return whether two outputs are equal.

    Parameters
    ----------
    a, b : object
        What to compare; see ``first_difference``.
    strict : bool, default True
        Whether kinds, dtypes and float bits must match too; see
        ``first_difference``.

    Returns
    -------
    bool
        ``True`` when ``first_difference`` finds no difference.

    Examples
    --------
    >>> import numpy as np
    >>> outputs_equal([np.int64(3)], [3])
    False
    >>> outputs_equal([np.int64(3)], [3], strict=False)
    True
    >>> nan = float("nan")
    >>> outputs_equal({"x": nan}, {"x": nan})
    True
    """
    return _diff(a, b, "", strict, 0) is None


def assert_outputs_equal(a: Any, b: Any, *, strict: bool = True) -> None:
    """Raise ``AssertionError`` unless two outputs are equal.

    Parameters
    ----------
    a, b : object
        What to compare; see ``first_difference``.
    strict : bool, default True
        Whether kinds, dtypes and float bits must match too; see
        ``first_difference``.

    Raises
    ------
    AssertionError
        With the description of the first difference as its message.

    Examples
    --------
    >>> import numpy as np
    >>> from arrow_outputs import AuxRequestOutput
    >>> assert_outputs_equal(AuxRequestOutput(0, np.zeros(4)), AuxRequestOutput(0, np.zeros(4)))
    >>> assert_outputs_equal(AuxRequestOutput(0, np.zeros(4)), AuxRequestOutput(0, np.zeros(8)))
    Traceback (most recent call last):
    ...
    AssertionError: rows: shape (4,) vs (8,)
    """
    difference = _diff(a, b, "", strict, 0)
    if difference is not None:
        raise AssertionError(difference)


# --- kinds ------------------------------------------------------------------------------


def _record_fields(x: Any) -> tuple[str, ...] | None:
    """The field names of a dataclass, NamedTuple or msgspec Struct, or a data-model look-alike."""
    t = type(x)
    if dataclasses.is_dataclass(t):
        return tuple(f.name for f in dataclasses.fields(t))
    if isinstance(x, tuple) and isinstance(getattr(t, "_fields", None), tuple):
        return tuple(t._fields)
    struct_fields = getattr(t, "__struct_fields__", None)  # msgspec.Struct
    if isinstance(struct_fields, tuple) and all(type(f) is str for f in struct_fields):
        return struct_fields
    known = _KNOWN_FIELDS.get(t.__name__)
    if known is not None and all(hasattr(x, name) for name in known):
        return known
    return None


def _category(x: Any) -> str:
    """The kind of ``x``, as far as comparing goes."""
    if x is None:
        return "none"
    if isinstance(x, (bool, np.bool_)):
        return "bool"
    if isinstance(x, (int, float, complex, np.number)):
        return "number"
    if isinstance(x, str):
        return "str"
    if isinstance(x, bytes):
        return "bytes"
    if isinstance(x, np.ndarray) or is_tensor(x):
        return "array"
    if _record_fields(x) is not None:
        return "record"
    if isinstance(x, Mapping):
        return "mapping"
    if isinstance(x, Set):
        return "set"
    if isinstance(x, Sequence):
        return "sequence"
    return "other"


def _type_name(x: Any) -> str:
    """``int``, ``numpy.int64``, ``torch.Tensor``, ``LogprobsLists``, ``None``."""
    if x is None:
        return "None"
    t = type(x)
    module = t.__module__
    if module == "builtins":
        return t.__qualname__
    root = module.partition(".")[0]
    if root in ("numpy", "torch"):
        return f"{root}.{t.__name__}"
    return t.__name__


def _type_names(a: Any, b: Any) -> str:
    """``"A vs B"``; qualified by module when the short names are the same."""
    na, nb = _type_name(a), _type_name(b)
    if na == nb:
        ta, tb = type(a), type(b)
        na, nb = f"{ta.__module__}.{ta.__qualname__}", f"{tb.__module__}.{tb.__qualname__}"
    return f"{na} vs {nb}"


def _short(x: Any) -> str:
    """``repr(x)`` on one line, cut short."""
    text = " ".join(repr(x).split())
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return text


def _at(path: str, message: str) -> str:
    """``"path: message"``; a very long path keeps its start and its end."""
    if len(path) > _MAX_PATH_CHARS:
        half = _MAX_PATH_CHARS // 2
        path = f"{path[:half]}...{path[-half:]}"
    return f"{path}: {message}" if path else message


def _values(a: Any, b: Any) -> str:
    """``"7 vs 8"``; with the types when the two look the same."""
    ra, rb = _number_text(a), _number_text(b)
    if ra == rb:
        return f"{ra} vs {rb} ({_type_names(a, b)})"
    return f"{ra} vs {rb}"


def _sorted(items: Any) -> list[Any]:
    items = list(items)
    try:
        return sorted(items)
    except TypeError:
        return sorted(items, key=repr)


# --- the walk ---------------------------------------------------------------------------


def _diff(a: Any, b: Any, path: str, strict: bool, depth: int) -> str | None:
    if a is b:
        return None
    if depth > _MAX_DEPTH:
        return _at(path, f"nested deeper than {_MAX_DEPTH} levels (a cycle?); not compared")
    ca, cb = _category(a), _category(b)
    if ca == "other" or cb == "other":
        return _diff_eq(a, b, path, types_first=True)
    if ca != cb:
        return _at(path, _type_names(a, b))
    if ca == "record":
        return _diff_record(a, b, path, strict, depth)
    if ca == "array":
        return _diff_array(a, b, path, strict, depth)
    if ca == "mapping":
        return _diff_mapping(a, b, path, strict, depth)
    if strict and ca != "none" and type(a) is not type(b):
        return _at(path, _type_names(a, b))
    if ca == "sequence":
        return _diff_sequence(a, b, path, strict, depth)
    if ca == "set":
        return _diff_set(a, b, path)
    if ca == "number":
        return _diff_number(a, b, path, strict)
    # none, bool, str, bytes
    return _diff_eq(a, b, path)


def _diff_eq(a: Any, b: Any, path: str, *, types_first: bool = False) -> str | None:
    """Compare with ``==``; a result with no single truth value is a difference.

    With ``types_first``, unequal objects of different types are described by their types.
    """
    same_type = type(a) is type(b)
    try:
        equal = bool(a == b)
    except Exception as e:
        types = _type_name(a) if same_type else _type_names(a, b)
        return _at(path, f"== on {types} failed ({type(e).__name__})")
    if equal:
        return None
    if types_first and not same_type:
        return _at(path, _type_names(a, b))
    return _at(path, _values(a, b))


def _diff_record(a: Any, b: Any, path: str, strict: bool, depth: int) -> str | None:
    fa, fb = _record_fields(a) or (), _record_fields(b) or ()
    name_a, name_b = type(a).__name__, type(b).__name__
    if name_a != name_b:
        return _at(path, f"{name_a} vs {name_b}")
    if set(fa) != set(fb):
        only_a = [f for f in fa if f not in fb]
        only_b = [f for f in fb if f not in fa]
        return _at(path, f"{name_a} fields {_short(only_a)} vs {_short(only_b)}")
    for name in fa:
        sub = f"{path}.{name}" if path else name
        found = _diff(getattr(a, name), getattr(b, name), sub, strict, depth + 1)
        if found is not None:
            return found
    return None


def _diff_mapping(a: Any, b: Any, path: str, strict: bool, depth: int) -> str | None:
    if a.keys() != b.keys():
        return _at(path, f"keys {_short(_sorted(a.keys()))} vs {_short(_sorted(b.keys()))}")
    for key in a:
        found = _diff(a[key], b[key], f"{path}[{key!r}]", strict, depth + 1)
        if found is not None:
            return found
    return None


def _diff_sequence(a: Any, b: Any, path: str, strict: bool, depth: int) -> str | None:
    if len(a) != len(b):
        return _at(path, f"length {len(a)} vs {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        found = _diff(x, y, f"{path}[{i}]", strict, depth + 1)
        if found is not None:
            return found
    return None


def _diff_set(a: Any, b: Any, path: str) -> str | None:
    if a == b:
        return None
    only_a = _sorted(x for x in a if x not in b)
    only_b = _sorted(x for x in b if x not in a)
    parts = [f"{_short(only_a)} only in first"] if only_a else []
    if only_b:
        parts.append(f"{_short(only_b)} only in second")
    return _at(path, f"items {', '.join(parts)}")


def _float_bits(x: Any) -> bytes:
    if type(x) is float:
        return struct.pack("<d", x)
    if type(x) is complex:
        return struct.pack("<dd", x.real, x.imag)
    if isinstance(x, np.generic):
        return x.tobytes()
    return repr(x).encode()  # a subclass of float or complex: only strict mode gets here


def _diff_number(a: Any, b: Any, path: str, strict: bool) -> str | None:
    if strict:
        # Same type here. Ints compare by value, floats by their bits.
        if isinstance(a, (int, np.integer)):
            return None if a == b else _at(path, _values(a, b))
        ba, bb = _float_bits(a), _float_bits(b)
        if ba == bb:
            return None
        ra, rb = _number_text(a), _number_text(b)
        if ra == rb:
            ra += f" (0x{ba[::-1].hex()})"
            rb += f" (0x{bb[::-1].hex()})"
        return _at(path, f"{ra} vs {rb}")
    x = a.item() if isinstance(a, np.generic) else a
    y = b.item() if isinstance(b, np.generic) else b
    if x == y or (_isnan(x) and _isnan(y)):
        return None
    return _at(path, _values(a, b))


def _number_text(x: Any) -> str:
    """Short text of a value: numpy numbers as numpy prints them (``0.1`` for float32)."""
    if isinstance(x, np.generic):
        return str(x) if x.dtype.kind in "biufc" else _short(x.item())
    return _short(x)


def _isnan(x: Any) -> bool:
    if isinstance(x, float):
        return math.isnan(x)
    if isinstance(x, complex):
        return cmath.isnan(x)
    if isinstance(x, np.inexact):
        return bool(np.isnan(x))
    return False


# --- arrays -----------------------------------------------------------------------------


def _dtype_name(x: Any) -> str:
    return tensor_dtype_name(x) if is_tensor(x) else str(x.dtype)


def _host_tensor(t: Any) -> Any:
    return t.detach().cpu().resolve_conj().resolve_neg()


def _bits(x: Any) -> np.ndarray:
    """The elements of an array or tensor as rows of bytes: ``[num_elements, itemsize]``."""
    if is_tensor(x):
        torch = sys.modules["torch"]
        t = _host_tensor(x).contiguous()
        try:
            arr = t.numpy()
        except TypeError:  # bfloat16 and other dtypes numpy lacks: same-size ints
            same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            arr = t.view(same_size[t.element_size()]).numpy()
    else:
        arr = x
    flat = np.ascontiguousarray(arr).reshape(-1)
    return flat.view(np.uint8).reshape(flat.size, flat.dtype.itemsize)


def _values_array(x: Any) -> np.ndarray:
    """The values of an array or tensor as a numpy array (bfloat16 as float32)."""
    if not is_tensor(x):
        return np.asarray(x)
    t = _host_tensor(x)
    try:
        return t.numpy()
    except TypeError:
        torch = sys.modules["torch"]
        if t.is_complex():
            return t.to(torch.complex128).numpy()
        return t.to(torch.float64 if t.is_floating_point() else torch.int64).numpy()


def _element_path(path: str, flat_index: int, shape: tuple[int, ...]) -> str:
    if not shape:
        return path
    index = np.unravel_index(flat_index, shape)
    return f"{path}[{', '.join(str(int(i)) for i in index)}]"


def _element_text(x: Any, flat_index: int) -> str:
    if is_tensor(x):
        return _short(_host_tensor(x).reshape(-1)[flat_index].item())
    return _number_text(np.asarray(x).reshape(-1)[flat_index])


def _diff_array(a: Any, b: Any, path: str, strict: bool, depth: int) -> str | None:
    if strict:
        if is_tensor(a) != is_tensor(b):
            return _at(path, _type_names(a, b))
        if a.dtype != b.dtype:
            return _at(path, f"dtype {_dtype_name(a)} vs {_dtype_name(b)}")
    shape_a, shape_b = tuple(a.shape), tuple(b.shape)
    if shape_a != shape_b:
        return _at(path, f"shape {shape_a} vs {shape_b}")
    if strict:
        if isinstance(a, np.ndarray) and a.dtype.hasobject:
            return _diff_elements(a, b, path, strict, depth)
        ra, rb = _bits(a), _bits(b)
        different = np.flatnonzero((ra != rb).any(axis=1))
        if different.size == 0:
            return None
        i = int(different[0])
        ta, tb = _element_text(a, i), _element_text(b, i)
        if ta == tb:
            order = slice(None, None, -1) if sys.byteorder == "little" else slice(None)
            ta += f" (0x{ra[i][order].tobytes().hex()})"
            tb += f" (0x{rb[i][order].tobytes().hex()})"
        return _at(_element_path(path, i, shape_a), f"{ta} vs {tb}")
    va, vb = _values_array(a), _values_array(b)
    ka, kb = va.dtype.kind, vb.dtype.kind
    if not (ka == kb or (ka in "iufc" and kb in "iufc")):
        return _at(path, f"dtype {_dtype_name(a)} vs {_dtype_name(b)}")
    if va.dtype.hasobject or vb.dtype.hasobject:
        return _diff_elements(va, vb, path, strict, depth)
    try:
        unequal = np.asarray(va != vb)
    except Exception as e:  # structured dtypes that do not compare
        return _at(path, f"dtype {_dtype_name(a)} vs {_dtype_name(b)} ({type(e).__name__})")
    if ka in "fc" and kb in "fc":
        unequal = unequal & ~(np.isnan(va) & np.isnan(vb))
    different = np.flatnonzero(unequal)
    if different.size == 0:
        return None
    i = int(different[0])
    return _at(_element_path(path, i, shape_a), f"{_element_text(a, i)} vs {_element_text(b, i)}")


def _diff_elements(a: np.ndarray, b: np.ndarray, path: str, strict: bool, depth: int) -> str | None:
    """Object arrays: element by element, like a sequence."""
    for i, (x, y) in enumerate(zip(a.reshape(-1), b.reshape(-1))):
        found = _diff(x, y, _element_path(path, i, a.shape), strict, depth + 1)
        if found is not None:
            return found
    return None
