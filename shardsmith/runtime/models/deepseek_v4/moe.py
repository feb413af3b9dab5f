"""DeepSeek-V4 MoE: sqrt-softplus router (or hash routing), FP4 routed experts, one shared expert.

Routing is replicated, so every rank picks the same experts (transformers ``DeepseekV4TopKRouter``
and ``DeepseekV4HashRouter``): ``s = sqrt(softplus(x @ gate.T))``; experts = top-k of
``s + gate.bias`` (or ``gate.tid2eid[token]`` in the first ``num_hash_layers`` layers); weights =
``s`` of those, renormalised, times ``routed_scaling_factor``. Each expert is
``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))`` with ``L = swiglu_limit``; the shared expert
(FP8) is the same with no routing weight.

Every expert is split on its intermediate dim (TP-within-expert), so each rank computes a partial
``[T, D]``; the routed and shared partials are added before the layer's one all-reduce. The
clamps act on whole elements of the rank's intermediate share, so splitting does not change them.

Bank arrays (``manifests/README.md``; FP4 stays packed, two e2m1 per byte):

=================  ======================  =========================================
array              shape (rank-local)      contents
=================  ======================  =========================================
``gate_up``        ``[E, 2*I_r, D/2]`` I8   rows ``[0, I_r)`` w1, ``[I_r, 2*I_r)`` w3
``gate_up_scale``  ``[E, 2*I_r, D/32]``     UE8M0, stacked the same way
``down``           ``[E, D, I_r/2]`` I8     w2 shard
``down_scale``     ``[E, D, I_r/32]``       UE8M0
=================  ======================  =========================================

Legend: T = tokens, D = hidden, E = experts, K = experts per token, I_r = local intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.dtypes import DTYPES
from shardsmith.errors import RuntimeLoadError
from shardsmith.runtime.layers.parallel import Shards, all_reduce
from shardsmith.runtime.layers.staging import rows_by_expert
from shardsmith.runtime.models.deepseek_v4.config import V4Args
from shardsmith.runtime.layers.quant import dequantize_fp4

ARRAYS = ("gate_up", "gate_up_scale", "down", "down_scale")
BATCHED_PAIRS = 16  # (token, expert) pairs up to which experts are expanded together


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` (no clamp when ``L`` is 0)."""
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def expert_swiglu(arrays: dict[str, torch.Tensor], x: torch.Tensor, limit: float) -> torch.Tensor:
    """One FP4 expert on its token rows: ``x [n, D] -> [n, D]`` in ``x.dtype``.

    Args:
        arrays: the expert's ``gate_up [2*I_r, D/2]`` I8, ``gate_up_scale [2*I_r, D/32]``,
            ``down [D, I_r/2]``, ``down_scale [D, I_r/32]``; limit: SwiGLU clamp.

    Shared by the resident bank and offloaded experts (slots or host banks): the same bits.
    """
    gate_up = dequantize_fp4(arrays["gate_up"], arrays["gate_up_scale"], x.dtype)  # [2*I_r, D]
    down = dequantize_fp4(arrays["down"], arrays["down_scale"], x.dtype)  # [D, I_r]
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [n, I_r] each
    return F.linear(swiglu(gate, up, limit), down)


