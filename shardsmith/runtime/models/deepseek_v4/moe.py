"""DeepSeek-V4 MoE: sqrt-softplus router (or hash routing), FP4 routed experts, one shared expert.

Routing is replicated, so every rank picks the same experts (transformers ``DeepseekV4TopKRouter``
and ``DeepseekV4HashRouter``): ``s = sqrt(softplus(x @ gate.T))``; experts = top-k of
``s + gate.bias`` (or ``gate.tid2eid[token]`` in the first ``num_hash_layers`` layers); weights =
``s`` of those, renormalised, times ``routed_scaling_factor``. With the ``SHARDSMITH_KERNELS=router`` item
on (``auto``: CUDA), a router of up to 16 tokens is one launch
(:func:`~shardsmith.runtime.layers.kernels.router.route_topk`) instead of about 6. Each expert is
``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))`` with ``L = swiglu_limit``; the shared expert
(FP8) is the same with no routing weight.

Every expert is split on its intermediate dim (TP-within-expert), so each rank computes a partial
``[T, D]``; the routed and shared partials are added before the layer's one all-reduce. The
clamps act on whole elements of the rank's intermediate share, so splitting does not change them.

The routed experts are a :class:`~shardsmith.runtime.layers.experts.ExpertBank` of FP4 arrays
(packed, two e2m1 per byte, UE8M0 scales): up to :data:`BATCHED_PAIRS` (token, expert) pairs
(decode) batched per pair with no host sync, more (prefill) expert by expert, float32 sums.

Legend: T = tokens, D = hidden, E = experts, K = experts per token, I_r = local intermediate.
"""

from __future__ import annotations


import torch
from torch import nn

from shardsmith.runtime.layers.experts import ExpertBank, ExpertMath
from shardsmith.runtime.layers.pairs import swiglu
from shardsmith.runtime.layers.kernels.fp8_linear import fp8_linear
from shardsmith.runtime.layers.kernels.router import route_topk, route_topk_reference
from shardsmith import settings
from shardsmith.runtime.layers.parallel import (ColumnParallelLinear, ReplicatedLinear, Shards, all_reduce, kernel_on,
                                                merge_rows)
from shardsmith.runtime.models.deepseek_v4.config import V4Args

BATCHED_PAIRS = 16  # (token, expert) pairs up to which experts are expanded together
ROUTER_TOKENS = 16  # routers of up to this many tokens run route_topk when ``kernel`` is on (decode batches)


