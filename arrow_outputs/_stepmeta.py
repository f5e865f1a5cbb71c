"""The step JSON: its structure rules, and whose batch a piece of step metadata belongs to.

Step metadata travels in two places: an in-memory batch's schema metadata (what
:func:`~arrow_outputs.to_record_batch` returns) and an IPC message's custom metadata (what a
stream or file carries per batch). A schema is shared by every batch of a stream or table,
so step metadata found in a schema is trusted only for the very batch that was made with
it: :func:`register` remembers the step column buffer that ``to_record_batch`` allocated
for that batch, and :func:`owns` proves a batch (or a slice of it) still holds that buffer.
It also remembers the batch object itself, so that the batch as it was made (the common
case: written, published or decoded right away) is recognised by :func:`made` without
reading its columns.

Everything read from the JSON is untrusted: :func:`parse` checks every key, type and bound
before any of it is used, and names the metadata path of the first violation.
"""

from __future__ import annotations

import array
import json
import re
import weakref
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import pyarrow as pa

from .errors import StepMetadataError

__all__ = ["made", "made_with", "owns", "parse", "register"]

INT32_MAX = 2**31 - 1
INT64 = (-(2**63), 2**63 - 1)
TENSOR_KINDS = ("torch", "numpy")

Check = Callable[[Any, str], Any]


def _text(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(lo: int, hi: int) -> Check:
    def check(v: Any, path: str) -> Any:
        if type(v) is not int or not lo <= v <= hi:
            raise StepMetadataError(path, f"an int within {lo}..{hi}", _text(v))
        return v

    return check


def _one_of(*values: Any) -> Check:
    def check(v: Any, path: str) -> Any:
        if type(v) not in (str, bool) or v not in values:
            raise StepMetadataError(path, " or ".join(repr(x) for x in values), _text(v))
        return v

    return check


def _optional(inner: Check) -> Check:
    def check(v: Any, path: str) -> Any:
        return None if v is None else inner(v, path)

    return check


def _any(v: Any, path: str) -> Any:
    return v  # connector values: checked when decoded (_jsonish.from_jsonable)


def _obj(spec: dict[str, Check], required: tuple[str, ...] = ()) -> Check:
    def check(v: Any, path: str) -> Any:
        if type(v) is not dict:
            raise StepMetadataError(path, "a JSON object", _text(v))
        unknown = [k for k in v if k not in spec]
        if unknown:
            raise StepMetadataError(
                path, f"keys among {', '.join(spec)}", f"unknown key {unknown[0]!r}"
            )
        missing = [k for k in required if k not in v]
        if missing:
            raise StepMetadataError(path, f"the key {missing[0]!r}", "no such key")
        return {k: spec[k](val, f"{path}.{k}") for k, val in v.items()}

    return check


def _list_of(inner: Check) -> Check:
    def check(v: Any, path: str) -> Any:
        if type(v) is not list:
            raise StepMetadataError(path, "a JSON array", _text(v))
        return [inner(x, f"{path}[{i}]") for i, x in enumerate(v)]

    return check


def _row_keyed(inner: Check) -> Check:
    """An object keyed by row numbers written as decimal strings ("0", "17")."""

    def check(v: Any, path: str) -> Any:
        if type(v) is not dict:
            raise StepMetadataError(path, "a JSON object keyed by row", _text(v))
        for k, val in v.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 10 and str(int(k)) == k):
                raise StepMetadataError(path, "row numbers as keys", _text(k))
            inner(val, f"{path}[{k}]")
        return v

    return check


def _string(v: Any, path: str) -> Any:
    if type(v) is not str:
        raise StepMetadataError(path, "a string", _text(v))
    return v


_WIDTH = _int(0, INT32_MAX)

_LOGPROBS = _obj(
    {
        "kind": _one_of("lists", "tensors"),
        "cu": _one_of("list", "tensor", "none"),
        "width": _WIDTH,
        "cu_dtype": _one_of("int32", "int64"),
    },
    required=("kind", "cu", "width"),
)