def expand_pairs(arrays: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered FP4 experts, one per (token, expert) pair, expanded: ``gate_up [P, 2*I_r, D]`` and
    ``down [P, D, I_r]`` in ``dtype``.

    Args:
        arrays: ``gate_up [P, 2*I_r, D/2]`` I8, ``gate_up_scale [P, 2*I_r, D/32]``,
            ``down [P, D, I_r/2]``, ``down_scale [P, D, I_r/32]``.
    """
    return (dequantize_fp4(arrays["gate_up"], arrays["gate_up_scale"], dtype),
            dequantize_fp4(arrays["down"], arrays["down_scale"], dtype))


def apply_pairs(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, limit: float) -> torch.Tensor:
    """``[P, D]`` outputs of expanded experts (:func:`expand_pairs`) on each pair's token row ``x [P, D]``.

    Two batched matmuls over all P pairs. Shared by the resident bank and the offloaded experts'
    decode path: the same inputs in the same order give the same bits on any device.
    """
    gate, up = torch.bmm(gate_up, x[:, :, None]).squeeze(-1).chunk(2, dim=-1)  # [P, I_r] each
    return torch.bmm(down, swiglu(gate, up, limit)[..., None]).squeeze(-1)  # [P, D]


def combine_pairs(y: torch.Tensor, weight: torch.Tensor, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's routed sum ``[T, D]`` in ``dtype`` from its pairs' outputs ``y [P = T*K, D]``
    (token-major, as :func:`apply_pairs` gets them) and routing weights ``weight [P]``.

    A float32 sum over the K pairs of each token: a reduction in a fixed order on CPU and CUDA
    (``index_add_`` with repeated rows is atomic, so run-to-run nondeterministic, on CUDA), so the
    resident bank, the offloaded slots and a captured graph give the same bits.
    """
    return (y.float() * weight[:, None]).view(tokens, -1, y.shape[-1]).sum(dim=1).to(dtype)


def routed_pairs(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 limit: float) -> torch.Tensor:
    """Each token's routed sum ``[T, D]`` (``x.dtype``) from its pairs' expanded experts.

    Args:
        gate_up: ``[P = T*K, 2*I_r, D]``, down: ``[P, D, I_r]`` (:func:`expand_pairs`), token-major;
        x: ``[T, D]``; weight: ``[T, K]`` float32 routing weights; limit: SwiGLU clamp.

    :func:`apply_pairs` on each pair's token row, then :func:`combine_pairs`: the one pair path of
    the resident bank, the offloaded slots and the captured decode piece.
    """
    T, K = weight.shape
    tok = torch.arange(T, device=x.device).repeat_interleave(K)  # [P]
    return combine_pairs(apply_pairs(gate_up, down, x[tok], limit), weight.flatten(), T, x.dtype)


class ExpertBank(nn.Module):
    """One layer's routed experts on this rank, FP4 weights expanded one expert at a time.

    Raises:
        RuntimeLoadError: the plan has no bank for ``layer`` or it is not FP4 (I8 + UE8M0).
    """

    def __init__(self, shards: Shards, layer: str, limit: float) -> None:
        super().__init__()
        self.limit = limit
        for name in ARRAYS:
            found = shards.bank_shape(layer, name)
            if found is None:
                raise RuntimeLoadError(f"missing expert bank {layer} {name!r}: DeepSeek-V4 layers are all MoE")
            shape, dt = found
            if dt != ("F8_E8M0" if name.endswith("_scale") else "I8"):
                raise RuntimeLoadError(f"expert bank {layer} {name!r}: dtype {dt}; this runtime runs FP4 experts "
                                       "(I8 packed e2m1 with F8_E8M0 scales)")
            self.register_buffer(name, torch.empty(shape, dtype=DTYPES[dt].torch_dtype, device="meta"))

    @staticmethod
    def decode_sync_free(pairs: int) -> bool:
        """Whether a step of ``pairs`` (token, expert) pairs takes the batched path (no host sync)."""
        return pairs <= BATCHED_PAIRS

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Partial sum ``[T, D]`` of the selected experts over this rank's intermediate share.

        Up to :data:`BATCHED_PAIRS` (token, expert) pairs (decode) each pair's expert is gathered by
        its id on the device, expanded and applied with two batched matmuls: no host sync, so the
        host keeps queueing kernels. More pairs (prefill) go expert by expert after one host sync
        (the ids), so at most one expert is expanded at a time.

        Args:
            x: ``[T, D]``; index: ``[T, K]`` expert ids; weight: ``[T, K]`` float32 routing weights.
        """
        T, K = index.shape
        if self.decode_sync_free(T * K):
            sel = index.flatten()  # [P] expert of each pair, on the device
            return routed_pairs(*expand_pairs({a: getattr(self, a)[sel] for a in ARRAYS}, x.dtype), x, weight,
                                self.limit)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        index_h = index.cpu()  # the one sync
        for e, (tok, k) in rows_by_expert(index_h, index_h.unique().tolist(), x.device).items():  # [n], [n]
            y = expert_swiglu({a: getattr(self, a)[e] for a in ARRAYS}, x[tok], self.limit)  # [n, D]
            out.index_add_(0, tok, y.float() * weight[tok, k, None])
        return out.to(x.dtype)


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
        self.experts = ExpertBank(shards, layer, args.swiglu_limit)
        self.shared_experts = nn.Module()
        self.shared_experts.w1 = shards.linear(prefix + ".shared_experts.w1")
        self.shared_experts.w3 = shards.linear(prefix + ".shared_experts.w3")
        self.shared_experts.w2 = shards.linear(prefix + ".shared_experts.w2", reduce=False)
        self.limit = args.swiglu_limit

    def route(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [T, K], weight [T, K] float32)`` for ``x`` ``[T, D]`` and token ids ``[T]``."""
        logits = F.linear(x.float(), self.gate.weight)  # [T, E]
        if self.score_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if self.hashed:
            index = self.gate.tid2eid[ids].long()
        else:
            index = torch.topk(scores + self.gate.bias, self.top_k, dim=-1, sorted=False).indices
        weight = scores.gather(1, index)
        return index, weight / (weight.sum(dim=-1, keepdim=True) + 1e-20) * self.scale

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's partial ``[T, D]`` over this rank's intermediate share (not reduced)."""
        se = self.shared_experts
        return se.w2(swiglu(se.w1(x), se.w3(x), self.limit))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        index, weight = self.route(x, ids)
        shared = self.shared(x)
        return all_reduce(self.experts(x, index, weight) + shared)
