"""Structure-aware fuzzing of the decoder: untrusted record batches, metadata and IPC bytes.

``from_record_batch`` reads batches that come from elsewhere (files, sockets, other
processes), so everything in them is untrusted: the step JSON, the schema and field
metadata, every buffer, and the IPC bytes they were read from. This module takes a corpus
of valid steps (every field of ``ModelRunnerOutput``, 0-row steps, speculative decoding,
tensors of every layout) and damages them in ways that know the format:

* ``json``: the step JSON, parsed and edited (a value's type, a dropped or unknown key,
  malformed ``$tags``, deep nesting, layout facts such as ``width`` or ``cu_dtype``, rows
  and step) or damaged as bytes (non-UTF-8, truncated), passed as IPC custom metadata or
  kept in the schema metadata;
* ``schema``: schema-level metadata (format name, version) and field metadata (tensor
  dtype and layout labels), column types and order;
* ``buffer``: the batch's (nested) buffers: flipped or overwritten bytes, shrunk buffers,
  offsets that point anywhere (a 0-row list whose only offset is 7), nulls in non-nullable
  columns and children, duplicate request ids, a ``req_index`` that is not ``0..n-1``,
  negative tensor shapes with plausible products, columns of another step, slices,
  filters and shuffles of the rows;
* ``ipc``: stream and file bytes with flipped bytes, truncations and splices, read back
  with ``read_next_batch_with_custom_metadata`` / ``get_batch_with_custom_metadata``.

The contract checked for every case:

1. ``from_record_batch`` either returns or raises an :class:`ArrowOutputsError`: no other
   exception, no warning, no hang (a per-case deadline), no memory use beyond a small
   multiple of the input (``tracemalloc`` peak during the decode). Reading IPC bytes with
   pyarrow may raise pyarrow's errors before the decoder is involved; those are counted,
   not failures.
2. A decode that succeeds agrees with pyarrow's reading of the batch: re-encoding the
   result with the batch's step and run schema gives the same columns. The only
   difference tolerated is documented in :func:`_legitimate_difference`.

Harness choices, so that the suite stays fast and leaves the process as it found it:
warnings are errors during a decode (a warning is no ``ArrowOutputsError``); on Linux a
decode may grow the address space by :data:`HEADROOM` only (``RLIMIT_AS``), so an allocation
bomb fails at once with ``MemoryError`` (reported) instead of taking seconds and gigabytes;
``torch._inductor`` is stubbed while fuzzing, since ``getattr(torch, "_inductor")`` (what an
unchecked ``cu_dtype`` reaches) would import it; batches that carry no step JSON are read
with ``missing_step_metadata="defaults"`` where the reader has that option.

Every escape is collected (the run never stops at the first) and the failure message
groups them by outcome, exception type and mutation kind, with ids that replay one case::

    python tests/test_fuzz.py --replay json:123        # the traceback of one case
    python tests/test_fuzz.py --scale 50               # a longer fuzz, summary printed

A crash (a segfault ends the process, so it is no finding) leaves the id of the case that
caused it in ``$TMPDIR/arrow_outputs_fuzz_current_case.txt`` (or the file named by
``ARROW_OUTPUTS_FUZZ_BREADCRUMB``).

``ARROW_OUTPUTS_FUZZ_SCALE`` (default 1) scales the number of cases under pytest; every
case is seeded by its id (``family:index``), so runs are deterministic.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import itertools
import json
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
import types
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from test_batch import (
    _aux,
    _aux_uint8,
    _aux_uint16,
    _empty_containers,
    _empty_with_ec_and_stats,
    _encoder_only,
    _index,
    _lists,
    _logprobs_zero_rows_with_requests,
    _masks_csr_cu_none,
    _masks_offsets_none_with_cu,
    _masks_single_position,
    _num_nans,
    _prompt_logprobs,
    _prompt_logprobs_int32,
    _rng,
    _speculative,
    _tensors,
)

import arrow_outputs as ao
from arrow_outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    ArrowOutputsError,
    AuxRequestOutput,
    CUDAGraphStat,
    ECConnectorOutput,
    KVConnectorOutput,
    ModelRunnerOutput,
    SamplingMaskLists,
)

# Every test here runs on the C accelerator and on the pure-Python path.
pytestmark = pytest.mark.usefixtures("codec_path")

KEY_STEP = b"arrow_outputs.step"
KEY_FORMAT = b"arrow_outputs.format"
KEY_VERSION = b"arrow_outputs.version"
KEY_DTYPE = b"arrow_outputs.dtype"
KEY_TENSOR = b"arrow_outputs.tensor"

#: Cases per family at scale 1 (2,400 in all; the team runs 10x before decoder changes).
CASES_PER_FAMILY = {"json": 1100, "schema": 300, "buffer": 650, "ipc": 350}
#: Seconds one decode may take before it counts as a hang.
DEADLINE_S = 10.0
MIB = 1 << 20


def _memory_bound(input_bytes: int) -> int:
    """Most bytes a decode may allocate (tracemalloc peak) for an input of this size."""
    return 64 * input_bytes + 16 * MIB


# =========================================================================== the corpus
# Valid steps covering every field; built like tests/test_batch.py's builders (copied, not
# imported: that module's private helpers change with it).


def _masks(lengths: list[int], cu: list[int] | None = None, *, seed: int = 0) -> SamplingMaskLists:
    rng = _rng(seed)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    parts = [np.sort(rng.choice(1000, size=k, replace=False)) for k in lengths]
    token_ids = np.concatenate(parts or [np.empty(0)]).astype(np.int32)
    return SamplingMaskLists(token_ids, offsets, cu)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _decode_step() -> ModelRunnerOutput:
    req_ids = ["r0", "r1", "r2"]
    return ModelRunnerOutput(req_ids, _index(req_ids), [[11], [12], [13]], logprobs=_lists(3, 21))


def _decode_int32() -> ModelRunnerOutput:
    req_ids = ["a", "b", "c"]
    lp = _lists(3, 6, [0, 1, 2, 3], ids=np.int32)
    return ModelRunnerOutput(req_ids, _index(req_ids), [[1], [2], [3]], logprobs=lp)


def _decode_int32_ranks() -> ModelRunnerOutput:
    req_ids = ["a", "b"]
    lp = _lists(2, 3, ids=np.int32, ranks=np.int32)
    return ModelRunnerOutput(req_ids, _index(req_ids), [[1], [2]], logprobs=lp)


def _pooling() -> ModelRunnerOutput:
    req_ids = ["p0", "p1", "p2"]
    return ModelRunnerOutput(
        req_ids, _index(req_ids), [], pooler_output=list(_randn(3, 16, seed=2).unbind(0))
    )


def _pooling_with_none() -> ModelRunnerOutput:
    req_ids = ["p0", "p1", "p2"]
    rows = [_randn(8, seed=3), None, _randn(8, seed=4)]
    return ModelRunnerOutput(req_ids, _index(req_ids), [], pooler_output=rows)


def _pooling_variable_shape() -> ModelRunnerOutput:
    req_ids = ["t0", "t1", "t2", "t3"]
    rows = [_randn(3, 4, seed=5), None, _randn(1, 4, seed=6), _randn(0, 4)]
    return ModelRunnerOutput(req_ids, _index(req_ids), [], pooler_output=rows)


def _empty_with_kv() -> ModelRunnerOutput:
    return ModelRunnerOutput.with_kv_conn_output_only(
        KVConnectorOutput(
            finished_sending={"a", "b"},
            finished_recving=set(),
            # Every JSON tag in valid metadata, so mutations meet them.
            kv_connector_stats={
                "bytes": b"\x00\x01\xff",
                "pair": (1, "x"),
                "frozen": frozenset({2, 3}),
                "inf": float("inf"),
                "np": np.int16(7),
                "npf": np.float32(0.5),
                "$looks_like_a_tag": 1,
                4: "int key",
            },
            kv_cache_events=[{"block": 3, "stored": True}],
            invalid_block_ids={3, 17},
            expected_finished_count=2,
        )
    )


def _prompt_token_id_logprobs() -> ModelRunnerOutput:
    req_ids = ["a", "b", "c"]
    padded = torch.tensor([[-0.5, -1.5, -float("inf")], [-0.25, -float("inf"), -float("inf")]])
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2], [3]],
        prompt_token_id_logprobs_dict={"c": padded, "a": -torch.rand(2, 2)},
    )


def _logprobs_zero_rows_no_requests() -> ModelRunnerOutput:
    return ModelRunnerOutput([], {}, [], logprobs=_lists(0, 21))


def _logprobs_tensors_cu_tensor() -> ModelRunnerOutput:
    req_ids = ["a", "b"]
    lp = _tensors(3, 4)._replace(
        cu_num_generated_tokens_tensor=torch.tensor([0, 2, 3], dtype=torch.int32)
    )
    return ModelRunnerOutput(req_ids, _index(req_ids), [[1, 2], [3]], logprobs=lp)


def _everything() -> ModelRunnerOutput:
    req_ids = ["req-0", "req-1", "req-2", "req-3", "ü-4"]
    pooled = _randn(5, 8, seed=9, dtype=torch.bfloat16)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index=_index(req_ids),
        sampled_token_ids=[[1, 2], [3], [], [2**40], [7]],
        logprobs=_lists(6, 9, [0, 2, 3, 3, 5, 6], ids=np.int32, seed=7),
        prompt_logprobs_dict={"req-0": _tensors(3, 9), "req-3": None, "ü-4": _tensors(0, 4)},
        prompt_token_id_logprobs_dict={"req-2": torch.tensor([[-1.0, -float("inf")]])},
        pooler_output=[pooled[i] for i in range(5)],
        kv_connector_output=KVConnectorOutput(
            finished_sending={"req-1"},
            finished_recving=None,
            kv_connector_stats={"bytes": 1024, "backend": "nixl", "per_layer": [1, 2]},
            kv_cache_events=({"block": 3, "stored": True},),
            invalid_block_ids={9},
            expected_finished_count=1,
        ),
        ec_connector_output=ECConnectorOutput(finished_sending={"req-0"}),
        num_nans_in_logits={"req-0": 0, "req-1": 3},
        cudagraph_stats=CUDAGraphStat(5, 8, 3, "PIECEWISE"),
        aux_output_connector_output={"req-1": AuxRequestOutput(4, _aux(2, np.uint16))},
        sampling_masks=_masks([1, 2, 0, 3, 4, 1], [0, 2, 3, 3, 5, 6]),
    )


def _pooling_bfloat16() -> ModelRunnerOutput:
    req_ids = ["b0", "b1"]
    rows = list(_randn(2, 6, seed=13, dtype=torch.bfloat16).unbind(0))
    return ModelRunnerOutput(req_ids, _index(req_ids), [], pooler_output=rows)


def _prompt_token_id_logprobs_bfloat16() -> ModelRunnerOutput:
    req_ids = ["a", "b"]
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2]],
        prompt_token_id_logprobs_dict={"b": _randn(3, 2, seed=14, dtype=torch.bfloat16)},
    )


def _many_requests() -> ModelRunnerOutput:
    # Many small rows: what a reader makes per row (lists, tensors, dict entries) against
    # the few bytes each row takes in the batch; the memory bound must hold here too.
    n = 120
    req_ids = [f"m{i}" for i in range(n)]
    counts = [i % 3 for i in range(n)]
    cu = np.concatenate([[0], np.cumsum(counts)]).tolist()
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[7] * c for c in counts],
        logprobs=_lists(cu[-1], 2, cu, seed=11),
        prompt_logprobs_dict={r: _tensors(i % 2, 2, seed=i) for i, r in enumerate(req_ids[::4])},
        num_nans_in_logits={r: 0 for r in req_ids[::2]},
        sampling_masks=_masks([1] * cu[-1], cu, seed=12),
    )


@dataclasses.dataclass(frozen=True)
class Entry:
    """One valid step, encoded, and its IPC forms."""

    name: str
    batch: pa.RecordBatch  # as to_record_batch made it: the step JSON in the schema metadata
    step: int | None
    custom: dict[bytes, bytes]  # step_custom_metadata(batch)
    run_schema: pa.Schema  # the batch's schema without the step key (what IPC readers give)
    stream: bytes  # an IPC stream of this step and the next
    file: bytes  # the same as an IPC file

    @property
    def plain(self) -> pa.RecordBatch:
        """The batch as IPC readers give it: step JSON only in the custom metadata."""
        return self.batch.replace_schema_metadata(self.run_schema.metadata)


# (name, builder, step, name of the entry whose run schema to encode with, or None)
_SPECS: list[tuple[str, Callable[[], ModelRunnerOutput], int | None, str | None]] = [
    ("decode_step", _decode_step, 7, None),
    ("decode_int32", _decode_int32, 0, None),
    ("decode_int32_ranks", _decode_int32_ranks, 1, None),
    ("speculative", _speculative, 12, None),
    ("pooling", _pooling, 3, None),
    ("pooling_with_none", _pooling_with_none, None, None),
    ("pooling_variable_shape", _pooling_variable_shape, 5, None),
    ("pooling_bfloat16", _pooling_bfloat16, 6, None),
    ("prompt_token_id_logprobs_bfloat16", _prompt_token_id_logprobs_bfloat16, 6, None),
    ("encoder_only", _encoder_only, 2**62, None),
    ("empty", lambda: EMPTY_MODEL_RUNNER_OUTPUT, None, None),
    ("empty_step", lambda: EMPTY_MODEL_RUNNER_OUTPUT, -5, None),
    ("empty_with_kv", _empty_with_kv, 8, None),
    ("empty_with_ec_and_stats", _empty_with_ec_and_stats, 9, None),
    ("prompt_logprobs", _prompt_logprobs, 10, None),
    ("prompt_logprobs_int32", _prompt_logprobs_int32, 11, None),
    ("prompt_token_id_logprobs", _prompt_token_id_logprobs, 13, None),
    ("num_nans", _num_nans, 14, None),
    ("masks_single_position", _masks_single_position, 15, None),
    ("masks_offsets_none_with_cu", _masks_offsets_none_with_cu, 16, None),
    ("masks_csr_cu_none", _masks_csr_cu_none, 17, None),
    ("aux_uint8", _aux_uint8, 18, None),
    ("aux_uint16", _aux_uint16, 19, None),
    ("logprobs_zero_rows_no_requests", _logprobs_zero_rows_no_requests, 20, None),
    ("logprobs_zero_rows_with_requests", _logprobs_zero_rows_with_requests, 21, None),
    ("logprobs_tensors_cu_tensor", _logprobs_tensors_cu_tensor, 22, None),
    ("empty_containers", _empty_containers, 23, None),
    ("everything", _everything, 24, None),
    ("everything_step_none", _everything, None, None),
    ("many_requests", _many_requests, 28, None),
    # Steps without a field, in a run whose schema declares it with other types.
    ("empty_in_everything_run", lambda: EMPTY_MODEL_RUNNER_OUTPUT, 25, "everything"),
    ("decode_in_everything_run", _decode_int32, 26, "everything"),
    ("encoder_in_pooling_run", _encoder_only, 27, "pooling"),
]


def _ipc_bytes(batches: list[pa.RecordBatch], schema: pa.Schema, *, file: bool) -> bytes:
    sink = pa.BufferOutputStream()
    new = pa.ipc.new_file if file else pa.ipc.new_stream
    with new(sink, schema) as writer:
        for b in batches:
            writer.write_batch(b, custom_metadata=ao.step_custom_metadata(b))
    return sink.getvalue().to_pybytes()


@cache
def corpus() -> tuple[Entry, ...]:
    entries: dict[str, Entry] = {}
    for name, build, step, run_of in _SPECS:
        output = build()
        schema = None if run_of is None else entries[run_of].run_schema
        batch = ao.to_record_batch(output, step=step, schema=schema)
        run = ao.run_schema(batch)
        following = ao.to_record_batch(output, step=None if step is None else step + 1, schema=run)
        entries[name] = Entry(
            name=name,
            batch=batch,
            step=step,
            custom=ao.step_custom_metadata(batch),
            run_schema=run,
            stream=_ipc_bytes([batch, following], run, file=False),
            file=_ipc_bytes([batch, following], run, file=True),
        )
    return tuple(entries.values())


# =========================================================================== cases


class Skip(Exception):
    """The mutation does not apply here, or pyarrow refused to build the damaged batch."""


@dataclasses.dataclass
class Attempt:
    """One decode to check: a (damaged) batch and the custom metadata passed with it."""

    batch: pa.RecordBatch
    custom: Any
    note: str = ""


@dataclasses.dataclass
class Case:
    """What a case id makes: its mutation kind and the decodes it asks for."""

    case_id: str
    entry: str
    kind: str
    detail: str
    attempts: list[Attempt]
    pyarrow_refused: str | None = None  # IPC parsing: pyarrow's error, which is fine


def _valid_json(entry: Entry) -> dict[str, Any]:
    return json.loads(entry.custom[KEY_STEP])


# --------------------------------------------------------------------------- json family

_HUGE = [10**30, 2**63, -(2**63) - 1, 10**18]
_RETYPE_VALUES: list[Any] = [
    "5",
    "",
    "\ud800",  # a lone surrogate: valid JSON (escaped), not valid UTF-8
    [],
    [1, 2],
    [[1]],
    {},
    {"a": 1},
    None,
    2.5,
    -0.0,
    float("nan"),
    float("inf"),
    True,
    False,
    0,
    -1,
    *_HUGE,
]


def _big_size(rng: random.Random) -> int:
    """Sizes for allocation-bomb tags: mostly ones that are cheap yet over the memory bound;
    sometimes gigabytes, where :func:`_address_space_guard` makes them fail fast."""
    if rng.random() < 0.3 and _GUARD_USABLE:
        return rng.choice([10**9, 2**31 - 1])
    return 3 * 10**7


def _malformed_tag(rng: random.Random) -> tuple[str, Any]:
    tags: list[tuple[str, Callable[[], Any]]] = [
        ("$set", lambda: {"$set": [[1]]}),
        ("$set", lambda: {"$set": [{"a": 1}]}),
        ("$set", lambda: {"$set": 5}),
        ("$frozenset", lambda: {"$frozenset": [[1]]}),
        ("$frozenset", lambda: {"$frozenset": None}),
        ("$numpy", lambda: {"$numpy": ["int8", 1000]}),
        ("$numpy", lambda: {"$numpy": ["uint8", -1]}),
        ("$numpy", lambda: {"$numpy": ["int64", 10**30]}),
        ("$numpy", lambda: {"$numpy": ["float16", 1e300]}),
        ("$numpy", lambda: {"$numpy": ["float32", "abc"]}),
        ("$numpy:S", lambda: {"$numpy": ["S", _big_size(rng)]}),
        ("$numpy:V", lambda: {"$numpy": ["V1", _big_size(rng)]}),
        ("$numpy:U", lambda: {"$numpy": ["U", 5]}),
        ("$numpy", lambda: {"$numpy": ["M8[s]", 5]}),
        ("$numpy", lambda: {"$numpy": ["O", 5]}),
        ("$numpy", lambda: {"$numpy": ["complex128", 1]}),
        ("$numpy", lambda: {"$numpy": ["no_such_dtype", 1]}),
        ("$numpy", lambda: {"$numpy": ["int64"]}),
        ("$numpy", lambda: {"$numpy": 5}),
        ("$numpy", lambda: {"$numpy": [["int8"], 1]}),
        ("$numpy", lambda: {"$numpy": [None, 1]}),
        ("$dict", lambda: {"$dict": 5}),
        ("$dict", lambda: {"$dict": [[1]]}),
        ("$dict", lambda: {"$dict": [[[1], 2]]}),
        ("$dict", lambda: {"$dict": [[1, 2, 3]]}),
        ("$float", lambda: {"$float": "abc"}),
        ("$float", lambda: {"$float": 5}),
        ("$float", lambda: {"$float": None}),
        ("$float", lambda: {"$float": "9" * 5000}),
        ("$bytes", lambda: {"$bytes": "!!"}),
        ("$bytes", lambda: {"$bytes": "abc"}),
        ("$bytes", lambda: {"$bytes": 5}),
        ("$bytes", lambda: {"$bytes": "\u00e9\u00e9=="}),
        ("$tuple", lambda: {"$tuple": 3}),
        ("$tuple", lambda: {"$tuple": None}),
        ("$unknown", lambda: {"$unknown": 1}),
    ]
    name, make = rng.choice(tags)
    return name, make()


def _paths(x: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*prefix, i))


def _get(x: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        x = x[p]
    return x


def _set(x: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _get(x, path[:-1])[path[-1]] = value
    return x


_DEEP = "\x00deep\x00"


def _deep_text(rng: random.Random) -> tuple[str, str]:
    depth = rng.randint(600, 2000)
    shape = rng.choice(["list", "dict", "tuple", "set"])
    open_, close = {
        "list": ("[", "]"),
        "dict": ('{"a":', "}"),
        "tuple": ('{"$tuple":[', "]}"),
        "set": ('{"$frozenset":[', "]}"),
    }[shape]
    return f"{shape}x{depth}", open_ * depth + "1" + close * depth


def _layout_edits(
    rng: random.Random, meta: dict[str, Any], n: int, step: Any
) -> list[tuple[tuple[str, ...], Any]]:
    """Edits of the facts the decoder reads off the step JSON, for this step's keys."""
    edits: list[tuple[tuple[str, ...], Any]] = []
    edits += [(("rows",), v) for v in (n + 1, n - 1, -1, str(n), None, float(n), 10**30, True)]
    step_values = [None, "5", 2.5, 10**30, -1, True, [], {}]
    if type(step) is int:
        step_values += [step + 1, float(step), str(step)]
    edits += [(("step",), v) for v in step_values]
    edits += [((key,), v) for key in ("rows", "step") for v in ("drop",)]
    lp = meta.get("logprobs")
    if isinstance(lp, dict):
        w = lp.get("width") if type(lp.get("width")) is int else 1
        for v in (-1, 0, 2.5, 10**18, 10**30, "9", None, True, w + 1, -w):
            edits.append((("logprobs", "width"), v))
        for v in ("none", "list", "tensor", "bogus", None, 5):
            edits.append((("logprobs", "cu"), v))
        for v in ("lists", "tensors", "numpy", None, 5):
            edits.append((("logprobs", "kind"), v))
        for v in ("_inductor", "bool", "float32", "int8", "uint8", "no_such", 5, None, "Tensor"):
            edits.append((("logprobs", "cu_dtype"), v))
            # As the tensors' cu dtype, which is where the reader makes a tensor of it.
            edits.append((("logprobs",), {**lp, "kind": "tensors", "cu": "tensor", "cu_dtype": v}))
    pl = meta.get("prompt_logprobs")
    if isinstance(pl, dict) or n:
        for v in ([n], [-1], [10**30], [0, 0], 5, "x", [[1]], [None], [2.5], None, {}):
            edits.append((("prompt_logprobs", "none_rows"), v))
        ew_rows = [str(i) for i in range(max(n, 1))]
        for v in (-1, 2.5, 10**18, 10**30, "3", None, 0, 1):
            edits.append((("prompt_logprobs", "empty_widths"), {rng.choice(ew_rows): v}))
        for v in ([], 5, "x", {"x": 1}, {"0": -1}, {"0": 10**30}):
            edits.append((("prompt_logprobs", "empty_widths"), v))
    for key in ("prompt_token_id_logprobs", "pooler_output"):
        for v in ("torch", "numpy", "bogus", None, 5, [], {}):
            edits.append(((key,), v))
    for v in ("torch", "numpy", "x", None, 5):
        edits.append((("aux_output", "kind"), v))
    for v in (None, [], 5, "numpy", {}):
        edits.append((("aux_output",), v))
    for sub in ("offsets", "cu"):
        for v in (True, False, 0, 1, "yes", None, []):
            edits.append((("sampling_mask", sub), v))
    for v in (None, [], 5, {}):
        edits.append((("sampling_mask",), v))
    for v in ("none", "lists", "x", None, 5):
        edits.append((("sampled_token_ids",), v))
    for v in ("dict", None, "x", 5, []):
        edits.append((("num_nans_in_logits",), v))
    for v in (None, {}, [], 5, "x", {"finished_sending": 5}, {"invalid_block_ids": [[1]]}):
        edits.append((("kv_connector_output",), v))
    for v in (None, {}, [], 5, {"finished_recving": {"$set": [[1]]}}):
        edits.append((("ec_connector_output",), v))
    cg = {"num_unpadded_tokens": 1, "num_padded_tokens": 2, "num_paddings": 1, "runtime_mode": "x"}
    for v in (None, {}, {"num_unpadded_tokens": 1}, [], 5, {**cg, "extra": 1}):
        edits.append((("cudagraph_stats",), v))
    for v in ([{"field": "x", "type": "y"}], 5, "x", [5]):
        edits.append((("dropped",), v))
    return edits


