"""Plain Python data <-> JSON, kind for kind: sets stay sets, tuples stay tuples.

Step-level objects (connector outputs, CUDA-graph stats) travel as JSON in the batch
metadata. JSON has no set, tuple, bytes, non-finite float or non-string key, so those are
tagged as one-key objects (``{"$set": [...]}``). A str-keyed dict whose keys could be
mistaken for a tag is itself tagged, so decoding is unambiguous.

Anything else (an object of some connector's own class) is *opaque*: it is never pickled.
``opaque="drop"`` records it (field path and type) and replaces it with None, with an
:class:`~arrow_outputs.errors.OpaqueValueWarning`; ``opaque="error"`` raises.
"""

from __future__ import annotations

import base64
import contextlib
import math
import warnings
from typing import Any

import numpy as np

from .errors import OpaqueValueWarning, UnsupportedValueError

__all__ = ["Dropped", "from_jsonable", "to_jsonable"]

_TAGS = ("$set", "$frozenset", "$tuple", "$bytes", "$float", "$numpy", "$dict")

Dropped = list[dict[str, str]]


def to_jsonable(x: Any, field: str, opaque: str, dropped: Dropped) -> Any:
    """Encode plain data; opaque values are dropped into ``dropped`` or raise."""
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return x
    if t is float:
        return x if math.isfinite(x) else {"$float": repr(x)}
    if t is list:
        return [to_jsonable(v, f"{field}[{i}]", opaque, dropped) for i, v in enumerate(x)]
    if t is tuple:
        return {
            "$tuple": [to_jsonable(v, f"{field}[{i}]", opaque, dropped) for i, v in enumerate(x)]
        }
    if t is set or t is frozenset:
        items = [to_jsonable(v, f"{field}{{}}", opaque, dropped) for v in x]
        # Sorted when the items allow it, so equal sets give equal bytes.
        with contextlib.suppress(TypeError):
            items.sort()
        return {"$set" if t is set else "$frozenset": items}
    if t is bytes:
        return {"$bytes": base64.b64encode(x).decode()}
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        # numpy scalars (block ids from an array, say): kept with their dtype.
        value = x.item()
        if type(value) is float and not math.isfinite(value):
            value = repr(value)
        return {"$numpy": [x.dtype.name, value]}
    if t is dict:
        if all(type(k) is str and not k.startswith("$") for k in x):
            return {k: to_jsonable(v, f"{field}.{k}", opaque, dropped) for k, v in x.items()}
        return {
            "$dict": [
                [
                    to_jsonable(k, f"{field}<key>", opaque, dropped),
                    to_jsonable(v, f"{field}[{k!r}]", opaque, dropped),
                ]
                for k, v in x.items()
            ]
        }
    type_name = f"{t.__module__}.{t.__qualname__}"
    if opaque == "error":
        raise UnsupportedValueError(
            field,
            "plain data (None, bool, int, float, str, bytes, list, tuple, set, dict); "
            "arrow_outputs never pickles",
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


def from_jsonable(x: Any) -> Any:
    """Inverse of :func:`to_jsonable`."""
    if type(x) is list:
        return [from_jsonable(v) for v in x]
    if type(x) is not dict:
        return x
    if len(x) == 1:
        ((tag, v),) = x.items()
        if tag == "$set":
            return {from_jsonable(i) for i in v}
        if tag == "$frozenset":
            return frozenset(from_jsonable(i) for i in v)
        if tag == "$tuple":
            return tuple(from_jsonable(i) for i in v)
        if tag == "$bytes":
            return base64.b64decode(v)
        if tag == "$float":
            return float(v)
        if tag == "$numpy":
            dtype, value = v
            return np.dtype(dtype).type(float(value) if type(value) is str else value)
        if tag == "$dict":
            return {from_jsonable(k): from_jsonable(val) for k, val in v}
    return {k: from_jsonable(v) for k, v in x.items()}
