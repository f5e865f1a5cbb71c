"""Shared fixtures. GPU tests take ``cuda_device`` and skip cleanly without CUDA, so the same
suite reruns unchanged on a machine with a GPU."""

from __future__ import annotations

import pytest


@pytest.fixture
def cuda_device():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda", 0)
