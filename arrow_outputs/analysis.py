"""Analytics over a run's record batches: token logprobs, perplexity, top-k entropy,
speculative-decoding acceptance and sampling-mask sizes.

Every function takes the batches of a run in any Arrow form (a ``pyarrow.Table``, a
``RecordBatch``, a ``RecordBatchReader``, a list of batches, any object with
``__arrow_c_stream__`` or ``__arrow_c_array__``, or the path of a run file) and returns a
``pyarrow.Table`` (or, for :func:`summary`, a dict of plain Python values). Only the columns a
function needs must be present, so ``table.select([...])`` and filtered tables work too.

The work is done with ``pyarrow.compute`` and numpy over the flattened values and offsets of
each record batch: the only Python loops are over batches and columns, never over rows.

Layout facts this module relies on (see ``docs/schema.md`` and vLLM 0.33):

- A ``logprobs`` cell holds one struct per *position* of the request in that step. The first
  entry of every position's ``token_ids`` / ``logprobs`` row is the sampled token; entries
  ``1..k`` are the top-k tokens, most likely first (the sampled token may appear among them
  again).
- With speculative decoding vLLM keeps one logprob position per *verified* position, so a
  request may have more positions than sampled tokens (rejected rows carry token id 0); the
  ``j``-th sampled token of a request in a step belongs to its ``j``-th position.
- A null ``logprobs`` / ``sampling_mask`` / ``sampled_token_ids`` cell means the step had no
  such data for that request (absent logprobs, a pooling step): it contributes no position
  and no token; it is never an error. Nulls *inside* a cell (a null position, a null token
  id) are not part of the format and are refused.

Inputs are untrusted: every column a function reads is validated in full before numpy looks at
its offsets, and every failure is an :class:`~arrow_outputs.ArrowOutputsError` naming the column.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import FieldTypeError, OffsetsError, SchemaMismatchError
from .schema import KEY_STEP

__all__ = [
    "acceptance_lengths",
    "as_table",
    "mask_sizes",
    "per_request",
    "summary",
    "token_logprobs",
    "topk_entropy",
]

# ----------------------------------------------------------------------------- input


def as_table(data: Any) -> pa.Table:
    """The run's batches as one ``pyarrow.Table`` (no copy for tables and batches; a batch's
    step JSON is left out of the table's schema, which is every batch's).

    Parameters
    ----------
    data
        A ``pyarrow.Table``, a ``pyarrow.RecordBatch``, a ``pyarrow.RecordBatchReader``, an
        iterable of record batches, an object with ``__arrow_c_stream__`` (a run reader, a
        Polars DataFrame) or ``__arrow_c_array__``, or a run file: its path (``str`` /
        ``os.PathLike``) or its bytes, read with :func:`arrow_outputs.read_table` (which
        validates every batch).

    Returns
    -------
    pyarrow.Table

    Raises
    ------
    FieldTypeError
        For anything else.

    Examples
    --------
    >>> import arrow_outputs as ao
    >>> batch = ao.to_record_batch(ao.ModelRunnerOutput(["a"], {"a": 0}, [[7]]), step=0)
    >>> as_table(batch).num_rows
    1
    """
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return _from_batches([data])
    if isinstance(data, pa.RecordBatchReader):
        return data.read_all()
    if isinstance(data, (str, os.PathLike, bytes, pa.Buffer)):
        from .reader import read_table  # validates every batch: files are untrusted

        return read_table(os.fspath(data) if isinstance(data, os.PathLike) else data)
    if hasattr(data, "__arrow_c_stream__"):
        return pa.RecordBatchReader.from_stream(data).read_all()
    if hasattr(data, "__arrow_c_array__"):
        return _from_batches([pa.record_batch(data)])
    if isinstance(data, Iterable) and not isinstance(data, dict):
        batches = list(data)
        if batches and all(isinstance(b, pa.RecordBatch) for b in batches):
            return _from_batches(batches)
        kinds = sorted({type(b).__name__ for b in batches}) or ["nothing"]
        raise FieldTypeError(
            "data", "a non-empty iterable of pyarrow.RecordBatch", f"one of {', '.join(kinds)}"
        )
    raise FieldTypeError(
        "data",
        "a pyarrow Table, RecordBatch or RecordBatchReader, record batches, "
        "an Arrow C stream or array, or a run file path",
        type(data).__name__,
    )


def _from_batches(batches: list[pa.RecordBatch]) -> pa.Table:
    # The table's schema without the first batch's step JSON, which is no other batch's.
    schema = batches[0].schema
    for i, batch in enumerate(batches):
        if not batch.schema.equals(schema):  # metadata aside: each batch has its own step
            raise SchemaMismatchError(
                f"data[{i}]",
                "record batches of one schema (a run's: see arrow_outputs.run_schema)",
                "a batch whose schema differs from batch 0's: "
                + _first_difference(schema, batch.schema),
            )
    metadata = {k: v for k, v in (schema.metadata or {}).items() if k != KEY_STEP}
    return pa.Table.from_batches(batches, schema=schema.with_metadata(metadata))


def _first_difference(a: pa.Schema, b: pa.Schema) -> str:
    for fa, fb in zip(a, b):
        if not fa.equals(fb):
            return f"{fb.name}: {fb.type} instead of {fa.type}"
    return f"{len(b)} columns instead of {len(a)}"


# ----------------------------------------------------------------------------- column checks

_LIST = (pa.types.is_list, pa.types.is_large_list)


def _is_list(t: pa.DataType) -> bool:
    return any(f(t) for f in _LIST)


def _is_int_list(t: pa.DataType) -> bool:
    return _is_list(t) and pa.types.is_integer(t.value_type)


def _logprobs_type_ok(t: pa.DataType) -> bool:
    if not (_is_list(t) and pa.types.is_struct(t.value_type)):
        return False
    s = t.value_type
    names = {s.field(i).name: s.field(i).type for i in range(s.num_fields)}
    return (
        _is_int_list(names.get("token_ids", pa.null()))
        and _is_list(names.get("logprobs", pa.null()))
        and pa.types.is_floating(names["logprobs"].value_type)
        and pa.types.is_integer(names.get("rank", pa.null()))
    )


# column -> (check, what it must be)
_COLUMN_RULES: dict[str, tuple[Any, str]] = {
    "step": (pa.types.is_integer, "an integer column"),
    "req_id": (
        lambda t: pa.types.is_string(t) or pa.types.is_large_string(t),
        "a string column",
    ),  # string_view (Polars') is cast to large_string first: compute's take has no kernel
    "sampled_token_ids": (_is_int_list, "a list<integer> column"),
    "logprobs": (
        _logprobs_type_ok,
        "a list<struct<token_ids: list<integer>, logprobs: list<float>, rank: integer>> column",
    ),
    "sampling_mask": (
        lambda t: _is_list(t) and _is_int_list(t.value_type),
        "a list<large_list<int32>> column",
    ),
}


def _prepare(data: Any, names: Iterable[str]) -> pa.Table:
    """The input as a table, its needed columns checked."""
    table = as_table(data)
    if "req_id" in table.schema.names and pa.types.is_string_view(
        table.schema.field("req_id").type
    ):
        i = table.schema.get_field_index("req_id")
        table = table.set_column(i, "req_id", table.column(i).cast(pa.large_string()))
    _check_columns(table, names)
    for name in names:
        # Offsets are read as numpy below: out-of-order or out-of-bounds ones must stop here
        # (IPC readers validate only the structure; this is O(columns), not a pass per row).
        try:
            table.column(name).validate(full=True)
        except pa.ArrowInvalid as e:
            raise OffsetsError(
                name, "valid Arrow data (ascending offsets within their values)", str(e)
            ) from e
    return table


def _check_columns(table: pa.Table, names: Iterable[str]) -> None:
    for name in names:
        if name not in table.schema.names:
            raise SchemaMismatchError(
                name, f"{_COLUMN_RULES[name][1]} named {name!r}", "no such column"
            )
        check, what = _COLUMN_RULES[name]
        field_type = table.schema.field(name).type
        if not check(field_type):
            raise SchemaMismatchError(name, what, str(field_type))
    if "req_id" in names and table.column("req_id").null_count:
        raise SchemaMismatchError(
            "req_id", "no null request ids", f"{table.column('req_id').null_count} null"
        )


def _no_nulls(arr: pa.Array, field: str, what: str) -> None:
    if arr.null_count:
        raise SchemaMismatchError(field, f"no null {what}", f"{arr.null_count} null")


def _lengths(arr: pa.Array) -> np.ndarray:
    """Per-row list lengths as int64, 0 for a null row (``flatten`` skips null rows)."""
    # The offsets of a sliced array are sliced with it; np.diff over them is one pass.
    lengths = np.diff(np.asarray(arr.offsets, dtype=np.int64))
    if arr.null_count:
        lengths[~_valid(arr)] = 0
    return lengths


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Exclusive running sum: where each row's items begin in the flattened values."""
    out = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=out[1:])
    return out