def _mutate_json(rng: random.Random, entry: Entry) -> tuple[str, str, bytes]:
    """(kind, detail, damaged step JSON bytes)."""
    try:
        meta = json.loads(entry.custom[KEY_STEP])
    except (ValueError, RecursionError):
        meta = None  # damaged by an earlier mutation of a chain
    op = rng.choices(
        ["retype", "drop_key", "add_key", "replace_sub", "tag", "deep", "layout", "bytes", "multi"],
        weights=[14, 8, 6, 6, 16, 5, 30, 10, 5],
    )[0]
    if not isinstance(meta, dict) or not meta:
        op = "bytes"
    paths = [p for p in _paths(meta) if p]
    if op == "multi":
        kinds = []
        raw = entry.custom[KEY_STEP]
        for _ in range(rng.randint(2, 4)):
            sub = dataclasses.replace(entry, custom={KEY_STEP: raw})
            try:
                kind, _detail, raw = _mutate_json(rng, sub)
            except (Skip, RecursionError):  # RecursionError: walking a deep nesting
                continue
            kinds.append(kind.removeprefix("json."))
        return "json.multi", "+".join(kinds), raw
    if op == "retype":
        path = rng.choice(paths)
        value = rng.choice(_RETYPE_VALUES)
        _set(meta, path, value)
        return f"json.retype.{_short(path)}", f"{list(path)} = {value!r}", _dumps(meta)
    if op == "drop_key":
        dict_paths = [p for p in _paths(meta) if isinstance(_get(meta, p), dict) and _get(meta, p)]
        path = rng.choice(dict_paths)
        key = rng.choice(list(_get(meta, path)))
        del _get(meta, path)[key]
        return f"json.drop_key.{_short((*path, key))}", f"del {[*path, key]}", _dumps(meta)
    if op == "add_key":
        dict_paths = [p for p in _paths(meta) if isinstance(_get(meta, p), dict)]
        path = rng.choice(dict_paths)
        key = rng.choice(["zzz_unknown", "$set", "$numpy", "kind", "width", "", "rows"])
        _get(meta, path)[key] = rng.choice(_RETYPE_VALUES)
        return "json.add_key", f"{[*path, key]} added", _dumps(meta)
    if op == "replace_sub":
        subs = [p for p in paths if isinstance(_get(meta, p), (dict, list))]
        if not subs:
            raise Skip("no sub-objects")
        path = rng.choice(subs)
        value = rng.choice([[], 5, {}, None, "x"])
        _set(meta, path, value)
        return f"json.replace_sub.{_short(path)}", f"{list(path)} = {value!r}", _dumps(meta)
    if op == "tag":
        name, tag = _malformed_tag(rng)
        step_objects = [
            p
            for p in paths
            if p[0] in ("kv_connector_output", "ec_connector_output", "cudagraph_stats")
            and len(p) >= 2
        ]
        if step_objects and rng.random() < 0.7:
            path = rng.choice(step_objects)
        elif rng.random() < 0.6:
            field = rng.choice(["kv_connector_stats", "kv_cache_events", "invalid_block_ids"])
            if not isinstance(meta.get("kv_connector_output"), dict):
                meta["kv_connector_output"] = {}
            path = ("kv_connector_output", field)
        else:
            path = rng.choice(paths)
        _set(meta, path, tag)
        return f"json.tag.{name}", f"{list(path)} = {_clip(tag)}", _dumps(meta)
    if op == "deep":
        shape, text = _deep_text(rng)
        if rng.random() < 0.6:
            field = rng.choice(
                ["kv_connector_stats", "kv_cache_events", "kv_connector_worker_meta"]
            )
            if not isinstance(meta.get("kv_connector_output"), dict):
                meta["kv_connector_output"] = {}
            path: tuple[Any, ...] = ("kv_connector_output", field)
        else:
            path = rng.choice(paths)
        _set(meta, path, _DEEP)
        raw = _dumps(meta).replace(json.dumps(_DEEP).encode(), text.encode())
        return "json.deep", f"{list(path)} = {shape}", raw
    if op == "layout":
        n = entry.batch.num_rows
        path, value = rng.choice(_layout_edits(rng, meta, n, entry.step))
        if value == "drop":
            meta.pop(path[0], None)
        else:
            parent = meta
            for p in path[:-1]:
                if not isinstance(parent.get(p), dict):
                    parent[p] = {}
                parent = parent[p]
            parent[path[-1]] = value
        return f"json.layout.{'.'.join(path)}", f"{list(path)} = {_clip(value)}", _dumps(meta)
    # op == "bytes": damage the text itself
    raw = entry.custom[KEY_STEP]
    how = rng.choice(["non_utf8", "truncate", "top_level", "dup_key", "huge_digits", "bom"])
    if how == "non_utf8":
        i = rng.randrange(len(raw) + 1)
        bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80", b"\xfe\xff"])
        return "json.bytes.non_utf8", f"{bad!r} at {i}", raw[:i] + bad + raw[i:]
    if how == "truncate":
        i = rng.randrange(max(1, len(raw)))
        return "json.bytes.truncate", f"first {i} bytes", raw[:i]
    if how == "top_level":
        text = rng.choice([b"[]", b"5", b"null", b'"x"', b"{}", b"", b"[{}]", b"true", b"1e999"])
        return "json.bytes.top_level", repr(text), text
    if how == "dup_key":
        return "json.bytes.dup_key", "rows twice", raw[:-1] + b',"rows":' + b"123}"
    if how == "huge_digits":
        key = rng.choice([b'"rows":', b'"step":'])
        if key not in raw:
            raise Skip("no such key")
        return "json.bytes.huge_digits", key.decode(), raw.replace(key, key + b"9" * 5000, 1)
    return "json.bytes.bom", "UTF-8 BOM", b"\xef\xbb\xbf" + raw


