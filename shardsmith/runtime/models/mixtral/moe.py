"""The MoE layer over a rank's expert bank, and the dense / shared-expert MLP.

Routing is replicated (every rank holds the router and picks the same experts); every routed
expert is split on its intermediate dim (TP-within-expert), so each rank computes a partial
``[T, D]`` for every selected expert. The shared expert's partial (Qwen2-MoE) is added before the
layer's single all-reduce.

The routed experts are a :class:`~shardsmith.runtime.layers.experts.ExpertBank` (dense or FP8
banks, no SwiGLU clamp, weighted outputs summed in the activation dtype).

Routers (sources: transformers ``modeling_mixtral.py``, ``modeling_qwen3_moe.py``,
``modeling_qwen2_moe.py``): softmax over all experts in float32, top-k, then renormalised to sum
to 1 (Mixtral always, Qwen when ``norm_topk_prob``). Legend: T = tokens, D = hidden, E = experts,
K = experts per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.experts import ExpertBank, ExpertMath
from shardsmith.runtime.layers.parallel import Shards, all_reduce
from shardsmith.runtime.models.common import MLP

if TYPE_CHECKING:
    from shardsmith.runtime.models.mixtral.config import ModelArgs


class SparseMoe(nn.Module):
    """Router + routed experts (+ Qwen2-MoE shared expert), one all-reduce.

    Args:
        shards: the rank's plan; prefix: ``model.layers.N.block_sparse_moe`` or ``....mlp``;
        layer: bank layer key (``model.layers.N``); args: the model config (K, ``norm_topk``,
        sizes, shared expert). Mixtral multiplies by float32 routing weights; Qwen casts them to
        the activation dtype first (as transformers does).
    """

    def __init__(self, shards: Shards, prefix: str, layer: str, args: "ModelArgs") -> None:
        super().__init__()
        self.top_k, self.norm_topk, self.keep_f32 = args.top_k, args.norm_topk, args.family == "mixtral"
        self.gate = shards.linear(prefix + ".gate", shape=(args.n_experts, args.dim))
        self.experts = ExpertBank(shards, layer, shards.dtype, top_k=args.top_k, math=ExpertMath(),
                                  formats=("dense", "fp8"), n_experts=args.n_experts,
                                  expert_shape=(args.expert_dim, args.dim),
                                  why=f"the config makes {layer} an MoE layer")
        shared = args.shared_expert
        self.shared_expert = (MLP(shards, prefix + ".shared_expert", dim=args.dim, inter=args.shared_dim, reduce=False)
                              if shared else None)
        self.shared_expert_gate = shards.linear(prefix + ".shared_expert_gate", shape=(1, args.dim)) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        index, weight = self.route(x)
        return self.finish(x, self.experts(x, index, weight))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [T, K], weight [T, K])``: top-k of the softmaxed router (renormalised if the config says)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weight, index = torch.topk(probs, self.top_k, dim=-1)  # [T, K], [T, K]
        if self.norm_topk:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        if not self.keep_f32:
            weight = weight.to(x.dtype)
        return index, weight

    def finish(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The routed partial ``[T, D]`` plus the shared expert's, all-reduced: the layer's output."""
        out = routed
        if self.shared_expert is not None:  # sigmoid(g) * sum_r partial_r == sum_r sigmoid(g) * partial_r
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(out)
