"""Tests of arrow_outputs.outputs: the vLLM v1 output data model without torch at import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arrow_outputs import outputs
from arrow_outputs.errors import ArrowOutputsError, ConsistencyError, ShapeError
from arrow_outputs.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
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
    make_empty_encoder_model_runner_output,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
REQUIRED = "<required>"


def _dataclass_spec(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) per field, in order; factories are named by ``factory:<name>``."""
    spec = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f"factory:{getattr(f.default_factory, '__name__', '?')}"
        else:
            default = REQUIRED
        spec.append((f.name, default))
    return tuple(spec)


def _make_tensors(
    num_positions: int = 4,
    width: int = 3,
    offset: int = 0,
    cu: list[int] | None = None,
    cu_tensor: torch.Tensor | None = None,
) -> LogprobsTensors:
    ids = torch.arange(num_positions * width, dtype=torch.int32).reshape(num_positions, width)
    return LogprobsTensors(
        ids + offset,
        (ids.to(torch.float32) + offset) / -10.0,
        torch.arange(num_positions, dtype=torch.int64) + offset,
        cu,
        cu_tensor,
    )


# --------------------------------------------------------------------------- module


def test_import_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import arrow_outputs.outputs as o\n"
        "stub = type('S', (), {'num_scheduled_tokens': {'a': 1}})\n"
        "o.make_empty_encoder_model_runner_output(stub)\n"
        "o.ModelRunnerOutput.with_kv_conn_output_only(o.KVConnectorOutput(finished_sending={'a'}))\n"
        "o.SamplingMaskLists(__import__('numpy').arange(3), None).to_nested_list()\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_all_names_resolve() -> None:
    assert set(outputs.__all__) == {
        "AsyncModelRunnerOutput",
        "AuxRequestOutput",
        "CUDAGraphStat",
        "DraftTokenIds",
        "ECConnectorOutput",
        "EMPTY_MODEL_RUNNER_OUTPUT",
        "KVConnectorOutput",
        "LogprobsLists",
        "LogprobsTensors",
        "ModelRunnerOutput",
        "PoolerOutput",
        "SamplerOutput",
        "SamplingMaskLists",
        "make_empty_encoder_model_runner_output",
    }
    for name in outputs.__all__:
        assert hasattr(outputs, name), name


def test_empty_model_runner_output_is_empty() -> None:
    assert ModelRunnerOutput(req_ids=[], req_id_to_index={}) == EMPTY_MODEL_RUNNER_OUTPUT


# --------------------------------------------------------------------------- fields


def test_logprobs_lists_fields() -> None:
    assert LogprobsLists._fields == (
        "logprob_token_ids",
        "logprobs",
        "sampled_token_ranks",
        "cu_num_generated_tokens",
    )
    assert LogprobsLists._field_defaults == {"cu_num_generated_tokens": None}


def test_logprobs_tensors_fields() -> None:
    assert LogprobsTensors._fields == (
        "logprob_token_ids",
        "logprobs",
        "selected_token_ranks",
        "cu_num_generated_tokens",
        "cu_num_generated_tokens_tensor",
    )
    assert LogprobsTensors._field_defaults == {
        "cu_num_generated_tokens": None,
        "cu_num_generated_tokens_tensor": None,
    }


def test_sampling_mask_lists_fields() -> None:
    assert SamplingMaskLists._fields == ("token_ids", "offsets", "cu_num_generated_tokens")
    assert SamplingMaskLists._field_defaults == {"offsets": None, "cu_num_generated_tokens": None}


def test_sampler_output_fields() -> None:
    assert _dataclass_spec(SamplerOutput) == (
        ("sampled_token_ids", REQUIRED),
        ("logprobs_tensors", REQUIRED),
    )


def test_kv_connector_output_fields() -> None:
    assert _dataclass_spec(KVConnectorOutput) == (
        ("finished_sending", None),
        ("finished_recving", None),
        ("kv_connector_stats", None),
        ("kv_cache_events", None),
        ("kv_connector_worker_meta", None),
        ("invalid_block_ids", "factory:set"),
        ("failed_recving", "factory:set"),
        ("expected_finished_count", 0),
    )


def test_kv_connector_output_fields_default_set_not_shared() -> None:
    a, b = KVConnectorOutput(), KVConnectorOutput()
    assert a.invalid_block_ids == set()
    assert a.invalid_block_ids is not b.invalid_block_ids


