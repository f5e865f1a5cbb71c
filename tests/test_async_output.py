"""AsyncArrowOutput against vLLM 0.33's AsyncOutput: the same output, and a record batch built
straight from the staged buffers that equals the output's record batch."""

from __future__ import annotations

import copy
import dataclasses
import gc
from typing import Any

import pyarrow as pa
import pytest
import torch

import arrow_outputs as ao
from arrow_outputs import async_output
from arrow_outputs.async_output import AsyncArrowOutput
from arrow_outputs.demo.sampler import SamplerOutput  # MRv2's SamplerOutput, by its names
from arrow_outputs.device import StagingPool

# Every test here runs on the C accelerator (prebuilt columns as nodes for the C assembly)
# and on the pure-Python path (prebuilt columns as arrays).
pytestmark = pytest.mark.usefixtures("codec_path")


def vllm_get_output(mro: Any, sampler: SamplerOutput, num_sampled: torch.Tensor) -> Any:
    """The host side of vLLM 0.33's AsyncOutput.get_output (vllm/v1/worker/gpu/async_utils.py),
    on CPU tensors: sampled ids to lists trimmed to their counts, NaN counts by request,
    logprobs tolists, prompt dicts as copied."""
    out = copy.copy(mro)
    sampled = sampler.sampled_token_ids.numpy().tolist()
    for ids, k in zip(sampled, num_sampled.numpy().tolist()):
        del ids[k:]
    out.sampled_token_ids = sampled
    if sampler.num_nans is not None:
        out.num_nans_in_logits = dict(zip(out.req_ids, sampler.num_nans.numpy().tolist()))
    if sampler.logprobs_tensors is not None:
        out.logprobs = sampler.logprobs_tensors.tolists()
    out.prompt_logprobs_dict = {
        k: None if v is None else v.to_cpu_nonblocking()
        for k, v in mro.prompt_logprobs_dict.items()
    }
    return out


def _step(n: int, k: int, *, seed: int = 0, nans: int | None = None, cu_tensor: bool = False):
    g = torch.Generator().manual_seed(seed)
    req_ids = [f"r{i}" for i in range(n)]
    counts = torch.randint(0 if k > 1 else 1, k + 1, (n,), generator=g, dtype=torch.int32)
    sampled = torch.randint(0, 50_000, (n, k), generator=g, dtype=torch.int64)
    sampled[torch.arange(k) >= counts[:, None].long()] = -1  # padding vLLM never reads
    positions = int(counts.sum()) if k > 1 else n
    cu = [0, *torch.cumsum(counts, 0).tolist()] if k > 1 else None
    lp = ao.LogprobsTensors(
        torch.randint(0, 50_000, (positions, 6), generator=g),
        torch.randn(positions, 6, generator=g),
        torch.randint(1, 9, (positions,), generator=g),
        None if cu_tensor else cu,
        torch.tensor(cu) if cu_tensor and cu is not None else None,
    )
    num_nans = None if nans is None else torch.zeros(nans, dtype=torch.int32) + 2
    sampler = SamplerOutput(sampled, lp, num_nans, counts, torch.zeros(n, dtype=torch.int32))
    prompt = (
        {
            "r0": ao.LogprobsTensors(
                torch.zeros(3, 2, dtype=torch.int64),
                torch.zeros(3, 2),
                torch.ones(3, dtype=torch.int64),
            )
        }
        if n
        else {}
    )
    mro = ao.ModelRunnerOutput(
        req_ids,
        {r: i for i, r in enumerate(req_ids)},
        prompt_logprobs_dict=prompt,
        kv_connector_output=ao.KVConnectorOutput(finished_sending={"x"}),
        cudagraph_stats=ao.CUDAGraphStat(n, n + 1, 1, "FULL"),
    )
    return mro, sampler, counts


