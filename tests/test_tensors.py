"""Tensor columns: fixed-shape (canonical extension) and variable-shape layouts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from arrow_outputs.tensors import TensorSpec, decode_tensor_rows, encode_tensor_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_encode_tensor_rows_views_of_one_tensor_are_zero_copy(dtype):
    whole = torch.randn(4, 8).to(dtype)
    arr, kind = encode_tensor_rows(list(whole.unbind(0)), TensorSpec(str(dtype)[6:], 1, (8,)), "p")
    assert kind == "torch"
    assert isinstance(arr.type, pa.FixedShapeTensorType)
    assert arr.storage.values.buffers()[1].address == whole.data_ptr()
    rows = decode_tensor_rows(arr, TensorSpec(str(dtype)[6:], 1, (8,)), "torch", "p")
    assert all(r.dtype == dtype for r in rows)
    assert torch.equal(torch.stack(rows), whole)
    assert rows[1].data_ptr() == rows[0].data_ptr() + 8 * whole.element_size()


def test_encode_tensor_rows_null_rows_in_fixed_shape():
    rows = [torch.ones(3), None, torch.zeros(3)]
    spec = TensorSpec("float32", 1, (3,))
    arr, _ = encode_tensor_rows(rows, spec, "p")
    assert arr.null_count == 1
    back = decode_tensor_rows(arr, spec, "torch", "p")
    assert back[1] is None
    assert torch.equal(back[0], rows[0])
    assert torch.equal(back[2], rows[2])


def test_encode_tensor_rows_variable_shape_numpy_kind_kept():
    rows = [np.arange(24, dtype=np.uint16).reshape(2, 3, 4), None, np.ones((1, 3, 4), np.uint16)]
    spec = TensorSpec("uint16", 3)
    arr, kind = encode_tensor_rows(rows, spec, "aux")
    assert kind == "numpy"
    back = decode_tensor_rows(arr, spec, kind, "aux")
    assert back[1] is None
    assert isinstance(back[0], np.ndarray)
    assert back[0].dtype == np.uint16
    np.testing.assert_array_equal(back[0], rows[0])
    np.testing.assert_array_equal(back[2], rows[2])


def test_encode_tensor_rows_consecutive_numpy_views_zero_copy():
    packed = np.arange(5 * 2 * 3, dtype=np.uint8).reshape(5, 2, 3)
    rows = [packed[0:2], packed[2:3], packed[3:5]]
    arr, _ = encode_tensor_rows(rows, TensorSpec("uint8", 3), "aux")
    assert arr.field("data").values.buffers()[1].address == packed.ctypes.data


def test_tensor_spec_field_round_trip():
    for spec in (TensorSpec("bfloat16", 1, (16,)), TensorSpec("float32", 2), TensorSpec()):
        assert TensorSpec.from_field(spec.field("x")) == spec