def test_ec_connector_output_fields() -> None:
    assert _dataclass_spec(ECConnectorOutput) == (
        ("finished_sending", None),
        ("finished_recving", None),
        ("ec_connector_stats", None),
        ("ec_connector_worker_meta", None),
    )


def test_cudagraph_stat_fields() -> None:
    assert _dataclass_spec(CUDAGraphStat) == (
        ("num_unpadded_tokens", REQUIRED),
        ("num_padded_tokens", REQUIRED),
        ("num_paddings", REQUIRED),
        ("runtime_mode", REQUIRED),
    )


def test_cudagraph_stat_frozen() -> None:
    stat = CUDAGraphStat(5, 8, 3, "FULL")
    with pytest.raises(dataclasses.FrozenInstanceError):
        stat.num_paddings = 0  # type: ignore[misc]
    assert hash(stat) == hash(CUDAGraphStat(5, 8, 3, "FULL"))


def test_aux_request_output_fields() -> None:
    assert _dataclass_spec(AuxRequestOutput) == (("token_start", REQUIRED), ("rows", REQUIRED))


def test_draft_token_ids_fields() -> None:
    assert _dataclass_spec(DraftTokenIds) == (
        ("req_ids", REQUIRED),
        ("draft_token_ids", REQUIRED),
    )


def test_model_runner_output_fields() -> None:
    assert _dataclass_spec(ModelRunnerOutput) == (
        ("req_ids", REQUIRED),
        ("req_id_to_index", REQUIRED),
        ("sampled_token_ids", "factory:list"),
        ("logprobs", None),
        ("prompt_logprobs_dict", "factory:dict"),
        ("prompt_token_id_logprobs_dict", "factory:dict"),
        ("pooler_output", None),
        ("kv_connector_output", None),
        ("ec_connector_output", None),
        ("num_nans_in_logits", None),
        ("cudagraph_stats", None),
        ("aux_output_connector_output", None),
        ("sampling_masks", None),
    )


def test_model_runner_output_fields_positional_order() -> None:
    values = [f"v{i}" for i in range(13)]
    out = ModelRunnerOutput(*values)  # type: ignore[arg-type]
    assert [getattr(out, f.name) for f in dataclasses.fields(out)] == values


# --------------------------------------------------------------------------- LogprobsLists


def test_logprobs_lists_slice_request_without_cu() -> None:
    lists = LogprobsLists(np.arange(12).reshape(6, 2), np.arange(12.0).reshape(6, 2), np.arange(6))
    part = lists.slice_request(2, 3)
    np.testing.assert_array_equal(part.logprob_token_ids, [[4, 5], [6, 7], [8, 9]])
    np.testing.assert_array_equal(part.logprobs, [[4.0, 5.0], [6.0, 7.0], [8.0, 9.0]])
    np.testing.assert_array_equal(part.sampled_token_ranks, [2, 3, 4])
    assert part.cu_num_generated_tokens is None


def test_logprobs_lists_slice_request_with_cu() -> None:
    lists = LogprobsLists(
        np.arange(12).reshape(6, 2), np.arange(12.0).reshape(6, 2), np.arange(6), [0, 1, 4, 6]
    )
    part = lists.slice_request(1, 3)
    np.testing.assert_array_equal(part.logprob_token_ids, [[2, 3], [4, 5], [6, 7]])
    np.testing.assert_array_equal(part.sampled_token_ranks, [1, 2, 3])
    assert part.cu_num_generated_tokens is None
    last = lists.slice_request(2, 2)
    np.testing.assert_array_equal(last.sampled_token_ranks, [4, 5])


def test_logprobs_lists_slice_request_returns_views() -> None:
    ids = np.arange(12).reshape(6, 2)
    part = LogprobsLists(ids, ids * 1.0, np.arange(6), [0, 2, 6]).slice_request(1, 4)
    assert np.shares_memory(part.logprob_token_ids, ids)


# --------------------------------------------------------------------------- LogprobsTensors


