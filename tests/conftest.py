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


@pytest.fixture(scope="module", params=["c", "python"])
def codec_path(request):
    """Run a module's tests on the C accelerator and on the pure-Python path in turn."""
    from arrow_outputs import _accel

    if request.param == "c" and not _accel.AVAILABLE:
        pytest.skip("the C accelerator is not built")
    was = _accel.accelerated()
    _accel.set_pure_python(request.param == "python")
    yield request.param
    _accel.set_pure_python(not was)