def _ints(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.int64)


def _valid(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


# ----------------------------------------------------------------------------- per batch


@dataclass
class _Tokens:
    row: np.ndarray  # the batch row of each sampled token
    token_id: np.ndarray
    index: np.ndarray  # its index among the row's tokens of this step
    per_row: np.ndarray  # sampled tokens per row


def _tokens(batch: pa.RecordBatch) -> _Tokens:
    col = batch.column("sampled_token_ids")
    per_row = _lengths(col)
    flat = col.flatten()
    _no_nulls(flat, "sampled_token_ids", "token ids")
    row = np.repeat(np.arange(len(per_row), dtype=np.int64), per_row)
    index = np.arange(len(row), dtype=np.int64) - _starts(per_row)[row]
    return _Tokens(row, _ints(flat), index, per_row)


@dataclass
class _Positions:
    """The logprob positions of one batch, flattened: one entry per position."""

    row: np.ndarray  # the batch row of each position
    index: np.ndarray  # its index among the row's positions
    per_row: np.ndarray  # positions per row (0 for a null cell)
    width: np.ndarray  # entries per position: 1 (the sampled token) + k
    start: np.ndarray  # where each position's entries begin in ids / values
    ids: np.ndarray  # every entry's token id (int64)
    values: np.ndarray  # every entry's logprob (float64)
    rank: np.ndarray  # the rank of each position's sampled token


def _positions(batch: pa.RecordBatch) -> _Positions:
    col = batch.column("logprobs")
    per_row = _lengths(col)
    structs = col.flatten()
    _no_nulls(structs, "logprobs", "positions")
    # StructArray.flatten honours the struct's own slice offset (and .field does not in older
    # pyarrow), so a sliced or filtered table reads the right children.
    fields = dict(zip([f.name for f in structs.type], structs.flatten()))
    id_lists, lp_lists, rank = fields["token_ids"], fields["logprobs"], fields["rank"]
    _no_nulls(id_lists, "logprobs.token_ids", "lists")
    _no_nulls(lp_lists, "logprobs.logprobs", "lists")
    _no_nulls(rank, "logprobs.rank", "ranks")
    width = _lengths(id_lists)
    lp_width = _lengths(lp_lists)
    if not np.array_equal(width, lp_width):
        bad = int(np.flatnonzero(width != lp_width)[0])
        raise OffsetsError(
            f"logprobs[{bad}]",
            "token_ids and logprobs of equal length at every position",
            f"{width[bad]} token ids and {lp_width[bad]} logprobs",
        )
    if len(width) and width.min() < 1:
        bad = int(np.flatnonzero(width < 1)[0])
        raise OffsetsError(
            f"logprobs[{bad}].token_ids",
            "at least one entry per position (the sampled token)",
            "an empty list",
        )
    ids_flat, values_flat = id_lists.flatten(), lp_lists.flatten()
    _no_nulls(ids_flat, "logprobs.token_ids", "token ids")
    _no_nulls(values_flat, "logprobs.logprobs", "logprobs")
    row = np.repeat(np.arange(len(per_row), dtype=np.int64), per_row)
    return _Positions(
        row=row,
        index=np.arange(len(row), dtype=np.int64) - _starts(per_row)[row],
        per_row=per_row,
        width=width,
        start=_starts(width),
        ids=_ints(ids_flat),
        values=np.asarray(values_flat.to_numpy(), dtype=np.float64),
        rank=_ints(rank),
    )


# Batches are merged up to this many bytes of the needed columns before the numpy work: a
# run of many small steps then costs few passes, while a memory-mapped run of any size is
# never copied whole into memory.
_GROUP_BYTES = 16 << 20


def _batches(table: pa.Table, names: Iterable[str]) -> Iterator[tuple[int, pa.RecordBatch]]:
    """The needed columns in batches, each with the table row its first row is (a loop over
    steps, not rows)."""
    group: list[pa.RecordBatch] = []
    size = first = 0
    for batch in table.select(list(names)).to_batches():
        group.append(batch)
        size += batch.nbytes
        if size >= _GROUP_BYTES:
            yield from _merged(first, group)
            first += sum(b.num_rows for b in group)
            group, size = [], 0
    if group:
        yield from _merged(first, group)


def _merged(first: int, group: list[pa.RecordBatch]) -> Iterator[tuple[int, pa.RecordBatch]]:
    if len(group) == 1:
        yield first, group[0]
        return
    for batch in pa.Table.from_batches(group).combine_chunks().to_batches():
        yield first, batch
        first += batch.num_rows


def _concat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)


