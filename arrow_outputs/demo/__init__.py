"""``arrow-outputs demo``: an embedded engine that produces genuine vLLM 0.33 step outputs.

A tiny decoder-only torch model with seeded random weights runs behind a scheduler with
continuous batching and a real sampler (temperature, top-k, top-p, logprobs with ranks,
prompt logprobs, sampling masks, speculative decoding with rejection sampling, NaN counts,
pooling requests). Every step goes through :class:`~arrow_outputs.AsyncArrowOutput` and an
:class:`~arrow_outputs.OutputWriter` into an Arrow IPC file, which is then summarised.

Importing this package does not import torch; :func:`run_demo` does.

Examples
--------
>>> from arrow_outputs.demo import DemoConfig
>>> DemoConfig().num_requests
64
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .cli import add_arguments, main
from .config import DemoConfig, RequestSpec, SamplingParams, make_requests

if TYPE_CHECKING:
    from .engine import run_demo
    from .summary import DemoSummary, summarize

__all__ = [
    "DemoConfig",
    "DemoSummary",
    "RequestSpec",
    "SamplingParams",
    "add_arguments",
    "main",
    "make_requests",
    "run_demo",
    "summarize",
]

_LAZY = {"run_demo": "engine", "DemoSummary": "summary", "summarize": "summary"}


def __getattr__(name: str) -> Any:
    # torch (engine) and the analysis module load on first use, not on import.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
