"""Tests of the record-batch codec: ``to_record_batch`` / ``from_record_batch`` are lossless.

"Lossless" is checked kind for kind by :func:`assert_same_output`: Python lists of Python
ints where vLLM has lists, numpy where it has numpy, torch where it has torch, sets as sets,
dtypes and shapes kept (0-row matrices keep their width), and every None / [] / {} / set()
distinction kept. Zero-copy is checked by buffer addresses.
"""

from __future__ import annotations

import copyreg
import dataclasses
import math
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pytest
import torch

import arrow_outputs
from arrow_outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AuxRequestOutput,
    ColumnTypes,
    CUDAGraphStat,
    ECConnectorOutput,
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    OpaqueValueWarning,
    SamplingMaskLists,
    SchemaMismatchError,
    UnsupportedValueError,
    from_record_batch,
    logprobs_from_arrow,
    logprobs_to_arrow,
    make_empty_encoder_model_runner_output,
    output_schema,
    run_metadata,
    run_schema,
    sampling_masks_from_arrow,
    sampling_masks_to_arrow,
    step_custom_metadata,
    step_metadata,
    to_record_batch,
)

# Every test here runs on the C accelerator and on the pure-Python path.
pytestmark = pytest.mark.usefixtures("codec_path")

KEY_STEP = b"arrow_outputs.step"

# --------------------------------------------------------------------------- the helper

_OURS: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        LogprobsLists,
        LogprobsTensors,
        SamplingMaskLists,
        KVConnectorOutput,
        ECConnectorOutput,
        CUDAGraphStat,
        AuxRequestOutput,
        ModelRunnerOutput,
    )
}
# Same-size integer views: arrays are compared bit for bit (NaN payloads, -0.0 included).
_NP_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _our_class(x: Any) -> type | None:
    """Our class for one of ours or a look-alike (``VllmLogprobsLists`` -> LogprobsLists)."""
    return _OURS.get(type(x).__name__.removeprefix("Vllm"))


def _field_names(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(cls._fields)  # type: ignore[attr-defined]


def _assert_same(a: Any, b: Any, path: str) -> None:
    if a is None:
        assert b is None, f"{path}: expected None, got {b!r}"
        return
    cls = _our_class(a)
    if cls is not None:
        assert type(b) is cls, f"{path}: expected {cls.__name__}, got {type(b).__name__}"
        for name in _field_names(cls):
            _assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
        return
    if isinstance(a, np.ndarray):
        assert type(b) is np.ndarray, f"{path}: expected numpy, got {type(b).__name__}"
        assert b.dtype == a.dtype, f"{path}: dtype {b.dtype} != {a.dtype}"
        assert b.shape == a.shape, f"{path}: shape {b.shape} != {a.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), f"{path}: values differ"
        bits = _NP_BITS[a.dtype.itemsize]
        assert np.array_equal(a.view(bits), b.view(bits)), f"{path}: bit patterns differ"
        return
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor, f"{path}: expected torch, got {type(b).__name__}"
        assert b.dtype == a.dtype, f"{path}: dtype {b.dtype} != {a.dtype}"
        assert b.shape == a.shape, f"{path}: shape {tuple(b.shape)} != {tuple(a.shape)}"
        assert b.device == a.device, f"{path}: device {b.device} != {a.device}"
        if a.dtype == torch.bool:
            assert torch.equal(a, b), f"{path}: values differ"
        else:
            bits = _TORCH_BITS[a.element_size()]
            assert torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)), (
                f"{path}: bit patterns differ"
            )
        return
    if isinstance(a, Mapping):
        # Whatever mapping went in (dict or a Mapping subclass), a dict comes back.
        assert type(b) is dict, f"{path}: expected dict, got {type(b).__name__}"
        assert set(a) == set(b), f"{path}: keys {sorted(b)} != {sorted(a)}"
        for key in a:
            _assert_same(a[key], b[key], f"{path}[{key!r}]")
        return
    if type(a) in (list, tuple):
        assert type(b) is type(a), f"{path}: expected {type(a).__name__}, got {type(b).__name__}"
        assert len(b) == len(a), f"{path}: length {len(b)} != {len(a)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
        return
    if type(a) in (set, frozenset):
        assert type(b) is type(a), f"{path}: expected {type(a).__name__}, got {type(b).__name__}"
        assert {(type(v), v) for v in b} == {(type(v), v) for v in a}, f"{path}: {b} != {a}"
        return
    assert type(b) is type(a), f"{path}: expected {type(a).__name__}, got {type(b).__name__}"
    if type(a) is float and math.isnan(a):
        assert math.isnan(b), f"{path}: {b!r} != nan"
    else:
        assert b == a, f"{path}: {b!r} != {a!r}"


def assert_same_output(a: Any, b: Any) -> None:
    """Assert that ``b`` (decoded) is ``a`` (the source), field by field and kind by kind.

    ``a`` may be ours or a vLLM look-alike; ``b`` must be of our classes. Numpy arrays are
    compared with their dtype and shape (bit for bit), torch tensors likewise, lists must be
    Python lists, ints Python ints, sets sets, and None must stay None.
    """
    assert type(b) is ModelRunnerOutput, f"expected a ModelRunnerOutput, got {type(b)}"
    _assert_same(a, b, "output")


# --------------------------------------------------------------------------- builders


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _index(req_ids: list[str]) -> dict[str, int]:
    return {r: i for i, r in enumerate(req_ids)}


def _lists(
    num_pos: int,
    width: int,
    cu: list[int] | None = None,
    *,
    ids: type = np.int64,
    ranks: type = np.int64,
    seed: int = 0,
) -> LogprobsLists:
    rng = _rng(seed)
    lps = -rng.exponential(size=(num_pos, width)).astype(np.float32)
    if num_pos:
        lps[0, -1] = -np.inf  # a masked-out candidate
    return LogprobsLists(
        rng.integers(0, 150_000, size=(num_pos, width)).astype(ids),
        lps,
        rng.integers(1, 1000, size=num_pos).astype(ranks),
        cu,
    )


def _tensors(
    num_pos: int, width: int, *, ids: torch.dtype = torch.int64, seed: int = 0
) -> LogprobsTensors:
    g = torch.Generator().manual_seed(seed)
    return LogprobsTensors(
        torch.randint(0, 150_000, (num_pos, width), generator=g).to(ids),
        -torch.rand((num_pos, width), generator=g) * 10,
        torch.randint(1, 1000, (num_pos,), generator=g).to(ids),
    )


def _masks(lengths: list[int], cu: list[int] | None = None, *, seed: int = 0) -> SamplingMaskLists:
    rng = _rng(seed)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    token_ids = np.concatenate(
        [np.sort(rng.choice(1000, size=k, replace=False)) for k in lengths] or [np.empty(0)]
    ).astype(np.int32)
    return SamplingMaskLists(token_ids, offsets, cu)