CASES = [
    pytest.param(dict(n=4, k=1), id="decode"),
    pytest.param(dict(n=5, k=4), id="spec"),
    pytest.param(dict(n=5, k=4, cu_tensor=True), id="spec-cu-tensor"),
    pytest.param(dict(n=6, k=1, nans=6), id="nans"),
    pytest.param(dict(n=6, k=1, nans=4), id="nans-shorter"),
    pytest.param(dict(n=0, k=1), id="empty"),
]


@pytest.mark.parametrize("kw", CASES)
def test_async_arrow_output_get_output_is_vllms(kw: dict[str, Any]) -> None:
    mro, sampler, counts = _step(**kw)
    expected = vllm_get_output(copy.copy(mro), sampler, counts)
    got = AsyncArrowOutput(mro, sampler, counts, pool=StagingPool(max_slabs=2)).get_output()
    ao.assert_outputs_equal(got, expected)


@pytest.mark.parametrize("kw", CASES)
def test_async_arrow_output_record_batch_equals_the_outputs(kw: dict[str, Any]) -> None:
    mro, sampler, counts = _step(**kw)
    expected = ao.to_record_batch(vllm_get_output(copy.copy(mro), sampler, counts), step=9)
    batch = AsyncArrowOutput(mro, sampler, counts, pool=StagingPool()).get_record_batch(step=9)
    assert batch.schema.equals(expected.schema, check_metadata=True)
    assert batch.equals(expected)
    ao.assert_outputs_equal(ao.from_record_batch(batch), ao.from_record_batch(expected))


def test_async_arrow_output_logprobs_point_into_the_slab() -> None:
    mro, sampler, counts = _step(8, 1)
    pool = StagingPool(max_slabs=2)
    out = AsyncArrowOutput(mro, sampler, counts, pool=pool, copy_host=True)
    batch = out.get_record_batch()
    slab = out._staged._lease.slab
    lo, hi = slab.data_ptr(), slab.data_ptr() + slab.numel()
    token_ids = batch.column("logprobs").values.field("token_ids").values.buffers()[1]
    assert lo <= token_ids.address < hi
    del out
    gc.collect()
    assert pool.free_slabs() == 0  # the batch still views the slab
    del batch, token_ids
    gc.collect()
    assert pool.free_slabs() == 1


def test_async_arrow_output_host_logprobs_are_used_in_place() -> None:
    # As vLLM's to_cpu_nonblocking(): host tensors are not copied; the batch views them.
    mro, sampler, counts = _step(8, 1)
    batch = AsyncArrowOutput(mro, sampler, counts).get_record_batch()
    token_ids = batch.column("logprobs").values.field("token_ids").values.buffers()[1]
    assert token_ids.address == sampler.logprobs_tensors.logprob_token_ids.data_ptr()


def test_async_arrow_output_with_a_declared_int32_schema() -> None:
    mro, sampler, counts = _step(3, 2)
    types = ao.ColumnTypes(sampled_token_ids="int32", prompt_logprob_token_ids="int64")
    schema = ao.output_schema(types)
    expected = ao.to_record_batch(vllm_get_output(copy.copy(mro), sampler, counts), schema=schema)
    batch = AsyncArrowOutput(mro, sampler, counts).get_record_batch(schema=schema)
    assert batch.equals(expected)


def test_async_arrow_output_kv_connector_output_even_when_conversion_fails() -> None:
    mro, sampler, counts = _step(3, 1)
    out = AsyncArrowOutput(mro, sampler, counts)
    mro.req_ids.append("extra")  # the output no longer matches the sampled rows
    with pytest.raises(ao.ArrowOutputsError):
        out.get_record_batch()
    assert out.get_kv_connector_output().finished_sending == {"x"}


@dataclasses.dataclass
class _NewerMRO(ao.ModelRunnerOutput):
    """A model-runner output of a newer vLLM, with a field the format has no place for."""

    routed_experts: Any = None


