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

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.dtypes import DTYPES
from shardsmith.errors import RuntimeLoadError
from shardsmith.runtime.layers.parallel import Shards, all_reduce, dequantize_blocks
from shardsmith.runtime.layers.staging import rows_by_expert

if TYPE_CHECKING:
    from shardsmith.runtime.models.mixtral.config import ModelArgs


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with column-parallel gate/up and row-parallel down.

    Args:
        shards: the rank's plan; prefix: ``model.layers.N.mlp`` or ``....mlp.shared_expert``.
        dim, inter: D and the global intermediate size (checked against the source).
        reduce: all-reduce the output (False: return this rank's partial sum).
    """

    def __init__(self, shards: Shards, prefix: str, *, dim: int, inter: int, reduce: bool = True) -> None:
        super().__init__()
        self.gate_proj = shards.linear(prefix + ".gate_proj", shape=(inter, dim))
        self.up_proj = shards.linear(prefix + ".up_proj", shape=(inter, dim))
        self.down_proj = shards.linear(prefix + ".down_proj", reduce=reduce, shape=(dim, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# A decode step gathers its experts (no host sync) while their bytes are at most this; past it the
# copy (read + write + read) costs more than the one host sync it saves. Not yet tuned on GPU.
DECODE_GATHER_MAX_BYTES = 64 << 20


class ExpertBank(nn.Module):
    """One layer's routed experts on this rank: buffers ``gate_up``, ``down`` (and FP8 scales)."""

    def __init__(self, shards: Shards, layer: str, dtype: torch.dtype, *, n_experts: int, dim: int, inter: int) -> None:
        super().__init__()
        self.block = None
        for name, expert_shape in (("gate_up", (inter, dim)), ("down", (dim, inter))):
            found = shards.bank_shape(layer, name, expert_shape, n_experts)
            if found is None:
                raise RuntimeLoadError(f"missing expert bank {layer} {name!r}: the config makes {layer} an MoE layer")
            shape, dt = found
            fp8 = DTYPES[dt].torch_dtype if dt.startswith("F8") else None
            self.register_buffer(name, torch.empty(shape, dtype=fp8 or dtype, device="meta"))
            if fp8 is not None:
                self.block = shards.block
                scale_shape, _ = shards.bank_shape(layer, name + "_scale") or (None, None)
                self.register_buffer(name + "_scale", torch.empty(scale_shape, dtype=torch.float32, device="meta"))

    def dequantize_(self, dtype: torch.dtype) -> None:
        """Dequantize FP8 banks to ``dtype`` once (at load); scales are dropped."""
        if self.block is None:
            return
        e = self.gate_up.shape[0]
        parts = [self._weights(i, dtype) for i in range(e)]
        self._buffers["gate_up"] = torch.stack([torch.cat((g, u)) for g, u, _ in parts])  # [E, 2*I_r, D]
        self._buffers["down"] = torch.stack([d for _, _, d in parts])  # [E, D, I_r]
        del self._buffers["gate_up_scale"], self._buffers["down_scale"]
        self.block = None

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

    def decode_sync_free(self, k: int) -> bool:
        """Whether a one-token step over ``k`` experts takes the gathered path (no host sync)."""
        return self.block is None and k * (self.gate_up[0].nbytes + self.down[0].nbytes) <= DECODE_GATHER_MAX_BYTES

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Partial sum over this rank's intermediate share of the selected experts.

        Args:
            x: ``[T, D]``; index: ``[T, K]`` expert ids; weight: ``[T, K]`` routing weights.

        Returns:
            ``[T, D]`` in ``x.dtype``, to be all-reduced by the caller.

        A decode step (``T == 1``) of dense banks whose K experts total at most
        :data:`DECODE_GATHER_MAX_BYTES` gathers them by id on the device (no host sync, so the host
        keeps queueing kernels) and adds them in ascending expert order with the general path's
        kernels. Larger experts take the general path, which needs one host sync (the ids) but
        reads the weights in place: gathering copies them, three times their bytes in memory traffic.
        """
        out = torch.zeros_like(x)
        if x.shape[0] == 1 and self.decode_sync_free(index.shape[1]):
            ids, order = index[0].sort()  # [K] ascending, as the general path adds them
            w = weight[0, order]  # [K]
            gate_up, down = self.gate_up.index_select(0, ids), self.down.index_select(0, ids)  # [K, 2*I_r, D], [K, D, I_r]
            i_r = gate_up.shape[1] // 2
            for k in range(ids.shape[0]):
                y = F.linear(F.silu(F.linear(x, gate_up[k, :i_r])) * F.linear(x, gate_up[k, i_r:]), down[k])  # [1, D]
                out.add_((y * w[k: k + 1, None]).to(out.dtype))  # [1, 1]: promotes like the general path
            return out
        index_h = index.cpu()  # the one host sync: ids -> rows per expert on the host
        experts = index_h.unique().tolist()
        for e, (tok, slot) in rows_by_expert(index_h, experts, x.device).items():  # [n], [n]
            gate, up, down = self._weights(e, x.dtype)
            h = x[tok]  # [n, D]
            y = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)  # [n, D]
            out.index_add_(0, tok, (y * weight[tok, slot, None]).to(out.dtype))
        return out


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
        self.experts = ExpertBank(shards, layer, shards.dtype, n_experts=args.n_experts, dim=args.dim,
                                  inter=args.expert_dim)
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