def _key_columns(table: pa.Table, rows: np.ndarray) -> dict[str, pa.ChunkedArray | pa.Array]:
    """step and req_id of the given table rows (one take per column)."""
    idx = pa.array(rows, pa.int64())
    out: dict[str, pa.ChunkedArray | pa.Array] = {}
    for name in ("step", "req_id"):
        out[name] = table.column(name).take(idx).combine_chunks()
    return out


def _masked(values: np.ndarray, valid: np.ndarray, type_: pa.DataType) -> pa.Array:
    return pa.array(values, type_, mask=~valid)


# ----------------------------------------------------------------------------- public


def token_logprobs(data: Any) -> pa.Table:
    """One row per sampled token, with its logprob and rank.

    The token's logprob is the entry of its position's logprobs row whose id is the sampled
    id: the first entry in vLLM's layout, so a token is found at once; should the first
    entry hold another id, the row's top-k entries are searched. The ``j``-th token a
    request sampled in a step belongs to its ``j``-th logprob position (speculative decoding
    keeps one position per verified draft, so there may be more positions than tokens).

    Parameters
    ----------
    data
        The run (see :func:`as_table`); needs ``step``, ``req_id``, ``sampled_token_ids`` and
        ``logprobs``.

    Returns
    -------
    pyarrow.Table
        ``step`` (int64), ``req_id`` (string), ``position`` (int64: the token's index in the
        request's output over the table's rows, in table order, which is step order for a
        run), ``step_position`` (int64: its index among the tokens the request sampled in
        that step; above 0 only with speculative decoding), ``token_id`` (int64),
        ``logprob`` (float32, null when the step has no logprobs for the request or the id
        is not in the row) and ``rank`` (int64, the token's rank in the vocabulary, 1 = most
        likely; null where ``logprob`` is null or the token was not the row's first entry).

    Raises
    ------
    SchemaMismatchError
        A needed column is missing or of another type, or holds nulls inside a cell.
    OffsetsError
        A position whose ``token_ids`` and ``logprobs`` differ in length, or are empty.

    Examples
    --------
    >>> import numpy as np
    >>> import arrow_outputs as ao
    >>> out = ao.ModelRunnerOutput(
    ...     ["a", "b"], {"a": 0, "b": 1}, [[5], [6, 7]],
    ...     logprobs=ao.LogprobsLists(
    ...         np.array([[5, 5], [6, 1], [7, 7]]),
    ...         np.array([[-0.5, -0.5], [-1.0, -0.2], [-0.1, -0.1]], np.float32),
    ...         np.array([1, 2, 1]), [0, 1, 3]))
    >>> t = token_logprobs(ao.to_record_batch(out, step=0))
    >>> t.column("logprob").to_pylist()
    [-0.5, -1.0, -0.10000000149011612]
    >>> t.column("step_position").to_pylist()
    [0, 0, 1]
    """
    table = _prepare(data, ("step", "req_id", "sampled_token_ids", "logprobs"))
    tok = _token_logprobs(table)
    keys = _key_columns(table, tok.rows)
    codes, _ = _codes(table)
    return pa.table(
        {
            **keys,
            "position": pa.array(_cumcount(codes[tok.rows]), pa.int64()),
            "step_position": pa.array(tok.step_position, pa.int64()),
            "token_id": pa.array(tok.token_id, pa.int64()),
            "logprob": _masked(tok.logprob.astype(np.float32), tok.scored, pa.float32()),
            "rank": _masked(tok.rank, tok.ranked, pa.int64()),
        }
    )