def test_async_arrow_output_refuses_a_field_the_format_lacks() -> None:
    mro, sampler, counts = _step(3, 1)
    newer = _NewerMRO(**{f.name: getattr(mro, f.name) for f in dataclasses.fields(mro)})
    newer.routed_experts = [1, 2, 3]
    with pytest.raises(ao.UnsupportedValueError, match=r"output\.routed_experts"):
        AsyncArrowOutput(newer, sampler, counts).get_record_batch()
    newer.routed_experts = None  # None is no data: the step encodes
    batch = AsyncArrowOutput(newer, sampler, counts).get_record_batch(step=1)
    expected = ao.to_record_batch(vllm_get_output(copy.copy(mro), sampler, counts), step=1)
    assert batch.equals(expected)


def test_async_arrow_output_older_objects_get_the_defaults() -> None:
    """An older vLLM's output object without the newer fields: the encoder's defaults."""
    mro, sampler, counts = _step(3, 1)

    class Older:
        def __init__(self) -> None:
            self.req_ids = mro.req_ids
            self.req_id_to_index = mro.req_id_to_index
            self.prompt_logprobs_dict: dict[str, Any] = {}

    batch = AsyncArrowOutput(Older(), sampler, counts).get_record_batch(step=1)
    plain = copy.copy(mro)
    plain.prompt_logprobs_dict = {}
    plain.kv_connector_output = plain.cudagraph_stats = None
    expected = ao.to_record_batch(vllm_get_output(plain, sampler, counts), step=1)
    assert batch.equals(expected)


def test_async_arrow_output_checks_its_tensors() -> None:
    mro, sampler, _ = _step(3, 1)
    with pytest.raises(ao.ShapeError, match="num_sampled_tokens"):
        AsyncArrowOutput(mro, sampler, torch.ones(2, dtype=torch.int32))


def test_async_arrow_output_no_slab_allocation_after_warm_up() -> None:
    pool = StagingPool(max_slabs=2)
    for seed in range(20):
        mro, sampler, counts = _step(16, 2, seed=seed)
        AsyncArrowOutput(mro, sampler, counts, pool=pool).get_record_batch()
    assert pool.stats().allocations == 1
    assert pool.stats().reuses == 19


@pytest.mark.gpu
def test_async_arrow_output_on_cuda(cuda_device: Any) -> None:
    mro, sampler, counts = _step(8, 3)
    expected = ao.to_record_batch(vllm_get_output(copy.copy(mro), sampler, counts))
    on_gpu = SamplerOutput(
        sampler.sampled_token_ids.to(cuda_device),
        ao.LogprobsTensors(
            *(
                t.to(cuda_device) if isinstance(t, torch.Tensor) else t
                for t in sampler.logprobs_tensors
            )
        ),
        None,
        sampler.num_sampled.to(cuda_device),
        sampler.num_rejected.to(cuda_device),
    )
    out = AsyncArrowOutput(
        mro, on_gpu, counts.to(cuda_device), copy_stream=torch.cuda.Stream(cuda_device)
    )
    batch = out.get_record_batch()
    assert batch.equals(expected)


def _pooling_mro(n: int) -> ao.ModelRunnerOutput:
    req_ids = [f"p{i}" for i in range(n)]
    return ao.ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_async_pooling_output_whole_tensor_is_one_zero_copy_column(dtype: torch.dtype) -> None:
    from arrow_outputs.async_output import AsyncArrowPoolingOutput

    pooled = torch.randn(4, 16).to(dtype)
    pool = StagingPool()
    out = AsyncArrowPoolingOutput(_pooling_mro(4), pooled, [True] * 4, pool=pool)
    batch = out.get_record_batch(step=1)
    rows = out.model_runner_output.pooler_output
    assert all(torch.equal(r, p) for r, p in zip(rows, pooled))
    slab = out._staged._lease.slab
    column = batch.column("pooler_output")
    storage = column.storage if isinstance(column, pa.ExtensionArray) else column.field(0)
    assert storage.values.buffers()[1].address == slab.data_ptr()