class MoE(nn.Module):
    """Router + routed experts + shared expert of layer ``prefix`` (``layers.N.ffn``), one all-reduce."""

    def __init__(self, args: V4Args, shards: Shards, layer: str, index: int) -> None:
        super().__init__()
        prefix = layer + ".ffn"
        self.top_k, self.scale, self.score_func = args.top_k, args.routed_scale, args.score_func
        self.hashed = index < args.n_hash_layers
        self.gate = nn.Module()
        self.gate.register_buffer("weight", torch.empty(args.n_experts, args.dim, dtype=torch.float32, device="meta"))
        if self.hashed:
            self.gate.register_buffer("tid2eid", torch.empty(args.vocab_size, args.top_k, dtype=torch.int64, device="meta"))
        else:
            self.gate.register_buffer("bias", torch.empty(args.n_experts, dtype=torch.float32, device="meta"))
        self.experts = ExpertBank(shards, layer, shards.dtype, top_k=args.top_k, formats=("fp4",),
                                  math=ExpertMath(limit=args.swiglu_limit, accumulate_f32=True,
                                                  batched_pairs=BATCHED_PAIRS),
                                  why="DeepSeek-V4 layers are all MoE")
        self.shared_experts = nn.Module()
        self.shared_experts.w1 = shards.linear(prefix + ".shared_experts.w1")
        self.shared_experts.w3 = shards.linear(prefix + ".shared_experts.w3")
        self.shared_experts.w2 = shards.linear(prefix + ".shared_experts.w2", reduce=False)
        self.limit = args.swiglu_limit
        self.shared_w13 = None  # (weight, scale) of w1 | w3 merged (fuse_projections_)
        self.kernel = False  # up to ROUTER_TOKENS tokens through route_topk (use_kernel_)

    def fuse_projections_(self) -> None:
        """Merge the shared expert's ``w1 [I_r, D]`` and ``w3 [I_r, D]`` (same input, both FP8 kernel
        linears split alike: replicated or column-parallel) into one FP8 weight and scale, so a decode
        step reads both in one :func:`fp8_linear` launch; the linears keep views of their rows. Once the
        weights are final (the model's ``setup_cache``); ``SHARDSMITH_KERNELS=merge_projections=reference`` keeps them
        apart. Equal within float32 summation order (another split-K), not bitwise."""
        se = self.shared_experts
        pair = [se.w1, se.w3]
        if self.shared_w13 is not None or not settings.current().merge_projections:
            return
        if all(type(m) is type(se.w1) and type(m) in (ReplicatedLinear, ColumnParallelLinear) and m.kernel
               and m.bias is None and m.block == se.w1.block and m.weight.shape[0] % m.block[0] == 0
               and m.weight_scale_inv.dtype == se.w1.weight_scale_inv.dtype for m in pair):
            self.shared_w13 = (merge_rows(pair, "weight"), merge_rows(pair, "weight_scale_inv"))

    def route(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [T, K], weight [T, K] float32)`` for ``x`` ``[T, D]`` and token ids ``[T]``: up to
        ``ROUTER_TOKENS`` tokens with ``kernel`` on, :func:`route_topk` (one launch; weights within float32
        rounding of the reference, experts in descending order), else its reference (the same bits as
        before the kernel)."""
        gate = self.gate
        table = {"tid2eid": gate.tid2eid, "ids": ids} if self.hashed else {}
        bias = None if self.hashed else gate.bias
        if self.kernel and x.shape[0] <= ROUTER_TOKENS:
            return route_topk(x, gate.weight, bias, self.top_k, self.score_func, self.scale, **table)
        return route_topk_reference(x, gate.weight, bias, self.top_k, self.score_func, self.scale, **table)

    def use_kernel_(self, device: torch.device) -> None:
        """Route up to ``ROUTER_TOKENS`` tokens through :func:`route_topk` when ``SHARDSMITH_KERNELS=router``
        allows on ``device`` (``auto``: on CUDA; ``off``: :func:`route_topk_reference`, the PyTorch ops)."""
        self.kernel = kernel_on("router_kernel", device)

    def warm_kernel(self, seen: set, *, dtype: torch.dtype) -> int:
        """Route one zero token of ``dtype`` (the activations') through :func:`route_topk`, so its kernel
        compiles before serving (``engine/warmup.py``; token and split counts are not specialised), unless
        a router of the same variant did (``seen``); returns the launches (0 or 1)."""
        gate = self.gate
        key = ("route_topk", self.top_k, self.score_func, dtype,
               tuple((n, tuple(b.shape), b.dtype) for n, b in gate.named_buffers()))
        if key in seen:
            return 0
        seen.add(key)
        dev = gate.weight.device
        self.route(torch.zeros(1, gate.weight.shape[1], dtype=dtype, device=dev),
                   torch.zeros(1, dtype=torch.int64, device=dev))
        return 1

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's partial ``[T, D]`` over this rank's intermediate share (not reduced)."""
        se = self.shared_experts
        if self.shared_w13 is not None:  # w1 | w3 in one launch
            gate, up = fp8_linear(x, *self.shared_w13, se.w1.block, backend="triton").split(
                se.w1.weight.shape[0], dim=-1)
            return se.w2(swiglu(gate, up, self.limit))
        return se.w2(swiglu(se.w1(x), se.w3(x), self.limit))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        index, weight = self.route(x, ids)
        shared = self.shared(x)
        return all_reduce(self.experts(x, index, weight) + shared)