def _aux(rows: int, dtype: type, *, seed: int = 0) -> np.ndarray:
    return _rng(seed).integers(0, np.iinfo(dtype).max, size=(rows, 4, 2)).astype(dtype)


def _decode_requests(n_req: int, seed: int, width: int) -> ModelRunnerOutput:
    """A decode step of requests ``r0, r1, ...``: token ``seed * 100 + i`` each and
    ``width`` logprobs per position (seeded)."""
    req_ids = [f"r{i}" for i in range(n_req)]
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[seed * 100 + i] for i in range(n_req)],
        logprobs=_lists(n_req, width, seed=seed),
    )


def _decode_step() -> ModelRunnerOutput:
    req_ids = ["r0", "r1", "r2"]
    return ModelRunnerOutput(
        req_ids, _index(req_ids), [[11], [12], [13]], logprobs=_lists(3, 21), sampling_masks=None
    )


def _decode_int32() -> ModelRunnerOutput:
    # The older model runner: int32 logprob token ids, int64 ranks, explicit cu.
    req_ids = ["a", "b", "c"]
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2], [3]],
        logprobs=_lists(3, 6, [0, 1, 2, 3], ids=np.int32),
    )


def _decode_int32_ranks() -> ModelRunnerOutput:
    req_ids = ["a", "b"]
    return ModelRunnerOutput(
        req_ids, _index(req_ids), [[1], [2]], logprobs=_lists(2, 3, ids=np.int32, ranks=np.int32)
    )


def _speculative() -> ModelRunnerOutput:
    # Varying accepted counts; one logprob row per verified position (rejected rows carry
    # token id 0), so cu ends at 9 while only 6 tokens were sampled.
    req_ids = ["s0", "s1", "s2", "s3"]
    lp = _lists(9, 5, [0, 4, 6, 6, 9], seed=1)
    lp.logprob_token_ids[3] = 0
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[11, 12, 13], [21], [], [41, 42]],
        logprobs=lp,
        sampling_masks=_masks([3, 0, 2, 4, 1, 5], [0, 3, 4, 4, 6]),
        num_nans_in_logits={"s0": 0, "s3": 2},
    )


def _sampled_nothing() -> ModelRunnerOutput:
    # A request that sampled nothing this step (its list is empty) among ones that did.
    req_ids = ["x", "y", "z"]
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[5], [], [7]],
        logprobs=_lists(2, 4, [0, 1, 1, 2]),
        sampling_masks=_masks([2, 3], [0, 1, 1, 2]),
    )


def _pooling() -> ModelRunnerOutput:
    req_ids = ["p0", "p1", "p2"]
    pooled = torch.randn(3, 16)
    return ModelRunnerOutput(req_ids, _index(req_ids), [], pooler_output=list(pooled.unbind(0)))


def _pooling_with_none() -> ModelRunnerOutput:
    req_ids = ["p0", "p1", "p2"]
    return ModelRunnerOutput(
        req_ids, _index(req_ids), [], pooler_output=[torch.randn(8), None, torch.randn(8)]
    )


def _pooling_variable_shape() -> ModelRunnerOutput:
    # Token-level pooling: one row per prompt token, so shapes differ per request.
    req_ids = ["t0", "t1", "t2", "t3"]
    rows = [torch.randn(3, 4), None, torch.randn(1, 4), torch.randn(0, 4)]
    return ModelRunnerOutput(req_ids, _index(req_ids), [], pooler_output=rows)


def _encoder_only() -> ModelRunnerOutput:
    return make_empty_encoder_model_runner_output(
        SimpleNamespace(num_scheduled_tokens={"e0": 5, "e1": 1, "e2": 7})
    )


def _empty() -> ModelRunnerOutput:
    return EMPTY_MODEL_RUNNER_OUTPUT


def _empty_with_kv() -> ModelRunnerOutput:
    out = ModelRunnerOutput.with_kv_conn_output_only(
        KVConnectorOutput(
            finished_sending={"a", "b"},
            finished_recving=set(),
            invalid_block_ids={3, 17},
            expected_finished_count=2,
        )
    )
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT
    return out


def _empty_with_ec_and_stats() -> ModelRunnerOutput:
    out = ModelRunnerOutput.with_ec_conn_output_only(ECConnectorOutput(finished_recving={"mm0"}))
    out.cudagraph_stats = CUDAGraphStat(10, 16, 6, "FULL")
    return out


def _prompt_logprobs() -> ModelRunnerOutput:
    # "a" absent, "b" present with None (chunked prefill not finished), "c" a one-token
    # prompt (0 rows, width kept), "d" prompt_len - 1 rows.
    req_ids = ["a", "b", "c", "d"]
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2], [3], [4]],
        prompt_logprobs_dict={"b": None, "c": _tensors(0, 21), "d": _tensors(6, 21, seed=3)},
    )


def _prompt_logprobs_int32() -> ModelRunnerOutput:
    req_ids = ["a", "b"]
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2]],
        prompt_logprobs_dict={
            "a": _tensors(4, 3, ids=torch.int32),
            "b": _tensors(2, 5, ids=torch.int32, seed=1),
        },
    )


def _prompt_logprobs_only_none() -> ModelRunnerOutput:
    req_ids = ["a", "b"]
    return ModelRunnerOutput(req_ids, _index(req_ids), [[1], [2]], prompt_logprobs_dict={"a": None})


def _prompt_token_id_logprobs() -> ModelRunnerOutput:
    req_ids = ["a", "b", "c"]
    padded = torch.tensor([[-0.5, -1.5, -float("inf")], [-0.25, -float("inf"), -float("inf")]])
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2], [3]],
        prompt_token_id_logprobs_dict={"c": padded, "a": -torch.rand(4, 2)},
    )


def _num_nans() -> ModelRunnerOutput:
    req_ids = ["a", "b", "c"]
    return ModelRunnerOutput(
        req_ids, _index(req_ids), [[1], [2], [3]], num_nans_in_logits={"a": 0, "c": 12}
    )


def _masks_single_position() -> ModelRunnerOutput:
    # One request, one position: vLLM leaves offsets None.
    m = _masks([4])
    return ModelRunnerOutput(
        ["a"], {"a": 0}, [[9]], sampling_masks=SamplingMaskLists(m.token_ids, None, None)
    )


def _masks_offsets_none_with_cu() -> ModelRunnerOutput:
    m = _masks([3])
    req_ids = ["a", "b"]
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[], [9]],
        sampling_masks=SamplingMaskLists(m.token_ids, None, [0, 0, 1]),
    )


def _masks_csr_cu_none() -> ModelRunnerOutput:
    req_ids = ["a", "b", "c", "d"]
    return ModelRunnerOutput(
        req_ids, _index(req_ids), [[1], [2], [3], [4]], sampling_masks=_masks([2, 0, 5, 1])
    )


