"""Device behaviour: skipped without CUDA, run as-is on a GPU machine."""

from __future__ import annotations

import pytest
import torch

import arrow_outputs as ao

pytestmark = pytest.mark.gpu


def test_empty_cpu_is_pinned_with_cuda(cuda_device):
    t = ao.LogprobsTensors.empty_cpu(8, 21)
    assert t.logprob_token_ids.is_pinned()
    assert t.logprobs.is_pinned()
    assert t.selected_token_ranks.is_pinned()


def test_to_cpu_nonblocking_then_record_batch(cuda_device):
    ids = torch.arange(12, device=cuda_device, dtype=torch.int64).reshape(4, 3)
    lps = torch.randn(4, 3, device=cuda_device)
    ranks = torch.ones(4, device=cuda_device, dtype=torch.int64)
    host = ao.LogprobsTensors(ids, lps, ranks, [0, 1, 4]).to_cpu_nonblocking()
    torch.cuda.synchronize()
    assert host.logprobs.device.type == "cpu"
    arr = ao.logprobs_to_arrow(host)
    back = ao.logprobs_from_arrow(arr, as_tensors=True)
    assert torch.equal(back.logprobs, lps.cpu())
    assert back.cu_num_generated_tokens == [0, 1, 4]


def test_device_tensor_is_refused_with_a_clear_error(cuda_device):
    out = ao.ModelRunnerOutput(
        ["a"], {"a": 0}, [[1]], pooler_output=[torch.ones(4, device=cuda_device)]
    )
    with pytest.raises(ao.UnsupportedValueError, match="host"):
        ao.to_record_batch(out)
