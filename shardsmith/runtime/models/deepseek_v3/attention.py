"""Multi-head latent attention (MLA, DeepSeek-V2/V3 papers) over this rank's heads, with a latent KV cache.

Projections (global shapes; H heads, c = ``kv_lora_rank``, n/r/v = nope/rope/value head dims):

=======================  ==================  ==================  =========================================
module                   weight              layout              role
=======================  ==================  ==================  =========================================
``q_a_proj``             ``[q_lora, D]``     replicated          query latent (then ``q_a_layernorm``)
``q_b_proj``/``q_proj``  ``[H*(n+r), *]``    column, by heads    per-head ``[q_nope | q_rope]``
``kv_a_proj_with_mqa``   ``[c + r, D]``      replicated          KV latent (then ``kv_a_layernorm``) and
                                                                 the one shared RoPE key
``kv_b_proj``            ``[H*(n+v), c]``    column, by heads    per-head ``[k_nope | value]`` from latent
``o_proj``               ``[D, H*v]``        row, by heads       partial sums, one all-reduce
=======================  ==================  ==================  =========================================

The cache keeps, per position, the normed latent ``[c]`` and the rotated shared key ``[r]``
(``c + r`` values per token per layer, shared by every head of the rank and the same on every rank).
Two equivalent ways to attend over it:

- *expanded* (prefill; transformers ``DeepseekV3Attention``): ``kv_b_proj`` turns every cached
  latent into per-head keys and values, then causal SDPA;
- *absorbed* (decode; DeepSeek-V3 ``inference/model.py`` ``MLA`` with ``attn_impl="absorb"``):
  ``W_UK`` (the key rows of ``kv_b_proj``) is folded into the query, scores are taken against the
  latents directly, and ``W_UV`` (the value rows) is applied to the attended latent:
  ``score = (q_nope W_UK) . latent + q_rope . k_rope``, ``out = (softmax(score) @ latent) W_UV^T``.

Legend: T = new tokens, S = cached positions, H = local heads, D = hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.models.deepseek_v3.config import V3Args
from shardsmith.runtime.models.mixtral.model import RMSNorm
from shardsmith.runtime.models.mixtral.model import apply_rope as rotate_half_rope

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the default eps in both sources
ABSORB_MODES = ("decode", "always", "never")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on ``x [T, n, r]`` with ``cos``/``sin`` ``[T, r]`` (frequencies duplicated).

    ``interleave``: pairs ``(x0, x1), (x2, x3) ...`` each rotated by one frequency, the result laid
    out as halves (transformers ``apply_rotary_pos_emb_interleave``; queries and keys alike, so the
    dot products are DeepSeek's complex-number RoPE's). Otherwise rotate-half.
    """
    if not interleave:
        return rotate_half_rope(x, cos, sin)
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, r/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class MLAttention(nn.Module):
    """MLA of layer ``prefix`` (``model.layers.N.self_attn``) on this rank's whole heads.

    Attributes:
        n_heads: local heads (from ``q_b_proj``'s rows; ``kv_b_proj`` and ``o_proj`` must agree).
        absorb: ``decode`` (absorbed for one-token steps, expanded otherwise), ``always`` or ``never``.
        cache_kv, cache_pe: ``[S_max, c]`` and ``[S_max, r]``, set by the model's ``setup_cache``.
    """

    def __init__(self, args: V3Args, shards: Shards, prefix: str) -> None:
        super().__init__()
        self.nope, self.rope, self.v_dim, self.c = args.qk_nope_dim, args.qk_rope_dim, args.v_head_dim, args.kv_lora_rank
        self.interleave, self.scale, self.absorb = args.rope_interleave, args.softmax_scale, "decode"
        H, D, qk = args.n_heads, args.dim, args.qk_nope_dim + args.qk_rope_dim
        if args.q_lora_rank:
            self.q_a_proj = shards.linear(prefix + ".q_a_proj", shape=(args.q_lora_rank, D))
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS, shards.dtype)
            self.q_b_proj = shards.linear(prefix + ".q_b_proj", shape=(H * qk, args.q_lora_rank))
            q_name = prefix + ".q_b_proj.weight"
        else:
            self.q_proj = shards.linear(prefix + ".q_proj", shape=(H * qk, D))
            q_name = prefix + ".q_proj.weight"
        self.kv_a_proj_with_mqa = shards.linear(prefix + ".kv_a_proj_with_mqa", shape=(self.c + self.rope, D))
        self.kv_a_layernorm = RMSNorm(self.c, LATENT_NORM_EPS, shards.dtype)
        self.kv_b_proj = shards.linear(prefix + ".kv_b_proj", shape=(H * (self.nope + self.v_dim), self.c))
        self.o_proj = shards.linear(prefix + ".o_proj", shape=(D, H * self.v_dim))
        self.n_heads = self._local_heads(shards, q_name, prefix, H, qk)
        self.cache_kv = self.cache_pe = None

    def _local_heads(self, shards: Shards, q_name: str, prefix: str, H: int, qk: int) -> int:
        """This rank's head count, checked across the three head-split projections (problems recorded)."""
        tq = shards.plan.tensors.get(q_name)
        if tq is None or tuple(tq.shape) != (H * qk, tq.shape[1]):
            return H  # already recorded as missing / mis-shaped
        rows = tq.local_shape(shards.rank)[0]
        n = rows // qk
        if rows % qk:
            shards.problems.append(f"tensor {q_name!r}: rank {shards.rank} holds {rows} rows, not whole heads of {qk}")
        want = {prefix + ".kv_b_proj.weight": (0, n * (self.nope + self.v_dim)),
                prefix + ".o_proj.weight": (1, n * self.v_dim)}
        for name, (dim, size) in want.items():
            t = shards.plan.tensors.get(name)
            if t is not None and t.local_shape(shards.rank)[dim] != size:
                shards.problems.append(f"tensor {name!r}: rank {shards.rank} holds {t.local_shape(shards.rank)[dim]} "
                                       f"along dim {dim}, {n} whole heads need {size} (heads must be split alike "
                                       f"in q_b_proj, kv_b_proj and o_proj)")
        return n

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, D]`` at positions ``[start, start + T)`` -> ``[T, D]`` (all-reduced by ``o_proj``).

        Writes the new latents into the cache; ``cos``/``sin`` ``[T, r]`` are the new positions' tables.
        """
        T, H = x.shape[0], self.n_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q_nope, q_pe = q.view(T, H, self.nope + self.rope).split((self.nope, self.rope), dim=-1)  # [T, H, n], [T, H, r]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split((self.c, self.rope), dim=-1)  # [T, c], [T, r]
        q_pe = apply_rope(q_pe, cos, sin, self.interleave)
        k_pe = apply_rope(k_pe[:, None], cos, sin, self.interleave)[:, 0]  # [T, r]
        end = start + T
        self.cache_kv[start:end] = self.kv_a_layernorm(latent)
        self.cache_pe[start:end] = k_pe
        absorbed = self.absorb == "always" or (self.absorb == "decode" and T == 1)
        o = (self.absorbed if absorbed else self.expanded)(q_nope, q_pe, start)  # [T, H, v]
        return self.o_proj(o.reshape(T, H * self.v_dim))

    def _mask(self, start: int, T: int, device: torch.device) -> torch.Tensor | None:
        """``[T, S]`` causal mask (True: attend), None for one token (it sees every cached position)."""
        if T == 1:
            return None
        qpos = torch.arange(start, start + T, device=device)[:, None]
        return torch.arange(start + T, device=device)[None, :] <= qpos

    def expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, start: int) -> torch.Tensor:
        """Attention with per-head keys/values expanded from the cached latents: ``[T, H, v]``."""
        T, H = q_nope.shape[:2]
        end = start + T
        kv = self.kv_b_proj(self.cache_kv[:end]).view(end, H, self.nope + self.v_dim)  # [S, H, n+v]
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)  # [S, H, n], [S, H, v]
        k = torch.cat((k_nope, self.cache_pe[:end, None].expand(end, H, self.rope)), dim=-1)  # [S, H, n+r]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, n+r]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=self._mask(start, T, q.device), scale=self.scale)  # [H, T, v]
        return o.transpose(0, 1)

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, start: int) -> torch.Tensor:
        """Attention in the latent space with ``kv_b_proj`` folded into query and output: ``[T, H, v]``.

        Scores in the compute dtype, softmax in float32 (DeepSeek ``inference/model.py``).
        """
        T, H = q_nope.shape[:2]
        end = start + T
        w = self.kv_b_proj.dense_weight(q_nope.dtype).view(H, self.nope + self.v_dim, self.c)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]  # [H, n, c], [H, v, c]
        latent, pe = self.cache_kv[:end], self.cache_pe[:end]  # [S, c], [S, r]
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # [T, H, c]
        scores = (torch.einsum("thc,sc->ths", q_lat, latent) + torch.einsum("thr,sr->ths", q_pe, pe)) * self.scale
        mask = self._mask(start, T, scores.device)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        probs = scores.float().softmax(dim=-1).to(q_nope.dtype)  # [T, H, S]
        return torch.einsum("thc,hvc->thv", torch.einsum("ths,sc->thc", probs, latent), w_uv)
