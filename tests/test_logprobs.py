"""logprobs_to_arrow / logprobs_from_arrow: layout, zero-copy both ways, dtypes kept."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from arrow_outputs import LogprobsLists, LogprobsTensors, logprobs_from_arrow, logprobs_to_arrow
from arrow_outputs.logprobs import logprobs_type


def _lists(n_pos: int, width: int, id_dtype=np.int64, rank_dtype=np.int64, cu=None):
    rng = np.random.default_rng(n_pos * 31 + width)
    return LogprobsLists(
        rng.integers(0, 150_000, (n_pos, width)).astype(id_dtype),
        rng.standard_normal((n_pos, width)).astype(np.float32),
        rng.integers(0, 50, n_pos).astype(rank_dtype),
        cu,
    )


def _struct(arr: pa.ListArray) -> pa.StructArray:
    return arr.values


def test_logprobs_to_arrow_offsets_are_cu_num_generated_tokens():
    src = _lists(6, 3, cu=[0, 1, 3, 3, 6])
    arr = logprobs_to_arrow(src)
    assert arr.offsets.to_pylist() == [0, 1, 3, 3, 6]
    assert [len(x) for x in arr.to_pylist()] == [1, 2, 0, 3]
    # The third request has no positions; the fourth's first position is source row 3.
    assert arr[3][0]["token_ids"].as_py() == src.logprob_token_ids[3].tolist()
    assert arr[3][0]["rank"].as_py() == int(src.sampled_token_ranks[3])


def test_logprobs_to_arrow_one_position_per_request_without_cu():
    arr = logprobs_to_arrow(_lists(4, 2))
    assert arr.offsets.to_pylist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("rank_dtype", [np.int32, np.int64])
def test_logprobs_to_arrow_zero_copy_values(id_dtype, rank_dtype):
    src = _lists(5, 21, id_dtype, rank_dtype, cu=[0, 2, 5])
    arr = logprobs_to_arrow(src)
    struct = _struct(arr)
    assert (
        struct.field("token_ids").values.buffers()[1].address == src.logprob_token_ids.ctypes.data
    )
    assert struct.field("logprobs").values.buffers()[1].address == src.logprobs.ctypes.data
    assert struct.field("rank").buffers()[1].address == src.sampled_token_ranks.ctypes.data
    assert arr.type == logprobs_type(np.dtype(id_dtype).name, np.dtype(rank_dtype).name)


def test_logprobs_from_arrow_zero_copy():
    src = _lists(5, 4, cu=[0, 3, 5])
    arr = logprobs_to_arrow(src)
    back = logprobs_from_arrow(arr)
    assert back.logprob_token_ids.ctypes.data == src.logprob_token_ids.ctypes.data
    assert back.logprobs.ctypes.data == src.logprobs.ctypes.data
    assert back.sampled_token_ranks.ctypes.data == src.sampled_token_ranks.ctypes.data
    assert back.cu_num_generated_tokens == [0, 3, 5]
    assert type(back.cu_num_generated_tokens[1]) is int


def test_logprobs_to_arrow_copies_only_non_contiguous_input():
    base = _lists(6, 8)
    strided = LogprobsLists(
        base.logprob_token_ids[:, ::2], base.logprobs[:, ::2], base.sampled_token_ranks
    )
    arr = logprobs_to_arrow(strided)
    back = logprobs_from_arrow(arr, cu_num_generated_tokens=False)
    np.testing.assert_array_equal(back.logprob_token_ids, strided.logprob_token_ids)
    assert back.cu_num_generated_tokens is None
    ranks = _struct(arr).field("rank").buffers()[1].address
    assert ranks == base.sampled_token_ranks.ctypes.data  # contiguous part stays zero-copy


def test_logprobs_schema_is_stable_across_widths():
    assert logprobs_to_arrow(_lists(3, 6)).type == logprobs_to_arrow(_lists(3, 21)).type


def test_logprobs_from_arrow_zero_positions_keep_width():
    arr = logprobs_to_arrow(_lists(0, 21, cu=[0, 0, 0]))
    back = logprobs_from_arrow(arr, width=21)
    assert back.logprob_token_ids.shape == (0, 21)
    assert back.logprobs.shape == (0, 21)
    assert back.cu_num_generated_tokens == [0, 0, 0]


def test_logprobs_tensors_round_trip_zero_copy():
    ids = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    lps = torch.randn(4, 3)
    ranks = torch.arange(4, dtype=torch.int64)
    arr = logprobs_to_arrow(LogprobsTensors(ids, lps, ranks, [0, 1, 4]))
    assert _struct(arr).field("token_ids").values.buffers()[1].address == ids.data_ptr()
    back = logprobs_from_arrow(arr, as_tensors=True)
    assert isinstance(back, LogprobsTensors)
    assert back.logprob_token_ids.dtype == torch.int32
    assert back.selected_token_ranks.dtype == torch.int64
    assert torch.equal(back.logprobs, lps)
    assert back.logprobs.data_ptr() == lps.data_ptr()
    assert back.cu_num_generated_tokens == [0, 1, 4]


def test_logprobs_from_arrow_sliced_array():
    src = _lists(6, 2, cu=[0, 1, 3, 3, 6])
    back = logprobs_from_arrow(logprobs_to_arrow(src).slice(1, 2))
    assert back.cu_num_generated_tokens == [0, 2, 2]
    np.testing.assert_array_equal(back.logprobs, src.logprobs[1:3])


def test_logprobs_from_arrow_reads_ipc_buffers_without_warning():
    src = _lists(3, 4, cu=[0, 2, 3])
    batch = pa.record_batch([logprobs_to_arrow(src)], names=["logprobs"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    read = pa.ipc.open_stream(sink.getvalue()).read_next_batch()
    assert not logprobs_from_arrow(read.column(0)).logprobs.flags.writeable
    back = logprobs_from_arrow(read.column(0), as_tensors=True)  # no read-only warning
    assert torch.equal(back.logprobs, torch.from_numpy(src.logprobs))