def _aux_uint8() -> ModelRunnerOutput:
    req_ids = ["a", "b", "c"]
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2, 3], [4]],
        aux_output_connector_output={
            "a": AuxRequestOutput(0, _aux(5, np.uint8)),
            "c": AuxRequestOutput(17, _aux(1, np.uint8, seed=2)),
        },
    )


def _aux_uint16() -> ModelRunnerOutput:
    req_ids = ["a", "b"]
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2, 3]],
        aux_output_connector_output={
            "a": AuxRequestOutput(100, _aux(1, np.uint16)),
            "b": AuxRequestOutput(3, _aux(2, np.uint16, seed=5)),
        },
    )


def _logprobs_zero_rows_no_requests() -> ModelRunnerOutput:
    out = ModelRunnerOutput([], {}, [], logprobs=_lists(0, 21))
    assert out.logprobs is not None
    assert out.logprobs.logprobs.shape == (0, 21)
    return out


def _logprobs_zero_rows_with_requests() -> ModelRunnerOutput:
    req_ids = ["a", "b"]
    return ModelRunnerOutput(
        req_ids, _index(req_ids), [[], []], logprobs=_lists(0, 21, [0, 0, 0], ids=np.int32)
    )


def _logprobs_tensors_cu_tensor() -> ModelRunnerOutput:
    # Adaptive verification: boundaries known only as a (here host) tensor.
    req_ids = ["a", "b"]
    t = _tensors(3, 4)
    lp = t._replace(cu_num_generated_tokens_tensor=torch.tensor([0, 2, 3], dtype=torch.int32))
    return ModelRunnerOutput(req_ids, _index(req_ids), [[1, 2], [3]], logprobs=lp)


def _empty_containers() -> ModelRunnerOutput:
    # {} (not None), [] (not None), set() (not None), and 0-size matrices.
    return ModelRunnerOutput(
        [],
        {},
        [],
        logprobs=_lists(0, 3, [0]),
        pooler_output=[],
        num_nans_in_logits={},
        aux_output_connector_output={},
        sampling_masks=SamplingMaskLists(np.empty(0, np.int32), np.zeros(1, np.int64), [0]),
        kv_connector_output=KVConnectorOutput(finished_sending=set(), finished_recving=None),
        ec_connector_output=ECConnectorOutput(finished_sending=set()),
    )


def _empty_containers_with_requests() -> ModelRunnerOutput:
    req_ids = ["a", "b"]
    return ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2]],
        num_nans_in_logits={},
        aux_output_connector_output={},
        pooler_output=[None, None],
    )


def _everything() -> ModelRunnerOutput:
    req_ids = ["req-0", "req-1", "req-2", "req-3", "ü-4"]
    pooled = torch.randn(5, 8, dtype=torch.bfloat16)
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
            kv_connector_worker_meta=None,
            invalid_block_ids={9},
            expected_finished_count=1,
        ),
        ec_connector_output=ECConnectorOutput(finished_sending={"req-0"}),
        num_nans_in_logits={"req-0": 0, "req-1": 3},
        cudagraph_stats=CUDAGraphStat(5, 8, 3, "PIECEWISE"),
        aux_output_connector_output={"req-1": AuxRequestOutput(4, _aux(2, np.uint16))},
        sampling_masks=_masks([1, 2, 0, 3, 4, 1], [0, 2, 3, 3, 5, 6]),
    )


CASES: list[Callable[[], ModelRunnerOutput]] = [
    _decode_step,
    _decode_int32,
    _decode_int32_ranks,
    _speculative,
    _sampled_nothing,
    _pooling,
    _pooling_with_none,
    _pooling_variable_shape,
    _encoder_only,
    _empty,
    _empty_with_kv,
    _empty_with_ec_and_stats,
    _prompt_logprobs,
    _prompt_logprobs_int32,
    _prompt_logprobs_only_none,
    _prompt_token_id_logprobs,
    _num_nans,
    _masks_single_position,
    _masks_offsets_none_with_cu,
    _masks_csr_cu_none,
    _aux_uint8,
    _aux_uint16,
    _logprobs_zero_rows_no_requests,
    _logprobs_zero_rows_with_requests,
    _logprobs_tensors_cu_tensor,
    _empty_containers,
    _empty_containers_with_requests,
    _everything,
]


def _ipc_bytes(batches: list[pa.RecordBatch]) -> pa.Buffer:
    """A stream written the documented way: the run schema, each step's metadata per message."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, run_schema(batches[0])) as writer:
        for b in batches:
            writer.write_batch(b, custom_metadata=step_custom_metadata(b))
    return sink.getvalue()


def _ipc(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, Any]:
    """The batch after an IPC stream round trip (its buffers now live in the stream bytes),
    with its message's custom metadata."""
    return pa.ipc.open_stream(_ipc_bytes([batch])).read_next_batch_with_custom_metadata()


def _decode_ipc(batch: pa.RecordBatch, **kw: Any) -> ModelRunnerOutput:
    read, meta = _ipc(batch)
    return from_record_batch(read, custom_metadata=meta, **kw)


def _roundtrip(out: Any, path: str, **kw: Any) -> ModelRunnerOutput:
    batch = to_record_batch(out, step=42, **kw)
    return _decode_ipc(batch) if path == "ipc" else from_record_batch(batch)


# --------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__.lstrip("_"))
def test_step_json_is_what_the_json_module_writes(make: Callable[[], ModelRunnerOutput]) -> None:
    """The encoder's step JSON (written through the C encoder made once) is byte for byte
    what ``json.JSONEncoder(separators=(",", ":")).encode`` makes of the same object."""
    import json

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = to_record_batch(make(), step=7).schema.metadata[b"arrow_outputs.step"]
    meta = json.loads(raw)
    assert raw == json.JSONEncoder(separators=(",", ":")).encode(meta).encode()


def test_step_json_tails_are_reused_only_for_the_same_layouts() -> None:
    """Steps of changing shapes, one after the other (each shape twice, so the writer's
    reuse of the last step's JSON tail is taken and left): every step's JSON is what the
    json module writes of it, and every step decodes to itself."""
    import json

    writer = json.JSONEncoder(separators=(",", ":"))
    makes = [_decode_step, _speculative, _masks_single_position, _empty_with_kv, _num_nans]
    for step, make in enumerate([m for m in makes for _ in range(2)] + makes):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = make()
            batch = to_record_batch(out, step=step)
        raw = batch.schema.metadata[b"arrow_outputs.step"]
        meta = json.loads(raw)
        assert raw == writer.encode(meta).encode()
        assert meta["step"] == step
        assert meta["rows"] == len(out.req_ids)
        assert_same_output(out, from_record_batch(batch))


@pytest.mark.parametrize("path", ["direct", "ipc"])
@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__.lstrip("_"))
def test_from_record_batch_lossless(make: Callable[[], ModelRunnerOutput], path: str) -> None:
    out = make()
    back = _roundtrip(out, path)
    assert_same_output(out, back)