@dataclass
class _TokenLogprobs:
    rows: np.ndarray  # the table row of each sampled token
    step_position: np.ndarray
    token_id: np.ndarray
    logprob: np.ndarray  # float64; 0 where not scored
    scored: np.ndarray  # bool: the token has a logprob
    rank: np.ndarray
    ranked: np.ndarray  # bool: the token was its position's first entry


def _token_logprobs(table: pa.Table) -> _TokenLogprobs:
    parts: dict[str, list[np.ndarray]] = {
        k: [] for k in ("rows", "step_position", "token_id", "logprob", "scored", "rank", "ranked")
    }
    for first, batch in _batches(table, ("sampled_token_ids", "logprobs")):
        tok = _tokens(batch)
        n = len(tok.row)
        lp = np.zeros(n, np.float64)
        rk = np.zeros(n, np.int64)
        scored = np.zeros(n, bool)
        first_entry = np.zeros(n, bool)
        if n and batch.column("logprobs").null_count < batch.num_rows:
            pos = _positions(batch)
            # The token's position: the row's first position plus the token's index, when
            # the row has that many positions (a null cell has none).
            has_pos = np.flatnonzero(tok.index < pos.per_row[tok.row])
            p = _starts(pos.per_row)[tok.row[has_pos]] + tok.index[has_pos]
            is_first = pos.ids[pos.start[p]] == tok.token_id[has_pos]
            hit = has_pos[is_first]
            lp[hit] = pos.values[pos.start[p[is_first]]]
            rk[hit] = pos.rank[p[is_first]]
            first_entry[hit] = True
            scored[hit] = True
            # Tokens whose position's first entry is another id: search their whole rows.
            miss, mp = has_pos[~is_first], p[~is_first]
            if len(miss):
                w = pos.width[mp]
                owner = np.repeat(np.arange(len(miss)), w)
                elem = np.arange(len(owner)) - _starts(w)[owner] + pos.start[mp][owner]
                match = np.flatnonzero(pos.ids[elem] == tok.token_id[miss][owner])
                # The first match of each token: matches come in token order.
                found, first_match = np.unique(owner[match], return_index=True)
                lp[miss[found]] = pos.values[elem[match[first_match]]]
                scored[miss[found]] = True
        parts["rows"].append(tok.row + first)
        parts["step_position"].append(tok.index)
        parts["token_id"].append(tok.token_id)
        parts["logprob"].append(lp)
        parts["scored"].append(scored)
        parts["rank"].append(rk)
        parts["ranked"].append(first_entry)
    return _TokenLogprobs(
        rows=_concat(parts["rows"], np.int64),
        step_position=_concat(parts["step_position"], np.int64),
        token_id=_concat(parts["token_id"], np.int64),
        logprob=_concat(parts["logprob"], np.float64),
        scored=_concat(parts["scored"], bool),
        rank=_concat(parts["rank"], np.int64),
        ranked=_concat(parts["ranked"], bool),
    )