def test_async_pooling_output_unfinished_rows_are_none() -> None:
    from arrow_outputs.async_output import AsyncArrowPoolingOutput

    pooled = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    out = AsyncArrowPoolingOutput(_pooling_mro(3), pooled, [True, False, True])
    got = out.get_output().pooler_output
    assert got[1] is None
    assert torch.equal(got[0], pooled[0])
    assert torch.equal(got[2], pooled[2])
    back = ao.from_record_batch(out.get_record_batch())
    assert back.pooler_output[1] is None
    with pytest.raises(ao.ShapeError, match="finished_mask"):
        AsyncArrowPoolingOutput(_pooling_mro(3), pooled, [True])


def _masked_step(n: int, k: int, *, seed: int = 0, width: int = 8, vocab: int = 100):
    """A step whose sampler also produced sampling masks (some rows wider than the width)."""
    mro, sampler, counts = _step(n, k, seed=seed)
    g = torch.Generator().manual_seed(seed)
    num_logits = counts.clone() if k > 1 else torch.ones(n, dtype=torch.int32)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(num_logits, 0)
    logits = torch.randn(int(cu[-1]), vocab, generator=g)
    keep = torch.rand(logits.shape, generator=g) < torch.rand(len(logits), 1, generator=g) * 0.3
    logits[~keep] = float("-inf")
    masks = ao.SamplingMaskTensors.from_logits(logits, cu, counts, width, rows_per_request=k)
    return mro, dataclasses.replace(sampler, sampling_mask_tensors=masks), counts


@pytest.mark.parametrize(("n", "k"), [(6, 1), (5, 3)], ids=["decode", "spec"])
def test_async_arrow_output_sampling_masks(n: int, k: int) -> None:
    mro, sampler, counts = _masked_step(n, k)
    assert int(sampler.sampling_mask_tensors.counts.max()) > 8  # some rows need the bitmask
    expected = copy.copy(mro)
    expected = vllm_get_output(expected, sampler, counts)
    expected.sampling_masks = sampler.sampling_mask_tensors.tolists(counts.numpy())
    got = AsyncArrowOutput(mro, sampler, counts).get_output()
    ao.assert_outputs_equal(got, expected)
    mro2, sampler2, counts2 = _masked_step(n, k)
    batch = AsyncArrowOutput(mro2, sampler2, counts2).get_record_batch(step=2)
    assert batch.equals(ao.to_record_batch(expected, step=2))


def test_async_arrow_output_chunked_prefill_requests_sample_nothing() -> None:
    mro, sampler, counts = _step(5, 1, nans=5)
    counts = torch.tensor([1, 0, 1, 0, 1], dtype=torch.int32)  # 1 and 3 are mid-prefill
    sampler = dataclasses.replace(sampler, logprobs_tensors=None, num_sampled=counts)
    expected = vllm_get_output(copy.copy(mro), sampler, counts)
    assert expected.sampled_token_ids[1] == []
    ao.assert_outputs_equal(
        AsyncArrowOutput(copy.copy(mro), sampler, counts).get_output(), expected
    )
    batch = AsyncArrowOutput(mro, sampler, counts).get_record_batch(step=4)
    assert batch.equals(ao.to_record_batch(expected, step=4))


@pytest.mark.parametrize(
    "counts",
    [[3, 3, 3, 3], [0, 0, 0, 0], [1, 1, 1, 1], [5, 4, 3, 9], [0, 3, 1, 2]],
    ids=["full", "none", "uniform", "past-the-row", "mixed"],
)
def test_async_arrow_output_sampled_ids_trimmed_as_vllm_trims(counts: list[int]) -> None:
    # Uniform counts take a strided copy, others a boolean gather; a count past the row
    # keeps the whole row, as del row[k:] does.
    mro, sampler, _ = _step(4, 3, seed=3)
    counts_t = torch.tensor(counts, dtype=torch.int32)
    sampler = dataclasses.replace(sampler, logprobs_tensors=None, num_sampled=counts_t)
    expected = vllm_get_output(copy.copy(mro), sampler, counts_t)
    assert expected.sampled_token_ids == [
        ids[:k] for ids, k in zip(sampler.sampled_token_ids.tolist(), counts)
    ]
    batch = AsyncArrowOutput(mro, sampler, counts_t).get_record_batch(step=1)
    assert batch.equals(ao.to_record_batch(expected, step=1))