def test_assert_same_output_catches_differences() -> None:
    # The helper itself must fail on each kind of loss the codec could commit.
    base = _everything()
    changes: dict[str, Callable[[ModelRunnerOutput], None]] = {
        "list->tuple": lambda o: setattr(
            o, "sampled_token_ids", [tuple(x) for x in o.sampled_token_ids]
        ),
        "int->numpy int": lambda o: setattr(
            o, "sampled_token_ids", [[np.int64(v) for v in x] for x in o.sampled_token_ids]
        ),
        "dtype": lambda o: setattr(
            o,
            "logprobs",
            o.logprobs._replace(logprob_token_ids=o.logprobs.logprob_token_ids.astype(np.int64)),
        ),
        "cu None": lambda o: setattr(
            o, "logprobs", o.logprobs._replace(cu_num_generated_tokens=None)
        ),
        "set->list": lambda o: setattr(o.kv_connector_output, "invalid_block_ids", [9]),
        "None->set()": lambda o: setattr(o.kv_connector_output, "finished_recving", set()),
        "key None->absent": lambda o: o.prompt_logprobs_dict.pop("req-3"),
        "torch->numpy": lambda o: setattr(
            o, "pooler_output", [r.float().numpy() for r in o.pooler_output]
        ),
        "bf16->f32": lambda o: setattr(o, "pooler_output", [r.float() for r in o.pooler_output]),
        "{}->None": lambda o: setattr(o, "num_nans_in_logits", None),
        "value": lambda o: o.sampled_token_ids[0].__setitem__(0, 99),
    }
    for name, change in changes.items():
        other = dataclasses.replace(
            base,
            sampled_token_ids=[list(x) for x in base.sampled_token_ids],
            prompt_logprobs_dict=dict(base.prompt_logprobs_dict),
            kv_connector_output=dataclasses.replace(base.kv_connector_output),
        )
        change(other)
        try:
            assert_same_output(base, other)
        except AssertionError:
            continue
        pytest.fail(f"assert_same_output missed a change: {name}")
    assert_same_output(base, base)


def test_from_record_batch_sampled_token_ids_kinds() -> None:
    # [] (pooling) vs [[]] * n (encoder-only) vs per-request lists with an empty one.
    req_ids = ["a", "b"]
    pooling = from_record_batch(to_record_batch(ModelRunnerOutput(req_ids, _index(req_ids), [])))
    encoder = from_record_batch(
        to_record_batch(ModelRunnerOutput(req_ids, _index(req_ids), [[]] * 2))
    )
    mixed = from_record_batch(
        to_record_batch(ModelRunnerOutput(req_ids, _index(req_ids), [[], [2**31]]))
    )
    assert pooling.sampled_token_ids == []
    assert encoder.sampled_token_ids == [[], []]
    assert mixed.sampled_token_ids == [[], [2**31]]
    for back in (encoder, mixed):
        assert type(back.sampled_token_ids) is list
        assert all(type(x) is list for x in back.sampled_token_ids)
        assert all(type(v) is int for x in back.sampled_token_ids for v in x)
    # Two rows that are independent lists: writing one must not change the other.
    encoder.sampled_token_ids[0].append(1)
    assert encoder.sampled_token_ids[1] == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pooler_output", None),
        ("pooler_output", []),
        ("num_nans_in_logits", None),
        ("num_nans_in_logits", {}),
        ("aux_output_connector_output", None),
        ("aux_output_connector_output", {}),
        ("prompt_logprobs_dict", {}),
        ("prompt_token_id_logprobs_dict", {}),
        ("logprobs", None),
        ("sampling_masks", None),
        ("kv_connector_output", None),
        ("kv_connector_output", KVConnectorOutput()),
        ("kv_connector_output", KVConnectorOutput(finished_sending=set(), finished_recving=set())),
        ("ec_connector_output", ECConnectorOutput()),
        ("ec_connector_output", ECConnectorOutput(finished_sending=set())),
        ("cudagraph_stats", None),
    ],
)
@pytest.mark.parametrize("path", ["direct", "ipc"])
def test_from_record_batch_keeps_none_vs_empty(field: str, value: Any, path: str) -> None:
    out = dataclasses.replace(EMPTY_MODEL_RUNNER_OUTPUT, req_ids=[], req_id_to_index={})
    setattr(out, field, value)
    back = _roundtrip(out, path)
    got = getattr(back, field)
    if value is None:
        assert got is None
    else:
        assert got is not None
        assert type(got) is type(value)
        assert got == value
    assert_same_output(out, back)


def test_from_record_batch_prompt_logprobs_absent_vs_none() -> None:
    back = from_record_batch(to_record_batch(_prompt_logprobs()))
    assert "a" not in back.prompt_logprobs_dict
    assert "b" in back.prompt_logprobs_dict
    assert back.prompt_logprobs_dict["b"] is None
    assert tuple(back.prompt_logprobs_dict["c"].logprobs.shape) == (0, 21)
    assert tuple(back.prompt_logprobs_dict["c"].logprob_token_ids.shape) == (0, 21)
    assert tuple(back.prompt_logprobs_dict["d"].logprob_token_ids.shape) == (6, 21)


@pytest.mark.parametrize("path", ["direct", "ipc"])
@pytest.mark.parametrize("cu", [None, [0, 0, 0]])
def test_from_record_batch_zero_row_logprobs_keep_width(cu: list[int] | None, path: str) -> None:
    n = 0 if cu is None else len(cu) - 1
    req_ids = [f"r{i}" for i in range(n)]
    out = ModelRunnerOutput(req_ids, _index(req_ids), [[]] * n, logprobs=_lists(0, 21, cu))
    back = _roundtrip(out, path)
    assert back.logprobs is not None
    assert back.logprobs.logprob_token_ids.shape == (0, 21)
    assert back.logprobs.logprobs.shape == (0, 21)
    assert back.logprobs.sampled_token_ranks.shape == (0,)
    assert back.logprobs.cu_num_generated_tokens == cu
    assert_same_output(out, back)


@pytest.mark.parametrize("path", ["direct", "ipc"])
def test_from_record_batch_cu_none_vs_explicit(path: str) -> None:
    req_ids = ["a", "b"]
    implicit = ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2]],
        logprobs=_lists(2, 3),
        sampling_masks=_masks([2, 1]),
    )
    explicit = ModelRunnerOutput(
        req_ids,
        _index(req_ids),
        [[1], [2]],
        logprobs=_lists(2, 3, [0, 1, 2]),
        sampling_masks=_masks([2, 1], [0, 1, 2]),
    )
    b_imp, b_exp = _roundtrip(implicit, path), _roundtrip(explicit, path)
    assert b_imp.logprobs.cu_num_generated_tokens is None
    assert b_imp.sampling_masks.cu_num_generated_tokens is None
    assert b_exp.logprobs.cu_num_generated_tokens == [0, 1, 2]
    assert b_exp.sampling_masks.cu_num_generated_tokens == [0, 1, 2]
    assert all(type(v) is int for v in b_exp.logprobs.cu_num_generated_tokens)
    assert type(b_exp.sampling_masks.cu_num_generated_tokens) is list
    assert_same_output(implicit, b_imp)
    assert_same_output(explicit, b_exp)