def _codes(table: pa.Table) -> tuple[np.ndarray, pa.Array]:
    """Integer codes of the table's request ids (in order of first appearance), and the
    distinct ids."""
    encoded = pc.dictionary_encode(table.column("req_id").combine_chunks())
    return _ints(encoded.indices), encoded.dictionary


def _cumcount(codes: np.ndarray) -> np.ndarray:
    """For each item, how many items with the same code come before it."""
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes) if len(codes) else np.empty(0, np.int64)
    out = np.empty(len(codes), np.int64)
    out[order] = np.arange(len(codes)) - _starts(counts)[codes[order]]
    return out


def per_request(data: Any) -> pa.Table:
    """One row per request: tokens, sequence logprob, mean logprob and perplexity.

    Parameters
    ----------
    data
        The run (see :func:`as_table`); needs ``step``, ``req_id``, ``sampled_token_ids`` and
        ``logprobs``.

    Returns
    -------
    pyarrow.Table
        One row per distinct ``req_id``, in order of first appearance: ``req_id``, ``steps``
        (rows of the request), ``first_step`` and ``last_step``, ``tokens`` (sampled
        tokens), ``scored_tokens`` (tokens with a logprob), ``sequence_logprob`` (float64:
        the sum of the scored tokens' logprobs), ``mean_logprob`` (its mean per scored
        token) and ``perplexity`` (``exp(-mean_logprob)``). The last three are null for a
        request with no scored token (a pooling request, logprobs not asked for).

    Examples
    --------
    >>> import numpy as np
    >>> import arrow_outputs as ao
    >>> out = ao.ModelRunnerOutput(
    ...     ["a"], {"a": 0}, [[5, 6]],
    ...     logprobs=ao.LogprobsLists(
    ...         np.array([[5], [6]]), np.array([[-1.0], [-3.0]], np.float32),
    ...         np.array([1, 4]), [0, 2]))
    >>> r = per_request(ao.to_record_batch(out, step=0)).to_pylist()[0]
    >>> r["sequence_logprob"], r["mean_logprob"], round(r["perplexity"], 4)
    (-4.0, -2.0, 7.3891)
    """
    table = _prepare(data, ("step", "req_id", "sampled_token_ids", "logprobs"))
    return _per_request(table, _token_logprobs(table))


def _per_request(table: pa.Table, tok: _TokenLogprobs) -> pa.Table:
    row_codes, names = _codes(table)
    n = len(names)
    tok_codes = row_codes[tok.rows]
    count = np.bincount(tok_codes, minlength=n)
    scored_count = np.bincount(tok_codes, weights=tok.scored, minlength=n).astype(np.int64)
    total = np.bincount(tok_codes, weights=np.where(tok.scored, tok.logprob, 0.0), minlength=n)
    has = scored_count > 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mean = np.where(has, total / np.maximum(scored_count, 1), 0.0)
        ppl = np.exp(-mean)
    step = table.column("step")
    step_valid = _valid(step)
    steps = _ints(step.fill_null(0))
    first = np.full(n, np.iinfo(np.int64).max)
    last = np.full(n, np.iinfo(np.int64).min)
    np.minimum.at(first, row_codes[step_valid], steps[step_valid])
    np.maximum.at(last, row_codes[step_valid], steps[step_valid])
    any_step = np.bincount(row_codes[step_valid], minlength=n) > 0
    return pa.table(
        {
            "req_id": names,
            "steps": pa.array(np.bincount(row_codes, minlength=n), pa.int64()),
            "first_step": _masked(first, any_step, pa.int64()),
            "last_step": _masked(last, any_step, pa.int64()),
            "tokens": pa.array(count, pa.int64()),
            "scored_tokens": pa.array(scored_count, pa.int64()),
            "sequence_logprob": _masked(total, has, pa.float64()),
            "mean_logprob": _masked(mean, has, pa.float64()),
            "perplexity": _masked(ppl, has, pa.float64()),
        }
    )