def _short(path: tuple[Any, ...]) -> str:
    """A path's first key: mutation kinds group by the top-level field."""
    return str(path[0]) if path else "<root>"


def _clip(x: Any, k: int = 80) -> str:
    text = repr(x)
    return text if len(text) <= k else text[: k - 3] + "..."


def _dumps(meta: Any) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


def _json_case(case_id: str, rng: random.Random) -> Case:
    entry = rng.choice(corpus())
    kind, detail, raw = _mutate_json(rng, entry)
    # The schema's step key is refused unless the batch is provably the one it was made
    # for, so most damaged JSON travels as custom metadata, where the parser meets it.
    where = rng.choices(
        ["custom", "schema", "custom_dict", "custom_str", "both"], weights=[62, 18, 6, 4, 10]
    )[0]
    if where == "custom":
        attempt = Attempt(entry.plain, pa.KeyValueMetadata({KEY_STEP: raw}), "custom metadata")
    elif where == "custom_dict":
        attempt = Attempt(entry.plain, {KEY_STEP: raw}, "custom metadata as a dict")
    elif where == "custom_str":
        attempt = Attempt(
            entry.plain, {KEY_STEP.decode(): raw}, "custom metadata as a dict with a str key"
        )
    elif where == "schema":
        meta = {**entry.run_schema.metadata, KEY_STEP: raw}
        attempt = Attempt(entry.batch.replace_schema_metadata(meta), None, "schema metadata")
    else:  # damaged in the schema, valid in the custom metadata (which wins)
        meta = {**entry.run_schema.metadata, KEY_STEP: raw}
        attempt = Attempt(
            entry.batch.replace_schema_metadata(meta), entry.custom, "schema damaged, custom ok"
        )
    return Case(case_id, entry.name, kind, f"{detail} [{attempt.note}]", [attempt])


