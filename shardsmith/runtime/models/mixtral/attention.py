"""Attention of the Mixtral / Qwen3-MoE / Qwen2-MoE family: RMSNorm, rotate-half RoPE, GQA over a
rank's heads with a KV cache in blocks.

The KV cache is one pool ``[K, P * B, d]`` per layer for keys and one for values: this rank's K KV
heads, ``P`` blocks of ``B`` positions shared by every slot through its block table
(:mod:`~shardsmith.runtime.models.kv_blocks`). Sources: transformers ``modeling_mixtral.py`` /
``modeling_qwen3_moe.py`` / ``modeling_qwen2_moe.py`` (RMSNorm in float32, rotate-half RoPE,
SDPA attention). Legend: T = new tokens, S = cached positions, D = hidden, H = local query heads,
K = local KV heads, d = head dim, P = blocks, B = positions per block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.parallel import HeadShard, Shards
from shardsmith.runtime.models.common import RMSNorm, apply_rope, causal_chunk_attention
from shardsmith.runtime.models.kv_blocks import KVBlocks
from shardsmith.runtime.models.mixtral.config import ModelArgs


class Attention(nn.Module):
    """GQA attention over this rank's heads; o_proj's all-reduce is the layer's one collective."""

    def __init__(self, args: ModelArgs, shards: Shards, prefix: str, window: int | None) -> None:
        super().__init__()
        self.head_dim, self.window = args.head_dim, window
        q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        before = len(shards.problems)
        self.q_proj = shards.linear(prefix + ".q_proj", bias=args.qkv_bias, shape=(q_rows, args.dim))
        self.k_proj = shards.linear(prefix + ".k_proj", bias=args.qkv_bias, shape=(kv_rows, args.dim))
        self.v_proj = shards.linear(prefix + ".v_proj", bias=args.qkv_bias, shape=(kv_rows, args.dim))
        self.o_proj = shards.linear(prefix + ".o_proj", bias=args.o_bias, shape=(args.dim, q_rows))
        if len(shards.problems) > before:  # the load fails; shapes here do not matter
            heads = HeadShard(args.n_heads, args.n_kv_heads, tuple(range(args.n_heads)))
        else:
            heads = shards.heads(prefix, args.head_dim, args.n_heads // args.n_kv_heads)
        self.n_heads, self.n_kv = heads.n_heads, heads.n_kv_heads
        group = self.n_heads // self.n_kv if self.n_heads % self.n_kv == 0 else 0
        self.gqa = group > 0 and heads.kv_index == tuple(j // group for j in range(self.n_heads))
        self.kv_index = torch.tensor(heads.kv_index)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, shards.dtype) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, shards.dtype) if args.qk_norm else None
        self.cache_k = self.cache_v = None  # [K, P * B, d] pools, set by Transformer.setup_cache
        self.kv: KVBlocks | None = None  # the block tables (the model's, shared by every layer)

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, slot: int = 0) -> torch.Tensor:
        return self.o_proj(self.core(*self.project(x, cos, sin), start, slot))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``q [T, H, d]``, ``k [T, K, d]`` (normed if Qwen3, RoPE applied) and ``v [T, K, d]``."""
        T, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(T, self.n_heads, d)  # [T, H, d]
        k = self.k_proj(x).view(T, self.n_kv, d)  # [T, K, d]
        v = self.v_proj(x).view(T, self.n_kv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, slot: int = 0) -> torch.Tensor:
        """Write ``k``/``v`` at ``[start, start + T)`` of slot ``slot``'s blocks (the model gave it
        the blocks of ``[0, start + T)``), attend: ``[T, H*d]`` (before ``o_proj``).

        Its shapes grow with the position, so a piecewise decode step runs it eagerly between pieces.
        """
        T, d = q.shape[0], self.head_dim
        end = start + T
        written = self.kv.index(slot, start, end, q.device)  # a slice of the pool, or a gather index
        self.cache_k[:, written] = k.transpose(0, 1)
        self.cache_v[:, written] = v.transpose(0, 1)
        held = self.kv.index(slot, 0, end, q.device)
        keys, values = self.cache_k[:, held], self.cache_v[:, held]  # [K, S, d]: views, or gathered
        if not self.gqa:  # kv-copies shares: map each query head to its local KV head
            idx = self.kv_index.to(keys.device)
            keys, values = keys.index_select(0, idx), values.index_select(0, idx)  # [H, S, d]
        if T > 1 and not self.window and q.is_cuda:  # a prefill chunk: its queries are the last T of the S positions
            # (on a CPU the masked math kernel below, whose rows are bitwise the same however a prompt is cut
            # into chunks or steps: a reused prefix then continues as the whole prompt would)
            o = causal_chunk_attention(q.transpose(0, 1), keys, values, start,
                                       gqa=self.gqa and self.n_kv != self.n_heads)  # [H, T, d]
            return o.transpose(0, 1).reshape(T, self.n_heads * d)
        mask = None
        if T > 1 or self.window:  # causal (within the window on a sliding layer)
            qpos = torch.arange(start, end, device=q.device)[:, None]  # [T, 1]
            kpos = torch.arange(end, device=q.device)[None, :]  # [1, S]
            mask = kpos <= qpos
            if self.window:
                mask &= qpos - kpos < self.window
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                           enable_gqa=self.gqa and self.n_kv != self.n_heads)  # [H, T, d]
        return o.transpose(0, 1).reshape(T, self.n_heads * d)
