"""The demo's configuration and its seeded workload of requests (no torch here).

A workload is a list of :class:`RequestSpec`: generation requests with different prompt and
output lengths and sampling parameters (temperature, top-k, top-p, logprobs, prompt
logprobs), and pooling (embedding) requests, arriving over the first steps of the run so the
scheduler batches them continuously. Everything is drawn from one seeded numpy generator:
the same config gives the same run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import FieldTypeError, UnsupportedValueError

__all__ = ["DemoConfig", "RequestSpec", "SamplingParams", "make_requests"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, with vLLM's meanings.

    Attributes
    ----------
    temperature
        0 samples greedily (the argmax); otherwise logits are divided by it.
    top_k
        Keep the ``top_k`` largest logits (ties with the k-th kept too); 0: off.
    top_p
        Keep the smallest set of largest logits whose probability reaches ``top_p``
        (vLLM's rule); 1.0: off.
    logprobs
        Top logprobs returned per sampled position (0: the sampled token's only); None: none.
    prompt_logprobs
        Top logprobs returned per prompt position; None: none.
    max_tokens
        Tokens to generate; the request finishes when it has them.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    max_tokens: int = 16


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload.

    ``kind`` is ``"generate"`` or ``"pool"`` (an embedding request: one pooled vector, no
    sampling). ``arrival`` is the first engine step it may be scheduled in.
    ``inject_nans`` puts a few NaNs into its logits every step (fault injection, so the
    ``num_nans_in_logits`` column has something to count; the sampler treats them as
    ``-inf``).
    """

    req_id: str
    kind: str
    prompt: tuple[int, ...]
    arrival: int
    params: SamplingParams = field(default_factory=SamplingParams)
    inject_nans: bool = False


