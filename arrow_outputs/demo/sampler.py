"""The demo's sampler: vLLM's semantics in batched torch, on any device.

Every function works on rows of logits (one row per position to sample), each row with its
own request's parameters, and never loops over rows in Python:

- :func:`count_nans` counts the NaNs of each raw logits row;
- :func:`process_logits` applies temperature, top-k and top-p as vLLM does (filtered
  logits become ``-inf``);
- :func:`target_probs` turns processed logits into the distribution sampled from
  (one-hot on the argmax for greedy rows);
- :func:`compute_logprobs` gives the sampled (or prompt) token's logprob and rank and the
  top-k logprobs, from the raw logits (vLLM's default ``logprobs_mode``);
- :func:`rejection_sample` verifies draft tokens against the target distribution
  (speculative decoding), accepting a variable number of them per request.

:class:`SamplerOutput` is Model Runner V2's sampler output, the shape
:class:`~arrow_outputs.AsyncArrowOutput` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Prefix widths _top_p tries before sorting a whole row (top-p alone keeps tens to a few
# thousand of 32k tokens at the demo's temperatures; a full sort costs ~10x a 1024-prefix).
_TOP_P_PREFIXES = (1024, 8192)

__all__ = [
    "SamplerOutput",
    "compute_logprobs",
    "count_nans",
    "draft_sample",
    "process_logits",
    "rejection_sample",
    "sample",
    "target_probs",
]


@dataclass
class SamplerOutput:
    """vLLM 0.33 Model Runner V2's ``SamplerOutput`` (``vllm/v1/worker/gpu/sample/output.py``).

    Attributes
    ----------
    sampled_token_ids
        int64 ``[num_reqs, num_speculative_tokens + 1]``; slots past ``num_sampled`` are -1.
    logprobs_tensors
        :class:`~arrow_outputs.LogprobsTensors` of every logits row, or None when no request
        asked for logprobs.
    num_nans
        int32 ``[num_reqs]``: NaNs in each request's logits rows this step. (MRv2 counts per
        logits row, ``[num_logits]``, and ``get_output`` zips that with the request ids,
        which pairs them right only without speculative rows; one count per request is what
        ``num_nans_in_logits`` means.)
    num_sampled
        int32 ``[num_reqs]``: tokens each request sampled (0 for a prefill chunk that does
        not end its prompt).
    num_rejected
        int32 ``[num_reqs]``: draft tokens rejected.
    sampling_mask_tensors
        :class:`~arrow_outputs.SamplingMaskTensors` or None.
    """

    sampled_token_ids: torch.Tensor
    logprobs_tensors: Any
    num_nans: torch.Tensor | None
    num_sampled: torch.Tensor
    num_rejected: torch.Tensor
    sampling_mask_tensors: Any = None


def count_nans(logits: torch.Tensor) -> torch.Tensor:
    """int32 ``[rows]``: the NaNs of each logits row."""
    return torch.isnan(logits).sum(-1, dtype=torch.int32)


def process_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Temperature, then top-k, then top-p, per row, as vLLM's sampler applies them.

    Parameters
    ----------
    logits
        float32 ``[rows, vocab]`` raw logits, without NaN.
    temperature
        float32 ``[rows]``; rows with 0 (greedy) are not scaled.
    top_k
        int64 ``[rows]``; 0 (or >= vocab) keeps every token. The k-th largest logit's ties
        are kept too (vLLM compares against the k-th value).
    top_p
        float32 ``[rows]``; 1.0 keeps every token. Sorting a row's logits ascending, the
        tokens whose cumulative probability (from the smallest up, theirs included) is
        ``<= 1 - top_p`` are dropped; the largest is always kept (vLLM's
        ``apply_top_k_top_p``).

    Returns
    -------
    torch.Tensor
        float32 ``[rows, vocab]``: the scaled logits, ``-inf`` where filtered.

    Examples
    --------
    >>> x = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    >>> process_logits(x, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    tensor([[-inf, 3., 2., -inf]])
    """
    rows, vocab = logits.shape
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = logits / scale[:, None]
    if rows == 0:
        return x
    has_k = (top_k > 0) & (top_k < vocab)
    if bool(has_k.any()):
        # One topk for every filtered row with the batch's largest k; each row's threshold
        # is its own k-th value (rows without top-k get -inf: nothing dropped).
        kmax = int(top_k[has_k].max())
        kth = x.topk(kmax, dim=-1).values.gather(1, (top_k.clamp(1, kmax) - 1)[:, None])
        kth = torch.where(has_k[:, None], kth, torch.full_like(kth, float("-inf")))
        x = x.masked_fill(x < kth, float("-inf"))
    has_p = top_p < 1.0
    # Rows after top-k hold at most ~k finite logits, the others up to the vocabulary: two
    # groups, so a few unfiltered rows do not make every row sort the whole vocabulary.
    for group in (has_p & has_k, has_p & ~has_k):
        if bool(group.any()):
            idx = group.nonzero()[:, 0]
            x[idx] = _top_p(x[idx], top_p[idx])
    return x