def test_logprobs_tensors_tolists_values_and_dtypes() -> None:
    t = _make_tensors()
    lists = t.tolists()
    assert isinstance(lists, LogprobsLists)
    for got, want in zip(lists[:3], t[:3], strict=True):
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, want.numpy())
        assert got.dtype == want.numpy().dtype
    assert lists.logprob_token_ids.dtype == np.int32
    assert lists.logprobs.dtype == np.float32
    assert lists.sampled_token_ranks.dtype == np.int64
    assert lists.cu_num_generated_tokens is None


def test_logprobs_tensors_tolists_cu_field() -> None:
    assert _make_tensors(cu=[0, 1, 4]).tolists().cu_num_generated_tokens == [0, 1, 4]


def test_logprobs_tensors_tolists_cu_tensor_beats_field() -> None:
    t = _make_tensors(cu=[0, 1, 4], cu_tensor=torch.tensor([0, 3, 4], dtype=torch.int32))
    cu = t.tolists().cu_num_generated_tokens
    assert cu == [0, 3, 4]
    assert isinstance(cu, list)
    assert all(type(x) is int for x in cu)


def test_logprobs_tensors_tolists_argument_beats_all() -> None:
    t = _make_tensors(cu=[0, 1, 4], cu_tensor=torch.tensor([0, 3, 4]))
    assert t.tolists([0, 2, 4]).cu_num_generated_tokens == [0, 2, 4]
    assert _make_tensors().tolists([0, 4]).cu_num_generated_tokens == [0, 4]


def test_logprobs_tensors_to_cpu_nonblocking_cpu_returns_self() -> None:
    t = _make_tensors(cu=[0, 4], cu_tensor=torch.tensor([0, 4]))
    assert t.to_cpu_nonblocking() is t