# --------------------------------------------------------------------------- schema family


_TENSOR_FIELDS = ["prompt_token_id_logprobs", "pooler_output", "aux_output.rows"]


def _with_field(batch: pa.RecordBatch, name: str, field: pa.Field) -> pa.RecordBatch:
    """The batch with one (possibly nested ``aux_output.rows``) field replaced."""
    schema = batch.schema
    if name == "aux_output.rows":
        aux_f = schema.field("aux_output")
        aux_t = aux_f.type
        new_t = pa.struct([aux_t.field(0), field])
        i = schema.get_field_index("aux_output")
        col = batch.column(i)
        new_col = pa.Array.from_buffers(
            new_t, len(col), col.buffers()[:1], children=[col.field(0), col.field(1)]
        )
        schema = schema.set(i, aux_f.with_type(new_t))
        cols = [*batch.columns[:i], new_col, *batch.columns[i + 1 :]]
        return pa.RecordBatch.from_arrays(cols, schema=schema)
    i = schema.get_field_index(name)
    return pa.RecordBatch.from_arrays(batch.columns, schema=schema.set(i, field))


def _field_of(schema: pa.Schema, name: str) -> pa.Field:
    if name == "aux_output.rows":
        return schema.field("aux_output").type.field("rows")
    return schema.field(name)


def _schema_case(case_id: str, rng: random.Random) -> Case:
    entry = rng.choice(corpus())
    batch = entry.plain
    op = rng.choice(
        ["version", "format", "dtype", "tensor_layout", "field_meta", "column_type", "columns"]
    )
    if op == "version":
        value = rng.choice(
            [
                *(b"9.0", b"2.0", b"x", b"\xff\xfe", b"", b"1", b"1.999", b"0.1", b"-1.0"),
                *(b"1e3", b" 2.0", b"01.0", b"\xd9\xa1.0", b"1.0.0", b"99999999999999999999.0"),
                None,
            ]
        )
        meta = dict(batch.schema.metadata)
        if value is None:
            del meta[KEY_VERSION]
        else:
            meta[KEY_VERSION] = value
        damaged = batch.replace_schema_metadata(meta)
        detail = f"version = {value!r}"
    elif op == "format":
        value = rng.choice(
            [b"\xff\xfe", b"other", b"", None, b"arrow_outputs.model_runner_output "]
        )
        meta = dict(batch.schema.metadata)
        if value is None:
            del meta[KEY_FORMAT]
        else:
            meta[KEY_FORMAT] = value
        damaged = batch.replace_schema_metadata(meta)
        detail = f"format = {value!r}"
    elif op in ("dtype", "tensor_layout"):
        name = rng.choice(_TENSOR_FIELDS)
        field = _field_of(batch.schema, name)
        key = KEY_DTYPE if op == "dtype" else KEY_TENSOR
        if op == "dtype":
            values = [b"\xff\xfe", b"float128", b"complex64", b"object", b"bool", b""]
            values += [b"bfloat16", b"uint16", b"float16", b"int64", b"float32 ", b"FLOAT32"]
        else:
            values = [b"\xff", b"fixed_shape", b"variable_shape", b"", b"sparse"]
        value = rng.choice([*values, None])
        meta = dict(field.metadata or {})
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
        damaged = _with_field(batch, name, field.with_metadata(meta))
        detail = f"{name} field metadata {key.decode()} = {value!r}"
    elif op == "field_meta":
        name = rng.choice(batch.schema.names)
        field = batch.schema.field(name)
        value = {b"\xff": b"\xfe", b"arrow_outputs.dtype": rng.choice([b"float32", b"\xff"])}
        damaged = _with_field(batch, name, field.with_metadata(value))
        detail = f"{name} field metadata = {value!r}"
    elif op == "column_type":
        damaged, detail = _retyped(rng, batch)
    else:
        damaged, detail = _reshuffled(rng, batch)
    custom = entry.custom if rng.random() < 0.8 else None
    if custom is None:  # the step JSON in the schema instead
        meta = {**damaged.schema.metadata, KEY_STEP: entry.custom[KEY_STEP]}
        damaged = damaged.replace_schema_metadata(meta)
    return Case(case_id, entry.name, f"schema.{op}", detail, [Attempt(damaged, custom)])


def _logprobs_type(ids: pa.DataType, ranks: pa.DataType) -> pa.DataType:
    fields = [("token_ids", pa.list_(ids)), ("logprobs", pa.list_(pa.float32())), ("rank", ranks)]
    return pa.list_(pa.struct(fields))


def _retyped(rng: random.Random, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, str]:
    """One column cast to another type (and the schema saying so)."""
    i32, i64 = pa.int32(), pa.int64()
    options: list[tuple[str, pa.DataType]] = [
        ("step", i32),
        ("step", pa.uint64()),
        ("req_index", i64),
        ("req_index", pa.uint32()),
        ("req_id", pa.large_string()),
        ("req_id", pa.binary()),
        ("sampled_token_ids", pa.list_(i32)),
        ("sampled_token_ids", pa.list_(pa.int16())),
        ("sampled_token_ids", pa.large_list(i64)),
        ("num_nans_in_logits", i64),
        ("logprobs", _logprobs_type(i32, i32)),
        ("logprobs", _logprobs_type(i64, i64)),
        ("logprobs", _logprobs_type(pa.int16(), i64)),
        ("sampling_mask", pa.list_(pa.list_(pa.int32()))),
        ("sampling_mask", pa.list_(pa.large_list(pa.int64()))),
    ]
    name, t = rng.choice(options)
    i = batch.schema.get_field_index(name)
    try:
        col = batch.column(i).cast(t, safe=False)
    except (pa.ArrowException, NotImplementedError) as e:
        raise Skip(f"cast {name} to {t}: {e}") from None
    field = batch.schema.field(i).with_type(t)
    schema = batch.schema.set(i, field)
    cols = [*batch.columns[:i], col, *batch.columns[i + 1 :]]
    return pa.RecordBatch.from_arrays(cols, schema=schema), f"{name} cast to {t}"