def _logprobs(v: Any, path: str) -> Any:
    out = _LOGPROBS(v, path)
    if (out["cu"] == "tensor") != ("cu_dtype" in out):
        raise StepMetadataError(
            f"{path}.cu_dtype",
            "present exactly when cu is 'tensor'",
            "present" if "cu_dtype" in out else "absent",
        )
    return out


def _connector(fields: tuple[str, ...], required: tuple[str, ...] = ()) -> Check:
    return _obj({name: _any for name in fields}, required)


def step_spec(
    kv_fields: tuple[str, ...], ec_fields: tuple[str, ...], cg_fields: tuple[str, ...]
) -> dict[str, Check]:
    """The top-level keys of the step JSON and their rules (``docs/schema.md``)."""
    return {
        "step": _optional(_int(*INT64)),
        "rows": _int(0, INT32_MAX),
        "sampled_token_ids": _one_of("none", "lists"),
        "logprobs": _optional(_logprobs),
        "prompt_logprobs": _optional(
            _obj(
                {"none_rows": _list_of(_int(0, INT32_MAX)), "empty_widths": _row_keyed(_WIDTH)},
                required=("none_rows",),
            )
        ),
        "prompt_token_id_logprobs": _optional(_one_of(*TENSOR_KINDS)),
        "pooler_output": _optional(_one_of(*TENSOR_KINDS)),
        "num_nans_in_logits": _optional(_one_of("dict")),
        "sampling_mask": _optional(
            _obj({"offsets": _one_of(True, False), "cu": _one_of(True, False)}, ("offsets", "cu"))
        ),
        "aux_output": _optional(_obj({"kind": _one_of(*TENSOR_KINDS)}, ("kind",))),
        "kv_connector_output": _optional(_connector(kv_fields)),
        "ec_connector_output": _optional(_connector(ec_fields)),
        "cudagraph_stats": _optional(_connector(cg_fields, cg_fields)),
        "dropped": _list_of(_obj({"field": _string, "type": _string}, ("field", "type"))),
    }


#: Keys a writer of format 1.0 left out when their field was empty; they read as None.
OPTIONAL_KEYS = ("prompt_logprobs", "prompt_token_id_logprobs", "dropped")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# The steps of a run differ in their step number and row count, rarely in anything else:
# what follows those two keys, once fully parsed and checked, is reused for every step that
# has the same bytes there. Keyed by those bytes (and the spec), never by a whole step.
_HEAD = re.compile(
    rb'\{"step":(null|-?(?:0|[1-9][0-9]{0,18})),"rows":(0|[1-9][0-9]{0,9}),(.+)\}', re.S
)
# (id(spec), rest) -> (spec, checked result): the spec is kept so that an id is never reused.
_TAILS: dict[tuple[int, bytes], tuple[dict[str, Check], dict[str, Any]]] = {}
# The head alone, read in place before a tail known to be the last one used.
_HEAD_ONLY = re.compile(rb'\{"step":(null|-?(?:0|[1-9][0-9]{0,18})),"rows":(0|[1-9][0-9]{0,9}),')
# (spec, the last tail used and the closing "}", its checked result): one tuple, replaced
# whole, so threads at worst miss it.
_LAST_TAIL: tuple[dict[str, Check], bytes, dict[str, Any]] | None = None


def parse(raw: Any, path: str, spec: dict[str, Check]) -> dict[str, Any]:
    """The step JSON at ``path`` (bytes from a file), checked against ``spec``.

    The result's nested values may be shared with other results: read them, never change
    them (copy first).
    """
    return parse_shared(raw, path, spec)[0]