def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's top-p on rows ``x`` (``-inf`` where already filtered), sorting as little as it
    can: a row's kept tokens are the largest ones, so the top ``m`` logits decide it whenever
    the probability outside them is itself droppable (``<= 1 - top_p``: every outside token's
    cumulative sum from below is at most that). Rows that need more try a wider prefix, and
    the last try sorts every finite logit."""
    out = torch.full_like(x, float("-inf"))
    todo = torch.arange(x.shape[0], device=x.device)
    width = int(torch.isfinite(x).sum(-1).max()) if x.shape[0] else 0
    for m in (*(m for m in _TOP_P_PREFIXES if m < width), width):
        if todo.numel() == 0:
            break
        rows, p = x[todo], top_p[todo]
        vals, order = rows.topk(max(m, 1), dim=-1)  # descending
        if m < width:
            # Probability outside the prefix, from the row's normaliser.
            probs = (vals - rows.logsumexp(-1, keepdim=True)).exp()
            outside = (1.0 - probs.sum(-1)).clamp(min=0.0)
            done = outside <= 1.0 - p
        else:
            probs = vals.softmax(-1)
            outside = torch.zeros_like(p)
            done = torch.ones_like(p, dtype=torch.bool)
        # Cumulative probability from the smallest up, in vLLM's summation order.
        from_below = probs.flip(-1).cumsum(-1).flip(-1) + outside[:, None]
        drop = from_below <= (1.0 - p)[:, None]
        drop[:, 0] = False
        kept = vals.masked_fill(drop, float("-inf"))
        idx = done.nonzero()[:, 0]
        out[todo[idx]] = out[todo[idx]].scatter(1, order[idx], kept[idx])
        todo = todo[~done]
    return out


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """int64 ``[rows]``: one token per row of ``probs`` (``[rows, vocab]``, rows summing to
    more than 0; they need not be normalised), by inverting each row's cumulative sum.

    Never returns a token of probability 0: the draw lands where the cumulative sum steps up.

    Examples
    --------
    >>> sample(torch.tensor([[0.0, 0.0, 2.0], [1.0, 0.0, 0.0]])).tolist()
    [2, 0]
    """
    cdf = probs.cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device)
    # The first index whose cumulative sum exceeds u * total: a step up, so a positive prob.
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    return token.clamp_(max=probs.shape[1] - 1)


def target_probs(processed: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows, vocab]``: softmax of the processed logits; one-hot on the argmax for
    greedy rows (so greedy verification is rejection sampling with a one-hot target)."""
    probs = processed.softmax(-1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs)
        onehot.scatter_(1, processed.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def draft_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's proposal: sample from each row's top ``top_k`` logits at its temperature.

    Any draft distribution keeps rejection sampling exact, so the drafter uses a cheap one:
    no top-p (which may sort the vocabulary), and work on ``[rows, max(top_k)]`` candidates
    except for writing the dense distribution the verifier needs.

    Parameters
    ----------
    logits
        float32 ``[rows, vocab]`` draft logits.
    temperature
        float32 ``[rows]``; 0 proposes the argmax.
    top_k
        int64 ``[rows]``, each within ``1..vocab``.
    generator
        Random source.

    Returns
    -------
    tuple of torch.Tensor
        int64 ``[rows]`` draft tokens, and float32 ``[rows, vocab]`` the distributions they
        were drawn from.
    """
    rows, vocab = logits.shape
    kmax = int(top_k.max()) if rows else 1
    vals, ids = logits.topk(kmax, dim=-1)
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    vals = (vals / scale[:, None]).masked_fill(
        torch.arange(kmax, device=logits.device)[None, :] >= top_k[:, None], float("-inf")
    )
    probs = vals.softmax(-1)
    greedy = temperature == 0
    if bool(greedy.any()):
        first = torch.zeros_like(probs)
        first[:, 0] = 1.0  # topk is descending: column 0 is the argmax
        probs = torch.where(greedy[:, None], first, probs)
    choice = sample(probs, generator)
    dense = torch.zeros((rows, vocab), dtype=probs.dtype, device=logits.device)
    dense.scatter_(1, ids, probs)
    return ids.gather(1, choice[:, None])[:, 0], dense


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen tokens' logprobs and ranks, and each row's top ``num_logprobs``.

    Parameters
    ----------
    logits
        float32 ``[rows, vocab]`` raw logits (vLLM's default ``logprobs_mode`` is the raw
        model output, before temperature and filtering).
    token_ids
        int64 ``[rows]``: the sampled (or prompt) token of each row.
    num_logprobs
        Top logprobs per row, after the chosen token's.

    Returns
    -------
    tuple of torch.Tensor
        int64 ids ``[rows, num_logprobs + 1]`` (column 0 the chosen token, then the top ones
        in descending order), their float32 logprobs, and int64 ranks ``[rows]``: the count
        of logprobs ``>=`` the chosen token's (vLLM's ``batched_count_greater_than``), so 1
        for the argmax and ties share the larger rank.

    Examples
    --------
    >>> ids, lps, ranks = compute_logprobs(torch.tensor([[0.0, 2.0, 1.0]]), torch.tensor([2]), 1)
    >>> ids.tolist(), ranks.tolist()
    ([[2, 1]], [2])
    """
    logprobs = logits.log_softmax(-1)
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs >= chosen).sum(-1)
    if num_logprobs:
        top_vals, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat([token_ids[:, None], top_ids], 1)
        vals = torch.cat([chosen, top_vals], 1)
    else:
        ids, vals = token_ids[:, None], chosen
    return ids, vals.float().contiguous(), ranks


