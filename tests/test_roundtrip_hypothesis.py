"""Property tests: every structure round-trips through Arrow for drawn shapes, dtypes and offsets.

The strategies draw the things a wrong implementation gets wrong: empty requests and
0-position steps, widths from 1 up, int32 and int64 ids and ranks, ``None`` vs explicit
``cu_num_generated_tokens``, CSR offsets with empty positions, absent vs ``None`` entries,
and slices of the Arrow arrays (non-zero offsets).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_batch import _assert_same, assert_same_output

from arrow_outputs import (
    AuxRequestOutput,
    CUDAGraphStat,
    ECConnectorOutput,
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    SamplingMaskLists,
    StepMetadataError,
    from_record_batch,
    logprobs_from_arrow,
    logprobs_to_arrow,
    run_schema,
    sampling_masks_from_arrow,
    sampling_masks_to_arrow,
    step_custom_metadata,
    to_record_batch,
)

# Every test here runs on the C accelerator and on the pure-Python path.
pytestmark = pytest.mark.usefixtures("codec_path")

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEW = settings(SETTINGS, max_examples=80)

INT_DTYPES = st.sampled_from([np.int32, np.int64])
SEEDS = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------- strategies


@st.composite
def offsets(draw: st.DrawFn, total: int) -> list[int]:
    """Non-decreasing offsets from 0 to ``total`` (repeats = requests with no positions)."""
    parts = draw(st.integers(1 if total else 0, 6))
    if parts == 0:
        return [0]
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    return [0, *cuts, total]


def _float32(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    out = -rng.exponential(size=shape).astype(np.float32)
    # Special values that must survive bit for bit.
    special = np.array([-np.inf, np.nan, -0.0, 0.0], dtype=np.float32)
    mask = rng.random(shape) < 0.1
    out[mask] = rng.choice(special, size=int(mask.sum()))
    return out


@st.composite
def logprobs_lists(draw: st.DrawFn, *, num_requests: int | None = None) -> LogprobsLists:
    """LogprobsLists with drawn N, W, dtypes and cu (None or drawn offsets)."""
    with_cu = draw(st.booleans())
    if num_requests is not None and not with_cu:
        num_pos = num_requests
    else:  # with 0 requests, cu is [0]: no positions
        num_pos = draw(st.integers(0, 12 if num_requests != 0 else 0))
    width = draw(st.integers(1, 8))
    ids_dt, ranks_dt = draw(INT_DTYPES), draw(INT_DTYPES)
    rng = np.random.default_rng(draw(SEEDS))
    info = np.iinfo(ids_dt)
    ids = rng.integers(info.min, info.max, size=(num_pos, width), dtype=ids_dt, endpoint=True)
    lps = _float32(rng, (num_pos, width))
    ranks = rng.integers(0, 2**31 - 1, size=num_pos).astype(ranks_dt)
    if draw(st.booleans()):
        # A non-contiguous source (a view into a wider buffer) must round-trip too.
        ids = np.repeat(ids, 2, axis=1)[:, ::2]
        lps = np.repeat(lps, 2, axis=1)[:, ::2]
    cu: list[int] | None = None
    if with_cu:
        if num_requests is None:
            cu = draw(offsets(num_pos))
        else:
            cu = draw(_exact_offsets(num_pos, num_requests))
    return LogprobsLists(ids, lps, ranks, cu)


@st.composite
def _exact_offsets(draw: st.DrawFn, total: int, parts: int) -> list[int]:
    """Offsets of exactly ``parts`` requests summing to ``total`` (needs total=0 if parts=0)."""
    if parts == 0:
        return [0]
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    return [0, *cuts, total]


@st.composite
def logprobs_tensors(draw: st.DrawFn) -> LogprobsTensors:
    lists = draw(logprobs_lists())
    return LogprobsTensors(
        torch.from_numpy(np.ascontiguousarray(lists.logprob_token_ids)),
        torch.from_numpy(np.ascontiguousarray(lists.logprobs)),
        torch.from_numpy(lists.sampled_token_ranks),
        lists.cu_num_generated_tokens,
    )


@st.composite
def sampling_masks(draw: st.DrawFn, *, num_requests: int | None = None) -> SamplingMaskLists:
    """CSR masks: drawn per-position lengths, int32 ids, int64 offsets; cu None or drawn.

    ``offsets=None`` (vLLM's single-position form) is drawn only with exactly one position.
    """
    with_cu = draw(st.booleans())
    if num_requests is not None and not with_cu:
        num_pos = num_requests
    else:  # with 0 requests, cu is [0]: no positions
        num_pos = draw(st.integers(0, 10 if num_requests != 0 else 0))
    lengths = draw(st.lists(st.integers(0, 6), min_size=num_pos, max_size=num_pos))
    rng = np.random.default_rng(draw(SEEDS))
    offs = np.zeros(num_pos + 1, dtype=np.int64)
    np.cumsum(lengths, out=offs[1:])
    token_ids = rng.integers(-(2**31), 2**31 - 1, size=int(offs[-1])).astype(np.int32)
    cu: list[int] | None = None
    if with_cu:
        cu = draw(
            offsets(num_pos) if num_requests is None else _exact_offsets(num_pos, num_requests)
        )
    no_offsets = num_pos == 1 and draw(st.booleans())
    return SamplingMaskLists(token_ids, None if no_offsets else offs, cu)


REQ_IDS = st.lists(st.text(max_size=6), max_size=8, unique=True)


@st.composite
def kv_outputs(draw: st.DrawFn, req_ids: list[str]) -> KVConnectorOutput | None:
    if not draw(st.booleans()):
        return None
    some = st.sets(st.sampled_from(req_ids)) if req_ids else st.just(set())
    plain = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**53), 2**53)
        | st.floats()
        | st.text(max_size=4)
        | st.binary(max_size=4),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.tuples(inner, inner)
            | st.dictionaries(st.text(max_size=3), inner, max_size=3)
            | st.frozensets(st.integers(0, 9), max_size=3)
        ),
        max_leaves=6,
    )
    return KVConnectorOutput(
        finished_sending=draw(st.none() | some),
        finished_recving=draw(st.none() | some),
        kv_connector_stats=draw(plain),
        kv_cache_events=draw(plain),
        kv_connector_worker_meta=draw(plain),
        invalid_block_ids=draw(st.sets(st.integers(0, 10_000), max_size=4)),
        expected_finished_count=draw(st.integers(0, 8)),
    )


def _tensor(rng: np.random.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)


@st.composite
def model_runner_outputs(draw: st.DrawFn) -> ModelRunnerOutput:
    """A whole step: 0..8 requests, each optional field present or not."""
    req_ids = draw(REQ_IDS)
    n = len(req_ids)
    rng = np.random.default_rng(draw(SEEDS))

    def subset() -> list[str]:
        return [r for r in req_ids if draw(st.booleans())]

    mode = draw(st.sampled_from(["lists", "pooling", "encoder"]))
    if mode == "pooling":
        sampled: list[list[int]] = []
    elif mode == "encoder":
        sampled = [[]] * n
    else:
        sampled = [draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)) for _ in range(n)]

    logprobs = draw(st.none() | logprobs_lists(num_requests=n))

    prompt: dict[str, Any] = {}
    if draw(st.booleans()):
        ids_dt = draw(st.sampled_from([torch.int32, torch.int64]))
        ranks_dt = draw(st.sampled_from([torch.int32, torch.int64]))
        for r in subset():
            if draw(st.booleans()):
                prompt[r] = None  # present, not ready yet
                continue
            p, w = draw(st.integers(0, 5)), draw(st.integers(1, 6))
            prompt[r] = LogprobsTensors(
                torch.from_numpy(rng.integers(0, 1000, size=(p, w))).to(ids_dt),
                torch.from_numpy(_float32(rng, (p, w))),
                torch.from_numpy(rng.integers(0, 1000, size=p)).to(ranks_dt),
            )

    tid: dict[str, torch.Tensor] = {}
    for r in subset() if draw(st.booleans()) else []:
        rows, cols = draw(st.integers(0, 4)), draw(st.integers(1, 4))
        tid[r] = torch.from_numpy(_float32(rng, (rows, cols)))

    pooler: list[torch.Tensor | None] | None = None
    if draw(st.booleans()):
        dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
        hidden = draw(st.integers(1, 6))
        how = draw(st.sampled_from(["views", "separate", "some_none", "variable"]))
        if how == "views":
            pooler = list(_tensor(rng, (n, hidden), dtype).unbind(0))
        elif how == "separate":
            pooler = [_tensor(rng, (hidden,), dtype) for _ in range(n)]
        elif how == "some_none":
            pooler = [
                _tensor(rng, (hidden,), dtype) if draw(st.booleans()) else None for _ in range(n)
            ]
        else:
            pooler = [_tensor(rng, (draw(st.integers(0, 3)), hidden), dtype) for _ in range(n)]

    nans: dict[str, int] | None = None
    if draw(st.booleans()):
        nans = {r: draw(st.integers(0, 2**31 - 1)) for r in subset()}

    masks = draw(st.none() | sampling_masks(num_requests=n))

    aux: dict[str, AuxRequestOutput] | None = None
    if draw(st.booleans()):
        aux_dt = draw(st.sampled_from([np.uint8, np.uint16]))
        aux = {
            r: AuxRequestOutput(
                draw(st.integers(0, 2**40)),
                rng.integers(0, np.iinfo(aux_dt).max, size=(draw(st.integers(0, 3)), 2, 3)).astype(
                    aux_dt
                ),
            )
            for r in subset()
        }

    ec = None
    if draw(st.booleans()):
        ec = ECConnectorOutput(
            finished_sending=draw(st.none() | st.sets(st.text(max_size=3), max_size=2)),
            finished_recving=draw(st.none() | st.sets(st.text(max_size=3), max_size=2)),
            ec_connector_worker_meta=draw(
                st.none() | st.dictionaries(st.text(max_size=3), st.integers())
            ),
        )
    cg = None
    if draw(st.booleans()):
        a, b = draw(st.integers(0, 4096)), draw(st.integers(0, 4096))
        cg = CUDAGraphStat(a, a + b, b, draw(st.sampled_from(["FULL", "PIECEWISE", "NONE"])))

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=logprobs,
        prompt_logprobs_dict=prompt,
        prompt_token_id_logprobs_dict=tid,
        pooler_output=pooler,
        kv_connector_output=draw(kv_outputs(req_ids)),
        ec_connector_output=ec,
        num_nans_in_logits=nans,
        cudagraph_stats=cg,
        aux_output_connector_output=aux,
        sampling_masks=masks,
    )


# --------------------------------------------------------------------------- logprobs


@SETTINGS
@given(logprobs_lists())
def test_logprobs_to_arrow_roundtrip_lists(src: LogprobsLists) -> None:
    arr = logprobs_to_arrow(src)
    cu = src.cu_num_generated_tokens
    assert len(arr) == (len(src.sampled_token_ranks) if cu is None else len(cu) - 1)
    width = src.logprobs.shape[1]
    back = logprobs_from_arrow(arr, cu_num_generated_tokens=cu is not None, width=width)
    assert type(back) is LogprobsLists
    _assert_same(src, back, "logprobs")


@SETTINGS
@given(logprobs_tensors())
def test_logprobs_to_arrow_roundtrip_tensors(src: LogprobsTensors) -> None:
    cu = src.cu_num_generated_tokens
    back = logprobs_from_arrow(
        logprobs_to_arrow(src),
        as_tensors=True,
        cu_num_generated_tokens=cu is not None,
        width=src.logprobs.shape[1],
    )
    assert type(back) is LogprobsTensors
    _assert_same(src, back, "logprobs")


@SETTINGS
@given(logprobs_lists(), st.data())
def test_logprobs_to_arrow_slice(src: LogprobsLists, data: st.DataObject) -> None:
    arr = logprobs_to_arrow(src)
    n = len(arr)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    cu = src.cu_num_generated_tokens or list(range(n + 1))
    p0, p1 = cu[a], cu[b]
    back = logprobs_from_arrow(arr.slice(a, b - a), width=src.logprobs.shape[1])
    expected = LogprobsLists(
        src.logprob_token_ids[p0:p1],
        src.logprobs[p0:p1],
        src.sampled_token_ranks[p0:p1],
        [c - p0 for c in cu[a : b + 1]],
    )
    _assert_same(expected, back, "logprobs")
    # Each request of the slice is the same as slice_request on the source.
    for i in range(b - a):
        mine = back.slice_request(i, cu[a + i + 1] - cu[a + i])
        theirs = src.slice_request(a + i, cu[a + i + 1] - cu[a + i])
        _assert_same(theirs, mine, f"request {a + i}")


# --------------------------------------------------------------------------- masks


@SETTINGS
@given(sampling_masks())
def test_sampling_masks_to_arrow_roundtrip(src: SamplingMaskLists) -> None:
    arr = sampling_masks_to_arrow(src)
    back = sampling_masks_from_arrow(
        arr,
        offsets=src.offsets is not None,
        cu_num_generated_tokens=src.cu_num_generated_tokens is not None,
    )
    assert type(back) is SamplingMaskLists
    _assert_same(src, back, "sampling_masks")
    assert back.to_nested_list() == src.to_nested_list()


@SETTINGS
@given(sampling_masks(), st.data())
def test_sampling_masks_to_arrow_slice(src: SamplingMaskLists, data: st.DataObject) -> None:
    arr = sampling_masks_to_arrow(src)
    n = len(arr)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    cu = src.cu_num_generated_tokens or list(range(n + 1))
    offs = src.offsets if src.offsets is not None else np.array([0, len(src.token_ids)], np.int64)
    p0, p1 = cu[a], cu[b]
    lo, hi = int(offs[p0]), int(offs[p1])
    back = sampling_masks_from_arrow(arr.slice(a, b - a))
    expected = SamplingMaskLists(
        src.token_ids[lo:hi], offs[p0 : p1 + 1] - lo, [c - p0 for c in cu[a : b + 1]]
    )
    _assert_same(expected, back, "sampling_masks")
    # pyarrow's own reading of the slice is the reference for the positions' contents.
    nested = src.to_nested_list()
    assert arr.slice(a, b - a).to_pylist() == [
        [nested[p] for p in range(cu[i], cu[i + 1])] for i in range(a, b)
    ]


# --------------------------------------------------------------------------- whole steps


KEY_STEP = b"arrow_outputs.step"


@FEW
@given(model_runner_outputs(), st.integers(0, 2**40))
def test_to_record_batch_roundtrip(src: ModelRunnerOutput, step: int) -> None:
    batch = to_record_batch(src, step=step)
    assert batch.num_rows == len(src.req_ids)
    assert batch.column("step").to_pylist() == [step] * len(src.req_ids)
    assert_same_output(src, from_record_batch(batch))


@FEW
@given(model_runner_outputs())
def test_to_record_batch_roundtrip_ipc(src: ModelRunnerOutput) -> None:
    batch = to_record_batch(src, step=1)
    sink = pa.BufferOutputStream()
    # The step JSON travels as the batch's custom metadata, not in the stream schema.
    with pa.ipc.new_stream(sink, run_schema(batch)) as writer:
        writer.write_batch(batch, custom_metadata=step_custom_metadata(batch))
    read, meta = pa.ipc.open_stream(sink.getvalue()).read_next_batch_with_custom_metadata()
    assert_same_output(src, from_record_batch(read, custom_metadata=meta))
    # Without it the batch is refused, never decoded with guessed or borrowed metadata.
    with pytest.raises(StepMetadataError):
        from_record_batch(read)
