"""A DeepSeek-V4 decoder layer (:class:`Block`), and the context of a batched decode step (:class:`Step`).

A block is ``hc_attn`` -> attention -> ``hc_ffn`` -> MoE on ``m`` residual streams (transformers
``DeepseekV4DecoderLayer``). Besides its forward (one sequence, ``T`` tokens), it exposes the same
maths as the pieces of a decode step that :class:`~shardsmith.runtime.engine.cuda_graphs.DecodeGraphs`
runs (that module's table): ``attn_in`` and ``ffn_block`` / ``ffn_in`` / ``ffn_out`` are row-wise
(static shapes for a fixed ``B``), ``attn_core`` reads and appends to each row's own slot, with
shapes fixed by ``B`` and the step's length bucket and no host value (:meth:`Block.attn_static`:
``attn_in`` + core as one device-only call, so a whole step can be one CUDA graph).

Legend: T = new tokens, B = rows of a batched decode step (one slot each), m = streams, D = hidden,
n = local heads, d = head dim, K = experts per token, r = rope dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardsmith.runtime.layers.experts import RoutedExperts
from shardsmith.runtime.layers.parallel import Shards, all_reduce
from shardsmith.runtime.models.deepseek_v4.attention import Attention
from shardsmith.runtime.models.deepseek_v4.config import V4Args
from shardsmith.runtime.models.deepseek_v4.hyper import HyperMixer
from shardsmith.runtime.models.deepseek_v4.moe import MoE
from shardsmith.runtime.models.common import RMSNormF32
from shardsmith.runtime.models.deepseek_v4.rows import DecodeRows


class Block(nn.Module):
    """Decoder layer N: ``hc_attn`` -> attention -> ``hc_ffn`` -> MoE, on ``m`` residual streams."""

    def __init__(self, args: V4Args, shards: Shards, i: int, freqs: dict[str, torch.Tensor]) -> None:
        super().__init__()
        prefix = f"layers.{i}"
        self.attn_norm = RMSNormF32(args.dim, args.norm_eps)
        self.attn = Attention(args, shards, prefix + ".attn", i, freqs_main=freqs["main"],
                              freqs_compress=freqs["compress"])
        self.ffn_norm = RMSNormF32(args.dim, args.norm_eps)
        self.ffn = MoE(args, shards, prefix, i)
        self.hc_attn = HyperMixer(args.dim, args.hc_mult, args.hc_iters, args.hc_eps, args.norm_eps)
        self.hc_ffn = HyperMixer(args.dim, args.hc_mult, args.hc_iters, args.hc_eps, args.norm_eps)

    def forward(self, streams: torch.Tensor, ids: torch.Tensor, start: int, slot: int = 0) -> torch.Tensor:  # [T, m, D]
        x, post, comb = self.hc_attn(streams, self.attn_norm)  # x: attn_norm(collapsed)
        streams = self.hc_attn.expand(streams, self.attn(x, start, slot), post, comb)
        x, post, comb = self.hc_ffn(streams, self.ffn_norm)
        return self.hc_ffn.expand(streams, self.ffn(x, ids), post, comb)

    # The same layer as pieces around its attention, for a decode step run piece by piece
    # (engine/cuda_graphs.py's table): the same kernels in the same order as forward, so the same bits.

    @property
    def experts(self) -> RoutedExperts:
        """The routed experts."""
        return self.ffn.experts

    def attn_in_args(self, step: "Step") -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, r/2]``: this layer's RoPE table at each row's own position."""
        return step.rope(self.attn)

    def attn_in(self, streams: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Mixer, norm and attention projections: ``(x [T, D], q [T, n, d], kv [T, d], q_lora, *side, post,
        comb)`` (``side``: the compressors' and indexer's row-wise inputs, :meth:`Attention.project`).

        ``cos``/``sin`` ``[T, r/2]``: this layer's RoPE at the new positions.
        """
        x, post, comb = self.hc_attn(streams, self.attn_norm)
        return (x, *self.attn.project(x, cos, sin), post, comb)

    def attn_core(self, a: tuple[torch.Tensor, ...], step: "Step") -> tuple[torch.Tensor, ...]:
        """The attention core (window, compressor, indexer, softmax) on :meth:`attn_in`'s ``B`` rows:
        ``(attn [B, n, d], cos, sin, post, comb, ids)``, the inputs of the pieces after it
        (:meth:`attn_core_rows` with the step's rows)."""
        return self.attn_core_rows(a, step.ids, step.rows)

    def attn_core_rows(self, a: tuple[torch.Tensor, ...], ids: torch.Tensor, rows: DecodeRows) -> tuple[torch.Tensor, ...]:
        """:meth:`attn_core` on explicit rows: every row attends over (and appends to) its own slot's
        state, padding rows over the scratch slot's; their output is then replaced by row 0's (a fixed
        shape ``where``), so the MoE sees copies of row 0 and routes no extra expert. Device-only."""
        x, q, kv, q_lora, *side, post, comb = a
        out = self.attn.decode_core(q, kv, side, rows)
        out = torch.where(rows.padding[:, None, None], out[:1], out)
        return (out, *rows.rope(self.attn.table), post, comb, ids)

    def attn_static(self, h: torch.Tensor, ids: torch.Tensor, rows: DecodeRows) -> tuple[torch.Tensor, ...]:
        """:meth:`attn_in` then :meth:`attn_core_rows` of streams ``h`` ``[B, m, D]`` (tokens ``ids`` ``[B]``) at
        ``rows``: the same ``(attn [B, n, d], cos, sin, post, comb, ids)`` as :meth:`attn_core`.

        Device-only with shapes fixed by ``(B, rows.key)``: no host value, no host-device copy, no
        data-dependent shape, so the lead's one-graph decode step can capture it with the layer's
        ``ffn_block``; its graph inputs are ``h``, ``ids`` and the rows' tensors
        (:meth:`DecodeRows.as_tuple`), its state the model's preallocated slots.
        """
        return self.attn_core_rows(self.attn_in(h, *rows.rope(self.attn.table)), ids, rows)

    def ffn_in(self, streams: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               post: torch.Tensor, comb: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Attention output projection onto the streams, then the MoE's input, routing and shared partial.

        Args:
            attn: the attention core's ``[T, n, d]``. Returns ``(streams [T, m, D], shared [T, D],
            post, comb, x [T, D], index [T, K], weight [T, K])``: the carry, then the experts' inputs.
        """
        streams = self.hc_attn.expand(streams, self.attn.output(attn, cos, sin), post, comb)
        x, post, comb = self.hc_ffn(streams, self.ffn_norm)
        index, weight = self.ffn.route(x, ids)
        return streams, self.ffn.shared(x), post, comb, x, index, weight

    def ffn_out(self, streams: torch.Tensor, shared: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                x: torch.Tensor, weight: torch.Tensor, routed: torch.Tensor) -> tuple[torch.Tensor]:
        """The layer's one all-reduce (routed + shared partials) spread onto the streams: ``([T, m, D],)``
        (``x`` and ``weight`` are part of the common signature and not needed here)."""
        return (self.hc_ffn.expand(streams, all_reduce(routed + shared), post, comb),)

    def ffn_block(self, streams: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  post: torch.Tensor, comb: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor]:
        """:meth:`ffn_in`, the routed experts, :meth:`ffn_out`: everything after the attention core."""
        streams, shared, post, comb, x, index, weight = self.ffn_in(streams, attn, cos, sin, post, comb, ids)
        return self.ffn_out(streams, shared, post, comb, x, weight, self.ffn.experts(x, index, weight))


@dataclass
class Step:
    """A batched one-token step's context for the layers' pieces (row ``b``: slot ``slots[b]``'s token
    ``ids[b]`` at position ``starts[b]``; rows ``>= real`` are padding, which run in the scratch slot).

    Attributes:
        ids: ``[B]`` token ids; starts / slots: ``B`` host ints; real: rows that are real sequences;
        key: the length bucket ``L`` (:func:`~shardsmith.runtime.models.deepseek_v4.rows.length_bucket`);
        tensors: ``(positions [B], index [B])`` int64 on the device, from one host-to-device copy (padding
        rows: row 0's position, the scratch slot); rows: the step's derived device tensors, each built
        once per step and shared by the layers (:class:`DecodeRows`).
    """

    ids: torch.Tensor
    starts: list[int]
    slots: list[int]
    real: int
    key: int
    tensors: tuple[torch.Tensor, torch.Tensor]
    rows: DecodeRows

    @property
    def positions(self) -> torch.Tensor:
        """``[B]`` int64: each row's position on the device."""
        return self.tensors[0]

    @property
    def index(self) -> torch.Tensor:
        """``[B]`` int64: each row's slot on the device (padding rows: the scratch slot)."""
        return self.tensors[1]

    def rope(self, attn: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, r/2]`` of ``attn``'s table at each row's position (sliding layers share
        ``main``, compressed ones ``compress``)."""
        return self.rows.rope(attn.table)
