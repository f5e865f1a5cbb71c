"""A tiny decoder-only transformer with seeded random weights and a slot KV cache.

The demo needs genuine logits at the speed of a unit test, not a good language model: a few
pre-norm layers (multi-head causal attention with learned positions, a GELU MLP), an
untied LM head over a 32k vocabulary, and a KV cache with one fixed slot per running
request, so continuous batching feeds any mix of prefill chunks and decode tokens (several
per request under speculative decoding) in one flattened forward pass, as vLLM does.

The first ``draft_layers`` layers with the final norm and LM head are the speculative
drafter (self-speculation by early exit): they share the target's weights and its KV cache,
whose entries for those layers depend only on the tokens, so the target's verify pass
rewrites them with the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import UnsupportedValueError

__all__ = ["Batch", "KVCache", "ModelConfig", "TinyDecoder"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and initialisation of :class:`TinyDecoder`.

    ``logit_std`` sets the spread of the LM head's logits (their standard deviation over the
    vocabulary), which decides how peaked the next-token distributions are: about 3 gives
    top-p supports of tens to hundreds of tokens over 32k. ``layer_scale`` sets how much each
    layer moves the residual stream; it decides how often the early-exit drafter agrees
    with the full model.
    """

    vocab_size: int = 32768
    d_model: int = 128
    num_layers: int = 3
    num_heads: int = 4
    mlp_ratio: int = 4
    max_model_len: int = 256
    draft_layers: int = 1
    logit_std: float = 3.0
    layer_scale: float = 0.3
    seed: int = 0


class KVCache:
    """Keys and values of every layer: ``[layers, slots, heads, max_model_len, head_dim]``.

    A request holds one slot from admission to its end; position ``p`` of its sequence is
    index ``p`` of its slot.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, device: torch.device) -> None:
        head_dim = cfg.d_model // cfg.num_heads
        shape = (cfg.num_layers, num_slots, cfg.num_heads, cfg.max_model_len, head_dim)
        self.k = torch.zeros(shape, device=device)
        self.v = torch.zeros(shape, device=device)
        self.num_slots = num_slots


@dataclass
class Batch:
    """One forward pass's flattened tokens, grouped by request (requests in order).

    Attributes
    ----------
    token_ids, positions : torch.Tensor
        int64 ``[T]``: the tokens of request 0, then of request 1...; each at its position.
    slots : torch.Tensor
        int64 ``[R]``: the KV slot of each request.
    query_lens : torch.Tensor
        int64 ``[R]``: tokens per request (at least 1); their sum is ``T``.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_lens: torch.Tensor

    def __post_init__(self) -> None:
        r = self.query_lens.shape[0]
        self.req_of_token = torch.repeat_interleave(
            torch.arange(r, device=self.query_lens.device), self.query_lens
        )
        starts = torch.cumsum(self.query_lens, 0) - self.query_lens
        self.index_in_req = (
            torch.arange(self.token_ids.shape[0], device=self.query_lens.device)
            - starts[self.req_of_token]
        )
        # Host ints: shapes of the padded attention tensors.
        self.max_query = int(self.query_lens.max()) if r else 0
        self.max_kv = int(self.positions.max()) + 1 if r else 0


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.num_heads
        self.head_dim = d // cfg.num_heads
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.up = nn.Linear(d, cfg.mlp_ratio * d, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * d, d, bias=False)

    def forward(self, x: torch.Tensor, batch: Batch, k_cache: torch.Tensor, v_cache: torch.Tensor):
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        # New keys and values go into each request's slot at their positions first, so the
        # padded attention below reads the whole prefix (cached and new) from one place.
        slot_of_token = batch.slots[batch.req_of_token]
        k_cache[slot_of_token, :, batch.positions] = k
        v_cache[slot_of_token, :, batch.positions] = v
        r = batch.query_lens.shape[0]
        qp = x.new_zeros((r, batch.max_query, self.num_heads, self.head_dim))
        qp[batch.req_of_token, batch.index_in_req] = q
        keys = k_cache[batch.slots, :, : batch.max_kv]
        values = v_cache[batch.slots, :, : batch.max_kv]
        # Query i of request r sees keys at positions <= its own; padding queries see key 0
        # only (a fully masked row would be NaN) and are discarded.
        qpos = torch.zeros((r, batch.max_query), dtype=torch.int64, device=x.device)
        qpos[batch.req_of_token, batch.index_in_req] = batch.positions
        kpos = torch.arange(batch.max_kv, device=x.device)
        mask = (kpos[None, None, :] <= qpos[:, :, None])[:, None]
        attn = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, values, attn_mask=mask)
        attn = attn.transpose(1, 2)[batch.req_of_token, batch.index_in_req].reshape(t, -1)
        x = x + self.out(attn)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyDecoder(nn.Module):
    """A small decoder-only transformer with seeded random weights.

    Parameters
    ----------
    cfg
        Shape and initialisation; the same config and seed give the same weights on every
        machine (initialised on the CPU, then moved).
    device
        Where the weights live.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if cfg.d_model % cfg.num_heads:
            raise UnsupportedValueError(
                "ModelConfig.d_model",
                f"a multiple of num_heads ({cfg.num_heads})",
                str(cfg.d_model),
            )
        if not 0 < cfg.draft_layers <= cfg.num_layers:
            raise UnsupportedValueError(
                "ModelConfig.draft_layers", f"within 1..{cfg.num_layers}", str(cfg.draft_layers)
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_model_len, cfg.d_model)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        self.to(device)
        self.eval()

    @torch.no_grad()
    def _init_weights(self) -> None:
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed)
        d = cfg.d_model
        self.embed.weight.normal_(0.0, 1.0, generator=g)
        self.pos.weight.normal_(0.0, 0.1, generator=g)
        for block in self.layers:
            assert isinstance(block, _Block)
            block.qkv.weight.normal_(0.0, 1.0 / math.sqrt(d), generator=g)
            block.up.weight.normal_(0.0, 1.0 / math.sqrt(d), generator=g)
            # Output projections scaled so each layer adds ~layer_scale to the stream's std.
            block.out.weight.normal_(0.0, cfg.layer_scale / math.sqrt(d), generator=g)
            block.down.weight.normal_(
                0.0, cfg.layer_scale / math.sqrt(cfg.mlp_ratio * d), generator=g
            )
        # The normed hidden state has unit variance per dimension: logits std = std * sqrt(d).
        self.lm_head.weight.normal_(0.0, cfg.logit_std / math.sqrt(d), generator=g)

    @torch.no_grad()
    def forward(
        self, batch: Batch, cache: KVCache, *, num_layers: int | None = None
    ) -> torch.Tensor:
        """Run ``batch`` through the first ``num_layers`` layers (all by default).

        Writes the batch's keys and values into ``cache`` and returns the final-normed hidden
        states ``[T, d_model]``.
        """
        x = self.embed(batch.token_ids) + self.pos(batch.positions)
        n = self.cfg.num_layers if num_layers is None else num_layers
        for i in range(n):
            x = self.layers[i](x, batch, cache.k[i], cache.v[i])
        return self.norm(x)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab_size]`` of final-normed hidden states."""
        return self.lm_head(hidden).float()
