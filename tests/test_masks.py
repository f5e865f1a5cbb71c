"""sampling_masks_to_arrow / sampling_masks_from_arrow: CSR offsets are the Arrow offsets."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from arrow_outputs import SamplingMaskLists, sampling_masks_from_arrow, sampling_masks_to_arrow
from arrow_outputs.masks import SAMPLING_MASK_TYPE


def _masks(cu=(0, 1, 3, 3, 5)):
    token_ids = np.array([4, 9, 1, 2, 3, 7, 8, 11, 12, 13], dtype=np.int32)
    offsets = np.array([0, 2, 5, 5, 8, 10], dtype=np.int64)
    return SamplingMaskLists(token_ids, offsets, None if cu is None else list(cu))


def test_sampling_masks_to_arrow_nested_layout():
    arr = sampling_masks_to_arrow(_masks())
    assert arr.type == SAMPLING_MASK_TYPE
    assert arr.to_pylist() == [[[4, 9]], [[1, 2, 3], []], [], [[7, 8, 11], [12, 13]]]


def test_sampling_masks_to_arrow_zero_copy_offsets_and_values():
    m = _masks()
    arr = sampling_masks_to_arrow(m)
    inner = arr.values
    assert inner.buffers()[1].address == m.offsets.ctypes.data
    assert inner.values.buffers()[1].address == m.token_ids.ctypes.data


def test_sampling_masks_from_arrow_zero_copy():
    m = _masks()
    back = sampling_masks_from_arrow(sampling_masks_to_arrow(m))
    assert back.token_ids.ctypes.data == m.token_ids.ctypes.data
    assert back.offsets.ctypes.data == m.offsets.ctypes.data
    assert back.offsets.dtype == np.int64
    assert back.token_ids.dtype == np.int32
    assert back.cu_num_generated_tokens == [0, 1, 3, 3, 5]
    assert back.to_nested_list() == m.to_nested_list()


def test_sampling_masks_without_cu_one_position_per_request():
    m = _masks(cu=None)
    arr = sampling_masks_to_arrow(m)
    assert len(arr) == 5
    back = sampling_masks_from_arrow(arr, cu_num_generated_tokens=False)
    assert back.cu_num_generated_tokens is None
    assert back.to_nested_list() == m.to_nested_list()


def test_sampling_masks_offsets_none_is_one_position():
    m = SamplingMaskLists(np.array([5, 6, 7], dtype=np.int32))
    arr = sampling_masks_to_arrow(m)
    assert arr.to_pylist() == [[[5, 6, 7]]]
    back = sampling_masks_from_arrow(arr, offsets=False, cu_num_generated_tokens=False)
    assert back.offsets is None
    assert back.cu_num_generated_tokens is None
    np.testing.assert_array_equal(back.token_ids, m.token_ids)


def test_sampling_masks_from_arrow_sliced_rebases_offsets():
    m = _masks()
    back = sampling_masks_from_arrow(sampling_masks_to_arrow(m).slice(3, 1))
    assert back.to_nested_list() == [[7, 8, 11], [12, 13]]
    assert back.offsets.tolist() == [0, 3, 5]
    assert back.cu_num_generated_tokens == [0, 2]


def test_sampling_masks_from_arrow_after_ipc_is_read_only():
    batch = pa.record_batch([sampling_masks_to_arrow(_masks())], names=["m"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    back = sampling_masks_from_arrow(pa.ipc.open_stream(sink.getvalue()).read_next_batch()[0])
    assert not back.token_ids.flags.writeable
    assert back.to_nested_list() == _masks().to_nested_list()
