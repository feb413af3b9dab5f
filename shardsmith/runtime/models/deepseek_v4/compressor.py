"""KV compressors and the Lightning Indexer of DeepSeek-V4's compressed attention layers.

A compressor turns every ``ratio`` source tokens into one compressed KV entry (paper §2.3,
transformers ``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` / ``DeepseekV4Indexer``):

=============  =====  ===============================  ============================================
layer kind     ratio  projections ``wkv``/``wgate``    entry ``w``
=============  =====  ===============================  ============================================
HCA            128    ``[d, D]``                       ``norm(sum_j softmax_j(Z_j + ape_j) C_j)``
                                                       over the 128 tokens of window ``w``
CSA            4      ``[2d, D]``: series Ca | Cb      the same over 8 slots: Ca of window ``w-1``
(overlap)                                              and Cb of window ``w``
=============  =====  ===============================  ============================================

Entry ``w`` gets RoPE (the compressed-layer RoPE) at position ``w * ratio`` and is visible to a
query at position ``t`` iff ``w < (t + 1) // ratio`` (its window is complete). Tokens of an
incomplete window wait in a buffer, and a CSA compressor keeps the last complete window's Ca
slots: both carried across decode steps. All projections here are replicated.

Legend: T = new tokens, D = hidden, d = entry dim, C = compressed entries so far, r = ratio,
h = indexer heads, k = top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.models.deepseek_v4.ops import RMSNorm, apply_rope, rope_cos_sin


class Compressor(nn.Module):
    """One compressor and its running state (batch 1).

    Args:
        shards: the rank's plan; prefix: ``layers.N.attn.compressor`` or
            ``layers.N.attn.indexer.compressor``; ratio: r; dim: d; overlap: CSA's two series.
        freqs: compressed-layer RoPE inverse frequencies ``[rope_dim/2]``; eps: norm epsilon.
    """

    def __init__(self, shards: Shards, prefix: str, *, ratio: int, dim: int, overlap: bool,
                 freqs: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.ratio, self.dim, self.overlap, self.freqs = ratio, dim, overlap, freqs
        width = (2 if overlap else 1) * dim
        self.wkv = shards.linear(prefix + ".wkv")
        self.wgate = shards.linear(prefix + ".wgate")
        self.register_buffer("ape", torch.empty(ratio, width, dtype=torch.float32, device="meta"))
        self.norm = RMSNorm(dim, eps)
        self.reset()

    def reset(self) -> None:
        """Forget every token (a new sequence starts at position 0)."""
        self.buf_kv = self.buf_gate = None  # [<r, width]: tokens of the incomplete window
        self.prev_kv = self.prev_gate = None  # [r, d]: Ca of the last complete window (CSA)
        self.entries = None  # [C, d]
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Take new tokens ``x`` ``[T, D]`` (in order, continuing the sequence); return all entries ``[C, d]``."""
        kv, gate = self.wkv(x), self.wgate(x)  # [T, width]
        if self.buf_kv is not None:
            kv, gate = torch.cat((self.buf_kv, kv)), torch.cat((self.buf_gate, gate))
        r, d = self.ratio, self.dim
        usable = kv.shape[0] // r * r
        self.buf_kv, self.buf_gate = kv[usable:], gate[usable:]
        if self.entries is None:
            self.entries = kv.new_zeros(0, d)
        if usable == 0:
            return self.entries
        n = usable // r
        kv = kv[:usable].view(n, r, -1)  # [n, r, width]
        gate = gate[:usable].view(n, r, -1) + self.ape  # float32
        if self.overlap:
            kv, gate = self._overlap(kv, gate)  # [n, 2r, d]
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        entry = self.norm((kv * weights).sum(dim=1))  # [n, d]
        positions = torch.arange(n, device=x.device) * r + self.count * r
        entry = apply_rope(entry, *rope_cos_sin(positions, self.freqs))
        self.entries = torch.cat((self.entries, entry))
        self.count += n
        return self.entries

    def _overlap(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Lay series Ca of window ``w-1`` and Cb of window ``w`` side by side: ``[n, 2r, d]``."""
        n, r, d = kv.shape[0], self.ratio, self.dim
        okv = kv.new_zeros(n, 2 * r, d)
        ogate = gate.new_full((n, 2 * r, d), float("-inf"))  # empty slots weigh 0
        okv[:, r:], ogate[:, r:] = kv[..., d:], gate[..., d:]
        okv[1:, :r], ogate[1:, :r] = kv[:-1, :, :d], gate[:-1, :, :d]
        if self.prev_kv is not None:
            okv[0, :r], ogate[0, :r] = self.prev_kv, self.prev_gate
        self.prev_kv, self.prev_gate = kv[-1, :, :d].clone(), gate[-1, :, :d].clone()
        return okv, ogate


def visible(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """``[T, C]`` bool: entry ``w`` is complete for the query at ``positions[t]``."""
    return torch.arange(n_entries, device=positions.device)[None, :] < ((positions + 1) // ratio)[:, None]


class Indexer(nn.Module):
    """Lightning Indexer: picks the top-``k`` compressed entries per query for CSA layers.

    ``score[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s]) / sqrt(c)`` with ``w = weights_proj(x) /
    sqrt(h)``, ``q = wq_b(q_lora)`` (compressed-layer RoPE at the query position) and ``K`` its own
    overlap compressor at ``index_head_dim`` (paper §2.3.1 eqs. 13-17).
    """

    def __init__(self, shards: Shards, prefix: str, *, ratio: int, heads: int, head_dim: int, topk: int,
                 freqs: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.ratio, self.heads, self.head_dim, self.topk, self.freqs = ratio, heads, head_dim, topk, freqs
        self.compressor = Compressor(shards, prefix + ".compressor", ratio=ratio, dim=head_dim, overlap=True,
                                     freqs=freqs, eps=eps)
        self.wq_b = shards.linear(prefix + ".wq_b")
        self.weights_proj = shards.linear(prefix + ".weights_proj")

    def forward(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Selection mask ``[T, C]`` bool over all compressed entries (causal and top-k).

        Args:
            x: ``[T, D]`` attention input; q_lora: ``[T, q_lora_rank]`` normed query latent;
            positions: ``[T]`` absolute positions.
        """
        keys = self.compressor(x)  # [C, c]
        T, C = x.shape[0], keys.shape[0]
        if C == 0:
            return torch.zeros(T, 0, dtype=torch.bool, device=x.device)
        q = self.wq_b(q_lora).view(T, self.heads, self.head_dim)  # [T, h, c]
        q = apply_rope(q, *rope_cos_sin(positions, self.freqs))
        scores = F.relu(torch.einsum("thc,sc->ths", q.float(), keys.float())) * self.head_dim ** -0.5
        w = self.weights_proj(x).float() * self.heads ** -0.5  # [T, h]
        score = (scores * w[..., None]).sum(dim=1)  # [T, C]
        causal = visible(positions, C, self.ratio)
        top = score.masked_fill(~causal, float("-inf")).topk(min(self.topk, C), dim=-1).indices  # [T, k]
        picked = torch.zeros(T, C, dtype=torch.bool, device=x.device).scatter_(1, top, True)
        return picked & causal