def parse_shared(
    raw: Any, path: str, spec: dict[str, Check]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """:func:`parse`, and the checked tail its result was copied from when it reused one
    (None after a full parse): results that share a tail share all their values but the
    step and row count, so what depends on those values alone can be cached by the tail
    (held, so that its id is not another's)."""
    if type(raw) is not bytes:
        return _parse(raw, path, spec), None
    last = _LAST_TAIL
    if last is not None and last[0] is spec and raw.endswith(last[1]):
        # The last tail again (a run's steps, one after another): only the head to read, in
        # place (no copy of the tail, no hash of it).
        got = _HEAD_ONLY.fullmatch(raw, 0, len(raw) - len(last[1]))
        if got is not None:
            out = _with_head(last[2], got[1], got[2])
            if out is not None:
                return out, last[2]
    head = _HEAD.fullmatch(raw)
    if head is not None:
        known = _TAILS.get((id(spec), head[3]))
        if known is not None and known[0] is spec:
            out = _with_head(known[1], head[1], head[2])
            if out is not None:
                _remember_last(spec, head[3], known[1])
                return out, known[1]
    out = _parse(raw, path, spec)
    if head is not None and len(head[3]) <= 4096:
        # Reusable only when the rest holds neither key again (a duplicate key would win
        # over the head in json.loads): proven by parsing the rest on its own.
        try:
            rest = json.loads(b"{" + head[3] + b"}", parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            rest = None
        if type(rest) is dict and "step" not in rest and "rows" not in rest:
            if len(_TAILS) >= 64:
                _TAILS.clear()
            _TAILS[id(spec), head[3]] = (spec, out.copy())
    return out, None


def _with_head(tail: dict[str, Any], step_text: bytes, rows_text: bytes) -> dict[str, Any] | None:
    """A copy of a checked tail with the head's step and row count; None outside the bounds
    of step_spec's "step" and "rows" checks (the full parse then raises its error)."""
    step = None if step_text == b"null" else int(step_text)
    rows = int(rows_text)
    if (step is None or INT64[0] <= step <= INT64[1]) and rows <= INT32_MAX:
        out = tail.copy()
        out["step"], out["rows"] = step, rows
        return out
    return None


def _remember_last(spec: dict[str, Check], rest: bytes, tail: dict[str, Any]) -> None:
    global _LAST_TAIL
    _LAST_TAIL = (spec, rest + b"}", tail)


def _parse(raw: Any, path: str, spec: dict[str, Check]) -> dict[str, Any]:
    if type(raw) is str:
        text = raw
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise StepMetadataError(path, "UTF-8 JSON", f"bytes that are not UTF-8 ({e})") from e
    else:
        raise StepMetadataError(path, "JSON bytes", _text(raw))
    try:
        meta = json.loads(text, parse_constant=_reject_constant)
    except RecursionError as e:
        raise StepMetadataError(path, "JSON of bounded depth", "nesting too deep to parse") from e
    except ValueError as e:
        raise StepMetadataError(path, "JSON", str(e)) from e
    if type(meta) is not dict:
        raise StepMetadataError(path, "a JSON object", type(meta).__name__)
    for key in spec:
        if key not in meta and key not in OPTIONAL_KEYS:
            raise StepMetadataError(f"{path}.{key}", "a value (the key is required)", "no such key")
    unknown = [k for k in meta if k not in spec]
    if unknown:
        raise StepMetadataError(
            path,
            "the keys of this format version (docs/schema.md)",
            f"unknown key {unknown[0]!r} (written by a newer arrow_outputs?)",
        )
    out = {key: spec[key](meta[key], f"{path}.{key}") if key in meta else None for key in spec}
    if out["dropped"] is None:
        out["dropped"] = []
    return out


# ------------------------------------------------------------------------------- layouts


@lru_cache(maxsize=256, typed=True)
def shared_layout(**items: Any) -> dict[str, Any]:
    """One dict object per distinct layout (``typed``: ``True`` and ``1`` stay apart), so
    that steps of one shape hand the step JSON writer the very same objects and it can reuse
    their JSON (``batch._step_json``). Never change the result: it is shared."""
    return dict(items)


# ------------------------------------------------------------------------------- ownership


# step column buffer address -> (weak reference to its int64 array, size, step JSON). No
# callback (it would cost every batch's release): an entry whose array is gone never matches,
# a new array at the same address replaces it, and a full table drops its dead entries
# (_Table.prune).
class _Table(dict[int, tuple[Any, ...]]):
    """Entries whose first item is a weak reference. When it reaches its limit it drops the
    dead ones and never a live one; the limit then becomes twice the live entries (at least
    ``floor``), so pruning costs O(1) per entry added however many stay alive. No lock: an
    entry is added, and a lookup made, by one dict operation (atomic under the GIL), and a
    prune running on another thread meanwhile never drops it (:meth:`prune`)."""

    def __init__(self, floor: int) -> None:
        super().__init__()
        self.floor = self.limit = floor

    def prune(self) -> None:
        """Drop the dead entries (at the limit, before an entry is added), while other
        threads may add and replace entries: each step is one atomic dict operation, and an
        entry found dead is taken out only if it is still the one found; a newer entry
        under its key is put back. Two live objects never share a key (an address, an
        id), so of two entries under one key the older is dead once the newer exists."""
        for key, entry in list(self.items()):
            if entry[0]() is None:
                got = self.pop(key, None)
                if got is not None and got is not entry:
                    self.setdefault(key, got)  # replaced meanwhile: the newer one stays
        self.limit = max(self.floor, 2 * len(self))


_OWNED = _Table(1024)


# id(batch) -> (weak reference to the batch, its step JSON, what its maker knew of it), for
# the whole batches to_record_batch returned; a dead reference never matches (ids are reused
# only after the batch is gone). Same table as _OWNED.
_BATCHES = _Table(1024)


def register(
    values: array.array[int], raw: bytes, batch: pa.RecordBatch, known: Any = None
) -> None:
    """Remember that step metadata ``raw`` belongs to the batch whose step column owns
    ``values`` (a fresh array per batch), for as long as the array lives; and that ``batch``,
    as ``to_record_batch`` returns it (a whole step), was made with it. ``known``: what its
    maker knew of its schema (the run's column types), handed back by :func:`made_with`."""
    address, count = values.buffer_info()  # its memory's address, without a buffer object
    if len(_OWNED) >= _OWNED.limit:
        _OWNED.prune()
    _OWNED[address] = (weakref.ref(values), count * values.itemsize, raw)
    if len(_BATCHES) >= _BATCHES.limit:
        _BATCHES.prune()
    _BATCHES[id(batch)] = (weakref.ref(batch), raw, known)


def made_with(batch: pa.RecordBatch) -> tuple[bytes, Any] | None:
    """(step metadata, ``known``) that ``batch`` was registered with, when it is the very
    batch object ``to_record_batch`` returned (and still registered); else None."""
    entry = _BATCHES.get(id(batch))
    if entry is None or entry[0]() is not batch:
        return None
    return entry[1], entry[2]


def made(batch: pa.RecordBatch) -> bytes | None:
    """The step metadata ``batch`` was made with, when it is the very batch object
    ``to_record_batch`` returned (and still registered); else None: ask :func:`owns`."""
    got = made_with(batch)
    return None if got is None else got[0]


def owns(step_column: pa.Array, raw: bytes) -> bool:
    """True when ``raw`` is the step metadata ``to_record_batch`` made for the batch whose
    step column is ``step_column`` (the batch itself or a slice of it).

    A live buffer has one address, so a batch read from IPC, or one that inherited a schema
    from another batch (a table, a stream), never passes.
    """
    buffers = step_column.buffers()
    buf = buffers[1] if len(buffers) > 1 else None
    if buf is None:
        return False
    entry = _OWNED.get(buf.address)
    if entry is None:
        return False
    ref, size, own = entry
    # At most the registered size: the C assembly's import sizes a buffer by the column's
    # length (0 bytes for a 0-row step over the 1-value array), py_buffer by the array.
    return ref() is not None and buf.size <= size and own == raw