@pytest.mark.parametrize("path", ["direct", "ipc"])
def test_from_record_batch_mask_offsets_none_vs_explicit(path: str) -> None:
    single = _masks_single_position()
    explicit = dataclasses.replace(single, sampling_masks=_masks([4]))
    b_single, b_explicit = _roundtrip(single, path), _roundtrip(explicit, path)
    assert b_single.sampling_masks.offsets is None
    assert b_explicit.sampling_masks.offsets is not None
    assert b_explicit.sampling_masks.offsets.dtype == np.int64
    assert b_explicit.sampling_masks.offsets.tolist() == [0, 4]
    assert_same_output(single, b_single)
    assert_same_output(explicit, b_explicit)


@pytest.mark.parametrize("path", ["direct", "ipc"])
def test_from_record_batch_speculative(path: str) -> None:
    out = _speculative()
    back = _roundtrip(out, path)
    # The last cu (verified positions) need not equal the number of sampled tokens.
    assert back.logprobs.cu_num_generated_tokens == [0, 4, 6, 6, 9]
    assert sum(map(len, back.sampled_token_ids)) == 6
    assert back.logprobs.logprob_token_ids[3].tolist() == [0] * 5
    assert back.sampling_masks.to_nested_list() == out.sampling_masks.to_nested_list()
    assert (
        back.logprobs.slice_request(1, 2).logprobs.tolist() == out.logprobs.logprobs[4:6].tolist()
    )
    assert_same_output(out, back)


@pytest.mark.parametrize("path", ["direct", "ipc"])
def test_from_record_batch_zero_row_step_keeps_step_data(path: str) -> None:
    out = _empty_with_kv()
    out.ec_connector_output = ECConnectorOutput(finished_recving={"mm"})
    out.cudagraph_stats = CUDAGraphStat(0, 8, 8, "FULL")
    batch, meta = to_record_batch(out, step=7), None
    if path == "ipc":
        batch, meta = _ipc(batch)
    assert batch.num_rows == 0
    assert step_metadata(batch, meta)["step"] == 7
    back = from_record_batch(batch, custom_metadata=meta)
    assert back.kv_connector_output == out.kv_connector_output
    assert back.kv_connector_output.invalid_block_ids == {3, 17}
    assert back.cudagraph_stats == CUDAGraphStat(0, 8, 8, "FULL")
    assert_same_output(out, back)


def test_from_record_batch_encoder_only_step() -> None:
    out = _encoder_only()
    back = _decode_ipc(to_record_batch(out, step=1))
    assert back.req_ids == ["e0", "e1", "e2"]
    assert back.sampled_token_ids == [[], [], []]
    assert back.pooler_output == [None, None, None]
    assert_same_output(out, back)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("path", ["direct", "ipc"])
def test_from_record_batch_pooler_dtypes(dtype: torch.dtype, path: str) -> None:
    req_ids = ["a", "b", "c"]
    pooled = torch.randn(3, 32).to(dtype)
    out = ModelRunnerOutput(req_ids, _index(req_ids), [], pooler_output=list(pooled.unbind(0)))
    back = _roundtrip(out, path)
    assert all(r.dtype == dtype for r in back.pooler_output)
    assert_same_output(out, back)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_to_record_batch_pooler_views_zero_copy(dtype: torch.dtype) -> None:
    n, hidden = 4, 24
    pooled = torch.randn(n, hidden).to(dtype)
    req_ids = [f"p{i}" for i in range(n)]
    out = ModelRunnerOutput(req_ids, _index(req_ids), [], pooler_output=list(pooled.unbind(0)))
    batch = to_record_batch(out)
    col = batch.column("pooler_output")
    storage = col.storage if isinstance(col, pa.ExtensionArray) else col
    assert storage.values.buffers()[1].address == pooled.data_ptr()

    rowbytes = hidden * pooled.element_size()
    bits = _TORCH_BITS[pooled.element_size()]
    for back in (from_record_batch(batch), _decode_ipc(batch)):
        rows = back.pooler_output
        assert all(type(r) is torch.Tensor and r.dtype == dtype for r in rows)
        for i, r in enumerate(rows):
            assert r.data_ptr() == rows[0].data_ptr() + i * rowbytes
            assert torch.equal(r.view(bits), pooled[i].view(bits))
    # Without IPC the rows come back as views of the source memory itself.
    assert from_record_batch(batch).pooler_output[0].data_ptr() == pooled.data_ptr()


def test_from_record_batch_prompt_token_id_logprobs_keep_neg_inf() -> None:
    out = _prompt_token_id_logprobs()
    back = _decode_ipc(to_record_batch(out))
    row = back.prompt_token_id_logprobs_dict["c"]
    assert row.dtype == torch.float32
    assert tuple(row.shape) == (2, 3)
    assert torch.isneginf(row).tolist() == [[False, False, True], [False, True, True]]
    assert_same_output(out, back)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_from_record_batch_aux_rows(dtype: type) -> None:
    out = _aux_uint8() if dtype is np.uint8 else _aux_uint16()
    batch = to_record_batch(out, step=3)
    back = _decode_ipc(batch)
    assert set(back.aux_output_connector_output) == set(out.aux_output_connector_output)
    for rid, aux in back.aux_output_connector_output.items():
        assert type(aux) is AuxRequestOutput
        assert type(aux.token_start) is int
        assert type(aux.rows) is np.ndarray
        assert aux.rows.dtype == dtype
        assert aux.rows.ndim == 3
        assert aux.token_start == out.aux_output_connector_output[rid].token_start
    assert_same_output(out, back)


# --------------------------------------------------------------------------- IPC, zero copy


def _numpy_arrays(out: ModelRunnerOutput) -> Iterator[tuple[str, np.ndarray]]:
    lp = out.logprobs
    for name in ("logprob_token_ids", "logprobs", "sampled_token_ranks"):
        yield f"logprobs.{name}", getattr(lp, name)
    m = out.sampling_masks
    yield "sampling_masks.token_ids", m.token_ids
    yield "sampling_masks.offsets", m.offsets
    for rid, aux in out.aux_output_connector_output.items():
        yield f"aux[{rid}].rows", aux.rows


