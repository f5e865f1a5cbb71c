"""The demo's scheduler and model runner: continuous batching into vLLM 0.33 MRv2 outputs.

:class:`Scheduler` admits requests as they arrive (up to ``max_num_seqs`` at once, each with
a KV-cache slot), gives every step a token budget (long prompts are prefilled in chunks;
decoding requests take one token plus their drafts), and alternates generation steps with
pooling steps while embedding requests wait.

:class:`ModelRunner` executes a step the way vLLM's Model Runner V2 does and returns what its
``AsyncOutput`` is built from: the ``ModelRunnerOutput`` (request ids, prompt logprobs), the
``SamplerOutput`` tensors (padded sampled ids, logprobs of every verified position, NaN
counts, sampling masks) and ``num_sampled``, wrapped in :class:`~arrow_outputs.AsyncArrowOutput`
(or the pooler tensor in :class:`~arrow_outputs.AsyncArrowPoolingOutput`), plus the host
copy of the sampled tokens the scheduler needs for the next step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..async_output import AsyncArrowOutput, AsyncArrowPoolingOutput
from ..device import StagingPool
from ..mask_tensors import SamplingMaskTensors
from ..outputs import LogprobsTensors, ModelRunnerOutput
from .config import DemoConfig, RequestSpec
from .model import Batch, KVCache, ModelConfig, TinyDecoder
from .sampler import (
    SamplerOutput,
    compute_logprobs,
    count_nans,
    draft_sample,
    process_logits,
    rejection_sample,
    target_probs,
)

__all__ = ["ModelRunner", "Request", "Scheduled", "Scheduler", "StepResult"]

# NaNs injected per logits row of a request with ``inject_nans``: 1..this many.
_MAX_INJECTED_NANS = 4
# The drafter's top-k for requests without one.
_DRAFT_TOP_K = 64


@dataclass
class Request:
    """A request's running state. Invariant while decoding: every token but the last is in
    the KV cache (``num_computed == len(tokens) - 1``)."""

    spec: RequestSpec
    tokens: list[int]
    num_computed: int = 0
    slot: int = -1
    num_output: int = 0
    finished: bool = False

    @property
    def req_id(self) -> str:
        return self.spec.req_id

    @property
    def prompt_len(self) -> int:
        return len(self.spec.prompt)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len


@dataclass
class Scheduled:
    """One step's work: the requests, in batch order, and their tokens this step."""

    kind: str  # "generate" or "pool"
    requests: list[Request]
    num_tokens: list[int]
    num_drafts: list[int]


@dataclass
class StepResult:
    """What a step changed: per request, the tokens it computed and the tokens it sampled."""

    new_tokens: list[list[int]] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)


class Scheduler:
    """Continuous batching over a workload of :class:`RequestSpec` (vLLM-style, simplified).

    Each generation step first serves the running requests in admission order (the rest of a
    prompt, in chunks within the token budget, or one token plus up to
    ``num_speculative_tokens`` drafts), then admits arrived requests while slots and budget
    last. Pooling requests run in their own steps, taken when generation has nothing to do or
    every ``pool_every`` steps while some wait.
    """

    def __init__(self, cfg: DemoConfig, specs: list[RequestSpec], *, pool_every: int = 4) -> None:
        self.cfg = cfg
        self.pool_every = pool_every
        self.waiting: dict[str, deque[Request]] = {"generate": deque(), "pool": deque()}
        self._pending = deque(sorted(specs, key=lambda s: s.arrival))
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self._since_pool = 0

    @property
    def done(self) -> bool:
        return not (self._pending or self.running or any(self.waiting.values()))

    def next_arrival(self) -> int | None:
        return self._pending[0].arrival if self._pending else None

    def schedule(self, step: int) -> Scheduled | None:
        """The work of engine step ``step``, or None when nothing can run (all arrive later)."""
        while self._pending and self._pending[0].arrival <= step:
            spec = self._pending.popleft()
            self.waiting[spec.kind].append(Request(spec, list(spec.prompt)))
        gen = self._build("generate")
        pool_ready = any(r.spec.kind == "pool" for r in self.running) or self.waiting["pool"]
        if pool_ready and (gen is None or self._since_pool >= self.pool_every):
            pooled = self._build("pool")
            if pooled is not None:
                self._since_pool = 0
                self._admit(pooled)
                return pooled
        if gen is not None:
            self._since_pool += 1
            self._admit(gen)
        return gen

    def _build(self, kind: str) -> Scheduled | None:
        budget = self.cfg.max_num_batched_tokens
        k = self.cfg.num_speculative_tokens
        reqs, tokens, drafts = [], [], []
        for r in self.running:
            if r.spec.kind != kind or budget == 0:
                continue
            if r.prefilling:
                n, d = min(r.prompt_len - r.num_computed, budget), 0
            else:
                # Drafts never overshoot max_tokens: accepted drafts + 1 <= what is left.
                left = r.spec.params.max_tokens - r.num_output
                d = max(0, min(k, left - 1, budget - 1))
                n = 1 + d
            reqs.append(r)
            tokens.append(n)
            drafts.append(d)
            budget -= n
        slots = len(self.free_slots)
        for spec_req in self.waiting[kind]:
            if budget == 0 or slots == 0:
                break
            n = min(spec_req.prompt_len, budget)
            reqs.append(spec_req)
            tokens.append(n)
            drafts.append(0)
            budget -= n
            slots -= 1
        if not reqs:
            return None
        return Scheduled(kind, reqs, tokens, drafts)

    def _admit(self, sched: Scheduled) -> None:
        for r in sched.requests:
            if r.slot < 0:
                self.waiting[r.spec.kind].remove(r)
                r.slot = self.free_slots.pop()
                self.running.append(r)

    def update(self, sched: Scheduled, result: StepResult) -> list[Request]:
        """Apply a step's result; returns the requests that finished in it."""
        done = []
        for r, new, computed in zip(sched.requests, result.new_tokens, result.num_computed):
            r.num_computed += computed
            r.tokens.extend(new)
            r.num_output += len(new)
            over = r.spec.kind == "pool" and not r.prefilling
            if over or (r.spec.kind == "generate" and r.num_output >= r.spec.params.max_tokens):
                r.finished = True
                done.append(r)
        for r in done:
            self.running.remove(r)
            self.free_slots.append(r.slot)
            self.finished.append(r)
        return done


