"""Plain Python data <-> JSON, kind for kind: sets stay sets, tuples stay tuples.

Step-level objects (connector outputs, CUDA-graph stats) travel as JSON in the batch
metadata. JSON has no set, tuple, bytes, non-finite float or non-string key, so those are
tagged as one-key objects (``{"$set": [...]}``). A str-keyed dict whose keys could be
mistaken for a tag is itself tagged, so decoding is unambiguous. Dataclasses, NamedTuples
and msgspec Structs of such values travel as ``{"$record": {"type", "kind", "fields"}}`` and
come back as read-only :class:`~arrow_outputs.records.Record` objects.

Anything else (an object of some connector's own class) is *opaque*: it is never pickled.
``opaque="drop"`` records it (field path and type) and replaces it with None, with an
:class:`~arrow_outputs.errors.OpaqueValueWarning`; ``opaque="error"`` raises.

Decoding treats the JSON as hostile: every tag's payload is checked, nesting is bounded,
numpy scalar types come from an explicit table, and nothing is looked up or imported by a
name found in the data.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import math
import warnings
from typing import Any

import numpy as np

from .errors import OpaqueValueWarning, StepMetadataError, UnsupportedValueError
from .records import RECORD_KINDS, Record, qualified_name, record_fields

__all__ = ["MAX_DEPTH", "Dropped", "from_jsonable", "to_jsonable"]

#: Deepest nesting of containers the format carries (encoder and decoder agree).
MAX_DEPTH = 64

Dropped = list[dict[str, str]]

#: Every tag of the format (docs/schema.md lists them).
_TAGS = ("$set", "$frozenset", "$tuple", "$bytes", "$float", "$numpy", "$dict", "$record")

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

# numpy scalar types a connector value may carry; names from the data go through this table.
_NUMPY_SCALARS: dict[str, type] = {
    name: np.dtype(name).type
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}


def to_jsonable(x: Any, field: str, opaque: str, dropped: Dropped, depth: int = 0) -> Any:
    """Encode plain data; opaque values are dropped into ``dropped`` or raise."""
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return x
    if t is float:
        return x if math.isfinite(x) else {"$float": repr(x)}
    if depth >= MAX_DEPTH:
        raise UnsupportedValueError(
            field, f"at most {MAX_DEPTH} levels of nested containers", "deeper nesting"
        )
    d = depth + 1
    if t is list:
        return [to_jsonable(v, f"{field}[{i}]", opaque, dropped, d) for i, v in enumerate(x)]
    if t is tuple:
        return {
            "$tuple": [to_jsonable(v, f"{field}[{i}]", opaque, dropped, d) for i, v in enumerate(x)]
        }
    if t is set or t is frozenset:
        items = [to_jsonable(v, f"{field}{{}}", opaque, dropped, d) for v in x]
        # Sorted when the items allow it, so equal sets give equal bytes.
        with contextlib.suppress(TypeError):
            items.sort()
        return {"$set" if t is set else "$frozenset": items}
    if t is bytes:
        return {"$bytes": base64.b64encode(x).decode()}
    if isinstance(x, (np.integer, np.floating, np.bool_)) and x.dtype.name in _NUMPY_SCALARS:
        # numpy scalars (block ids from an array, say): kept with their dtype.
        value = x.item()
        if type(value) is float and not math.isfinite(value):
            value = repr(value)
        return {"$numpy": [x.dtype.name, value]}
    if t is dict:
        if all(type(k) is str and not k.startswith("$") for k in x):
            return {k: to_jsonable(v, f"{field}.{k}", opaque, dropped, d) for k, v in x.items()}
        return {
            "$dict": [
                [
                    to_jsonable(k, f"{field}<key>", opaque, dropped, d),
                    to_jsonable(v, f"{field}[{k!r}]", opaque, dropped, d),
                ]
                for k, v in x.items()
            ]
        }
    if t is Record:
        return _record(x.type_name, x.kind, dict(x.fields), field, opaque, dropped, d)
    described = record_fields(x)
    if described is not None:
        kind, names = described
        values = {name: getattr(x, name) for name in names}
        return _record(qualified_name(t), kind, values, field, opaque, dropped, d)
    type_name = qualified_name(t)
    if opaque == "error":
        raise UnsupportedValueError(
            field,
            "plain data (None, bool, int, float, str, bytes, list, tuple, set, dict, or a "
            "dataclass / NamedTuple / msgspec Struct of those); arrow_outputs never pickles",
            f"an object of type {type_name} (pass opaque='drop' to drop such objects)",
        )
    dropped.append({"field": field, "type": type_name})
    warnings.warn(
        f"{field}: dropped an opaque {type_name} (arrow_outputs never pickles); "
        "the batch metadata lists it under 'dropped'",
        OpaqueValueWarning,
        stacklevel=4,
    )
    return None


def _record(
    type_name: str,
    kind: str,
    values: dict[str, Any],
    field: str,
    opaque: str,
    dropped: Dropped,
    depth: int,
) -> dict[str, Any]:
    fields = {k: to_jsonable(v, f"{field}.{k}", opaque, dropped, depth) for k, v in values.items()}
    return {"$record": {"type": type_name, "kind": kind, "fields": fields}}


def _bad(path: str, expected: str, got: Any) -> StepMetadataError:
    if len(path) > 160:  # deep nesting: keep the message readable
        path = f"{path[:80]}...{path[-60:]}"
    text = repr(got)
    return StepMetadataError(path, expected, text if len(text) <= 60 else text[:57] + "...")


def _hashable(v: Any, path: str) -> Any:
    try:
        hash(v)
    except TypeError:
        raise _bad(path, "a hashable item (set members and dict keys)", v) from None
    return v


def from_jsonable(x: Any, path: str, depth: int = 0) -> Any:
    """Inverse of :func:`to_jsonable` over untrusted JSON; violations name ``path``."""
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return x
    if t is float:
        if not math.isfinite(x):  # "1e400" parses as inf; the writer tags non-finite floats
            raise _bad(path, "a finite number (non-finite ones are tagged $float)", x)
        return x
    if depth >= MAX_DEPTH:
        raise _bad(path, f"at most {MAX_DEPTH} levels of nesting", "deeper nesting")
    d = depth + 1
    if t is list:
        return [from_jsonable(v, f"{path}[{i}]", d) for i, v in enumerate(x)]
    if t is not dict:
        raise _bad(path, "a JSON value", x)
    if len(x) == 1:
        ((tag, v),) = x.items()
        if tag.startswith("$"):
            return _tagged(tag, v, f"{path}.{tag}", d)
    for k in x:
        if k.startswith("$"):
            raise _bad(path, "plain keys (a '$' key only as the one key of a tag)", k)
    return {k: from_jsonable(v, f"{path}.{k}", d) for k, v in x.items()}


def _items(v: Any, path: str, depth: int) -> list[Any]:
    if type(v) is not list:
        raise _bad(path, "a JSON array", v)
    return [from_jsonable(item, f"{path}[{i}]", depth) for i, item in enumerate(v)]


def _tagged(tag: str, v: Any, path: str, depth: int) -> Any:
    if tag == "$set" or tag == "$frozenset":
        items = [_hashable(item, f"{path}[{i}]") for i, item in enumerate(_items(v, path, depth))]
        return set(items) if tag == "$set" else frozenset(items)
    if tag == "$tuple":
        return tuple(_items(v, path, depth))
    if tag == "$bytes":
        if type(v) is not str:
            raise _bad(path, "a base64 string", v)
        try:
            return base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _bad(path, "a base64 string", v) from e
    if tag == "$float":
        if type(v) is not str or v not in _NONFINITE:
            raise _bad(path, "'nan', 'inf' or '-inf'", v)
        return _NONFINITE[v]
    if tag == "$numpy":
        return _numpy_scalar(v, path)
    if tag == "$dict":
        if type(v) is not list:
            raise _bad(path, "a JSON array of [key, value] pairs", v)
        out = {}
        for i, pair in enumerate(v):
            if type(pair) is not list or len(pair) != 2:
                raise _bad(f"{path}[{i}]", "a [key, value] pair", pair)
            key = _hashable(from_jsonable(pair[0], f"{path}[{i}][0]", depth), f"{path}[{i}][0]")
            out[key] = from_jsonable(pair[1], f"{path}[{i}][1]", depth)
        return out
    if tag == "$record":
        return _decode_record(v, path, depth)
    raise _bad(path, f"a tag of the format ({', '.join(_TAGS)})", tag)


def _numpy_scalar(v: Any, path: str) -> Any:
    if type(v) is not list or len(v) != 2 or type(v[0]) is not str:
        raise _bad(path, "[dtype name, value]", v)
    name, value = v
    scalar = _NUMPY_SCALARS.get(name)
    if scalar is None:
        raise _bad(f"{path}[0]", f"one of {', '.join(_NUMPY_SCALARS)}", name)
    kind = np.dtype(scalar).kind
    if kind == "b":
        ok = type(value) is bool
    elif kind in "iu":
        info = np.iinfo(scalar)
        ok = type(value) is int and info.min <= value <= info.max
    else:
        ok = type(value) in (int, float) or (type(value) is str and value in _NONFINITE)
    if not ok:
        raise _bad(f"{path}[1]", f"a value of {name}", value)
    if type(value) is str:
        return scalar(_NONFINITE[value])
    if kind == "f":
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not (math.isfinite(value) and abs(value) <= float(np.finfo(scalar).max)):
            raise _bad(f"{path}[1]", f"a finite value within {name}", value)
    return scalar(value)


def _decode_record(v: Any, path: str, depth: int) -> Record:
    if type(v) is not dict or set(v) != {"type", "kind", "fields"}:
        raise _bad(path, "an object with type, kind and fields", v)
    type_name, kind, fields = v["type"], v["kind"], v["fields"]
    if type(type_name) is not str or not type_name:
        raise _bad(f"{path}.type", "a class name", type_name)
    if kind not in RECORD_KINDS:
        raise _bad(f"{path}.kind", " or ".join(RECORD_KINDS), kind)
    if type(fields) is not dict:
        raise _bad(f"{path}.fields", "an object of field values", fields)
    return Record(
        type_name,
        {k: from_jsonable(val, f"{path}.fields.{k}", depth) for k, val in fields.items()},
        kind,
    )