def _reshuffled(rng: random.Random, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, str]:
    schema = batch.schema
    cols = list(batch.columns)
    fields = list(schema)
    how = rng.choice(["swap", "drop", "extra", "rename", "nullable", "fixed_shape"])
    if how == "swap":
        i, j = rng.sample(range(len(fields)), 2)
        fields[i], fields[j] = fields[j], fields[i]
        cols[i], cols[j] = cols[j], cols[i]
        detail = f"columns {i} and {j} swapped"
    elif how == "drop":
        i = rng.randrange(len(fields))
        del fields[i], cols[i]
        detail = f"column {i} dropped"
    elif how == "extra":
        fields.append(pa.field("extra", pa.int64()))
        cols.append(pa.nulls(batch.num_rows, pa.int64()))
        detail = "an extra column"
    elif how == "rename":
        i = rng.randrange(len(fields))
        fields[i] = fields[i].with_name(rng.choice(["", "req_id", fields[i].name.upper()]))
        detail = f"column {i} renamed"
    elif how == "nullable":
        i = rng.randrange(len(fields))
        fields[i] = fields[i].with_nullable(not fields[i].nullable)
        detail = f"{fields[i].name} nullable flipped"
    else:
        i = schema.get_field_index("pooler_output")
        t = fields[i].type
        if not isinstance(t, pa.FixedShapeTensorType) or math.prod(t.shape) % 2:
            raise Skip("no even fixed-shape pooler")
        size = math.prod(t.shape)
        shape = rng.choice([[size, 1], [2, size // 2], [1, 1, size]])
        new_t = pa.fixed_shape_tensor(t.value_type, shape)
        cols[i] = pa.ExtensionArray.from_storage(new_t, cols[i].storage)
        fields[i] = fields[i].with_type(new_t)
        detail = f"pooler fixed shape {list(t.shape)} -> {shape}"
    new = pa.schema(fields, metadata=schema.metadata)
    try:
        return pa.RecordBatch.from_arrays(cols, schema=new), detail
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise Skip(str(e)) from None


# --------------------------------------------------------------------------- buffer family


@dataclasses.dataclass
class Node:
    """An array's layout, editable: own buffers and children (extension types unwrapped)."""

    type: pa.DataType
    ext: pa.DataType | None
    length: int
    offset: int
    buffers: list[pa.Buffer | None]
    children: list[Node]

    @staticmethod
    def of(arr: pa.Array) -> Node:
        ext = None
        if isinstance(arr.type, pa.BaseExtensionType):
            ext, arr = arr.type, arr.storage
        t = arr.type
        own = list(arr.buffers()[: t.num_buffers])
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            children = [Node.of(arr.values)]
        elif pa.types.is_struct(t):
            children = [Node.of(arr.field(i)) for i in range(t.num_fields)]
        else:
            children = []
        return Node(t, ext, len(arr), arr.offset, own, children)

    def build(self) -> pa.Array:
        children = [c.build() for c in self.children] or None
        arr = pa.Array.from_buffers(
            self.type, self.length, self.buffers, null_count=-1, offset=self.offset,
            children=children,
        )  # fmt: skip
        return arr if self.ext is None else pa.ExtensionArray.from_storage(self.ext, arr)

    def walk(self, path: str) -> Iterator[tuple[str, Node]]:
        yield path, self
        t = self.type
        names = (
            [t.field(i).name for i in range(t.num_fields)]
            if pa.types.is_struct(t)
            else ["values"] * len(self.children)
        )
        for name, child in zip(names, self.children):
            yield from child.walk(f"{path}.{name}")


def _copy(buf: pa.Buffer | None, size: int | None = None) -> np.ndarray:
    """A fresh, aligned, writable copy of a buffer's bytes (optionally resized)."""
    data = b"" if buf is None else buf.to_pybytes()
    size = len(data) if size is None else size
    out = np.zeros(size, dtype=np.uint8)
    k = min(size, len(data))
    out[:k] = np.frombuffer(data, np.uint8)[:k]
    return out


def _element_size(t: pa.DataType, i: int) -> int:
    """Bytes per element of buffer ``i`` of type ``t`` (0 for bitmaps and byte data)."""
    if i == 0:
        return 0
    if pa.types.is_large_list(t) or pa.types.is_large_string(t):
        return 8
    if pa.types.is_list(t) or pa.types.is_string(t) or pa.types.is_binary(t):
        return 4 if i == 1 else 1
    if t.num_buffers == 2 and not pa.types.is_boolean(t):
        return t.bit_width // 8
    return 0


def _rebuild(batch: pa.RecordBatch, i: int, col: pa.Array) -> pa.RecordBatch:
    cols = list(batch.columns)
    cols[i] = col
    return pa.RecordBatch.from_arrays(cols, schema=batch.schema)


_INTERESTING = [-1, 0, 1, 7, 2**31 - 1, -(2**31), 2**15, 255, 2**32 - 1, 2**63 - 1, -(2**63)]


def _buffer_op(
    rng: random.Random, batch: pa.RecordBatch, op: str | None = None
) -> tuple[str, str, pa.RecordBatch]:
    """A damage to one buffer of one node of one column (``op`` None: any kind)."""
    op = op or rng.choice(["flip", "overwrite", "shrink", "nulls", "length", "offset"])
    roots = [Node.of(col) for col in batch.columns]
    read = [  # columns a reader reads: with values, or of a 0-row step
        i for i, col in enumerate(batch.columns) if not len(col) or col.null_count < len(col)
    ]
    empty = [
        (i, path, node)
        for i in read
        for path, node in roots[i].walk(batch.schema.names[i])
        if node.length == 0
    ]
    if op == "empty_offset":
        # An offset into an empty array: no element is read, so pyarrow's checks pass
        # whatever the buffer holds (or does not).
        if not empty:
            raise Skip("no empty array")
        i, path, node = rng.choice(empty)
        op = "offset"
    else:
        i = rng.randrange(batch.num_columns)
        path, node = rng.choice(list(roots[i].walk(batch.schema.names[i])))
    root = roots[i]
    if op in ("flip", "overwrite", "shrink"):
        present = [j for j, b in enumerate(node.buffers) if b is not None and b.size]
        if not present:
            raise Skip("no buffer")
        j = rng.choice(present)
        data = _copy(node.buffers[j])
        width = _element_size(node.type, j)
        if op == "flip":
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            detail = f"{path} buffer {j}: bits flipped"
        elif op == "overwrite":
            if width in (4, 8) and len(data) >= width:
                k = rng.randrange(len(data) // width)
                v = rng.choice([*_INTERESTING, node.length + 1, rng.randint(-1000, 1000)])
                dt = np.int32 if width == 4 else np.int64
                info = np.iinfo(dt)
                value = np.array([min(max(v, info.min), info.max)], dt)
                data[k * width : (k + 1) * width] = value.view(np.uint8)
                detail = f"{path} buffer {j}[{k}] = {v}"
            else:
                k = rng.randrange(len(data))
                data[k] = rng.choice([0, 0xFF, 0x80, 0x7F])
                detail = f"{path} buffer {j} byte {k} = {data[k]}"
        else:
            cut = rng.randint(1, max(1, width + 3))
            data = data[: max(0, len(data) - cut)].copy()
            detail = f"{path} buffer {j} shrunk by {cut} bytes"
        node.buffers[j] = pa.py_buffer(data)
    elif op == "nulls":
        if node.type.num_buffers == 0 or pa.types.is_null(node.type):
            raise Skip("no validity")
        bits = np.ones(node.offset + node.length, dtype=bool)
        if not len(bits):
            raise Skip("empty")
        for _ in range(rng.randint(1, 3)):
            bits[rng.randrange(len(bits))] = False
        node.buffers[0] = pa.py_buffer(np.packbits(bits, bitorder="little"))
        detail = f"{path}: nulls added"
    elif op == "length":
        delta = rng.choice([-3, -1, 1, 2, -node.length])
        node.length = max(0, node.length + delta)
        detail = f"{path}: length {delta:+d}"
    else:
        node.offset += rng.choice([1, 2])
        node.length = max(0, node.length - rng.choice([0, 1, 2]))
        detail = f"{path}: offset {node.offset}"
    try:
        col = root.build()
        damaged = _rebuild(batch, i, col)
    except (pa.ArrowException, ValueError, TypeError, IndexError) as e:
        raise Skip(f"pyarrow refused: {e}") from None
    return f"buffer.{op}", detail, damaged


def _list_column_with_offsets(batch: pa.RecordBatch, rng: random.Random) -> tuple[str, str, Any]:
    """A 0-row list column whose only offset is 7 (or a list column starting at 7)."""
    names = ["sampled_token_ids", "logprobs", "prompt_logprobs", "sampling_mask"]
    name = rng.choice(names)
    i = batch.schema.get_field_index(name)
    root = Node.of(batch.column(i))
    # The column itself, or a nested list (positions' token_ids, mask positions).
    lists = [
        (p, n)
        for p, n in root.walk(name)
        if pa.types.is_list(n.type) or pa.types.is_large_list(n.type)
    ]
    path, node = rng.choice(lists)
    dt = np.int64 if pa.types.is_large_list(node.type) else np.int32
    start = rng.choice([7, -1, 2**31 - 1, 1])
    offs = np.frombuffer(_copy(node.buffers[1], (node.offset + node.length + 1) * dt().itemsize),
                         dtype=dt).copy()  # fmt: skip
    offs += start - (offs[0] if len(offs) else 0)
    node.buffers[1] = pa.py_buffer(offs)
    try:
        return (
            "buffer.offsets_start",
            f"{path} offsets start at {start}",
            _rebuild(batch, i, root.build()),
        )
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise Skip(str(e)) from None


def _negative_shape(batch: pa.RecordBatch, rng: random.Random) -> tuple[str, str, Any]:
    """Variable-shape tensor rows whose shape has negative dims with a plausible product."""
    names = [
        n
        for n in ("prompt_token_id_logprobs", "pooler_output", "aux_output")
        if batch.column(n).null_count < batch.num_rows
    ]
    candidates = []
    for name in names:
        i = batch.schema.get_field_index(name)
        root = Node.of(batch.column(i))
        for path, node in root.walk(name):
            if pa.types.is_struct(node.type) and node.type.get_field_index("shape") >= 0:
                candidates.append((i, root, path, node))
    if not candidates:
        raise Skip("no variable-shape tensor")
    i, root, path, node = rng.choice(candidates)
    shape_values = node.children[1].children[0]
    ndim = node.type.field("shape").type.list_size
    values = np.frombuffer(_copy(shape_values.buffers[1]), np.int32).copy()
    rows = values[: len(values) // ndim * ndim].reshape(-1, ndim)
    if not len(rows):
        raise Skip("no rows")
    r = rng.randrange(len(rows))
    how = rng.choice(["two_negative", "one_negative", "zero_big", "big_big", "swap_product"])
    if how == "two_negative" and ndim >= 2:
        a, b = rng.sample(range(ndim), 2)
        rows[r, a], rows[r, b] = -rows[r, a], -rows[r, b]
    elif how == "one_negative":
        rows[r, rng.randrange(ndim)] = -1
    elif how == "zero_big":
        rows[r] = 0
        rows[r, 0] = 2**31 - 1
    elif how == "big_big":
        rows[r] = 2**16
    else:
        rows[r] = rows[r][::-1]
    shape_values.buffers[1] = pa.py_buffer(values)
    try:
        damaged = _rebuild(batch, i, root.build())
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise Skip(str(e)) from None
    return f"buffer.shape.{how}", f"{path} row {r} shape {rows[r].tolist()}", damaged


def _request_columns(batch: pa.RecordBatch, rng: random.Random) -> tuple[str, str, Any]:
    """req_id / req_index / step columns that contradict what the format promises."""
    n = batch.num_rows
    if n == 0:
        raise Skip("no rows")
    ids = batch.column("req_id").to_pylist()
    how = rng.choice(
        ["null_req_id", "null_req_index", "dup_req_id", "req_index", "step", "null_step"]
    )
    if how == "null_req_id":
        ids[rng.randrange(n)] = None
        return f"buffer.{how}", str(ids), _rebuild(batch, 1, pa.array(ids, pa.string()))
    if how == "dup_req_id":
        if n < 2:
            raise Skip("one row")
        a, b = rng.sample(range(n), 2)
        ids[a] = ids[b]
        return f"buffer.{how}", str(ids), _rebuild(batch, 1, pa.array(ids, pa.string()))
    if how in ("req_index", "null_req_index"):
        index: list[int | None] = list(range(n))
        variant = rng.choice(["reversed", "shift", "negative", "big", "min", "repeat"])
        if how == "null_req_index":
            index[rng.randrange(n)] = None
        elif variant == "reversed" and n > 1:
            index.reverse()
        elif variant == "shift":
            index = [v + 1 for v in range(n)]
        elif variant == "negative":
            index[rng.randrange(n)] = -1
        elif variant == "big":
            index[rng.randrange(n)] = 2**31 - 1
        elif variant == "min":  # differences that overflow int32
            index[rng.randrange(n)] = -(2**31) + rng.choice([0, 1, 5])
        else:
            index = [0] * n
        return f"buffer.{how}", str(index), _rebuild(batch, 2, pa.array(index, pa.int32()))
    steps = batch.column("step").to_pylist()
    if how == "null_step":
        steps[rng.randrange(n)] = None
    else:
        base = steps[0] if steps[0] is not None else 0
        steps = [base + rng.choice([0, 1]) for _ in range(n)]
        steps[-1] = base + 1 if n > 1 or steps[0] is None else base - 1
    return f"buffer.{how}", str(steps), _rebuild(batch, 0, pa.array(steps, pa.int64()))


def _foreign_column(batch: pa.RecordBatch, rng: random.Random) -> tuple[str, str, Any]:
    """A column of another step with the same type and row count (its layout facts differ)."""
    options = []
    for other in corpus():
        o = other.batch
        if o is batch or o.num_rows != batch.num_rows:
            continue
        for i, (f, g) in enumerate(zip(batch.schema, o.schema)):
            if i > 2 and f.type == g.type and not batch.column(i).equals(o.column(i)):
                options.append((other.name, i, o.column(i)))
    if not options:
        raise Skip("no foreign column")
    name, i, col = rng.choice(options)
    column = batch.schema.names[i]
    return "buffer.foreign_column", f"{column} of {name}", _rebuild(batch, i, col)


def _sliced(
    rng: random.Random, entry: Entry, batch: pa.RecordBatch
) -> tuple[str, str, pa.RecordBatch, Any]:
    """A slice of a step (buffers with offsets), with its step JSON as it was, with ``rows``
    made the slice's, or with ``req_index`` renumbered too (a batch a writer could make)."""
    n = batch.num_rows
    if n < 2:
        raise Skip("too few rows")
    start = rng.randint(0, n - 1)
    length = rng.randint(0 if start else 1, n - start - (0 if start else 1))
    damaged = batch.slice(start, length)
    meta = _valid_json(entry)
    detail = f"rows {start}:{start + length} of {n}"
    how = rng.choice(["step_json_kept", "rows_made_the_slice's", "reindexed"])
    if how == "step_json_kept":
        return "buffer.slice", detail, damaged, entry.custom
    meta["rows"] = length
    custom = {KEY_STEP: _dumps(meta)}
    if how == "reindexed":
        # req_index 0..length-1 again: only the sliced (offset) buffers differ from a batch
        # a writer makes, so it must decode to exactly its rows.
        index = pa.array(np.arange(length, dtype=np.int32))
        damaged = _rebuild(damaged, 2, index)
        return "buffer.slice_reindexed", detail + ", req_index 0..n-1", damaged, custom
    return "buffer.slice_rows", detail + ", rows made the slice's", damaged, custom


def _taken(rng: random.Random, batch: pa.RecordBatch) -> tuple[str, str, pa.RecordBatch]:
    """Rows taken from a step: increasing (a filter), shuffled or repeated."""
    n = batch.num_rows
    if n < 2:
        raise Skip("too few rows")
    how = rng.choice(["filter", "shuffled", "repeated"])
    if how == "filter":
        rows = sorted(rng.sample(range(n), rng.randint(1, n - 1)))
    elif how == "shuffled":
        rows = rng.sample(range(n), n)
        if rows == sorted(rows):
            rows.reverse()
    else:
        rows = sorted(rng.choices(range(n), k=n))
    return f"buffer.take.{how}", f"rows {rows}", batch.take(pa.array(rows, pa.int64()))


#: Buffer mutations and their weights.
_BUFFER_OPS = {
    "buffer": 45,
    "empty_offset": 4,
    "offsets": 12,
    "shape": 10,
    "requests": 15,
    "foreign": 8,
    "slice": 5,
    "take": 3,
    "chain": 5,
}


def _buffer_case(case_id: str, rng: random.Random) -> Case:
    op = rng.choices(list(_BUFFER_OPS), weights=list(_BUFFER_OPS.values()))[0]
    for _ in range(7):  # steps the mutation applies to (and pyarrow builds)
        with contextlib.suppress(Skip):
            return _buffer_mutation(case_id, rng, op, rng.choice(corpus()))
    return _buffer_mutation(case_id, rng, op, rng.choice(corpus()))


def _buffer_mutation(case_id: str, rng: random.Random, op: str, entry: Entry) -> Case:
    batch = entry.plain
    custom: Any = entry.custom
    if op == "buffer":
        kind, detail, damaged = _buffer_op(rng, batch)
    elif op == "empty_offset":
        kind, detail, damaged = _buffer_op(rng, batch, "empty_offset")
        kind = "buffer.empty_offset"
    elif op == "offsets":
        kind, detail, damaged = _list_column_with_offsets(batch, rng)
    elif op == "shape":
        kind, detail, damaged = _negative_shape(batch, rng)
    elif op == "requests":
        kind, detail, damaged = _request_columns(batch, rng)
    elif op == "foreign":
        kind, detail, damaged = _foreign_column(batch, rng)
    elif op == "chain":
        kinds, details, damaged = [], [], batch
        for _ in range(rng.randint(2, 3)):
            with contextlib.suppress(Skip):
                k, d, damaged = _buffer_op(rng, damaged)
                kinds.append(k.removeprefix("buffer."))
                details.append(d)
        if not kinds:
            raise Skip("nothing applied")
        kind, detail = "buffer.chain", f"{'+'.join(kinds)}: {'; '.join(details)}"
    elif op == "slice":
        kind, detail, damaged, custom = _sliced(rng, entry, batch)
    else:
        kind, detail, damaged = _taken(rng, batch)
    if rng.random() < 0.1 and op not in ("slice", "take"):
        custom = None  # no step JSON at all: every layout fact read off the columns
        detail += " [no step metadata]"
    return Case(case_id, entry.name, kind, detail, [Attempt(damaged, custom)])


# --------------------------------------------------------------------------- ipc family


def _ipc_case(case_id: str, rng: random.Random) -> Case:
    entry = rng.choice(corpus())
    fmt = rng.choice(["stream", "file"])
    data = bytearray(entry.stream if fmt == "stream" else entry.file)
    op = rng.choice(["flip", "schema_flip", "truncate", "splice", "int32", "zero"])
    if op == "schema_flip":
        # Bits of the schema message only: field names, types, field and schema metadata.
        start = 0 if fmt == "stream" else 8  # after the file's magic
        length = int.from_bytes(data[start + 4 : start + 8], "little")
        k = rng.randint(1, 3)
        for _ in range(k):
            data[start + 8 + rng.randrange(length)] ^= 1 << rng.randrange(8)
        detail = f"{k} bits of the schema message flipped"
    elif op == "flip":
        k = rng.randint(1, 8)
        for _ in range(k):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        detail = f"{k} bits flipped"
    elif op == "truncate":
        cut = rng.randrange(len(data))
        del data[cut:]
        detail = f"truncated at {cut}"
    elif op == "splice":
        other = rng.choice(corpus())
        src = other.stream if fmt == "stream" else other.file
        a = rng.randrange(len(data))
        b = min(len(data), a + rng.randint(1, 256))
        c = rng.randrange(len(src))
        data[a:b] = src[c : c + (b - a)]
        detail = f"bytes {a}:{b} from {other.name}[{c}:]"
    elif op == "int32":
        k = rng.randrange(len(data) // 4)
        v = rng.choice(_INTERESTING[:7])
        data[4 * k : 4 * k + 4] = np.array([v], np.int32).tobytes()
        detail = f"int32 {k} = {v}"
    else:
        a = rng.randrange(len(data))
        b = min(len(data), a + rng.randint(1, 64))
        data[a:b] = bytes(b - a)
        detail = f"bytes {a}:{b} zeroed"
    with_meta = rng.random() < 0.9
    case = Case(case_id, entry.name, f"ipc.{fmt}.{op}", detail, [])
    if not with_meta:
        case.detail += " [custom metadata not passed]"
    buf = pa.py_buffer(bytes(data))
    try:
        if fmt == "stream":
            reader = pa.ipc.open_stream(buf)
            for _ in range(4):
                try:
                    b, meta = reader.read_next_batch_with_custom_metadata()
                except StopIteration:
                    break
                case.attempts.append(Attempt(b, meta if with_meta else None))
        else:
            reader = pa.ipc.open_file(buf)
            for i in range(min(reader.num_record_batches, 4)):
                b, meta = reader.get_batch_with_custom_metadata(i)
                case.attempts.append(Attempt(b, meta if with_meta else None))
    except (pa.ArrowException, OSError, ValueError, UnicodeDecodeError) as e:
        # pyarrow's refusal, before the decoder is involved: fine (batches read so far are
        # still decoded).
        case.pyarrow_refused = type(e).__name__
    return case


FAMILIES: dict[str, Callable[[str, random.Random], Case]] = {
    "json": _json_case,
    "schema": _schema_case,
    "buffer": _buffer_case,
    "ipc": _ipc_case,
}


def make_case(case_id: str) -> Case:
    """The case an id names (``family:index``): the same on every run."""
    family = case_id.split(":", 1)[0]
    return FAMILIES[family](case_id, random.Random(case_id))


# =========================================================================== the oracle


class Timeout(BaseException):
    """A decode ran past its deadline (raised by SIGALRM)."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """SIGALRM after ``seconds`` (main thread on POSIX only; elsewhere no deadline)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise Timeout(f"decode ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


#: Address space a decode may add (RLIMIT_AS): far above the memory bound of any corpus
#: input, far below what an allocation bomb asks for, so bombs fail fast (MemoryError)
#: instead of taking seconds, or a small machine's memory.
HEADROOM = 512 * MIB
_GUARD_USABLE = sys.platform.startswith("linux") and os.path.exists("/proc/self/statm")


@contextlib.contextmanager
def _address_space_guard() -> Iterator[None]:
    if not _GUARD_USABLE:
        yield
        return
    import resource

    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = used + HEADROOM
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class _LazyTorchModule(types.ModuleType):
    """Stands in for ``torch._inductor``, which ``getattr(torch, "_inductor")`` would import
    (seconds, tens of MB, and a changed process for the tests after this one)."""


@contextlib.contextmanager
def _no_lazy_torch_imports() -> Iterator[None]:
    name = "torch._inductor"
    if name in sys.modules:
        yield
        return
    stub = sys.modules[name] = _LazyTorchModule(name)
    try:
        yield
    finally:
        if sys.modules.get(name) is stub:
            del sys.modules[name]


@dataclasses.dataclass
class Finding:
    outcome: str  # escape | timeout | warning | memory | unencodable | mismatch
    what: str  # exception type, warning class, or the differing column
    kind: str  # mutation kind
    case_id: str
    entry: str
    detail: str
    message: str
    frame: str  # the last arrow_outputs frame of the traceback ("" when none)
    raised_at: str  # the traceback's very last frame


def _frames(e: BaseException) -> tuple[str, str]:
    tb = traceback.extract_tb(e.__traceback__)
    ours = [f for f in tb if f"{os.sep}arrow_outputs{os.sep}" in f.filename]

    def fmt(f: traceback.FrameSummary) -> str:
        return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()}"

    return (fmt(ours[-1]) if ours else "", fmt(tb[-1]) if tb else "")


def _input_bytes(batch: pa.RecordBatch, custom: Any) -> int:
    try:
        size = batch.get_total_buffer_size()
    except Exception:
        size = 0
    meta = dict(batch.schema.metadata or {})
    size += sum(len(k) + len(v) for k, v in meta.items())
    for f in batch.schema:
        size += sum(len(k) + len(v) for k, v in (f.metadata or {}).items())
    if custom is not None:
        with contextlib.suppress(Exception):
            size += sum(len(k) + len(v) for k, v in dict(custom).items())
    return size


def _canon(x: Any) -> Any:
    """A comparable form of ``to_pylist()`` values: NaNs equal each other."""
    if type(x) is float:
        return ("nan",) if math.isnan(x) else x
    if type(x) is list:
        return [_canon(v) for v in x]
    if type(x) is dict:
        return {k: _canon(v) for k, v in x.items()}
    return x


#: The hardened reader refuses a batch without its own step JSON unless told to read it off
#: the columns; that reading is what such attempts here are for.
_MISSING_KW = (
    {"missing_step_metadata": "defaults"}
    if "missing_step_metadata" in inspect.signature(ao.from_record_batch).parameters
    else {}
)


def _decode_kwargs(attempt: Attempt) -> dict[str, Any]:
    if attempt.custom is None and KEY_STEP not in (attempt.batch.schema.metadata or {}):
        return _MISSING_KW
    return {}


def _step_json(attempt: Attempt) -> dict[str, Any]:
    return ao.step_metadata(attempt.batch, attempt.custom, **_decode_kwargs(attempt))


def _step_of(batch: pa.RecordBatch, meta: dict[str, Any]) -> Any:
    if "step" in meta:
        return meta["step"]
    return batch.column(0)[0].as_py() if batch.num_rows else None


def _legitimate_difference(
    name: str, given: pa.Array, again: pa.Array, meta: dict[str, Any]
) -> str | None:
    """Why a column may legitimately differ after a decode/re-encode round trip, or None.

    Values under nulls are no difference (``to_pylist`` and ``Array.equals`` ignore them).
    One difference is legitimate: a slice or filter of a step (fewer rows than its step
    JSON's ``rows``, ``req_index`` increasing within ``0..rows-1``) decodes to the output of
    its rows, as docs/schema.md says of ``req_index``, and that output re-encodes with its
    rows numbered ``0..k-1``, while the batch's ``req_index`` holds their positions in the
    step. Everything else (a step column that the step JSON contradicts, data the step JSON
    says is absent, null or repeated request ids, a ``req_index`` that is not ``0..n-1`` in a
    batch of all its step's rows) is the decoder accepting a batch no writer makes and
    reading it otherwise than pyarrow does.
    """
    rows, n = meta.get("rows"), len(given)
    if name == "req_index" and type(rows) is int and n < rows:
        index = given.to_pylist()
        increasing = all(type(a) is int and a < b for a, b in itertools.pairwise(index))
        inside = not index or (index[0] >= 0 and index[-1] < rows)
        if increasing and inside and again.to_pylist() == list(range(n)):
            return "a slice or filter of its step decodes to its own rows"
    return None


def check(attempt: Attempt, case: Case) -> tuple[str, list[Finding]]:
    """Decode one attempt: ``("accepted" | "rejected" | "escaped", findings)``, where the
    findings are every way it broke the contract."""
    findings: list[Finding] = []

    def add(outcome: str, what: str, message: str, e: BaseException | None = None) -> None:
        frame, raised_at = _frames(e) if e is not None else ("", "")
        detail = case.detail + (f" ({attempt.note})" if attempt.note else "")
        findings.append(
            Finding(
                outcome, what, case.kind, case.case_id, case.entry, detail, message[:300],
                frame, raised_at,
            )
        )  # fmt: skip

    batch, custom = attempt.batch, attempt.custom
    limit = _memory_bound(_input_bytes(batch, custom))
    tracing = tracemalloc.is_tracing()
    base = 0
    if tracing:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
    out, status = None, "escaped"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with _deadline(DEADLINE_S), _address_space_guard():
                out = ao.from_record_batch(batch, custom_metadata=custom, **_decode_kwargs(attempt))
        status = "accepted"
    except ArrowOutputsError:
        status = "rejected"
    except Timeout as e:
        add("timeout", "Timeout", str(e), e)
    except Warning as e:
        add("warning", type(e).__name__, str(e), e)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        add("escape", type(e).__name__, str(e), e)
    if tracing:
        peak = tracemalloc.get_traced_memory()[1] - base
        if peak > limit:
            add("memory", "peak", f"tracemalloc peak {peak:,} B over the bound {limit:,} B")
    if status == "accepted":
        round_trip(attempt, out, add)
    return status, findings


def round_trip(attempt: Attempt, out: Any, add: Callable[..., None]) -> None:
    """Re-encode a decoded step with the batch's step and run schema; report how the
    columns differ from the batch's (``add(outcome, what, message, exception)``)."""
    batch = attempt.batch
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            meta = _step_json(attempt)
            again = ao.to_record_batch(out, step=_step_of(batch, meta), schema=ao.run_schema(batch))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        # The decoder accepted what no writer can make: its output does not encode.
        add("unencodable", type(e).__name__, str(e), e)
        return
    for i, name in enumerate(batch.schema.names):
        given, made = batch.column(i), again.column(i)
        if given.equals(made):
            continue
        a, b = _canon(given.to_pylist()), _canon(made.to_pylist())
        if a == b or _legitimate_difference(name, given, made, meta) is not None:
            continue
        add("mismatch", name, f"batch {_clip(a, 120)} != decoded {_clip(b, 120)}")


# =========================================================================== the driver


@dataclasses.dataclass
class Report:
    cases: int = 0
    decodes: int = 0
    accepted: int = 0
    rejected: int = 0
    skipped: Counter = dataclasses.field(default_factory=Counter)
    pyarrow_refused: Counter = dataclasses.field(default_factory=Counter)
    kinds: Counter = dataclasses.field(default_factory=Counter)
    findings: list[Finding] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def summary(self, *, limit_ids: int = 4) -> str:
        lines = [
            f"{self.cases} cases ({sum(self.skipped.values())} skipped: mutation did not "
            f"apply or pyarrow would not build it), {self.decodes} decodes "
            f"({self.accepted} accepted, {self.rejected} refused with ArrowOutputsError), "
            f"{sum(self.pyarrow_refused.values())} IPC inputs refused by pyarrow before "
            f"decoding, {self.seconds:.1f} s",
        ]
        if not self.findings:
            lines.append("no escapes")
            return "\n".join(lines)
        groups: dict[tuple[str, str, str], list[Finding]] = defaultdict(list)
        for f in self.findings:
            groups[(f.outcome, f.what, f.kind)].append(f)
        by_outcome = Counter(f.outcome for f in self.findings)
        lines.append(
            f"{len(self.findings)} findings in {len(groups)} groups: "
            + ", ".join(f"{k} {v}" for k, v in by_outcome.most_common())
        )
        lines.append(
            "(escape/warning/timeout: from_record_batch raised something else than an "
            "ArrowOutputsError; memory: tracemalloc peak over the bound; unencodable: the "
            "decoded output is one to_record_batch refuses; mismatch: it re-encodes to other "
            "columns than the batch's. The last two are batches no writer makes, accepted.)"
        )
        order = sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], -len(kv[1])))
        for (outcome, what, kind), fs in order:
            f = fs[0]
            ids = ", ".join(list(dict.fromkeys(x.case_id for x in fs))[:limit_ids])
            lines.append(f"[{outcome}] {what} <- {kind}: {len(fs)}x (e.g. {ids})")
            lines.append(f"    {f.entry}: {f.detail[:200]}")
            lines.append(f"    {f.message[:200]}")
            if f.frame:
                lines.append(f"    at {f.frame}")
            if f.raised_at and f.raised_at != f.frame:
                lines.append(f"    raised {f.raised_at}")
        lines.append("replay one: python tests/test_fuzz.py --replay <case id>")
        return "\n".join(lines)


#: Where the id of the case being run is kept, so that a crash (a segfault is no exception
#: and ends the process) still says which case to replay.
BREADCRUMB = os.environ.get(
    "ARROW_OUTPUTS_FUZZ_BREADCRUMB",
    os.path.join(tempfile.gettempdir(), "arrow_outputs_fuzz_current_case.txt"),
)


def run_cases(case_ids: list[str], report: Report | None = None) -> Report:
    report = report or Report()
    corpus()  # built before tracing starts
    started = time.perf_counter()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    crumb = os.open(BREADCRUMB, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    lazy = _no_lazy_torch_imports()
    lazy.__enter__()
    try:
        for case_id in case_ids:
            os.pwrite(crumb, f"{case_id:<40}\n".encode(), 0)
            report.cases += 1
            try:
                case = make_case(case_id)
            except Skip as e:
                report.skipped[str(e)[:40]] += 1
                continue
            except Exception as e:  # a bug of this module: shown, never hiding the rest
                frame = _frames(e)[1]
                report.findings.append(
                    Finding("harness", type(e).__name__, "?", case_id, "?", "", str(e), "", frame)
                )
                continue
            report.kinds[case.kind] += 1
            if case.pyarrow_refused:
                report.pyarrow_refused[case.pyarrow_refused] += 1
            for attempt in case.attempts:
                report.decodes += 1
                status, found = check(attempt, case)
                report.accepted += status == "accepted"
                report.rejected += status == "rejected"
                report.findings += found
    finally:
        lazy.__exit__(None, None, None)
        os.close(crumb)
        if not was_tracing:
            tracemalloc.stop()
    with contextlib.suppress(OSError):
        os.unlink(BREADCRUMB)  # finished: no case to blame
    report.seconds += time.perf_counter() - started
    return report


def case_ids(family: str, scale: float) -> list[str]:
    count = max(1, round(CASES_PER_FAMILY[family] * scale))
    return [f"{family}:{i}" for i in range(count)]


def _scale() -> float:
    return float(os.environ.get("ARROW_OUTPUTS_FUZZ_SCALE", "1"))


# =========================================================================== tests


def test_corpus_round_trips() -> None:
    """The corpus is valid: every entry (and its IPC forms) decodes and re-encodes exactly."""
    for entry in corpus():
        attempts = [Attempt(entry.batch, None), Attempt(entry.plain, entry.custom)]
        for data, fmt in ((entry.stream, "stream"), (entry.file, "file")):
            case = _ipc_from_bytes(data, fmt)
            assert len(case) == 2, entry.name
            attempts += case
        for attempt in attempts:
            out = ao.from_record_batch(attempt.batch, custom_metadata=attempt.custom)
            round_trip(attempt, out, _raise_finding)


def _raise_finding(outcome: str, what: str, message: str, e: BaseException | None = None) -> None:
    raise AssertionError(f"{outcome} {what}: {message}") from e


def _ipc_from_bytes(data: bytes, fmt: str) -> list[Attempt]:
    if fmt == "stream":
        reader = pa.ipc.open_stream(data)
        out = []
        while True:
            try:
                b, meta = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                return out
            out.append(Attempt(b, meta))
    reader = pa.ipc.open_file(data)
    return [Attempt(*reader.get_batch_with_custom_metadata(i)) for i in range(2)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fuzz_decoder(family: str) -> None:
    """Damaged inputs raise ArrowOutputsError or decode to what pyarrow reads."""
    report = run_cases(case_ids(family, _scale()))
    assert report.findings == [], "\n" + report.summary()


# =========================================================================== script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=_scale(), help="case count multiplier")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    parser.add_argument("--replay", metavar="CASE_ID", help="run one case, show its traceback")
    parser.add_argument("--timeout", type=float, default=DEADLINE_S, help="seconds per decode")
    parser.add_argument("--json", metavar="PATH", help="write the findings as JSON")
    args = parser.parse_args(argv)
    globals()["DEADLINE_S"] = args.timeout
    if args.replay:
        return _replay(args.replay)
    report = Report()
    for family in args.families.split(","):
        t0 = time.perf_counter()
        ids = case_ids(family, args.scale)
        before = len(report.findings)
        run_cases(ids, report)
        print(
            f"{family}: {len(ids)} cases, {len(report.findings) - before} findings, "
            f"{time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
    print(report.summary(limit_ids=6))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(x) for x in report.findings], f, indent=1)
    return 1 if report.findings else 0


def _replay(case_id: str) -> int:
    try:
        case = make_case(case_id)
    except Skip as e:
        print(f"{case_id}: skipped ({e})")
        return 0
    print(f"{case_id}: {case.kind} on {case.entry}: {case.detail}")
    if case.pyarrow_refused:
        print(f"pyarrow refused part of the IPC input: {case.pyarrow_refused}")
    status = 0
    for attempt in case.attempts:
        print(f"-- decode (custom_metadata={_clip(attempt.custom, 200)})")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                out = ao.from_record_batch(
                    attempt.batch, custom_metadata=attempt.custom, **_decode_kwargs(attempt)
                )
            except ArrowOutputsError as e:
                print(f"rejected: {type(e).__name__}: {e}")
                continue
            except Exception:
                traceback.print_exc()
                status = 1
                continue
        problems: list[tuple[Any, ...]] = []
        round_trip(attempt, out, lambda *a, found=problems: found.append(a))
        for outcome, what, message, *exc in problems:
            print(f"accepted, but {outcome} {what}: {message}")
            if exc and exc[0] is not None:
                traceback.print_exception(exc[0])
        status |= bool(problems)
        print("decoded:", _clip(out, 400))
    return status


if __name__ == "__main__":
    sys.exit(main())