class ModelRunner:
    """Runs scheduled steps on :class:`TinyDecoder` and returns vLLM 0.33 MRv2 step outputs.

    Parameters
    ----------
    cfg
        The demo's config (model shape, speculative tokens, masks, device, seed).
    pool
        The staging pool the async outputs stage through.
    """

    def __init__(self, cfg: DemoConfig, pool: StagingPool) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model_cfg = ModelConfig(
            vocab_size=cfg.vocab_size,
            d_model=cfg.d_model,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            max_model_len=cfg.max_model_len,
            draft_layers=cfg.draft_layers,
            seed=cfg.seed,
        )
        self.model = TinyDecoder(self.model_cfg, self.device)
        self.cache = KVCache(self.model_cfg, cfg.max_num_seqs, self.device)
        self.pool = pool
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed + 1)
        self.rows_per_request = cfg.num_speculative_tokens + 1
        if self.device.type == "cuda":
            self.copy_stream: Any = torch.cuda.Stream(self.device)
        else:
            self.copy_stream = None

    # -- helpers -----------------------------------------------------------------------

    def _tensor(self, values: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values), dtype=dtype).to(self.device)

    def _forward(
        self, reqs: list[Any], token_ids: list[int], positions: list[int], n_tok: list[int]
    ) -> torch.Tensor:
        """The model over one packed batch (all layers): ``n_tok[i]`` tokens of ``reqs[i]``
        at ``positions``, written into and read from each request's KV-cache slot."""
        batch = Batch(
            self._tensor(token_ids, torch.int64),
            self._tensor(positions, torch.int64),
            self._tensor([r.slot for r in reqs], torch.int64),
            self._tensor(n_tok, torch.int64),
        )
        return self.model(batch, self.cache)

    def _streams(self) -> dict[str, Any]:
        if self.copy_stream is None:
            return {}
        return {
            "main_stream": torch.cuda.current_stream(self.device),
            "copy_stream": self.copy_stream,
        }

    def _params(self, reqs: list[Request], rows: list[int]) -> tuple[torch.Tensor, ...]:
        """Per-row sampling parameters (each request's repeated over its rows)."""
        p = [r.spec.params for r in reqs]
        rep = self._tensor(rows, torch.int64)
        temperature = self._tensor([x.temperature for x in p], torch.float32)
        top_k = self._tensor([x.top_k for x in p], torch.int64)
        top_p = self._tensor([x.top_p for x in p], torch.float32)
        return tuple(t.repeat_interleave(rep) for t in (temperature, top_k, top_p))

    # -- generation --------------------------------------------------------------------

    def _draft(
        self, reqs: list[Request], num_drafts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose drafts by early exit: ``[n, k]`` draft ids and ``[n, k, vocab]`` the
        distributions they were drawn from (zero rows past a request's drafts)."""
        n, k, vocab = len(reqs), self.cfg.num_speculative_tokens, self.cfg.vocab_size
        ids = torch.zeros((n, max(k, 0)), dtype=torch.int64, device=self.device)
        probs = torch.zeros((n, max(k, 0), vocab), device=self.device)
        if not any(num_drafts):
            return ids, probs
        counts = np.asarray(num_drafts)
        current = self._tensor([r.tokens[r.num_computed] for r in reqs], torch.int64)
        slots = self._tensor([r.slot for r in reqs], torch.int64)
        start = self._tensor([r.num_computed for r in reqs], torch.int64)
        for j in range(int(counts.max())):
            active_np = np.nonzero(counts > j)[0]
            active = self._tensor(active_np, torch.int64)
            batch = Batch(
                current[active],
                start[active] + j,
                slots[active],
                torch.ones(len(active_np), dtype=torch.int64, device=self.device),
            )
            hidden = self.model(batch, self.cache, num_layers=self.cfg.draft_layers)
            logits = self.model.logits(hidden)
            temperature, top_k, _ = self._params([reqs[i] for i in active_np], [1] * len(active_np))
            # The drafter samples with temperature and top-k only (top-k 64 where a request
            # has none): see draft_sample.
            top_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, _DRAFT_TOP_K))
            token, q = draft_sample(logits, temperature, top_k, self.generator)
            ids[active, j] = token
            probs[active, j] = q
            current = current.clone()
            current[active] = token
        return ids, probs

    def execute(self, sched: Scheduled) -> tuple[Any, StepResult]:
        """Run one step; returns its async output (for the writer) and its result (for the
        scheduler)."""
        if sched.kind == "pool":
            return self._execute_pooling(sched)
        return self._execute_generate(sched)

    def _execute_generate(self, sched: Scheduled) -> tuple[AsyncArrowOutput, StepResult]:
        reqs, n_tok, n_draft = sched.requests, sched.num_tokens, sched.num_drafts
        n, k, dev = len(reqs), self.cfg.num_speculative_tokens, self.device
        draft_ids, draft_probs = self._draft(reqs, n_draft)
        draft_host = draft_ids.cpu().tolist() if any(n_draft) else None

        # The flattened batch: each request's prefill chunk, or its last token and drafts.
        token_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []  # flattened token index of each logits row
        num_logits: list[int] = []
        prompt_rows: dict[int, tuple[list[int], list[int]]] = {}
        for i, (r, t, d) in enumerate(zip(reqs, n_tok, n_draft)):
            base = len(token_ids)
            pos0 = r.num_computed
            if r.prefilling:
                token_ids += r.tokens[pos0 : pos0 + t]
                # vLLM samples at a chunk's last token even mid-prompt (then discards it).
                sample_rows.append(base + t - 1)
                num_logits.append(1)
                if r.spec.params.prompt_logprobs is not None:
                    # Row for position p scores prompt token p + 1: prompt_len - 1 rows in all.
                    last = min(pos0 + t, r.prompt_len - 1)
                    ps = list(range(pos0, last))
                    prompt_rows[i] = ([base + p - pos0 for p in ps], [r.tokens[p + 1] for p in ps])
            else:
                token_ids.append(r.tokens[pos0])
                if d and draft_host is not None:
                    token_ids += draft_host[i][:d]
                sample_rows += range(base, base + 1 + d)
                num_logits.append(1 + d)
            positions += range(pos0, pos0 + t)
        hidden = self._forward(reqs, token_ids, positions, n_tok)
        logits = self.model.logits(hidden[self._tensor(sample_rows, torch.int64)])

        # NaN faults, counted per request over its rows, then treated as -inf.
        row_req = np.repeat(np.arange(n), num_logits)
        inject = np.array([reqs[i].spec.inject_nans for i in row_req], dtype=bool)
        if inject.any():
            nan_rows = self._tensor(np.nonzero(inject)[0], torch.int64)
            count = int(nan_rows.shape[0]) * _MAX_INJECTED_NANS
            cols = torch.randint(
                0, self.cfg.vocab_size, (count,), generator=self.generator, device=dev
            )
            keep = torch.rand(count, generator=self.generator, device=dev) < 0.5
            keep[::_MAX_INJECTED_NANS] = True  # at least one per row
            logits[nan_rows.repeat_interleave(_MAX_INJECTED_NANS)[keep], cols[keep]] = float("nan")
        per_row_nans = count_nans(logits)
        row_req_t = self._tensor(row_req, torch.int64)
        num_nans = torch.zeros(n, dtype=torch.int32, device=dev).index_add_(
            0, row_req_t, per_row_nans
        )
        logits = logits.nan_to_num(nan=float("-inf"))

        temperature, top_k, top_p = self._params(reqs, num_logits)
        processed = process_logits(logits, temperature, top_k, top_p)
        probs = target_probs(processed, temperature == 0)

        # Verify: target rows padded to [n, k + 1] (rows past a request's own repeat its last).
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_logits, out=cu[1:])
        offs = np.minimum(np.arange(k + 1)[None, :], np.asarray(num_logits)[:, None] - 1)
        padded = probs[self._tensor(cu[:-1, None] + offs, torch.int64)]
        out_ids, num_sampled = rejection_sample(
            padded, draft_probs, draft_ids, self._tensor(n_draft, torch.int64), self.generator
        )
        ends_prompt = self._tensor(
            [not r.prefilling or r.num_computed + t >= r.prompt_len for r, t in zip(reqs, n_tok)],
            torch.bool,
        )
        num_sampled = torch.where(ends_prompt, num_sampled, torch.zeros_like(num_sampled))
        num_rejected = (self._tensor(n_draft, torch.int32) - num_sampled + 1).clamp(min=0)
        num_rejected = torch.where(ends_prompt, num_rejected, torch.zeros_like(num_rejected))

        # Logprobs of every verified position: the sampled token there, or id 0 for the
        # rejected ones (MRv2), from the raw logits.
        logprobs_tensors = None
        wanted = [r.spec.params.logprobs for r in reqs if r.spec.params.logprobs is not None]
        if wanted:
            slot = self._tensor(np.concatenate([np.arange(c) for c in num_logits]), torch.int64)
            row_tok = out_ids[row_req_t, slot]
            sampled_here = slot < num_sampled.to(torch.int64)[row_req_t]
            discarded = ~ends_prompt[row_req_t]  # a mid-prompt row keeps the token it drew
            row_tok = torch.where(sampled_here | discarded, row_tok, torch.zeros_like(row_tok))
            ids, vals, ranks = compute_logprobs(logits, row_tok, max(wanted))
            spec = k > 0
            logprobs_tensors = LogprobsTensors(ids, vals, ranks, cu.tolist() if spec else None)

        masks = None
        if self.cfg.sampling_masks:
            all_k = all(r.spec.params.top_k > 0 for r in reqs)
            max_kept = max(r.spec.params.top_k for r in reqs) if all_k else self.cfg.vocab_size
            masks = SamplingMaskTensors.from_logits(
                processed,
                self._tensor(cu, torch.int64),
                num_sampled,
                max_kept,
                rows_per_request=self.rows_per_request,
            )

        prompt_logprobs: dict[str, Any] = {}
        flat = [j for rows, _ in prompt_rows.values() for j in rows]
        if flat:
            prompt_logits = self.model.logits(hidden[self._tensor(flat, torch.int64)])
            at = 0
            for i, (rows, targets) in prompt_rows.items():
                if not rows:
                    continue  # a last chunk of one token scores nothing
                num = reqs[i].spec.params.prompt_logprobs
                assert num is not None
                ids, vals, ranks = compute_logprobs(
                    prompt_logits[at : at + len(rows)], self._tensor(targets, torch.int64), num
                )
                prompt_logprobs[reqs[i].req_id] = LogprobsTensors(ids, vals, ranks)
                at += len(rows)

        sampler_output = SamplerOutput(
            out_ids, logprobs_tensors, num_nans, num_sampled, num_rejected, masks
        )
        req_ids = [r.req_id for r in reqs]
        mro = ModelRunnerOutput(
            req_ids, {r: i for i, r in enumerate(req_ids)}, prompt_logprobs_dict=prompt_logprobs
        )
        async_output = AsyncArrowOutput(
            mro, sampler_output, num_sampled, pool=self.pool, **self._streams()
        )
        # The scheduler's own copy (vLLM's async scheduling keeps these on the device).
        host_ids = out_ids.cpu().numpy()
        host_n = num_sampled.cpu().numpy()
        result = StepResult()
        for i, (r, t) in enumerate(zip(reqs, n_tok)):
            m = int(host_n[i])
            result.new_tokens.append(host_ids[i, :m].tolist())
            # Prefill: the chunk; decode: the last token and the accepted drafts.
            result.num_computed.append(t if r.prefilling else m)
        return async_output, result

    # -- pooling -----------------------------------------------------------------------

    def _execute_pooling(self, sched: Scheduled) -> tuple[AsyncArrowPoolingOutput, StepResult]:
        reqs, n_tok = sched.requests, sched.num_tokens
        token_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        finished: list[bool] = []
        for r, t in zip(reqs, n_tok):
            pos0 = r.num_computed
            token_ids += r.tokens[pos0 : pos0 + t]
            positions += range(pos0, pos0 + t)
            last_rows.append(len(token_ids) - 1)
            finished.append(pos0 + t >= r.prompt_len)
        hidden = self._forward(reqs, token_ids, positions, n_tok)
        # LAST pooling, normalised: vLLM's default for decoder-only embedding models.
        pooled = torch.nn.functional.normalize(hidden[self._tensor(last_rows, torch.int64)], dim=-1)
        req_ids = [r.req_id for r in reqs]
        mro = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)})
        async_output = AsyncArrowPoolingOutput(
            mro, pooled, finished, pool=self.pool, **self._streams()
        )
        return async_output, StepResult([[] for _ in reqs], list(n_tok))