def topk_entropy(data: Any) -> pa.Table:
    """One row per logprob position: the entropy of its renormalised top-k distribution.

    A position's row holds the sampled token first, then the ``k`` most likely tokens. The
    file keeps only those ``k`` logprobs, not the whole distribution, so the entropy is that
    of the top-k probabilities renormalised to sum to 1 (in nats): 0 when one token held all
    the top-k mass, ``log(k)`` when the ``k`` were equally likely.

    Parameters
    ----------
    data
        The run (see :func:`as_table`); needs ``step``, ``req_id``, ``sampled_token_ids`` and
        ``logprobs``.

    Returns
    -------
    pyarrow.Table
        ``step``, ``req_id``, ``step_position`` (int64: the position's index among the
        request's positions in that step), ``token_id`` (int64: the position's first entry,
        the sampled token), ``sampled`` (bool: the request sampled a token at this position;
        false for the rejected rows of speculative decoding), ``k`` (int64: top-k entries),
        ``topk_mass`` (float64: the probability the top-k tokens held) and ``entropy``
        (float64; null when ``k`` is 0 or no top-k logprob is finite).

    Examples
    --------
    >>> import numpy as np
    >>> import arrow_outputs as ao
    >>> lp = np.log(np.array([[0.5, 0.5, 0.25, 0.25]], np.float32))  # sampled, then top-3
    >>> out = ao.ModelRunnerOutput(
    ...     ["a"], {"a": 0}, [[5]],
    ...     logprobs=ao.LogprobsLists(np.array([[5, 5, 1, 2]]), lp, np.array([1])))
    >>> e = topk_entropy(ao.to_record_batch(out, step=0)).to_pylist()[0]
    >>> e["k"], round(e["topk_mass"], 6), round(e["entropy"], 6)  # -(.5 ln .5 + 2 .25 ln .25)
    (3, 1.0, 1.039721)
    """
    table = _prepare(data, ("step", "req_id", "sampled_token_ids", "logprobs"))
    cols: dict[str, list[np.ndarray]] = {
        k: [] for k in ("row", "index", "token", "sampled", "k", "mass", "defined", "entropy")
    }
    for first, batch in _batches(table, ("sampled_token_ids", "logprobs")):
        if batch.column("logprobs").null_count == batch.num_rows:
            continue
        pos = _positions(batch)
        n_pos = len(pos.row)
        owner = np.repeat(np.arange(n_pos), pos.width)
        is_top = np.arange(len(owner)) - pos.start[owner] >= 1  # entry 0 is the sampled one
        top_owner, top_lp = owner[is_top], pos.values[is_top]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            # Shift by each position's largest top-k logprob before exp (log-sum-exp), so
            # very negative logprobs do not underflow to a zero mass.
            peak = np.full(n_pos, -np.inf)
            np.maximum.at(peak, top_owner, top_lp)
            p = np.exp(top_lp - peak[top_owner])
            p[~np.isfinite(p)] = 0.0  # -inf logprobs: no mass
            scaled_mass = np.bincount(top_owner, weights=p, minlength=n_pos)
            log_mass = np.log(scaled_mass) + peak
            q_log = top_lp - log_mass[top_owner]  # log of the renormalised probability
            terms = np.where(p > 0, -np.exp(q_log) * q_log, 0.0)
            entropy = np.bincount(top_owner, weights=terms, minlength=n_pos)
            mass = np.exp(log_mass)
        cols["row"].append(pos.row + first)
        cols["index"].append(pos.index)
        cols["token"].append(pos.ids[pos.start])
        tokens_per_row = _lengths(batch.column("sampled_token_ids"))
        cols["sampled"].append(pos.index < tokens_per_row[pos.row])
        cols["k"].append(pos.width - 1)
        cols["mass"].append(np.where(pos.width > 1, mass, 0.0))
        # Defined where some top-k logprob is finite (the mass itself may underflow to 0).
        cols["defined"].append((pos.width > 1) & np.isfinite(peak) & np.isfinite(entropy))
        cols["entropy"].append(entropy)
    rows = _concat(cols["row"], np.int64)
    mass = _concat(cols["mass"], np.float64)
    entropy = _concat(cols["entropy"], np.float64)
    k = _concat(cols["k"], np.int64)
    ok = _concat(cols["defined"], bool)
    return pa.table(
        {
            **_key_columns(table, rows),
            "step_position": pa.array(_concat(cols["index"], np.int64), pa.int64()),
            "token_id": pa.array(_concat(cols["token"], np.int64), pa.int64()),
            "sampled": pa.array(_concat(cols["sampled"], bool), pa.bool_()),
            "k": pa.array(k, pa.int64()),
            "topk_mass": pa.array(mass, pa.float64()),
            "entropy": _masked(np.where(ok, entropy, 0.0), ok, pa.float64()),
        }
    )


