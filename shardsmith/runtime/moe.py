"""The MoE layer over a rank's expert bank, and the dense / shared-expert MLP.

Routing is replicated (every rank holds the router and picks the same experts); every routed
expert is split on its intermediate dim (TP-within-expert), so each rank computes a partial
``[T, D]`` for every selected expert. The shared expert's partial (Qwen2-MoE) is added before the
layer's single all-reduce.

Bank arrays (``manifests/README.md``; E = experts, I_r = this rank's intermediate share, D = hidden):

=================  ==================  ===================================================
array              shape               contents
=================  ==================  ===================================================
``gate_up``        ``[E, 2*I_r, D]``   rows ``[0, I_r)`` gate (w1), ``[I_r, 2*I_r)`` up (w3)
``down``           ``[E, D, I_r]``     w2 shard
``*_scale``        blocks of the above FP8 ``weight_scale_inv``, stacked the same way
=================  ==================  ===================================================

Routers (sources: transformers ``modeling_mixtral.py``, ``modeling_qwen3_moe.py``,
``modeling_qwen2_moe.py``): softmax over all experts in float32, top-k, then renormalised to sum
to 1 (Mixtral always, Qwen when ``norm_topk_prob``). Legend: T = tokens, D = hidden, E = experts,
K = experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..dtypes import DTYPES
from ..errors import RuntimeLoadError
from .parallel import Shards, all_reduce, dequantize_blocks


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with column-parallel gate/up and row-parallel down.

    Args:
        shards: the rank's plan; prefix: ``model.layers.N.mlp`` or ``....mlp.shared_expert``.
        reduce: all-reduce the output (False: return this rank's partial sum).
    """

    def __init__(self, shards: Shards, prefix: str, *, reduce: bool = True) -> None:
        super().__init__()
        self.gate_proj = shards.linear(prefix + ".gate_proj")
        self.up_proj = shards.linear(prefix + ".up_proj")
        self.down_proj = shards.linear(prefix + ".down_proj", reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertBank(nn.Module):
    """One layer's routed experts on this rank: buffers ``gate_up``, ``down`` (and FP8 scales)."""

    def __init__(self, shards: Shards, layer: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.block = None
        for name in ("gate_up", "down"):
            found = shards.bank_shape(layer, name)
            if found is None:
                raise RuntimeLoadError(f"missing expert bank {layer} {name!r}: the config makes {layer} an MoE layer")
            shape, dt = found
            fp8 = DTYPES[dt].torch_dtype if dt.startswith("F8") else None
            self.register_buffer(name, torch.empty(shape, dtype=fp8 or dtype, device="meta"))
            if fp8 is not None:
                self.block = shards.block
                scale_shape, _ = shards.bank_shape(layer, name + "_scale") or (None, None)
                self.register_buffer(name + "_scale", torch.empty(scale_shape, dtype=torch.float32, device="meta"))

    def _weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert ``e``'s gate ``[I_r, D]``, up ``[I_r, D]`` and down ``[D, I_r]`` in ``dtype``."""
        gu, down = self.gate_up[e], self.down[e]
        i_r = gu.shape[0] // 2
        if self.block is None:
            return gu[:i_r], gu[i_r:], down
        s = self.gate_up_scale[e]
        s_r = s.shape[0] // 2  # gate and up scale rows stacked like their weights
        return (dequantize_blocks(gu[:i_r], s[:s_r], self.block, dtype),
                dequantize_blocks(gu[i_r:], s[s_r:], self.block, dtype),
                dequantize_blocks(down, self.down_scale[e], self.block, dtype))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Partial sum over this rank's intermediate share of the selected experts.

        Args:
            x: ``[T, D]``; index: ``[T, K]`` expert ids; weight: ``[T, K]`` routing weights.

        Returns:
            ``[T, D]`` in ``x.dtype``, to be all-reduced by the caller.
        """
        out = torch.zeros_like(x)
        for e in index.unique().tolist():
            tok, slot = torch.where(index == e)  # [n], [n]
            gate, up, down = self._weights(e, x.dtype)
            h = x[tok]  # [n, D]
            y = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)  # [n, D]
            out.index_add_(0, tok, (y * weight[tok, slot, None]).to(out.dtype))
        return out


class SparseMoe(nn.Module):
    """Router + routed experts (+ Qwen2-MoE shared expert), one all-reduce.

    Args:
        shards: the rank's plan; prefix: ``model.layers.N.block_sparse_moe`` or ``....mlp``;
        layer: bank layer key (``model.layers.N``); top_k: K; norm_topk: renormalise the top-k
        weights; keep_f32_weights: multiply by float32 routing weights (Mixtral) instead of
        casting them to the activation dtype first (Qwen); shared: has a shared expert.
    """

    def __init__(self, shards: Shards, prefix: str, layer: str, *, top_k: int, norm_topk: bool,
                 keep_f32_weights: bool, shared: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.norm_topk, self.keep_f32 = top_k, norm_topk, keep_f32_weights
        self.gate = shards.linear(prefix + ".gate")
        self.experts = ExpertBank(shards, layer, dtype)
        self.shared_expert = MLP(shards, prefix + ".shared_expert", reduce=False) if shared else None
        self.shared_expert_gate = shards.linear(prefix + ".shared_expert_gate") if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weight, index = torch.topk(probs, self.top_k, dim=-1)  # [T, K], [T, K]
        if self.norm_topk:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        if not self.keep_f32:
            weight = weight.to(x.dtype)
        out = self.experts(x, index, weight)  # [T, D] partial
        if self.shared_expert is not None:  # sigmoid(g) * sum_r partial_r == sum_r sigmoid(g) * partial_r
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(out)