def rejection_sample(
    target: torch.Tensor,
    draft: torch.Tensor,
    draft_ids: torch.Tensor,
    num_draft: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative decoding's verification: accept a prefix of each request's drafts.

    Draft ``j`` of a request (drawn from ``draft[r, j]``) is accepted with probability
    ``min(1, target[r, j, d] / draft[r, j, d])`` while every earlier one was; at the first
    rejection a token is drawn from the residual ``max(target - draft, 0)`` (normalised) at
    that position, and when all are accepted a bonus token is drawn from the target after
    the last draft. The tokens then follow the target distribution exactly.

    Parameters
    ----------
    target
        float32 ``[n, k + 1, vocab]``: the target distribution at each verified position
        (rows past ``num_draft[r] + 1`` are ignored).
    draft
        float32 ``[n, k, vocab]``: the distribution each draft token was drawn from.
    draft_ids
        int64 ``[n, k]``: the drafts (slots past ``num_draft[r]`` are ignored).
    num_draft
        int64 ``[n]``: drafts per request, within ``0..k``.
    generator
        Random source (on the tensors' device).

    Returns
    -------
    tuple of torch.Tensor
        int64 ``[n, k + 1]`` output tokens (accepted drafts, then the recovered or bonus
        token, then -1), and int32 ``[n]`` tokens per request (accepted + 1).
    """
    n, k1, _ = target.shape
    k = k1 - 1
    device = target.device
    out = torch.full((n, k1), -1, dtype=torch.int64, device=device)
    if n == 0:
        return out, torch.zeros(0, dtype=torch.int32, device=device)
    if k:
        p_d = target[:, :k].gather(2, draft_ids[:, :, None].clamp(min=0))[:, :, 0]
        q_d = draft.gather(2, draft_ids[:, :, None].clamp(min=0))[:, :, 0]
        u = torch.rand((n, k), generator=generator, device=device)
        # u < p/q without dividing: a draft never has q == 0 where it was drawn.
        ok = (u * q_d < p_d) & (torch.arange(k, device=device)[None, :] < num_draft[:, None])
        accepted = ok.to(torch.int64).cumprod(1).sum(1)
    else:
        accepted = torch.zeros(n, dtype=torch.int64, device=device)
    rows = torch.arange(n, device=device)
    final = target[rows, accepted]
    rejected = accepted < num_draft
    if k and bool(rejected.any()):
        q_at = draft[rows, accepted.clamp(max=k - 1)]
        residual = (final - q_at).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # p == q leaves no residual mass; rejection then had probability 0 (kept as p).
        use = rejected[:, None] & (mass > 0)
        final = torch.where(use, residual / mass.clamp(min=1e-30), final)
    last = sample(final, generator)
    if k:
        keep = torch.arange(k, device=device)[None, :] < accepted[:, None]
        out[:, :k] = torch.where(keep, draft_ids, out[:, :k])
    out[rows, accepted] = last
    return out, (accepted + 1).to(torch.int32)