def acceptance_lengths(data: Any) -> pa.Table:
    """Tokens per request per step: the acceptance length of speculative decoding.

    In a speculative step a request verifies its draft tokens, accepts a prefix of them and
    samples one more token, so it gets ``accepted_drafts + 1`` tokens. vLLM's model runner V2
    keeps one logprob (and sampling-mask) position per verified position, so the number of
    positions is ``draft_tokens + 1``. A producer that keeps positions only for the sampled
    tokens (vLLM's older runner) makes ``draft_tokens`` equal ``accepted_drafts``: the
    drafts it rejected are not in the file.

    Parameters
    ----------
    data
        The run (see :func:`as_table`); needs ``step``, ``req_id`` and ``sampled_token_ids``;
        ``draft_tokens`` needs ``logprobs`` or ``sampling_mask``.

    Returns
    -------
    pyarrow.Table
        One row per table row that sampled at least one token (rows of pooling steps and of
        chunked-prefill steps that sampled nothing are left out): ``step``, ``req_id``,
        ``tokens`` (int64, the acceptance length), ``accepted_drafts`` (``tokens - 1``) and
        ``draft_tokens`` (int64: verified positions - 1, from the ``logprobs`` cell, else the
        ``sampling_mask`` cell; null when neither is there).

    Examples
    --------
    >>> import arrow_outputs as ao
    >>> out = ao.ModelRunnerOutput(["a", "b", "c"], {"a": 0, "b": 1, "c": 2}, [[1, 2, 3], [4], []])
    >>> acceptance_lengths(ao.to_record_batch(out, step=0)).column("tokens").to_pylist()
    [3, 1]
    """
    table = _prepare(data, ("step", "req_id", "sampled_token_ids"))
    sources = [c for c in ("logprobs", "sampling_mask") if c in table.schema.names]
    _check_columns(table, sources)
    rows, tokens, drafts, has_drafts = [], [], [], []
    for first, batch in _batches(table, ("sampled_token_ids", *sources)):
        sampled = batch.column("sampled_token_ids")
        _no_nulls(sampled.flatten(), "sampled_token_ids", "token ids")
        n_tok = _lengths(sampled)
        positions = np.zeros(batch.num_rows, np.int64)
        known = np.zeros(batch.num_rows, bool)
        for name in sources:  # logprobs first: it wins where both are there
            col = batch.column(name)
            valid = _valid(col) & ~known
            positions[valid] = _lengths(col)[valid]
            known |= valid
        keep = np.flatnonzero(n_tok > 0)
        rows.append(keep + first)
        tokens.append(n_tok[keep])
        drafts.append(positions[keep] - 1)
        has_drafts.append(known[keep] & (positions[keep] > 0))
    all_rows = _concat(rows, np.int64)
    n = _concat(tokens, np.int64)
    return pa.table(
        {
            **_key_columns(table, all_rows),
            "tokens": pa.array(n, pa.int64()),
            "accepted_drafts": pa.array(n - 1, pa.int64()),
            "draft_tokens": _masked(
                _concat(drafts, np.int64), _concat(has_drafts, bool), pa.int64()
            ),
        }
    )


def mask_sizes(data: Any, *, by: Literal["position", "step"] = "position") -> pa.Table:
    """How many token ids the sampling mask kept, per position or per step.

    Parameters
    ----------
    data
        The run (see :func:`as_table`); needs ``step``, ``req_id`` and ``sampling_mask``.
    by
        ``"position"``: one row per mask position: ``step``, ``req_id``, ``step_position``
        (the position's index among the request's positions in that step) and ``size``
        (int64, ids kept). ``"step"``: one row per step, ascending: ``step``, ``positions``,
        ``kept`` (ids kept in all), ``mean_size`` (float64), ``min_size``, ``max_size``.

    Returns
    -------
    pyarrow.Table
        Rows whose ``sampling_mask`` cell is null (no masks that step) add nothing.

    Examples
    --------
    >>> import numpy as np
    >>> import arrow_outputs as ao
    >>> masks = ao.SamplingMaskLists(
    ...     np.array([1, 2, 3, 4, 5, 6], np.int32), np.array([0, 1, 3, 6]), [0, 1, 3])
    >>> out = ao.ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[1], [2, 4]],
    ...                            sampling_masks=masks)
    >>> mask_sizes(ao.to_record_batch(out, step=0)).column("size").to_pylist()
    [1, 2, 3]
    >>> mask_sizes(ao.to_record_batch(out, step=0), by="step").to_pylist()
    [{'step': 0, 'positions': 3, 'kept': 6, 'mean_size': 2.0, 'min_size': 1, 'max_size': 3}]
    """
    if by not in ("position", "step"):
        raise FieldTypeError("by", "'position' or 'step'", repr(by))
    table = _prepare(data, ("step", "req_id", "sampling_mask"))
    rows, index, size = [], [], []
    for first, batch in _batches(table, ("sampling_mask",)):
        col = batch.column("sampling_mask")
        if col.null_count == batch.num_rows:
            continue
        per_row = _lengths(col)
        positions = col.flatten()
        _no_nulls(positions, "sampling_mask", "positions")
        _no_nulls(positions.flatten(), "sampling_mask", "token ids")
        row = np.repeat(np.arange(batch.num_rows, dtype=np.int64), per_row)
        rows.append(row + first)
        index.append(np.arange(len(row), dtype=np.int64) - _starts(per_row)[row])
        size.append(_lengths(positions))
    sizes = pa.table(
        {
            **_key_columns(table, _concat(rows, np.int64)),
            "step_position": pa.array(_concat(index, np.int64), pa.int64()),
            "size": pa.array(_concat(size, np.int64), pa.int64()),
        }
    )
    if by == "position":
        return sizes
    grouped = sizes.group_by("step", use_threads=False).aggregate(
        [("size", "count"), ("size", "sum"), ("size", "mean"), ("size", "min"), ("size", "max")]
    )
    grouped = grouped.sort_by([("step", "ascending")])
    return pa.table(
        {
            "step": grouped.column("step"),
            "positions": grouped.column("size_count").cast(pa.int64()),
            "kept": grouped.column("size_sum").cast(pa.int64()),
            "mean_size": grouped.column("size_mean").cast(pa.float64()),
            "min_size": grouped.column("size_min").cast(pa.int64()),
            "max_size": grouped.column("size_max").cast(pa.int64()),
        }
    )


