"""The torch boundary: the only module that imports torch, and only when a tensor is made.

Tensors cross to numpy (and so to Arrow) through DLPack, zero-copy. DLPack has no bfloat16,
so bfloat16 crosses as its uint16 bit pattern and is viewed back on the way out.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np

from .errors import DTypeError, UnsupportedValueError

# numpy 2.1 added DLPack 1.0 exports, which carry a read-only flag.
_READONLY_DLPACK = np.lib.NumpyVersion(np.__version__) >= "2.1.0"

__all__ = ["host_numpy", "is_tensor", "numpy_to_tensor", "tensor_dtype_name", "tensor_to_numpy"]


def is_tensor(x: Any) -> bool:
    """True for a ``torch.Tensor``; never imports torch (no tensor exists without it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def tensor_dtype_name(t: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(t.dtype).removeprefix("torch.")


def tensor_to_numpy(t: Any, field: str) -> np.ndarray:
    """A zero-copy numpy view of a host tensor (bfloat16 as uint16 bits).

    Device tensors are refused rather than synchronised here: a hidden device-to-host copy
    would stall the engine thread. Move them with ``arrow_outputs``' device staging first.
    """
    if t.device.type != "cpu":
        raise UnsupportedValueError(field, "a host (CPU) tensor", f"a tensor on {t.device}")
    if t.requires_grad:
        t = t.detach()
    if t.dtype == sys.modules["torch"].bfloat16:
        t = t.view(sys.modules["torch"].uint16)
    return np.from_dlpack(t)


def host_numpy(t: Any, field: str) -> np.ndarray:
    """:func:`tensor_to_numpy` on the per-step path: ``Tensor.numpy()``, a quarter of DLPack's
    cost, where it shares the memory as it is; it refuses the rest (a device tensor,
    autograd, a lazy conjugate or negation, bfloat16), which go the general way."""
    try:
        return t.numpy()
    except (RuntimeError, TypeError):
        return tensor_to_numpy(t, field)


def numpy_to_tensor(a: np.ndarray, dtype: str) -> Any:
    """A torch tensor over ``a``'s memory; read-only arrays from Arrow buffers are fine.

    ``torch.from_numpy`` warns on read-only arrays; DLPack carries the read-only flag
    without a warning, so it is the path taken. The tensor shares the batch's memory and
    must be treated as read-only.
    """
    import torch

    base = a.view(np.uint16) if dtype == "bfloat16" else a
    if a.flags.writeable or _READONLY_DLPACK:
        t = torch.from_dlpack(base)
    else:
        # numpy < 2.1 cannot mark an export read-only over DLPack, so it refuses to export;
        # torch.from_numpy shares the memory but warns that it is not writable. The tensor is
        # read-only by contract (see from_record_batch), so that one warning is expected.
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="The given NumPy array is not writable", category=UserWarning
            )
            t = torch.from_numpy(base)
    if dtype == "bfloat16":
        return t.view(torch.bfloat16)
    if tensor_dtype_name(t) != dtype:
        raise DTypeError("tensor", dtype, tensor_dtype_name(t))
    return t


def as_tensor(values: list[int], dtype: str) -> Any:
    """A small tensor built from Python ints (offsets that lived on device)."""
    import torch

    # An explicit table: a dtype name from a file never reaches getattr(torch, ...).
    return torch.tensor(values, dtype={"int32": torch.int32, "int64": torch.int64}[dtype])