def test_async_arrow_output_negative_count_is_refused() -> None:
    mro, sampler, _ = _step(3, 2)
    counts = torch.tensor([1, -1, 2], dtype=torch.int32)
    out = AsyncArrowOutput(mro, dataclasses.replace(sampler, logprobs_tensors=None), counts)
    with pytest.raises(
        ao.ConsistencyError, match=r"^num_sampled_tokens\[1\]: expected a count >= 0"
    ):
        out.get_record_batch()


def test_async_arrow_output_nans_out_of_int32_are_refused() -> None:
    mro, sampler, counts = _step(2, 1)
    sampler = dataclasses.replace(sampler, num_nans=torch.tensor([1, 2**40]))
    with pytest.raises(ao.UnsupportedValueError, match=r"^sampler_output\.num_nans: "):
        AsyncArrowOutput(mro, sampler, counts).get_record_batch()


def test_async_arrow_output_batch_leaves_the_slab_free_with_host_tensors() -> None:
    # Host logprobs are used in place and the few staged bytes (sampled ids, counts, NaN
    # counts) are copied out: a batch kept alive does not hold a slab of the pool.
    mro, sampler, counts = _step(8, 1, nans=8)
    pool = StagingPool(max_slabs=1, timeout=0.1)
    batches = [AsyncArrowOutput(copy.copy(mro), sampler, counts, pool=pool).get_record_batch()]
    gc.collect()
    assert pool.free_slabs() == 1
    batches.append(AsyncArrowOutput(copy.copy(mro), sampler, counts, pool=pool).get_record_batch())
    assert batches[0].equals(batches[1])


def test_async_arrow_output_schema_inference_follows_each_step() -> None:
    # Decode steps share one cached inferred schema per logprob dtypes; a step with prompt
    # logprobs, or with other dtypes, infers its own, as to_record_batch does.
    for ids_dtype in (torch.int64, torch.int32, torch.int64):
        mro, sampler, counts = _step(3, 1, seed=5)
        lp = sampler.logprobs_tensors
        sampler = dataclasses.replace(
            sampler,
            logprobs_tensors=lp._replace(logprob_token_ids=lp.logprob_token_ids.to(ids_dtype)),
        )
        for prompt in ({}, mro.prompt_logprobs_dict):
            mro.prompt_logprobs_dict = prompt
            expected = ao.to_record_batch(vllm_get_output(copy.copy(mro), sampler, counts), step=2)
            batch = AsyncArrowOutput(copy.copy(mro), sampler, counts).get_record_batch(step=2)
            assert batch.schema.equals(expected.schema, check_metadata=True)
            assert batch.equals(expected)


