"""gpt-oss attention on this rank's heads: GQA with per-head sinks, sliding or full, over per-sequence slots.

Transformers ``modeling_gpt_oss.py`` ``eager_attention_forward`` and OpenAI's reference ``sdpa``
with ``S``: q/k/v/o with biases, scale ``d^-0.5``, every head's learned sink logit joins its
softmax as an extra column that is then dropped (the weights of a row sum to less than 1);
``sliding_attention`` layers (``layer_types``; the even ones in the release) attend to the last
``sliding_window`` positions (``q - k < window``), the others to all. RoPE rotates halves with
YaRN cos/sin tables (:func:`~shardsmith.runtime.models.gpt_oss.config.rope_tables`). RMSNorm
weights stay float32, as transformers keeps them.

The KV cache is one pool of keys and one of values per layer, in blocks that the ``max_num_seqs``
slots hold through their block tables (:mod:`~shardsmith.runtime.models.kv_blocks`): a prefill or
step runs one sequence in its slot (:meth:`Attention.forward`); a batched decode step
(:meth:`Attention.core_rows`) gathers each row's slot and masks the positions its own window and
position exclude.

Legend: B = sequences (rows), T = new tokens, S = cached positions, N = slots, D = hidden,
H = local query heads, K = local KV heads, d = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.parallel import HeadShard, Shards
from shardsmith.runtime.models.gpt_oss.config import GptOssArgs
from shardsmith.runtime.models.seq_slots import Rows


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves: ``x [T, n, d]``, ``cos``/``sin`` ``[T, d/2]`` (YaRN-scaled)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class Attention(nn.Module):
    """This rank's heads with sinks; ``o_proj``'s all-reduce (bias added once after) is its collective."""

    def __init__(self, args: GptOssArgs, shards: Shards, prefix: str, window: int | None) -> None:
        super().__init__()
        self.head_dim, self.window, self.scale = args.head_dim, window, args.head_dim ** -0.5
        q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        before = len(shards.problems)
        self.q_proj = shards.linear(prefix + ".q_proj", bias=True, shape=(q_rows, args.dim))
        self.k_proj = shards.linear(prefix + ".k_proj", bias=True, shape=(kv_rows, args.dim))
        self.v_proj = shards.linear(prefix + ".v_proj", bias=True, shape=(kv_rows, args.dim))
        self.o_proj = shards.linear(prefix + ".o_proj", bias=True, shape=(args.dim, q_rows))
        sinks = shards.tensor(prefix + ".sinks", (args.n_heads,))
        if len(shards.problems) > before:  # the load fails; shapes here do not matter
            heads = HeadShard(args.n_heads, args.n_kv_heads, tuple(range(args.n_heads)))
        else:
            heads = shards.heads(prefix, args.head_dim, args.n_heads // args.n_kv_heads)
        self.n_heads, self.n_kv = heads.n_heads, heads.n_kv_heads
        self.kv_index = torch.tensor(heads.kv_index)  # [H]: the local KV head each query head reads
        n_sinks = sinks.local_shape(shards.rank)[0] if sinks is not None and len(shards.problems) == before else self.n_heads
        self.register_buffer("sinks", torch.empty(n_sinks, dtype=shards.dtype, device="meta"))
        self.cache_k = self.cache_v = None  # [K, P * B, d] pools (P blocks of B positions), set by GptOss.setup_cache
        self.kv = None  # the slots' block tables into them (the model's KVBlocks)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [T, D]`` (normed) -> ``q [T, H, d]``, ``k [T, K, d]`` (RoPE applied) and ``v [T, K, d]``."""
        T, d = x.shape[0], self.head_dim
        q = apply_rope(self.q_proj(x).view(T, self.n_heads, d), cos, sin)  # [T, H, d]
        k = apply_rope(self.k_proj(x).view(T, self.n_kv, d), cos, sin)  # [T, K, d]
        return q, k, self.v_proj(x).view(T, self.n_kv, d)

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """``x [T, D]`` at positions ``[start, start + T)`` of sequence ``slot`` -> ``[T, D]`` (all-reduced,
        ``o_proj`` bias once).

        Writes the new keys and values into the slot's cache, then attends to the cached positions the
        window allows; the softmax runs in the compute dtype, as transformers' eager path does.
        """
        T = x.shape[0]
        q, k, v = self.project(x, cos, sin)
        end = start + T
        written = self.kv.index(slot, start, end, x.device)  # a slice of the pool, or a gather index
        self.cache_k[:, written] = k.transpose(0, 1)
        self.cache_v[:, written] = v.transpose(0, 1)
        lo = max(0, start - self.window + 1) if self.window else 0  # older keys are outside every window
        qpos = torch.arange(start, end, device=x.device)  # [T]
        held = self.kv.index(slot, lo, end, x.device)
        o = self.attend(q.transpose(0, 1)[None], self.cache_k[:, held][None], self.cache_v[:, held][None],
                        qpos[None], lo)[0]  # [H, T, d]
        return self.o_proj(o.transpose(0, 1).reshape(T, self.n_heads * self.head_dim))

    def core_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> torch.Tensor:
        """One token per row, each of its own sequence: ``[B, H*d]`` (before ``o_proj``).

        Real rows write ``k``/``v`` ``[B, K, d]`` at their slot's pool position for their position
        (``rows.kv_write``); every row attends over its slot's positions its window allows up to its own
        (gathered from the pool to ``[B, K, S, d]`` by ``rows.kv_read`` over the positions any row needs,
        the others masked); padding rows get row 0's output.
        """
        R, B = rows.real, q.shape[0]
        self.cache_k[:, rows.kv_write] = k[:R].transpose(0, 1)  # each real row at its slot's block for its position
        self.cache_v[:, rows.kv_write] = v[:R].transpose(0, 1)
        lo = max(0, min(rows.starts) - self.window + 1) if self.window else 0
        read = rows.kv_read[:, lo:]  # [B, S]: each row's slot's positions lo .. length-1 (past its own: masked)
        keys = self.cache_k[:, read].transpose(0, 1)  # [B, K, S, d]
        values = self.cache_v[:, read].transpose(0, 1)
        o = self.attend(q[:, :, None], keys, values, rows.pos[:, None], lo)[:, :, 0]  # [B, H, d]
        return rows.keep_padding(o.reshape(B, self.n_heads * self.head_dim))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, qpos: torch.Tensor, lo: int) -> torch.Tensor:
        """Queries ``q [B, H, T, d]`` at positions ``qpos [B, T]`` over cached ``keys``/``values``
        ``[B, K, S, d]`` at positions ``lo .. lo+S-1``, causal and windowed, sinks joining each
        softmax: ``[B, H, T, d]``."""
        B, H, T, _ = q.shape
        idx = self.kv_index.to(q.device)
        keys, values = keys.index_select(1, idx), values.index_select(1, idx)  # [B, H, S, d]
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scale  # [B, H, T, S]
        kpos = torch.arange(lo, lo + keys.shape[2], device=q.device)[None, None, :]  # [1, 1, S]
        allowed = kpos <= qpos[:, :, None]  # [B, T, S]
        if self.window:
            allowed &= qpos[:, :, None] - kpos < self.window
        scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
        sink = self.sinks.to(scores.dtype)[None, :, None, None].expand(B, -1, T, 1)  # [B, H, T, 1]
        logits = torch.cat((scores, sink), dim=-1)
        probs = F.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]  # drop the sink
        return torch.matmul(probs, values)  # [B, H, T, d]