@dataclass(frozen=True)
class DemoConfig:
    """Everything that shapes a demo run; the defaults finish in seconds on 2 CPU cores.

    Attributes
    ----------
    num_requests
        Requests in the workload (generation and pooling together).
    max_steps
        Engine steps at most; the run stops there even with requests unfinished.
    seed
        Seeds the weights, the workload and the sampler.
    device
        ``"cpu"`` or a CUDA device (``"cuda"``, ``"cuda:1"``): the model, the sampler and
        the sampler's outputs live there, and outputs cross to the host through the pinned
        staging pool.
    vocab_size, d_model, num_layers, num_heads, draft_layers
        The model (:class:`~arrow_outputs.demo.model.ModelConfig`); the first
        ``draft_layers`` layers are the speculative drafter.
    num_speculative_tokens
        Draft tokens proposed per decoding request and step (0: no speculative decoding).
    max_num_seqs, max_num_batched_tokens
        Continuous batching: requests running at once, tokens per step (long prompts are
        prefilled in chunks).
    pooling_fraction, nan_fraction
        Share of pooling requests; share of generation requests with NaNs injected.
    prompt_len, output_len
        Inclusive ranges the lengths are drawn from.
    arrival_steps
        Requests arrive spread over this many steps.
    sampling_masks
        Capture each sampled position's support (vLLM's ``return_sampling_mask``).
    compression
        IPC compression of the file: None, ``"lz4"`` or ``"zstd"``.
    threads
        torch's intra-op threads during the run (restored after). One by default: the
        writer's thread takes another core, and the demo's many small ops gain nothing from
        a thread pool, which spin-waits badly when the cores are shared (measured on 2 busy
        cores: 40 steps in 8 s with 1 thread, 60 s with 2).
    """

    num_requests: int = 64
    max_steps: int = 400
    seed: int = 0
    device: str = "cpu"
    vocab_size: int = 32768
    d_model: int = 128
    num_layers: int = 3
    num_heads: int = 4
    draft_layers: int = 1
    num_speculative_tokens: int = 3
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    pooling_fraction: float = 0.125
    nan_fraction: float = 0.0625
    prompt_len: tuple[int, int] = (8, 160)
    output_len: tuple[int, int] = (8, 48)
    arrival_steps: int = 60
    sampling_masks: bool = True
    compression: str | None = None
    threads: int = 1

    def __post_init__(self) -> None:
        positive = {
            "num_requests": 1,
            "max_steps": 1,
            "vocab_size": 2,
            "d_model": 1,
            "num_layers": 1,
            "num_heads": 1,
            "draft_layers": 1,
            "num_speculative_tokens": 0,
            "max_num_seqs": 1,
            "max_num_batched_tokens": 1,
            "arrival_steps": 1,
            "seed": 0,
            "threads": 1,
        }
        for name, low in positive.items():
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise FieldTypeError(f"DemoConfig.{name}", f"an int >= {low}", repr(value))
        for name in ("pooling_fraction", "nan_fraction"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise FieldTypeError(f"DemoConfig.{name}", "a number within 0..1", repr(value))
        for name, low in (("prompt_len", 2), ("output_len", 1)):
            value = getattr(self, name)
            if (
                not isinstance(value, tuple)
                or len(value) != 2
                or any(type(v) is not int for v in value)
                or not low <= value[0] <= value[1]
            ):
                raise FieldTypeError(
                    f"DemoConfig.{name}",
                    f"a (low, high) pair of ints with {low} <= low <= high",
                    repr(value),
                )
        if self.draft_layers > self.num_layers:
            raise UnsupportedValueError(
                "DemoConfig.draft_layers",
                f"at most num_layers ({self.num_layers})",
                str(self.draft_layers),
            )
        if self.d_model % self.num_heads:
            raise UnsupportedValueError(
                "DemoConfig.d_model",
                f"a multiple of num_heads ({self.num_heads})",
                str(self.d_model),
            )
        if self.compression not in (None, "lz4", "zstd"):
            raise FieldTypeError(
                "DemoConfig.compression", "None, 'lz4' or 'zstd'", repr(self.compression)
            )
        if not isinstance(self.device, str):
            raise FieldTypeError(
                "DemoConfig.device", "a device name such as 'cpu'", repr(self.device)
            )

    @property
    def max_model_len(self) -> int:
        """Positions a sequence may reach: the longest prompt, output and draft."""
        return self.prompt_len[1] + self.output_len[1] + self.num_speculative_tokens + 1

    def to_json(self) -> dict[str, Any]:
        """The config as plain JSON values (recorded as the file's run metadata)."""
        out = asdict(self)
        out["prompt_len"] = list(self.prompt_len)
        out["output_len"] = list(self.output_len)
        return out


# The workload's mix of sampling parameters: (weight, temperature, top_k, top_p). Most
# requests filter with top-k (small supports, small masks); some use top-p alone, and at
# temperature 1 over 32k tokens their supports (a few thousand ids) are wider than the
# compact mask width (2048), so they are read back from the bitmask; some sample greedily.
_SAMPLING_MIX = (
    (0.30, 1.0, 50, 1.0),
    (0.20, 0.8, 20, 0.9),
    (0.15, 1.2, 100, 0.95),
    (0.13, 0.7, 0, 0.8),
    (0.07, 1.0, 0, 0.95),
    (0.15, 0.0, 20, 1.0),
)


def make_requests(cfg: DemoConfig) -> list[RequestSpec]:
    """The seeded workload of ``cfg``: ``cfg.num_requests`` requests in arrival order.

    Examples
    --------
    >>> reqs = make_requests(DemoConfig(num_requests=8, seed=1))
    >>> len(reqs), reqs[0].req_id
    (8, 'req-0')
    >>> reqs == make_requests(DemoConfig(num_requests=8, seed=1))
    True
    """
    rng = np.random.default_rng([cfg.seed, 0xD3])
    weights = np.array([w for w, *_ in _SAMPLING_MIX])
    arrivals = np.sort(rng.integers(0, cfg.arrival_steps, cfg.num_requests))
    arrivals[0] = 0  # the run starts with work
    out = []
    for i in range(cfg.num_requests):
        lo, hi = cfg.prompt_len
        # Short prompts are common, long ones (prefilled in chunks) rarer: a skewed draw.
        length = lo + int((hi - lo) * float(rng.random()) ** 2)
        prompt = tuple(int(t) for t in rng.integers(0, cfg.vocab_size, length))
        if rng.random() < cfg.pooling_fraction:
            out.append(RequestSpec(f"req-{i}", "pool", prompt, int(arrivals[i])))
            continue
        _, temperature, top_k, top_p = _SAMPLING_MIX[rng.choice(len(weights), p=weights)]
        logprobs = [None, 0, 1, 5, 20][rng.choice(5, p=[0.1, 0.2, 0.2, 0.3, 0.2])]
        prompt_logprobs = [None, 0, 5][rng.choice(3, p=[0.7, 0.1, 0.2])]
        params = SamplingParams(
            temperature=temperature,
            top_k=min(top_k, cfg.vocab_size),
            top_p=top_p,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            max_tokens=int(rng.integers(cfg.output_len[0], cfg.output_len[1] + 1)),
        )
        nans = bool(rng.random() < cfg.nan_fraction)
        out.append(RequestSpec(f"req-{i}", "generate", prompt, int(arrivals[i]), params, nans))
    return out
