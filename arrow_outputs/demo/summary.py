"""The demo's summary, computed from the run file it wrote (not from the engine's memory).

The figures come from :mod:`arrow_outputs.analysis` (per-request logprobs and perplexity,
acceptance lengths, mask sizes) and from Arrow compute over the file's columns (NaN counts,
prompt-logprob rows, pooler rows); only the wall-clock time comes from the engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import analysis
from ..reader import open_run

__all__ = ["DemoSummary", "summarize"]


@dataclass
class DemoSummary:
    """A demo run in numbers; :meth:`format` prints it, :meth:`to_dict` gives it as JSON.

    ``per_request`` is :func:`arrow_outputs.analysis.per_request` of the run (one row per
    request: tokens, sequence logprob, perplexity) and ``acceptance`` counts the speculative
    rows by tokens gained (``{1: rows that accepted no draft, 2: ..., ...}``).
    """

    path: str
    file_bytes: int
    complete: bool
    steps: int
    rows: int
    requests: int
    generation_requests: int
    pooling_requests: int
    tokens: int
    elapsed_s: float | None
    steps_per_second: float | None
    tokens_per_second: float | None
    mean_logprob: float | None
    perplexity: float | None
    request_perplexity: dict[str, float] | None
    mean_topk_entropy: float | None
    speculative_rows: int
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    acceptance: dict[int, int]
    mask_positions: int | None
    mean_mask_size: float | None
    max_mask_size: int | None
    nans_in_logits: int
    rows_with_nans: int
    prompt_logprob_rows: int
    pooler_rows: int
    per_request: pa.Table = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Every figure as plain JSON values; of ``per_request``, each scored request's
        perplexity (``perplexity_by_request``)."""
        out = {k: v for k, v in self.__dict__.items() if k != "per_request"}
        out["acceptance"] = {str(k): v for k, v in self.acceptance.items()}
        scored = self.per_request.filter(pc.is_valid(self.per_request.column("perplexity")))
        out["perplexity_by_request"] = dict(
            zip(scored.column("req_id").to_pylist(), scored.column("perplexity").to_pylist())
        )
        return out

    def format(self) -> str:
        """The summary as a few lines of text."""

        def num(x: float | None, fmt: str = ".3f") -> str:
            return "n/a" if x is None else format(x, fmt)

        lines = [
            f"run file        {self.path} ({self.file_bytes / 1e6:.1f} MB, "
            f"{'complete' if self.complete else 'INCOMPLETE'})",
            f"requests        {self.requests} ({self.generation_requests} generation, "
            f"{self.pooling_requests} pooling)",
            f"steps           {self.steps} ({self.rows} rows), "
            f"{num(self.steps_per_second, '.1f')} steps/s",
            f"tokens          {self.tokens} sampled, {num(self.tokens_per_second, '.0f')} tokens/s",
            f"mean logprob    {num(self.mean_logprob)} (perplexity {num(self.perplexity, '.1f')})",
        ]
        if self.request_perplexity:
            p = self.request_perplexity
            lines.append(
                f"perplexity/req  min {p['min']:.1f}  q1 {p['q1']:.1f}  median {p['median']:.1f}"
                f"  q3 {p['q3']:.1f}  max {p['max']:.1f}"
            )
        if self.speculative_rows:
            hist = "  ".join(f"{k}:{v}" for k, v in sorted(self.acceptance.items()))
            lines.append(
                f"acceptance      {num(self.mean_acceptance_length, '.2f')} tokens/step over "
                f"{self.speculative_rows} speculative rows, rate {num(self.acceptance_rate, '.2f')}"
                f"  [{hist}]"
            )
        if self.mask_positions:
            lines.append(
                f"mask sizes      mean {num(self.mean_mask_size, '.1f')}, max {self.max_mask_size}"
                f" ids over {self.mask_positions} positions"
            )
        lines.append(
            f"NaN logits      {self.nans_in_logits} in {self.rows_with_nans} request-steps; "
            f"prompt logprob rows {self.prompt_logprob_rows}; pooler rows {self.pooler_rows}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _int(x: Any) -> int:
    value = x.as_py() if isinstance(x, pa.Scalar) else x
    return int(value or 0)


def summarize(path: str | os.PathLike[str], *, elapsed_s: float | None = None) -> DemoSummary:
    """Summarise a run file (any run file of this format, not only the demo's).

    Parameters
    ----------
    path
        The run file (IPC file or stream).
    elapsed_s
        Wall-clock seconds the run took, for the rates (None: no rates).

    Returns
    -------
    DemoSummary
    """
    run = open_run(path)
    table = run.read_all()
    base = analysis.summary(table)
    per_request = analysis.per_request(table)

    pooled = table.column("pooler_output").is_valid()
    # Rows of pooling steps have no sampled_token_ids at all (null, not an empty list).
    sampled = table.column("sampled_token_ids").is_valid()
    pool_ids = pc.unique(table.column("req_id").filter(pc.invert(sampled)))
    gen_ids = pc.unique(table.column("req_id").filter(sampled))
    request_ppl = None
    ppl = per_request.column("perplexity").drop_null().to_numpy()
    if len(ppl):
        q = np.quantile(ppl, [0.0, 0.25, 0.5, 0.75, 1.0])
        request_ppl = dict(zip(("min", "q1", "median", "q3", "max"), map(float, q)))
    acc = analysis.acceptance_lengths(table)
    spec = acc.filter(pc.fill_null(pc.greater(acc.column("draft_tokens"), 0), False))
    counts = pc.value_counts(spec.column("tokens")) if spec.num_rows else []
    hist = {int(c["values"].as_py()): int(c["counts"].as_py()) for c in counts}
    max_mask = None
    if "sampling_mask" in table.schema.names:
        sizes = analysis.mask_sizes(table).column("size")
        max_mask = _int(pc.max(sizes)) if len(sizes) else None
    nans = table.column("num_nans_in_logits")
    steps = base["steps"]
    tokens = base["tokens"]
    rates = elapsed_s is not None and elapsed_s > 0
    return DemoSummary(
        path=os.fspath(path),
        file_bytes=os.path.getsize(path),
        complete=run.complete,
        steps=steps,
        rows=base["rows"],
        requests=base["requests"],
        generation_requests=len(gen_ids),
        pooling_requests=len(pool_ids),
        tokens=tokens,
        elapsed_s=elapsed_s,
        steps_per_second=steps / elapsed_s if rates and elapsed_s else None,
        tokens_per_second=tokens / elapsed_s if rates and elapsed_s else None,
        mean_logprob=base["mean_logprob"],
        perplexity=base["perplexity"],
        request_perplexity=request_ppl,
        mean_topk_entropy=base["mean_topk_entropy"],
        speculative_rows=base["speculative_rows"],
        mean_acceptance_length=base["mean_acceptance_length"],
        acceptance_rate=base["acceptance_rate"],
        acceptance=hist,
        mask_positions=base["mask_positions"],
        mean_mask_size=base["mean_mask_size"],
        max_mask_size=max_mask,
        nans_in_logits=_int(pc.sum(nans)),
        rows_with_nans=_int(pc.sum(pc.greater(nans, 0))),
        prompt_logprob_rows=_int(pc.sum(pc.list_value_length(table.column("prompt_logprobs")))),
        pooler_rows=_int(pc.sum(pooled)),
        per_request=per_request,
    )


def to_json(summary: DemoSummary) -> str:
    """The summary as one JSON document."""
    return json.dumps(summary.to_dict(), indent=2)
