"""DeepSeek-V3 MoE: the ``noaux_tc`` router, routed experts and shared experts, one all-reduce.

Router (DeepSeek-V3 paper, section 2.1.2 "auxiliary-loss-free load balancing"; transformers
``DeepseekV3TopkRouter``; DeepSeek ``inference/model.py`` ``Gate``), all in float32 and
replicated, so every rank picks the same experts:

1. ``s = sigmoid(x @ gate.weight.T)``  ``[T, E]``; choice scores ``s + e_score_correction_bias``;
2. group selection: experts form ``n_group`` equal groups; a group's score is the sum of its two
   best choice scores; only experts of the ``topk_group`` best groups stay eligible;
3. the top-``K`` eligible experts by choice score; their weights are ``s`` (no bias), divided by
   their sum (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``.

The routed experts are the shared :class:`~shardsmith.runtime.layers.experts.ExpertBank`
(same bank layout, same SwiGLU ``down(silu(gate x) * up x)``, FP8 blocks dequantized at load or
per use); the shared experts (intermediate ``n_shared_experts * moe_intermediate_size``) are its
:class:`~shardsmith.runtime.models.mixtral.moe.MLP`. Both are split on the intermediate dim, so each
rank's routed and shared partials are added before the layer's single all-reduce.

Legend: T = tokens, D = hidden, E = routed experts, K = experts per token, G = groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.parallel import Shards, all_reduce
from shardsmith.runtime.models.deepseek_v3.config import V3Args
from shardsmith.runtime.layers.experts import ExpertBank, ExpertMath
from shardsmith.runtime.models.common import MLP


class Router(nn.Module):
    """The ``noaux_tc`` gate of one MoE layer: buffers ``weight [E, D]`` and
    ``e_score_correction_bias [E]``, both float32 (the source's BF16 weight is widened at load)."""

    def __init__(self, args: V3Args, shards: Shards, prefix: str) -> None:
        super().__init__()
        E = args.n_experts
        self.top_k, self.n_group, self.topk_group = args.top_k, args.n_group, args.topk_group
        self.scale, self.norm_topk = args.routed_scale, args.norm_topk
        shards.tensor(prefix + ".weight", (E, args.dim))
        shards.tensor(prefix + ".e_score_correction_bias", (E,))
        self.register_buffer("weight", torch.empty(E, args.dim, dtype=torch.float32, device="meta"))
        self.register_buffer("e_score_correction_bias", torch.empty(E, dtype=torch.float32, device="meta"))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, D]`` -> ``(index [T, K] int64, weight [T, K] float32)``."""
        scores = F.linear(x.float(), self.weight).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias  # [T, E]
        if self.n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False).indices, True)
            choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(T, E), float("-inf"))
        index = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [T, K]
        weight = scores.gather(1, index)
        if self.norm_topk:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return index, weight * self.scale


class MoE(nn.Module):
    """Router, routed expert bank and shared experts of layer ``layer`` (``model.layers.N``).

    Raises:
        RuntimeLoadError: the pack has no expert bank for ``layer`` (from ``ExpertBank``).
    """

    def __init__(self, args: V3Args, shards: Shards, layer: str) -> None:
        super().__init__()
        prefix = layer + ".mlp"
        self.top_k = args.top_k
        self.gate = Router(args, shards, prefix + ".gate")
        self.experts = ExpertBank(shards, layer, shards.dtype, top_k=args.top_k, math=ExpertMath(),
                                  formats=("dense", "fp8"), n_experts=args.n_experts,
                                  expert_shape=(args.moe_inter, args.dim),
                                  why=f"the config makes {layer} an MoE layer")
        self.shared_experts = (MLP(shards, prefix + ".shared_experts", dim=args.dim,
                                   inter=args.n_shared * args.moe_inter, reduce=False) if args.n_shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        index, weight = self.gate(x)
        return self.finish(x, self.experts(x, index, weight))

    def finish(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The routed partial ``[T, D]`` plus the shared experts' partial, all-reduced."""
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return all_reduce(routed)