def test_from_record_batch_ipc_arrays_read_only_without_warning() -> None:
    out = _everything()
    data = _ipc_bytes([to_record_batch(out, step=1)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch, meta = pa.ipc.open_stream(data).read_next_batch_with_custom_metadata()
        back = from_record_batch(batch, custom_metadata=meta)
    seen = 0
    for name, arr in _numpy_arrays(back):
        assert type(arr) is np.ndarray, name
        assert arr.flags.writeable is False, name
        seen += 1
    assert seen == 6
    # The torch fields came through the same read-only memory, still as torch tensors.
    assert type(back.pooler_output[0]) is torch.Tensor
    assert type(back.prompt_logprobs_dict["req-0"].logprobs) is torch.Tensor
    assert type(back.prompt_token_id_logprobs_dict["req-2"]) is torch.Tensor
    lo, hi = data.address, data.address + data.size
    assert lo <= back.pooler_output[0].data_ptr() < hi
    assert lo <= back.prompt_logprobs_dict["req-0"].logprobs.data_ptr() < hi
    assert lo <= back.logprobs.logprobs.ctypes.data < hi
    assert_same_output(out, back)


@pytest.mark.parametrize("ids", [np.int32, np.int64])
def test_to_record_batch_logprobs_zero_copy(ids: type) -> None:
    out = _speculative()
    out.logprobs = _lists(9, 5, [0, 4, 6, 6, 9], ids=ids)
    lp = out.logprobs
    batch = to_record_batch(out)
    struct = batch.column("logprobs").values
    assert struct.field("token_ids").values.buffers()[1].address == lp.logprob_token_ids.ctypes.data
    assert struct.field("logprobs").values.buffers()[1].address == lp.logprobs.ctypes.data
    assert struct.field("rank").buffers()[1].address == lp.sampled_token_ranks.ctypes.data

    back = from_record_batch(batch).logprobs
    assert back.logprob_token_ids.ctypes.data == lp.logprob_token_ids.ctypes.data
    assert back.logprobs.ctypes.data == lp.logprobs.ctypes.data
    assert back.sampled_token_ranks.ctypes.data == lp.sampled_token_ranks.ctypes.data


def test_from_record_batch_logprobs_point_into_ipc_buffers() -> None:
    batch, meta = _ipc(to_record_batch(_speculative()))
    struct = batch.column("logprobs").values
    back = from_record_batch(batch, custom_metadata=meta)
    lp = back.logprobs
    assert lp.logprob_token_ids.ctypes.data == struct.field("token_ids").values.buffers()[1].address
    assert lp.logprobs.ctypes.data == struct.field("logprobs").values.buffers()[1].address
    assert lp.sampled_token_ranks.ctypes.data == struct.field("rank").buffers()[1].address
    masks = batch.column("sampling_mask").values
    assert back.sampling_masks.offsets.ctypes.data == masks.buffers()[1].address
    assert back.sampling_masks.token_ids.ctypes.data == masks.values.buffers()[1].address


def test_to_record_batch_sampling_masks_zero_copy() -> None:
    out = _speculative()
    m = out.sampling_masks
    masks = to_record_batch(out).column("sampling_mask").values
    assert masks.buffers()[1].address == m.offsets.ctypes.data
    assert masks.values.buffers()[1].address == m.token_ids.ctypes.data


# --------------------------------------------------------------------------- schema


def test_to_record_batch_schema_stable_across_steps() -> None:
    steps = [
        ModelRunnerOutput(["a", "b"], _index(["a", "b"]), [[1], [2]], logprobs=_lists(2, 6)),
        ModelRunnerOutput(
            ["a", "b", "c"],
            _index(["a", "b", "c"]),
            [[3], [4, 5], [6]],
            logprobs=_lists(4, 21, [0, 1, 3, 4], seed=2),
        ),
        ModelRunnerOutput(["c"], {"c": 0}, [[7]], num_nans_in_logits={"c": 1}),
    ]
    first = to_record_batch(steps[0], step=0, metadata={"model": "tiny"})
    schema = first.schema
    batches = [first] + [
        to_record_batch(s, step=i, schema=schema) for i, s in enumerate(steps) if i
    ]
    for b in batches[1:]:
        assert b.schema.equals(schema, check_metadata=False)
        assert b.schema.metadata[KEY_STEP] != schema.metadata[KEY_STEP]
    widths = [step_metadata(b)["logprobs"] for b in batches]
    assert [w and w["width"] for w in widths] == [6, 21, None]

    reader = pa.ipc.open_stream(_ipc_bytes(batches))
    assert run_metadata(reader.schema) == {"model": "tiny"}
    for i, src in enumerate(steps):
        batch, meta = reader.read_next_batch_with_custom_metadata()
        assert step_metadata(batch, meta)["step"] == i
        assert_same_output(src, from_record_batch(batch, custom_metadata=meta))
    with pytest.raises(StopIteration):
        reader.read_next_batch()


def test_to_record_batch_schema_refuses_other_dtypes() -> None:
    schema = to_record_batch(_decode_step()).schema  # int64 logprob token ids
    with pytest.raises(SchemaMismatchError) as info:
        to_record_batch(_decode_int32(), schema=schema)
    assert "logprob_token_ids" in info.value.field


def test_to_record_batch_declared_schema_int32_sampled_ids() -> None:
    schema = output_schema(ColumnTypes(sampled_token_ids="int32", logprob_token_ids="int32"))
    out = _decode_int32()
    batch = to_record_batch(out, schema=schema)
    assert batch.schema.field("sampled_token_ids").type == pa.list_(pa.int32())
    assert_same_output(out, from_record_batch(batch))
    with pytest.raises(UnsupportedValueError):
        to_record_batch(ModelRunnerOutput(["a"], {"a": 0}, [[2**31]]), schema=schema)


# --------------------------------------------------------------------------- duck typing


class VllmLogprobsLists(NamedTuple):
    logprob_token_ids: np.ndarray
    logprobs: np.ndarray
    sampled_token_ranks: np.ndarray
    cu_num_generated_tokens: list[int] | None = None


class VllmLogprobsTensors(NamedTuple):
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor
    cu_num_generated_tokens: list[int] | None = None
    cu_num_generated_tokens_tensor: torch.Tensor | None = None


class VllmSamplingMaskLists(NamedTuple):
    token_ids: np.ndarray
    offsets: np.ndarray | None = None
    cu_num_generated_tokens: list[int] | None = None


@dataclasses.dataclass
class VllmKVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any = None
    kv_cache_events: Any = None
    kv_connector_worker_meta: Any = None
    invalid_block_ids: set[int] = dataclasses.field(default_factory=set)
    failed_recving: set[str] = dataclasses.field(default_factory=set)
    expected_finished_count: int = 0


class VllmECConnectorOutput:
    def __init__(self, finished_sending: Any = None, finished_recving: Any = None) -> None:
        self.finished_sending = finished_sending
        self.finished_recving = finished_recving
        self.ec_connector_stats = None
        self.ec_connector_worker_meta = None


class VllmCUDAGraphStat(NamedTuple):
    num_unpadded_tokens: int
    num_padded_tokens: int
    num_paddings: int
    runtime_mode: str


class VllmAuxRequestOutput:
    def __init__(self, token_start: int, rows: np.ndarray) -> None:
        self.token_start = token_start
        self.rows = rows


class AuxMapping(Mapping):
    """A read-only mapping that is not a dict (vLLM may hand over any Mapping)."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = items

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


@dataclasses.dataclass
class VllmModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: Any = None
    prompt_logprobs_dict: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt_token_id_logprobs_dict: dict[str, Any] = dataclasses.field(default_factory=dict)
    pooler_output: Any = None
    kv_connector_output: Any = None
    ec_connector_output: Any = None
    num_nans_in_logits: dict[str, int] | None = None
    cudagraph_stats: Any = None
    aux_output_connector_output: Any = None
    sampling_masks: Any = None


def _lookalike() -> VllmModelRunnerOutput:
    lp = _lists(5, 4, [0, 2, 3, 5], ids=np.int32)
    m = _masks([1, 0, 2, 3, 2], [0, 2, 3, 5])
    pl = _tensors(3, 4)
    req_ids = ["a", "b", "c"]
    return VllmModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index=_index(req_ids),
        sampled_token_ids=[[1, 2], [3], [4, 5]],
        logprobs=VllmLogprobsLists(*lp),
        prompt_logprobs_dict={"b": VllmLogprobsTensors(*pl), "c": None},
        kv_connector_output=VllmKVConnectorOutput(finished_recving={"a"}, invalid_block_ids={1}),
        ec_connector_output=VllmECConnectorOutput(finished_sending={"c"}),
        num_nans_in_logits={"a": 1},
        cudagraph_stats=VllmCUDAGraphStat(3, 4, 1, "FULL"),
        aux_output_connector_output=AuxMapping({"c": VllmAuxRequestOutput(2, _aux(3, np.uint8))}),
        sampling_masks=VllmSamplingMaskLists(*m),
    )


@pytest.mark.parametrize("path", ["direct", "ipc"])
def test_to_record_batch_accepts_vllm_lookalikes(path: str) -> None:
    src = _lookalike()
    back = _roundtrip(src, path)
    assert type(back) is ModelRunnerOutput
    assert type(back.logprobs) is LogprobsLists
    assert type(back.sampling_masks) is SamplingMaskLists
    assert type(back.prompt_logprobs_dict["b"]) is LogprobsTensors
    assert type(back.kv_connector_output) is KVConnectorOutput
    assert type(back.ec_connector_output) is ECConnectorOutput
    assert type(back.cudagraph_stats) is CUDAGraphStat
    assert type(back.aux_output_connector_output) is dict
    assert type(back.aux_output_connector_output["c"]) is AuxRequestOutput
    assert_same_output(src, back)


def test_logprobs_to_arrow_accepts_lookalikes() -> None:
    lp = VllmLogprobsLists(*_lists(5, 4, [0, 2, 3, 5]))
    back = logprobs_from_arrow(logprobs_to_arrow(lp))
    assert type(back) is LogprobsLists
    _assert_same(lp, back, "logprobs")
    lt = VllmLogprobsTensors(*_tensors(3, 2)[:3], [0, 3])
    back_t = logprobs_from_arrow(logprobs_to_arrow(lt), as_tensors=True)
    assert type(back_t) is LogprobsTensors
    _assert_same(lt, back_t, "logprobs")


def test_sampling_masks_to_arrow_accepts_lookalikes() -> None:
    m = VllmSamplingMaskLists(*_masks([2, 0, 3], [0, 1, 3]))
    back = sampling_masks_from_arrow(sampling_masks_to_arrow(m))
    assert type(back) is SamplingMaskLists
    _assert_same(m, back, "sampling_masks")
    single = VllmSamplingMaskLists(np.array([4, 8], np.int32))
    back1 = sampling_masks_from_arrow(
        sampling_masks_to_arrow(single), offsets=False, cu_num_generated_tokens=False
    )
    _assert_same(single, back1, "sampling_masks")


# --------------------------------------------------------------------------- opaque, pickle


class ConnectorStats:
    """A connector's own stats class: not plain data, so never carried (and never pickled)."""

    def __init__(self) -> None:
        self.num_transfers = 3


def _with_opaque_stats() -> ModelRunnerOutput:
    out = _sampled_nothing()
    out.kv_connector_output = KVConnectorOutput(
        finished_sending={"x"}, kv_connector_stats=ConnectorStats(), invalid_block_ids={5}
    )
    return out


def test_to_record_batch_opaque_drop_warns_and_records() -> None:
    out = _with_opaque_stats()
    with pytest.warns(OpaqueValueWarning, match=r"kv_connector_output\.kv_connector_stats"):
        batch = to_record_batch(out, step=2)
    type_name = f"{ConnectorStats.__module__}.{ConnectorStats.__qualname__}"
    dropped = step_metadata(batch)["dropped"]
    assert dropped == [{"field": "kv_connector_output.kv_connector_stats", "type": type_name}]
    back = _decode_ipc(batch)
    assert back.kv_connector_output.kv_connector_stats is None
    assert back.kv_connector_output.finished_sending == {"x"}
    assert back.kv_connector_output.invalid_block_ids == {5}
    expected = dataclasses.replace(
        out,
        kv_connector_output=dataclasses.replace(out.kv_connector_output, kv_connector_stats=None),
    )
    assert_same_output(expected, back)


def test_to_record_batch_opaque_error_names_field() -> None:
    with pytest.raises(UnsupportedValueError) as info:
        to_record_batch(_with_opaque_stats(), opaque="error")
    assert info.value.field == "kv_connector_output.kv_connector_stats"
    assert "kv_connector_output.kv_connector_stats" in str(info.value)
    assert "ConnectorStats" in info.value.got


def test_to_record_batch_nested_opaque_is_dropped() -> None:
    out = _empty_with_kv()
    out.kv_connector_output = dataclasses.replace(
        out.kv_connector_output, kv_cache_events=[{"ok": 1}, ConnectorStats()]
    )
    with pytest.warns(OpaqueValueWarning):
        batch = to_record_batch(out)
    assert [d["field"] for d in step_metadata(batch)["dropped"]] == [
        "kv_connector_output.kv_cache_events[1]"
    ]
    assert from_record_batch(batch).kv_connector_output.kv_cache_events == [{"ok": 1}, None]


def _plain_data_output() -> ModelRunnerOutput:
    out = _decode_step()
    out.kv_connector_output = KVConnectorOutput(
        finished_sending={"r0", "r1"},
        finished_recving=set(),
        kv_connector_stats={
            "bytes": 10,
            "backend": "nixl",
            "per_layer": [1, 2, 3],
            "nested": {"pair": (1, "x"), "ids": {4, 5}, "frozen": frozenset({"q"})},
            "ratio": 0.5,
            "neg_inf": float("-inf"),
            "int_keys": {1: "a", 2: "b"},
            "raw": b"\x00\xff",
            "dollar": {"$set": 1},
            "flag": True,
        },
        kv_cache_events=("stored", 2, None, (3, 4)),
        kv_connector_worker_meta={"rank": 0, "blocks": [[1, 2], [3]]},
        invalid_block_ids={4, 5},
        failed_recving={"r9"},
        expected_finished_count=3,
    )
    out.ec_connector_output = ECConnectorOutput(
        finished_recving={"r2"},
        ec_connector_stats={"loads": [0.5]},
        ec_connector_worker_meta={"k": [1.5, 2.5]},
    )
    out.cudagraph_stats = CUDAGraphStat(10, 16, 6, "FULL")
    return out


@pytest.mark.parametrize("path", ["direct", "ipc"])
def test_to_record_batch_plain_connector_data_roundtrips(path: str) -> None:
    out = _plain_data_output()
    batch = to_record_batch(out, opaque="error")  # plain data is never "opaque"
    assert step_metadata(batch)["dropped"] == []
    back = _decode_ipc(batch) if path == "ipc" else from_record_batch(batch)
    stats = back.kv_connector_output.kv_connector_stats
    assert type(stats["nested"]["pair"]) is tuple
    assert type(stats["nested"]["ids"]) is set
    assert type(stats["nested"]["frozen"]) is frozenset
    assert type(stats["raw"]) is bytes
    assert list(stats["int_keys"]) == [1, 2]
    assert stats["dollar"] == {"$set": 1}
    assert type(back.kv_connector_output.kv_cache_events) is tuple
    assert_same_output(out, back)


def test_to_record_batch_never_pickles(monkeypatch: pytest.MonkeyPatch) -> None:
    import _pickle

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle (or copyreg) was used")

    class RefusePickler:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            refuse()

    out = _everything()
    for mod in (pickle, _pickle):
        for name in ("dumps", "loads", "dump", "load"):
            monkeypatch.setattr(mod, name, refuse)
        monkeypatch.setattr(mod, "Pickler", RefusePickler)
        monkeypatch.setattr(mod, "Unpickler", RefusePickler)
    for name in ("_reduce_ex", "_reconstructor", "__newobj__", "__newobj_ex__"):
        monkeypatch.setattr(copyreg, name, refuse)
    with pytest.raises(AssertionError, match="pickle"):
        pickle.dumps(out)  # the patches are live

    batch = to_record_batch(out, step=1)
    back = _decode_ipc(batch)
    monkeypatch.undo()
    assert_same_output(out, back)


# --------------------------------------------------------------------------- no torch


_NO_TORCH_SCRIPT = """
import sys
import arrow_outputs as ao
assert "torch" not in sys.modules, "import arrow_outputs imported torch"
import numpy as np
import pyarrow as pa

req_ids = ["a", "b", "c"]
out = ao.ModelRunnerOutput(
    req_ids,
    {r: i for i, r in enumerate(req_ids)},
    [[1, 2], [], [3]],
    logprobs=ao.LogprobsLists(
        np.arange(12, dtype=np.int32).reshape(4, 3),
        np.zeros((4, 3), np.float32),
        np.ones(4, np.int64),
        [0, 2, 3, 4],
    ),
    sampling_masks=ao.SamplingMaskLists(
        np.array([1, 5, 9], np.int32), np.array([0, 1, 1, 3, 3], np.int64), [0, 2, 3, 4]
    ),
    aux_output_connector_output={"b": ao.AuxRequestOutput(2, np.ones((2, 3, 4), np.uint16))},
    num_nans_in_logits={"a": 0},
    kv_connector_output=ao.KVConnectorOutput(finished_sending={"a"}),
)
batch = ao.to_record_batch(out, step=0)
assert "torch" not in sys.modules, "to_record_batch imported torch"
sink = pa.BufferOutputStream()
with pa.ipc.new_stream(sink, ao.run_schema(batch)) as w:
    w.write_batch(batch, custom_metadata=ao.step_custom_metadata(batch))
read, meta = pa.ipc.open_stream(sink.getvalue()).read_next_batch_with_custom_metadata()
back = ao.from_record_batch(read, custom_metadata=meta)
assert "torch" not in sys.modules, "from_record_batch imported torch"
assert back.sampled_token_ids == [[1, 2], [], [3]]
assert back.aux_output_connector_output["b"].rows.dtype == np.uint16
assert back.logprobs.cu_num_generated_tokens == [0, 2, 3, 4]
print("ok")
"""


def test_to_record_batch_numpy_only_does_not_import_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_import_arrow_outputs_does_not_import_torch() -> None:
    code = "import sys, arrow_outputs; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    assert arrow_outputs.__name__ == "arrow_outputs"


def test_to_record_batch_numpy_scalars_in_connector_output_kept():
    kv = KVConnectorOutput(
        invalid_block_ids={np.int64(3), 4}, kv_connector_stats={"n": np.float32(1.5)}
    )
    out = ModelRunnerOutput(["a"], {"a": 0}, [[1]], kv_connector_output=kv)
    back = from_record_batch(to_record_batch(out))  # no OpaqueValueWarning (warnings are errors)
    assert back.kv_connector_output.invalid_block_ids == {3, 4}
    assert {type(v) for v in back.kv_connector_output.invalid_block_ids} == {np.int64, int}
    assert type(back.kv_connector_output.kv_connector_stats["n"]) is np.float32


def test_inferred_schema_of_a_decode_step_is_the_full_inference() -> None:
    """Decode steps take their inferred schema from a cache keyed by the logprob dtypes
    (_quick_key); every other step is inferred in full, so a cached decode step's schema is
    never handed to a step whose prompt logprobs, pooler or aux output decide its types."""
    from arrow_outputs.batch import _inferred_schema
    from arrow_outputs.schema import infer_column_types

    def full(out: ModelRunnerOutput) -> pa.Schema:
        return output_schema(infer_column_types(out))

    decode = [
        ModelRunnerOutput(["a"], {"a": 0}, [[1]], logprobs=_lists(1, 3, ids=ids, ranks=ranks))
        for ids in (np.int32, np.int64)
        for ranks in (np.int32, np.int64)
    ] + [ModelRunnerOutput(["a"], {"a": 0}, [[1]])]
    for out in decode * 2:  # the second time from the cache
        assert _inferred_schema(out, None).equals(full(out), check_metadata=True)
    int32 = _lists(1, 3, ids=np.int32, ranks=np.int32)
    others = [
        ModelRunnerOutput(
            ["a"],
            {"a": 0},
            [[1]],
            logprobs=int32,
            prompt_logprobs_dict={"a": _tensors(2, 3, ids=torch.int32)},
        ),
        ModelRunnerOutput(
            ["a"], {"a": 0}, [[1]], logprobs=int32, pooler_output=[torch.zeros(2, 4)]
        ),
    ]
    cached = _inferred_schema(decode[0], None)  # int32 logprob ids and ranks, as others'
    for out in others:
        got = _inferred_schema(out, None)
        assert got.equals(full(out), check_metadata=True)
        assert not got.equals(cached, check_metadata=True)
    tensors = ModelRunnerOutput(["a"], {"a": 0}, [[1]], logprobs=_tensors(1, 3, ids=torch.int32))
    assert _inferred_schema(tensors, None).equals(full(tensors), check_metadata=True)
