"""gpt-oss's MoE block on one rank: a replicated router with bias and the rank's share of every expert.

Every expert is split on its intermediate dim (TP-within-expert, :mod:`shardsmith.plans.gpt_oss`):
the rank holds whole interleaved gate/up pairs and the matching columns of the down projection, so
each rank computes a partial ``[T, D]`` for every selected expert and the layer all-reduces once.
The down bias is not split: it is the MoE block's, added once after the all-reduce, weighted by the
routing weight as the reference adds it inside each expert.

Resident experts are dequantized from MXFP4 once at load (:func:`expand_mxfp4`) to the compute
dtype: simple and exact, but 4x (bf16) the MXFP4 bytes in memory. Offloaded experts
(``--moe-backend``, :func:`~shardsmith.runtime.offload.attach.attach_offload`) stay MXFP4 in host
banks and cache slots (:func:`~shardsmith.pack.banks.stacked_bank_specs`) and are expanded per use;
both run :func:`~shardsmith.runtime.layers.experts.expert_mlp` with this family's
:class:`~shardsmith.runtime.layers.experts.ExpertMath` (:func:`expert_math`), so they compute the
same bits on one device.

==========================  ====================  =================================================
buffer                      shape (rank-local)    contents
==========================  ====================  =================================================
``experts.gate_up_proj``    ``[E, 2*I_r, D]``     row ``2j`` gate channel j, row ``2j+1`` up channel j
``experts.gate_up_proj_bias``  ``[E, 2*I_r]``     split with its rows (column-parallel)
``experts.down_proj``       ``[E, D, I_r]``       row-parallel: partial sums
``down_proj_bias``          ``[E, D]``            whole, on the MoE block; added once after the all-reduce
==========================  ====================  =================================================

Maths (transformers ``GptOssTopKRouter`` / ``GptOssExperts``, OpenAI's gpt-oss ``swiglu``): router
``logits = x W^T + b``, top-k of the logits, softmax over those k; per expert
``gate = min(g, limit)``, ``up = clamp(u, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``.
Legend: T = tokens, D = hidden, E = experts, K = experts per token, I_r = this rank's channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.experts import ExpertMath, RoutedExperts, expert_mlp
from shardsmith.runtime.layers.parallel import Shards, all_reduce
from shardsmith.runtime.layers.quant import dequantize_fp4
from shardsmith.runtime.models.gpt_oss.config import GptOssArgs

MX_BLOCK = 32


def expand_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | str:
    """MXFP4 ``blocks`` uint8 ``[E, N, K/32, 16]`` with E8M0 ``scales`` uint8 ``[E, N, K/32]`` -> ``[E, N, K]``.

    Low nibble first, ``e2m1 * 2^(scale - 127)`` (OCP MX spec; transformers ``integrations/mxfp4.py``);
    exact in bf16 and wider. Returns a message instead when the shapes do not pair up.
    """
    if blocks.dim() != 4 or blocks.shape[-1] != MX_BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        return (f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair up "
                f"(blocks [E, N, K/32, 16], scales [E, N, K/32])")
    e, n, g, b = blocks.shape
    return dequantize_fp4(blocks.reshape(e, n, g * b), scales, dtype)


def expert_math(args: GptOssArgs) -> ExpertMath:
    """gpt-oss's :class:`~shardsmith.runtime.layers.experts.ExpertMath`: the clamp ``limit``, GLU ``alpha``,
    interleaved gate/up rows, each weighted output summed in the activation dtype (as transformers)."""
    return ExpertMath(limit=args.limit, alpha=args.alpha, interleaved=True)


def _local(shards: Shards, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Rank-local shape of source tensor ``name`` whose global shape the config says is ``shape``;
    a missing or mis-shaped tensor is recorded in ``shards.problems`` and ``shape`` returned."""
    tp = shards.tensor(name, shape)
    return tp.local_shape(shards.rank) if tp is not None and tuple(tp.shape) == shape else shape


class Experts(RoutedExperts):
    """One layer's experts resident on this rank (``experts.*`` buffers of the module docstring's table).

    A :class:`~shardsmith.runtime.layers.experts.RoutedExperts` with the defaults: it reads the
    routed ids on the host (not sync-free), so a piecewise decode step runs it between ``ffn_in``
    and ``ffn_out``; no expert cache slots. Offload replaces it (it has a ``math``).
    """

    def __init__(self, args: GptOssArgs, shards: Shards, prefix: str) -> None:
        super().__init__()
        self.math = expert_math(args)
        e, d, i = args.n_experts, args.dim, args.expert_dim
        for proj, rows, cols in (("gate_up_proj", 2 * i, d), ("down_proj", d, i)):
            e_, rows_r, blocks_r, _ = _local(shards, f"{prefix}.{proj}_blocks", (e, rows, cols // MX_BLOCK, MX_BLOCK // 2))
            _local(shards, f"{prefix}.{proj}_scales", (e, rows, cols // MX_BLOCK))
            self.register_buffer(proj, torch.empty((e_, rows_r, blocks_r * MX_BLOCK), dtype=shards.dtype, device="meta"))
        gu_bias = _local(shards, f"{prefix}.gate_up_proj_bias", (e, 2 * i))
        self.register_buffer("gate_up_proj_bias", torch.empty(gu_bias, dtype=shards.dtype, device="meta"))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This rank's partial ``[T, D]`` of the selected experts, without the down bias, summed in
        ascending expert order (as the offloaded experts sum theirs).

        Args:
            x: ``[T, D]``; index: ``[T, K]`` expert ids; weight: ``[T, K]`` routing weights.
        """
        out = self.math.accumulator(x)
        index_h = index.cpu()  # one host sync: the rows of each selected expert
        for e in index_h.unique().tolist():
            tok, slot = (t.to(x.device) for t in torch.where(index_h == e))  # [n], [n]
            y = expert_mlp(x[tok], self.gate_up_proj[e], self.down_proj[e], self.math, self.gate_up_proj_bias[e])
            out.index_add_(0, tok, self.math.contribution(y, weight[tok, slot], x.dtype))
        return out.to(x.dtype)


class MoE(nn.Module):
    """Router, this rank's expert partials (resident or offloaded), one all-reduce, then the down biases once."""

    def __init__(self, args: GptOssArgs, shards: Shards, prefix: str) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.router = shards.linear(prefix + ".router", bias=True, shape=(args.n_experts, args.dim))
        self.experts: RoutedExperts = Experts(args, shards, prefix + ".experts")
        down_bias = _local(shards, f"{prefix}.experts.down_proj_bias", (args.n_experts, args.dim))
        self.register_buffer("down_proj_bias", torch.empty(down_bias, dtype=shards.dtype, device="meta"))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [T, K], weight [T, K])``: top-k router logits, softmax over the k (in ``x.dtype``)."""
        top, index = torch.topk(self.router(x), self.top_k, dim=-1)  # [T, K]
        return index, F.softmax(top, dim=-1, dtype=top.dtype)

    def bias(self, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``sum_k weight[t, k] * down_proj_bias[index[t, k]]``: ``[T, D]``, the same on every rank."""
        return (self.down_proj_bias[index] * weight[..., None]).sum(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        index, weight = self.route(x)
        return all_reduce(self.experts(x, index, weight)) + self.bias(index, weight)
