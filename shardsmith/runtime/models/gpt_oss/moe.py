"""gpt-oss's MoE block on one rank: a replicated router with bias and the rank's share of every expert.

Every expert is split on its intermediate dim (TP-within-expert, :mod:`shardsmith.plans.gpt_oss`):
the rank holds whole interleaved gate/up pairs and the matching columns of the down projection, so
each rank computes a partial ``[T, D]`` for every selected expert and the layer all-reduces once.
The down bias is not split: it is the MoE block's, added once after the all-reduce, weighted by the
routing weight as the reference adds it inside each expert.

Resident experts stay MXFP4 in memory, as the pack holds them (the release's ``<proj>_blocks`` and
``<proj>_scales``: e2m1 codes two to a byte, an E8M0 scale per 32 values), read as an FP4 expert bank
(:meth:`Experts.arrays`): decode-sized steps on CUDA by the fused decode kernel
(:func:`~shardsmith.runtime.layers.kernels.fused_experts`, no host sync), longer ones by
:func:`~shardsmith.runtime.layers.experts.grouped_experts` (on CUDA the
tile kernel decodes them in registers; on a CPU 32 experts at a time are expanded for
``torch._grouped_mm``), or expert by expert (:func:`~shardsmith.runtime.layers.experts.grouped_experts_reference`,
each expert expanded per use) where no grouped path runs (float64). Offloaded experts
(``--moe-backend``, :func:`~shardsmith.runtime.offload.attach.attach_offload`) are the same bytes in
host banks and cache slots (:func:`~shardsmith.pack.banks.stacked_bank_specs`); both compute with this
family's :class:`~shardsmith.runtime.layers.experts.ExpertMath` (:func:`expert_math`).

==============================  ==========================  ===============================================
buffer                          shape (rank-local)          contents
==============================  ==========================  ===============================================
``experts.gate_up_proj_blocks`` ``[E, 2*I_r, D/32, 16]`` u8  row ``2j`` gate channel j, row ``2j+1`` up channel j
``experts.gate_up_proj_scales`` ``[E, 2*I_r, D/32]`` u8      E8M0, one per 32 values of a row
``experts.gate_up_proj_bias``   ``[E, 2*I_r]``               split with its rows (column-parallel)
``experts.down_proj_blocks``    ``[E, D, I_r/32, 16]`` u8    row-parallel: partial sums
``experts.down_proj_scales``    ``[E, D, I_r/32]`` u8
``down_proj_bias``              ``[E, D]``                   whole, on the MoE block; added once after the all-reduce
==============================  ==========================  ===============================================

Maths (transformers ``GptOssTopKRouter`` / ``GptOssExperts``, OpenAI's gpt-oss ``swiglu``): router
``logits = x W^T + b``, top-k of the logits, softmax over those k; per expert
``gate = min(g, limit)``, ``up = clamp(u, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``.
Legend: T = tokens, D = hidden, E = experts, K = experts per token, I_r = this rank's channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.experts import (FUSED_TOKENS_MAX, ExpertMath, RoutedExperts, fused_bank,
                                              grouped_experts, grouped_experts_reference, grouped_runs)
from shardsmith.runtime.layers.parallel import Shards, all_reduce, kernel_on
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
    """One layer's experts resident on this rank, MXFP4 as the pack holds them (the module docstring's table).

    A :class:`~shardsmith.runtime.layers.experts.RoutedExperts`: with the fused kernel (on CUDA,
    :meth:`use_kernel_`) a decode-sized step reads the routed ids on the device (sync-free, so a decode
    step is captured whole); otherwise it reads them on the host, and a piecewise decode step runs it
    between ``ffn_in`` and ``ffn_out``. No expert cache slots. Offload replaces it (it has a ``math``).
    """

    def __init__(self, args: GptOssArgs, shards: Shards, prefix: str) -> None:
        super().__init__()
        self.math, self.top_k = expert_math(args), args.top_k
        e, d, i = args.n_experts, args.dim, args.expert_dim
        for proj, rows, cols in (("gate_up_proj", 2 * i, d), ("down_proj", d, i)):
            blocks = _local(shards, f"{prefix}.{proj}_blocks", (e, rows, cols // MX_BLOCK, MX_BLOCK // 2))
            scales = _local(shards, f"{prefix}.{proj}_scales", (e, rows, cols // MX_BLOCK))
            self.register_buffer(proj + "_blocks", torch.empty(blocks, dtype=torch.uint8, device="meta"))
            self.register_buffer(proj + "_scales", torch.empty(scales, dtype=torch.uint8, device="meta"))
        gu_bias = _local(shards, f"{prefix}.gate_up_proj_bias", (e, 2 * i))
        self.register_buffer("gate_up_proj_bias", torch.empty(gu_bias, dtype=shards.dtype, device="meta"))

    def arrays(self) -> dict[str, torch.Tensor]:
        """The layer's experts as an FP4 expert bank (views, no copy): ``gate_up [E, 2*I_r, D/2]``,
        ``down [E, D, I_r/2]`` uint8 codes with their ``_scale`` E8M0 bytes ``[E, rows, K/32]`` and
        ``gate_up_bias [E, 2*I_r]`` (:func:`~shardsmith.runtime.layers.experts.grouped_experts`' layout)."""
        return {"gate_up": self.gate_up_proj_blocks.flatten(2), "gate_up_scale": self.gate_up_proj_scales,
                "down": self.down_proj_blocks.flatten(2), "down_scale": self.down_proj_scales,
                "gate_up_bias": self.gate_up_proj_bias}

    def use_kernel_(self, device: torch.device) -> None:
        """Run decode-sized steps through :func:`~shardsmith.runtime.layers.kernels.fused_experts` (gpt-oss's
        GLU, the MXFP4 bytes read in place) when ``SHARDSMITH_KERNELS``'s ``fused_experts`` allows on ``device``."""
        self.kernel = kernel_on("fused_experts", device)

    def sync_free(self, tokens: int, k: int | None = None) -> bool:
        """Whether ``tokens`` tokens run with no host sync: the fused kernel's decode-sized steps."""
        return self.kernel and tokens <= FUSED_TOKENS_MAX

    def decode_sync_free(self) -> bool:
        return self.sync_free(1)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This rank's partial ``[T, D]`` of the selected experts, without the down bias.

        A decode-sized step with the kernel (:meth:`sync_free`) is one fused call (each token's pairs
        summed in float32, no host sync); otherwise one host sync, then the experts added in ascending
        expert order per token (as the offloaded experts add theirs).

        Args:
            x: ``[T, D]``; index: ``[T, K]`` expert ids; weight: ``[T, K]`` routing weights.
        """
        if self.sync_free(x.shape[0]):
            return fused_bank(x, index, weight, self.arrays(), self.math, None)
        if grouped_runs(x, "fp4"):
            return grouped_experts(x, index, weight, self.arrays(), self.math)
        return grouped_experts_reference(x, index, weight, self.arrays(), self.math)


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
