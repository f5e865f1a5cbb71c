"""Read-only records: connector payloads (stats, events, worker metadata) without pickle.

A connector object that is a dataclass, a ``NamedTuple`` or a msgspec ``Struct`` of plain
values travels as a tagged record: its qualified class name and its fields. Decoding gives a
:class:`Record`, never the class itself, because a file must never make the reader import
anything. A caller who trusts some classes names them (``classes=[KVConnectorStats]``) and
records of exactly those qualified names are rebuilt as those classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from .errors import ConsistencyError, FieldTypeError

__all__ = ["RECORD_KINDS", "Record", "qualified_name", "record_fields"]

#: How a record's class keeps its fields: how to read them and how to rebuild it.
RECORD_KINDS = ("dataclass", "namedtuple", "struct")


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class: the name a record carries and an allow-list matches."""
    return f"{cls.__module__}.{cls.__qualname__}"


def record_fields(x: Any) -> tuple[str, list[str]] | None:
    """(kind, field names) when ``x`` is a dataclass, NamedTuple or msgspec Struct instance."""
    t = type(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return "dataclass", [f.name for f in dataclasses.fields(x)]
    fields = getattr(t, "_fields", None)
    if isinstance(x, tuple) and isinstance(fields, tuple):
        return "namedtuple", list(fields)
    fields = getattr(t, "__struct_fields__", None)
    if isinstance(fields, tuple) and all(type(f) is str for f in fields):
        return "struct", list(fields)
    return None


class Record:
    """A read-only record of a connector object: its class name and its fields.

    Fields read as attributes; two records are equal when their class names, kinds and
    fields are. Nothing is imported to make one.

    Examples
    --------
    >>> r = Record("vllm.KVConnectorStats", {"data": {"bytes": [1, 2]}})
    >>> r.data, r.type_name
    ({'bytes': [1, 2]}, 'vllm.KVConnectorStats')
    >>> r == Record("vllm.KVConnectorStats", {"data": {"bytes": [1, 2]}})
    True
    >>> r.data = {}
    Traceback (most recent call last):
    ...
    AttributeError: Record is read-only
    """

    __slots__ = ("_fields", "_kind", "_type_name")

    def __init__(self, type_name: str, fields: Mapping[str, Any], kind: str = "dataclass") -> None:
        if kind not in RECORD_KINDS:
            raise FieldTypeError("Record.kind", " or ".join(RECORD_KINDS), repr(kind))
        object.__setattr__(self, "_type_name", str(type_name))
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_fields", MappingProxyType(dict(fields)))

    @property
    def type_name(self) -> str:
        """The qualified name of the class the record was made from."""
        return self._type_name

    @property
    def kind(self) -> str:
        """``"dataclass"``, ``"namedtuple"`` or ``"struct"`` (msgspec)."""
        return self._kind

    @property
    def fields(self) -> Mapping[str, Any]:
        """The fields, in the class's order (a read-only mapping)."""
        return self._fields

    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        raise AttributeError(
            f"record of {object.__getattribute__(self, '_type_name')} has no field {name!r}"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Record is read-only")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Record is read-only")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return (
            self._type_name == other._type_name
            and self._kind == other._kind
            and dict(self._fields) == dict(other._fields)
        )

    def __hash__(self) -> int:
        # Hashable exactly when its values are (like a tuple): events can sit in sets.
        return hash((self._type_name, self._kind, tuple(self._fields.items())))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._fields.items())
        return f"Record[{self._type_name}]({inner})"

    def to_dict(self) -> dict[str, Any]:
        """The fields as a new dict."""
        return dict(self._fields)


def rebuild(value: Any, classes: Mapping[str, type], path: str) -> Any:
    """``value`` with every record whose class is in ``classes`` rebuilt as that class.

    ``classes`` maps qualified names to classes (the caller's allow-list); other records stay
    records. Containers are rebuilt around their items, bottom up.
    """
    if not classes:
        return value
    t = type(value)
    if t is list:
        return [rebuild(v, classes, f"{path}[{i}]") for i, v in enumerate(value)]
    if t is tuple:
        return tuple(rebuild(v, classes, f"{path}[{i}]") for i, v in enumerate(value))
    if t is set or t is frozenset:
        return t(rebuild(v, classes, f"{path}{{}}") for v in value)
    if t is dict:
        return {
            rebuild(k, classes, f"{path}<key>"): rebuild(v, classes, f"{path}[{k!r}]")
            for k, v in value.items()
        }
    if t is not Record:
        return value
    fields = {k: rebuild(v, classes, f"{path}.{k}") for k, v in value.fields.items()}
    cls = classes.get(value.type_name)
    if cls is None:
        return Record(value.type_name, fields, value.kind)
    return _construct(cls, value.kind, fields, path)


def _construct(cls: type, kind: str, fields: dict[str, Any], path: str) -> Any:
    if kind == "dataclass" and dataclasses.is_dataclass(cls):
        declared = dataclasses.fields(cls)
        names = [f.name for f in declared]
        init = {f.name for f in declared if f.init}
    else:
        names = list(getattr(cls, "_fields", None) or getattr(cls, "__struct_fields__", ()) or ())
        init = set(names)
    if sorted(names) != sorted(fields):
        raise ConsistencyError(
            path,
            f"the fields of {qualified_name(cls)} ({', '.join(names)})",
            f"a record with fields {', '.join(fields)}",
        )
    try:
        obj = cls(**{k: v for k, v in fields.items() if k in init})
        for k, v in fields.items():
            if k not in init:
                object.__setattr__(obj, k, v)
    except Exception as e:  # the caller's class refused its own fields: say where
        raise ConsistencyError(
            path, f"fields that {qualified_name(cls)} accepts", f"{type(e).__name__}: {e}"
        ) from e
    return obj


def allow_list(classes: Iterable[type] | None) -> dict[str, type]:
    """``classes`` (a caller's allow-list) keyed by qualified name."""
    if classes is None:
        return {}
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Iterable):
        raise FieldTypeError("classes", "an iterable of classes", repr(classes))
    out: dict[str, type] = {}
    for cls in classes:
        if not isinstance(cls, type):
            raise FieldTypeError("classes", "classes (types)", repr(cls))
        out[qualified_name(cls)] = cls
    return out
