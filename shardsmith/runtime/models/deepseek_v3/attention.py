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

The cache is one pool per layer in blocks that the sequence slots hold through their block tables
(:mod:`~shardsmith.runtime.models.kv_blocks`): a prefill or step runs in one slot
(:meth:`MLAttention.forward`); a batched decode step (:meth:`MLAttention.core_rows`) gathers each
row's slot.

Legend: B = sequences (rows), T = new tokens, S = cached positions, N = slots, H = local heads, D = hidden,
P = blocks, B (of a pool) = positions per block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.models.deepseek_v3.config import V3Args
from shardsmith.runtime.models.common import RMSNorm, causal_chunk_attention
from shardsmith.runtime.models.seq_slots import Rows
from shardsmith.runtime.models.common import apply_rope as rotate_half_rope

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the default eps in both sources
ABSORB_MODES = ("decode", "always", "never")


def chunk_sdpa(x: torch.Tensor) -> bool:
    """Whether a prefill chunk of ``x`` attends through :func:`causal_chunk_attention` (SDPA's fused causal
    kernels, no ``[T, S]`` mask): on CUDA. On a CPU the masked kernel, whose rows are bitwise the same however
    a prompt is cut into chunks (a reused prefix then continues as the whole prompt would)."""
    return x.is_cuda


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
        cache_kv, cache_pe: the pools ``[P * B, c]`` and ``[P * B, r]`` (P blocks of B positions), set by
            the model's ``setup_cache``; kv: the slots' block tables into them
            (:class:`~shardsmith.runtime.models.kv_blocks.KVBlocks`, the model's).
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
        self.kv = None

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

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [T, D]`` (normed), ``cos``/``sin`` ``[T, r]`` -> ``(q_nope [T, H, n], q_pe [T, H, r],
        latent [T, c], k_pe [T, r])``: RoPE applied, the latent normed (what the cache stores)."""
        T, H = x.shape[0], self.n_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q_nope, q_pe = q.view(T, H, self.nope + self.rope).split((self.nope, self.rope), dim=-1)  # [T, H, n], [T, H, r]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split((self.c, self.rope), dim=-1)  # [T, c], [T, r]
        q_pe = apply_rope(q_pe, cos, sin, self.interleave)
        k_pe = apply_rope(k_pe[:, None], cos, sin, self.interleave)[:, 0]  # [T, r]
        return q_nope, q_pe, self.kv_a_layernorm(latent), k_pe

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """``x [T, D]`` at positions ``[start, start + T)`` of sequence ``slot`` -> ``[T, D]`` (all-reduced
        by ``o_proj``).

        Writes the new latents into the slot's cache; ``cos``/``sin`` ``[T, r]`` are the new positions' tables.
        """
        T, H = x.shape[0], self.n_heads
        q_nope, q_pe, latent, k_pe = self.project(x, cos, sin)
        end = start + T
        written = self.kv.index(slot, start, end, x.device)  # a slice of the pool, or a gather index
        self.cache_kv[written] = latent
        self.cache_pe[written] = k_pe
        held = self.kv.index(slot, 0, end, x.device)
        absorbed = self.absorb == "always" or (self.absorb == "decode" and T == 1)
        if T > 1 and not absorbed and chunk_sdpa(x):  # a prefill chunk's expanded heads: no [T, S] mask
            o = self.expanded(q_nope[None], q_pe[None], self.cache_kv[held][None], self.cache_pe[held][None], None,
                              causal_start=start)[0]  # [T, H, v]
            return self.o_proj(o.reshape(T, H * self.v_dim))
        mask = None
        if T > 1:  # causal; one token sees every cached position
            qpos = torch.arange(start, end, device=x.device)[:, None]
            mask = (torch.arange(end, device=x.device)[None, :] <= qpos)[None]  # [1, T, S]
        o = self.attend(q_nope[None], q_pe[None], self.cache_kv[held][None], self.cache_pe[held][None],
                        mask, absorbed=absorbed)[0]  # [T, H, v]
        return self.o_proj(o.reshape(T, H * self.v_dim))

    def core_rows(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                  rows: Rows) -> torch.Tensor:
        """One token per row, each of its own sequence: ``[B, H*v]`` (before ``o_proj``).

        Real rows write their ``latent [B, c]`` and ``k_pe [B, r]`` at their slot's pool position for their
        position (``rows.kv_write``); every row attends over its slot's positions ``[0, start]`` (gathered
        from the pool to ``[B, S, *]`` by ``rows.kv_read``, later positions masked); padding rows get row 0's output. Absorbed unless ``absorb == "never"``.
        """
        R, B = rows.real, q_nope.shape[0]
        self.cache_kv[rows.kv_write] = latent[:R]  # each real row at its slot's block for its position
        self.cache_pe[rows.kv_write] = k_pe[:R]
        lat = self.cache_kv[rows.kv_read]  # [B, S, c]: each row's slot's positions 0 .. S-1 (past its own: masked)
        pe = self.cache_pe[rows.kv_read]  # [B, S, r]
        mask = (rows.positions(0, q_nope.device)[None, :] <= rows.pos[:, None])[:, None]  # [B, 1, S]
        o = self.attend(q_nope[:, None], q_pe[:, None], lat, pe, mask, absorbed=self.absorb != "never")[:, 0]
        return rows.keep_padding(o.reshape(B, self.n_heads * self.v_dim))

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, pe: torch.Tensor,
               mask: torch.Tensor | None, *, absorbed: bool) -> torch.Tensor:
        """Attention of queries ``q_nope [B, T, H, n]``, ``q_pe [B, T, H, r]`` over cached ``latent
        [B, S, c]`` and ``pe [B, S, r]`` (``mask [B, T, S]``, True: attend; None: all): ``[B, T, H, v]``."""
        return (self.absorbed if absorbed else self.expanded)(q_nope, q_pe, latent, pe, mask)

    def expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, pe: torch.Tensor,
                 mask: torch.Tensor | None, *, causal_start: int | None = None) -> torch.Tensor:
        """Per-head keys/values expanded from the latents by ``kv_b_proj``, then SDPA: ``[B, T, H, v]``.

        ``causal_start``: one sequence (``B = 1``) whose queries sit at ``[causal_start, causal_start + T)``
        of its ``S = causal_start + T`` positions, attended causally without a mask
        (:func:`~shardsmith.runtime.models.common.causal_chunk_attention`; ``mask`` is then None)."""
        B, T, H = q_nope.shape[:3]
        S = latent.shape[1]
        kv = self.kv_b_proj(latent).view(B, S, H, self.nope + self.v_dim)  # [B, S, H, n+v]
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)  # [B, S, H, n], [B, S, H, v]
        k = torch.cat((k_nope, pe[:, :, None].expand(B, S, H, self.rope)), dim=-1)  # [B, S, H, n+r]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [B, T, H, n+r]
        if causal_start is not None:
            o = causal_chunk_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), causal_start,
                                       gqa=False, scale=self.scale)  # [H, T, v]
            return o.transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=None if mask is None else mask[:, None],
                                           scale=self.scale)  # [B, H, T, v]
        return o.transpose(1, 2)

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, pe: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """Attention in the latent space with ``kv_b_proj`` folded into query and output: ``[B, T, H, v]``.

        Scores in the compute dtype, softmax in float32 (DeepSeek ``inference/model.py``).
        """
        H = q_nope.shape[2]
        w = self.kv_b_proj.dense_weight(q_nope.dtype).view(H, self.nope + self.v_dim, self.c)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]  # [H, n, c], [H, v, c]
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # [B, T, H, c]
        scores = (torch.einsum("bthc,bsc->bths", q_lat, latent) + torch.einsum("bthr,bsr->bths", q_pe, pe)) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
        probs = scores.float().softmax(dim=-1).to(q_nope.dtype)  # [B, T, H, S]
        return torch.einsum("bthc,hvc->bthv", torch.einsum("bths,bsc->bthc", probs, latent), w_uv)