class _FakeDeviceTensor:
    """Just enough of a device tensor for to_cpu_nonblocking: device.type and to()."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.device = SimpleNamespace(type="cuda")
        self.calls: list[tuple[Any, ...]] = []

    def to(self, device: str, non_blocking: bool = False) -> tuple[str, str, bool]:
        self.calls.append((device, non_blocking))
        return (self.name, device, non_blocking)


def test_logprobs_tensors_to_cpu_nonblocking_device_copies() -> None:
    fakes = [_FakeDeviceTensor(n) for n in ("ids", "lp", "ranks", "cu")]
    t = LogprobsTensors(fakes[0], fakes[1], fakes[2], [0, 2], fakes[3])  # type: ignore[arg-type]
    moved = t.to_cpu_nonblocking()
    assert moved is not t
    assert isinstance(moved, LogprobsTensors)
    assert tuple(moved) == (
        ("ids", "cpu", True),
        ("lp", "cpu", True),
        ("ranks", "cpu", True),
        [0, 2],
        ("cu", "cpu", True),
    )
    assert all(f.calls == [("cpu", True)] for f in fakes)


def test_logprobs_tensors_to_cpu_nonblocking_device_without_cu_tensor() -> None:
    fakes = [_FakeDeviceTensor(n) for n in ("ids", "lp", "ranks")]
    moved = LogprobsTensors(*fakes).to_cpu_nonblocking()  # type: ignore[arg-type]
    assert moved.cu_num_generated_tokens is None
    assert moved.cu_num_generated_tokens_tensor is None


def test_logprobs_tensors_filter_bool_mask() -> None:
    t = _make_tensors(num_positions=4)
    mask = torch.tensor([True, False, True, False])
    out = t.filter(mask)
    assert isinstance(out, LogprobsTensors)
    assert torch.equal(out.logprob_token_ids, t.logprob_token_ids[[0, 2]])
    assert torch.equal(out.logprobs, t.logprobs[[0, 2]])
    assert torch.equal(out.selected_token_ranks, torch.tensor([0, 2]))
    assert out.cu_num_generated_tokens is None
    assert out.cu_num_generated_tokens_tensor is None


def test_logprobs_tensors_filter_all_false() -> None:
    out = _make_tensors(num_positions=3, width=2).filter(torch.zeros(3, dtype=torch.bool))
    assert out.logprob_token_ids.shape == (0, 2)
    assert out.selected_token_ranks.shape == (0,)


def test_logprobs_tensors_filter_error_cu_list() -> None:
    t = _make_tensors(cu=[0, 1, 4])
    with pytest.raises(ConsistencyError) as info:
        t.filter(torch.ones(4, dtype=torch.bool))
    assert info.value.field == "cu_num_generated_tokens"
    assert "None" in info.value.expected
    assert "[0, 1, 4]" in info.value.got
    assert str(info.value).startswith("cu_num_generated_tokens: expected None")


def test_logprobs_tensors_filter_error_cu_tensor() -> None:
    t = _make_tensors(cu_tensor=torch.tensor([0, 1, 4]))
    with pytest.raises(ConsistencyError) as info:
        t.filter(torch.ones(4, dtype=torch.bool))
    assert info.value.field == "cu_num_generated_tokens_tensor"
    assert "(3,)" in info.value.got
    assert isinstance(info.value, ValueError)


def test_logprobs_tensors_cat_single_no_cu_same_object() -> None:
    t = _make_tensors()
    assert LogprobsTensors.cat([t]) is t
    with_cu_tensor = _make_tensors(cu_tensor=torch.tensor([0, 4]))
    assert LogprobsTensors.cat((with_cu_tensor,)) is with_cu_tensor


def test_logprobs_tensors_cat_single_with_cu_replaces() -> None:
    cu_tensor = torch.tensor([0, 4])
    t = _make_tensors(cu=[0, 4], cu_tensor=cu_tensor)
    out = LogprobsTensors.cat([t], [0, 1, 4])
    assert out is not t
    assert out.cu_num_generated_tokens == [0, 1, 4]
    assert t.cu_num_generated_tokens == [0, 4]
    assert out.logprob_token_ids is t.logprob_token_ids
    assert out.logprobs is t.logprobs
    assert out.selected_token_ranks is t.selected_token_ranks
    assert out.cu_num_generated_tokens_tensor is cu_tensor


def test_logprobs_tensors_cat_several_concatenates() -> None:
    a = _make_tensors(num_positions=2, offset=0)
    b = _make_tensors(num_positions=3, offset=100, cu=[0, 3])
    out = LogprobsTensors.cat([a, b], [0, 2, 5])
    assert torch.equal(out.logprob_token_ids, torch.cat([a.logprob_token_ids, b.logprob_token_ids]))
    assert torch.equal(out.logprobs, torch.cat([a.logprobs, b.logprobs]))
    assert out.selected_token_ranks.tolist() == [0, 1, 100, 101, 102]
    assert out.logprob_token_ids.dtype == torch.int32
    assert out.cu_num_generated_tokens == [0, 2, 5]
    assert out.cu_num_generated_tokens_tensor is None


def test_logprobs_tensors_cat_several_without_cu() -> None:
    out = LogprobsTensors.cat([_make_tensors(1), _make_tensors(1, offset=7)])
    assert out.selected_token_ranks.tolist() == [0, 7]
    assert out.cu_num_generated_tokens is None


def test_logprobs_tensors_cat_error_empty() -> None:
    with pytest.raises(ShapeError) as info:
        LogprobsTensors.cat([])
    assert info.value.field == "tensors"
    assert str(info.value) == (
        "tensors: expected at least one LogprobsTensors, got an empty sequence"
    )


@pytest.mark.parametrize("count", [1, 2])
def test_logprobs_tensors_cat_error_cu_missing(count: int) -> None:
    chunks = [_make_tensors() for _ in range(count - 1)] + [_make_tensors(cu=[0, 4])]
    with pytest.raises(ConsistencyError) as info:
        LogprobsTensors.cat(chunks)
    assert info.value.field == "cu_num_generated_tokens"
    assert f"tensors[{count - 1}]" in info.value.got


def test_logprobs_tensors_cat_error_cu_tensor_several() -> None:
    chunks = [_make_tensors(), _make_tensors(cu_tensor=torch.tensor([0, 4]))]
    with pytest.raises(ConsistencyError) as info:
        LogprobsTensors.cat(chunks, [0, 4, 8])
    assert info.value.field == "tensors[1].cu_num_generated_tokens_tensor"
    with pytest.raises(ConsistencyError):
        LogprobsTensors.cat(chunks)


def test_logprobs_tensors_empty_cpu_shapes_dtypes() -> None:
    t = LogprobsTensors.empty_cpu(3, 5)
    assert t.logprob_token_ids.shape == (3, 5)
    assert t.logprobs.shape == (3, 5)
    assert t.selected_token_ranks.shape == (3,)
    assert t.logprob_token_ids.dtype == torch.int32
    assert t.logprobs.dtype == torch.float32
    assert t.selected_token_ranks.dtype == torch.int32
    assert all(x.device.type == "cpu" for x in t[:3])
    assert t.cu_num_generated_tokens is None
    assert t.cu_num_generated_tokens_tensor is None
    pinned = torch.cuda.is_available()
    assert [x.is_pinned() for x in t[:3]] == [pinned] * 3


def test_logprobs_tensors_empty_cpu_pin_evaluated_at_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = LogprobsTensors.empty_cpu(2, 1)
    assert not any(x.is_pinned() for x in t[:3])


def test_logprobs_tensors_empty_cpu_pins_when_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend CUDA is there; record the pin_memory requests and allocate unpinned.
    requested: list[Any] = []
    real_empty, real_new_empty = torch.empty, torch.Tensor.new_empty

    def fake_empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        requested.append(pin_memory)
        return real_empty(*args, **kwargs)

    def fake_new_empty(self: torch.Tensor, *args: Any, pin_memory: bool = False, **kwargs: Any):
        requested.append(pin_memory)
        return real_new_empty(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.Tensor, "new_empty", fake_new_empty)
    t = LogprobsTensors.empty_cpu(2, 3)
    assert requested == [True, True, True]
    assert t.selected_token_ranks.dtype == torch.int32


def test_logprobs_tensors_empty_cpu_zero_positions() -> None:
    t = LogprobsTensors.empty_cpu(0, 4)
    assert t.logprobs.shape == (0, 4)
    assert t.selected_token_ranks.shape == (0,)


# --------------------------------------------------------------------------- SamplingMaskLists


def _masks(cu: list[int] | None = None) -> SamplingMaskLists:
    # positions: [10, 11] [] [12] [13, 14, 15] [16]
    return SamplingMaskLists(
        np.arange(10, 17, dtype=np.int32), np.array([0, 2, 2, 3, 6, 7], dtype=np.int64), cu
    )


def test_sampling_mask_lists_slice_request_without_cu_single_position() -> None:
    masks = _masks()
    part = masks.slice_request(3, 1)
    assert part.token_ids.tolist() == [13, 14, 15]
    assert part.offsets is None
    assert part.cu_num_generated_tokens is None
    assert masks.slice_request(1, 1).token_ids.tolist() == []


def test_sampling_mask_lists_slice_request_without_cu_multi_position() -> None:
    part = _masks().slice_request(1, 3)  # positions 1..3
    assert part.token_ids.tolist() == [12, 13, 14, 15]
    assert part.offsets is not None
    assert part.offsets.tolist() == [0, 0, 1, 4]
    assert part.offsets.dtype == np.int64
    assert part.cu_num_generated_tokens is None


def test_sampling_mask_lists_slice_request_with_cu() -> None:
    masks = _masks(cu=[0, 2, 3, 5])
    first = masks.slice_request(0, 2)
    assert first.token_ids.tolist() == [10, 11]
    assert first.offsets is not None
    assert first.offsets.tolist() == [0, 2, 2]
    assert first.to_nested_list() == [[10, 11], []]
    second = masks.slice_request(1, 1)
    assert second.token_ids.tolist() == [12]
    assert second.offsets is None
    third = masks.slice_request(2, 2)
    assert third.token_ids.tolist() == [13, 14, 15, 16]
    assert third.offsets is not None
    assert third.offsets.tolist() == [0, 3, 4]


def test_sampling_mask_lists_slice_request_error_no_offsets() -> None:
    with pytest.raises(ConsistencyError) as info:
        SamplingMaskLists(np.arange(3)).slice_request(0, 1)
    assert info.value.field == "offsets"
    assert info.value.got == "None"
    assert str(info.value) == "offsets: expected CSR offsets (slice_request needs them), got None"


def test_sampling_mask_lists_to_nested_list_offsets_none() -> None:
    assert SamplingMaskLists(np.array([4, 5, 6])).to_nested_list() == [[4, 5, 6]]
    assert SamplingMaskLists(np.array([], dtype=np.int32)).to_nested_list() == [[]]


def test_sampling_mask_lists_to_nested_list_with_offsets() -> None:
    nested = _masks().to_nested_list()
    assert nested == [[10, 11], [], [12], [13, 14, 15], [16]]
    assert all(type(x) is int for row in nested for x in row)
    assert SamplingMaskLists(np.array([], dtype=np.int32), np.array([0, 0])).to_nested_list() == [
        []
    ]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.lists(st.integers(0, 1000), max_size=4), min_size=1, max_size=4),
        min_size=1,
        max_size=5,
    )
)
def test_sampling_mask_lists_slice_request_matches_nested(
    requests: list[list[list[int]]],
) -> None:
    rows = [row for req in requests for row in req]
    token_ids = np.array([x for row in rows for x in row], dtype=np.int32)
    offsets = np.cumsum([0] + [len(row) for row in rows])
    cu = list(np.cumsum([0] + [len(req) for req in requests]).tolist())
    masks = SamplingMaskLists(token_ids, offsets, cu)
    assert masks.to_nested_list() == rows
    for i, req in enumerate(requests):
        assert masks.slice_request(i, len(req)).to_nested_list() == req


# --------------------------------------------------------------------------- connectors


KV_NON_EMPTY = {
    "finished_sending": {"r1"},
    "finished_recving": {"r2"},
    "kv_connector_stats": {"bytes": 1},
    "kv_cache_events": ["event"],
    "kv_connector_worker_meta": "meta",
    "invalid_block_ids": {7},
    "failed_recving": {"r3"},
}


def test_kv_connector_output_is_empty_default() -> None:
    assert KVConnectorOutput().is_empty()


@pytest.mark.parametrize(("name", "value"), sorted(KV_NON_EMPTY.items()))
def test_kv_connector_output_is_empty_each_field(name: str, value: Any) -> None:
    assert not KVConnectorOutput(**{name: value}).is_empty()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("finished_sending", set()),
        ("finished_recving", set()),
        ("kv_connector_stats", {}),
        ("kv_cache_events", []),
        ("kv_connector_worker_meta", 0),
        ("invalid_block_ids", set()),
        ("failed_recving", set()),
        ("expected_finished_count", 3),
    ],
)
def test_kv_connector_output_is_empty_falsy_fields(name: str, value: Any) -> None:
    assert KVConnectorOutput(**{name: value}).is_empty()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("finished_sending", {"a"}),
        ("finished_recving", {"b"}),
        ("ec_connector_stats", {"loads": [1.0]}),
        ("ec_connector_worker_meta", [1]),
    ],
)
def test_ec_connector_output_is_empty_each_field(name: str, value: Any) -> None:
    assert ECConnectorOutput().is_empty()
    assert not ECConnectorOutput(**{name: value}).is_empty()
    assert ECConnectorOutput(**{name: type(value)()}).is_empty()


# --------------------------------------------------------------------------- ModelRunnerOutput


def _assert_empty_untouched() -> None:
    assert ModelRunnerOutput(req_ids=[], req_id_to_index={}) == EMPTY_MODEL_RUNNER_OUTPUT


def test_with_kv_conn_output_only_none_and_empty() -> None:
    assert ModelRunnerOutput.with_kv_conn_output_only(None) is EMPTY_MODEL_RUNNER_OUTPUT
    empty = KVConnectorOutput(expected_finished_count=2)
    assert ModelRunnerOutput.with_kv_conn_output_only(empty) is EMPTY_MODEL_RUNNER_OUTPUT
    _assert_empty_untouched()


def test_with_kv_conn_output_only_non_empty_copies() -> None:
    kv = KVConnectorOutput(finished_recving={"r"})
    out = ModelRunnerOutput.with_kv_conn_output_only(kv)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT
    assert out.kv_connector_output is kv
    assert out.req_ids == []
    assert out.req_id_to_index == {}
    assert out.ec_connector_output is None
    _assert_empty_untouched()
    other = ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(invalid_block_ids={1}))
    assert other is not out
    assert out.kv_connector_output is kv


def test_with_ec_conn_output_only_none_and_empty() -> None:
    assert ModelRunnerOutput.with_ec_conn_output_only(None) is EMPTY_MODEL_RUNNER_OUTPUT
    assert (
        ModelRunnerOutput.with_ec_conn_output_only(ECConnectorOutput()) is EMPTY_MODEL_RUNNER_OUTPUT
    )
    _assert_empty_untouched()


def test_with_ec_conn_output_only_non_empty_copies() -> None:
    ec = ECConnectorOutput(finished_sending={"r"})
    out = ModelRunnerOutput.with_ec_conn_output_only(ec)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT
    assert out.ec_connector_output is ec
    assert out.kv_connector_output is None
    _assert_empty_untouched()


def test_with_ec_conn_output_none_and_empty_returns_output_unchanged() -> None:
    given = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    assert ModelRunnerOutput.with_ec_conn_output(given, None) is given
    assert ModelRunnerOutput.with_ec_conn_output(given, ECConnectorOutput()) is given
    assert given.ec_connector_output is None


def test_with_ec_conn_output_mutates_given_output() -> None:
    given = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    ec = ECConnectorOutput(finished_recving={"a"})
    out = ModelRunnerOutput.with_ec_conn_output(given, ec)
    assert out is given
    assert given.ec_connector_output is ec


def test_with_ec_conn_output_empty_shared_output_is_copied() -> None:
    ec = ECConnectorOutput(ec_connector_worker_meta="m")
    out = ModelRunnerOutput.with_ec_conn_output(EMPTY_MODEL_RUNNER_OUTPUT, ec)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT
    assert out.ec_connector_output is ec
    _assert_empty_untouched()


def test_with_ec_conn_output_copy_of_empty_not_treated_as_shared() -> None:
    kv_only = ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(finished_sending={"x"}))
    ec = ECConnectorOutput(finished_sending={"x"})
    assert ModelRunnerOutput.with_ec_conn_output(kv_only, ec) is kv_only
    assert kv_only.ec_connector_output is ec
    _assert_empty_untouched()


# --------------------------------------------------------------------------- encoder stub


def test_make_empty_encoder_model_runner_output_empty() -> None:
    scheduled: dict[str, int] | None
    for scheduled in ({}, None):
        stub = SimpleNamespace(num_scheduled_tokens=scheduled)
        assert make_empty_encoder_model_runner_output(stub) is EMPTY_MODEL_RUNNER_OUTPUT


def test_make_empty_encoder_model_runner_output_requests() -> None:
    stub = SimpleNamespace(num_scheduled_tokens={"z": 4, "a": 1, "m": 9})
    out = make_empty_encoder_model_runner_output(stub)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT
    assert out.req_ids == ["z", "a", "m"]
    assert out.req_id_to_index == {"z": 0, "a": 1, "m": 2}
    assert out.sampled_token_ids == [[], [], []]
    assert len({id(x) for x in out.sampled_token_ids}) == 3
    assert out.pooler_output == [None, None, None]
    assert out.logprobs is None
    assert out.prompt_logprobs_dict == {}
    assert out.kv_connector_output is None
    out.sampled_token_ids[0].append(1)
    assert out.sampled_token_ids == [[1], [], []]
    _assert_empty_untouched()


# --------------------------------------------------------------------------- async output


def test_async_model_runner_output_abstract() -> None:
    # vLLM 0.33: both methods are abstract (get_kv_connector_output salvages a failed step).
    assert AsyncModelRunnerOutput.__abstractmethods__ == frozenset(
        {"get_output", "get_kv_connector_output"}
    )
    with pytest.raises(TypeError):
        AsyncModelRunnerOutput()  # type: ignore[abstract]

    class OnlyGetOutput(AsyncModelRunnerOutput):
        def get_output(self) -> ModelRunnerOutput:
            return EMPTY_MODEL_RUNNER_OUTPUT

    with pytest.raises(TypeError):
        OnlyGetOutput()  # type: ignore[abstract]


def test_async_model_runner_output_get_kv_connector_output_override() -> None:
    kv = KVConnectorOutput(finished_sending={"r"})

    class Early(AsyncModelRunnerOutput):
        def get_output(self) -> ModelRunnerOutput:
            return EMPTY_MODEL_RUNNER_OUTPUT

        def get_kv_connector_output(self) -> KVConnectorOutput | None:
            return kv

    assert Early().get_kv_connector_output() is kv
    assert Early().get_output() is EMPTY_MODEL_RUNNER_OUTPUT


# --------------------------------------------------------------------------- errors


def test_errors_are_arrow_outputs_errors() -> None:
    with pytest.raises(ArrowOutputsError):
        LogprobsTensors.cat([])
    with pytest.raises(ValueError, match="offsets"):
        SamplingMaskLists(np.arange(2)).slice_request(0, 2)