def _spy_staged_encoder(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each call of batch.encode_staged_step gave: True for a batch, False for None
    (the general path then encodes the step)."""
    calls: list[bool] = []
    real = async_output.encode_staged_step

    def spy(*args: Any, **kwargs: Any) -> Any:
        got = real(*args, **kwargs)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(async_output, "encode_staged_step", spy)
    return calls


@pytest.mark.parametrize("kw", [c for c in CASES if c.id != "empty"])
@pytest.mark.parametrize("objects", [False, True], ids=["plain", "step-objects"])
def test_async_arrow_output_decode_steps_take_the_staged_encoder(
    kw: dict[str, Any], objects: bool, codec_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The steps a decode run makes every step (no prompt logprobs, pooler or aux output) go
    # through encode_staged_step on the C path, once their schema is known, and give the
    # very batch of the general path.
    mro, sampler, counts = _step(**kw)
    mro.prompt_logprobs_dict = {}
    if not objects:
        mro.kv_connector_output = mro.cudagraph_stats = None
    expected = ao.to_record_batch(vllm_get_output(copy.copy(mro), sampler, counts), step=9)
    calls = _spy_staged_encoder(monkeypatch)
    for schema in (None, None, ao.run_schema(expected)):
        out = AsyncArrowOutput(copy.copy(mro), sampler, counts, pool=StagingPool())
        batch = out.get_record_batch(step=9, schema=schema)
        assert batch.schema.equals(expected.schema, check_metadata=True)
        assert batch.equals(expected)
        ao.assert_outputs_equal(ao.from_record_batch(batch), ao.from_record_batch(expected))
    # The first step may infer its schema (the general path caches it for the next ones).
    assert calls[1:] == ([] if codec_path == "python" else [True, True])


def test_async_arrow_output_other_steps_take_the_general_path(
    codec_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mro, sampler, counts = _step(4, 1)  # r0 has prompt logprobs
    expected = ao.to_record_batch(vllm_get_output(copy.copy(mro), sampler, counts), step=3)
    calls = _spy_staged_encoder(monkeypatch)
    for _ in range(2):
        batch = AsyncArrowOutput(copy.copy(mro), sampler, counts).get_record_batch(step=3)
        assert batch.equals(expected)
    assert calls == ([] if codec_path == "python" else [False, False])


@pytest.mark.parametrize("fault", ["req-id-bytes", "req-id-surrogate", "ids-vs-schema"])
def test_async_arrow_output_decode_step_errors_are_the_encoders(fault: str) -> None:
    # Whichever path encodes a decode step, a fault gets to_record_batch's own error.
    mro, sampler, counts = _step(3, 1, seed=2)
    mro.prompt_logprobs_dict = {}
    schema = None
    if fault == "ids-vs-schema":
        types = ao.ColumnTypes(logprob_token_ids="int32")
        schema = ao.output_schema(types)
    for _ in range(2):  # the second step finds the run (and the inferred schema) cached
        m = copy.copy(mro)
        if fault.startswith("req-id"):
            bad: Any = b"r1" if fault == "req-id-bytes" else "r\udc80"
            m.req_ids = ["r0", bad, "r2"]
            m.req_id_to_index = {r: i for i, r in enumerate(m.req_ids)}
        with pytest.raises(ao.ArrowOutputsError) as want:
            ao.to_record_batch(vllm_get_output(copy.copy(m), sampler, counts), schema=schema)
        with pytest.raises(ao.ArrowOutputsError) as got:
            AsyncArrowOutput(m, sampler, counts).get_record_batch(schema=schema)
        assert type(got.value) is type(want.value)
        assert str(got.value) == str(want.value)


@pytest.mark.parametrize("fault", ["bitmask-disagrees", "count-past-vocab"])
def test_async_arrow_output_mask_errors_are_the_mask_converters(fault: str) -> None:
    # The batch tries the C walk over the staged masks first; a mask it declines gets the
    # checked path's error, the one mask_tensors_to_arrow gives for the same tensors.
    mro, sampler, counts = _masked_step(6, 1)
    masks = sampler.sampling_mask_tensors
    wide = int(torch.nonzero(masks.counts > masks.token_ids.shape[1])[0, 0])
    bad = masks.counts.clone()
    bad[wide] = bad[wide] + 1 if fault == "bitmask-disagrees" else masks.vocab_size + 1
    masks = ao.SamplingMaskTensors(masks.token_ids, masks.packed_mask, bad, masks.vocab_size)
    sampler = dataclasses.replace(sampler, sampling_mask_tensors=masks)
    with pytest.raises(ao.ArrowOutputsError) as want:
        ao.mask_tensors_to_arrow(masks, counts.numpy())
    with pytest.raises(ao.ArrowOutputsError) as got:
        AsyncArrowOutput(mro, sampler, counts).get_record_batch(step=1)
    assert type(got.value) is type(want.value)
    assert str(got.value) == str(want.value)