def _mean(arr: pa.Array | pa.ChunkedArray) -> float | None:
    value = pc.mean(arr).as_py() if len(arr) else None
    return None if value is None or math.isnan(value) else float(value)


def summary(data: Any) -> dict[str, Any]:
    """The run in a few numbers, as plain Python values (JSON-ready).

    Parameters
    ----------
    data
        The run (see :func:`as_table`). ``step``, ``req_id`` and ``sampled_token_ids`` are
        needed; the logprob figures need ``logprobs`` and the mask figures
        ``sampling_mask`` (``None`` without them).

    Returns
    -------
    dict
        ``steps`` (distinct step numbers), ``rows``, ``requests``, ``tokens``,
        ``scored_tokens``, ``mean_logprob`` (per scored token), ``perplexity``
        (``exp(-mean_logprob)`` over every scored token), ``median_request_perplexity``,
        ``mean_topk_entropy`` (over sampled positions), ``speculative_rows`` (rows that
        verified at least one draft token), ``mean_acceptance_length`` (tokens per such row),
        ``acceptance_rate`` (accepted drafts / drafts), ``mask_positions``,
        ``mean_mask_size``. A figure with nothing to average is ``None``.

    Examples
    --------
    >>> import arrow_outputs as ao
    >>> out = ao.ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[1, 2], [3]])
    >>> s = summary(ao.to_record_batch(out, step=0))
    >>> s["tokens"], s["requests"], s["mean_logprob"]
    (3, 2, None)
    """
    table = _prepare(data, ("step", "req_id", "sampled_token_ids"))
    names = table.schema.names
    out: dict[str, Any] = {
        "steps": int(pc.count_distinct(table.column("step"), mode="only_valid").as_py()),
        "rows": table.num_rows,
        "requests": int(pc.count_distinct(table.column("req_id")).as_py()),
        "tokens": int(pc.sum(pc.list_value_length(table.column("sampled_token_ids"))).as_py() or 0),
    }
    keys = (
        "scored_tokens",
        "mean_logprob",
        "perplexity",
        "median_request_perplexity",
        "mean_topk_entropy",
    )
    out.update(dict.fromkeys(keys))
    if "logprobs" in names:
        _check_columns(table, ("logprobs",))
        tok = _token_logprobs(table)
        scored = tok.logprob[tok.scored]
        out["scored_tokens"] = len(scored)
        mean = float(scored.mean()) if len(scored) else math.nan
        if not math.isnan(mean):
            out["mean_logprob"] = mean
            with np.errstate(over="ignore"):  # inf, not OverflowError, past float64
                out["perplexity"] = float(np.exp(-mean))
        ppl = _per_request(table, tok).column("perplexity").drop_null()
        if len(ppl):
            out["median_request_perplexity"] = float(np.median(ppl.to_numpy()))
        ent = topk_entropy(table)
        out["mean_topk_entropy"] = _mean(ent.filter(ent.column("sampled")).column("entropy"))
    acc = acceptance_lengths(table)
    spec = acc.filter(pc.fill_null(pc.greater(acc.column("draft_tokens"), 0), False))
    drafts = int(pc.sum(spec.column("draft_tokens")).as_py() or 0)
    accepted = int(pc.sum(spec.column("accepted_drafts")).as_py() or 0)
    out["speculative_rows"] = spec.num_rows
    out["mean_acceptance_length"] = _mean(spec.column("tokens"))
    out["acceptance_rate"] = accepted / drafts if drafts else None
    out["mask_positions"] = None
    out["mean_mask_size"] = None
    if "sampling_mask" in names:
        sizes = mask_sizes(table)
        out["mask_positions"] = sizes.num_rows
        out["mean_mask_size"] = _mean(sizes.column("size"))
    return out
