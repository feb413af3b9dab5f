"""Routed experts: the one :class:`ExpertBank`, the SwiGLU and (token, expert) pair maths every
placement shares (resident bank, offloaded cache slots, host banks).

Every routed expert is split on its intermediate dim (TP-within-expert), so a bank computes this
rank's partial ``[T, D]`` of the selected experts; the MoE layer adds its shared expert and does
the one all-reduce. Bank arrays (``manifests/README.md``; E = experts, I_r = this rank's
intermediate share, D = hidden):

=================  =====================================  ========================================
array              shape (rank-local)                     contents
=================  =====================================  ========================================
``gate_up``        ``[E, 2*I_r, D]`` (FP4: ``D/2`` I8)    rows ``[0, I_r)`` gate (w1), then up (w3);
                                                          gpt-oss: gate and up rows interleaved
``down``           ``[E, D, I_r]`` (FP4: ``I_r/2`` I8)    w2 shard
``*_scale``        blocks of the above                    FP8: F32 ``weight_scale_inv`` blocks;
                                                          FP4: UE8M0 per 1x32, stacked the same way
``gate_up_bias``   ``[E, 2*I_r]``                         gpt-oss only (offloaded host banks and slots)
=================  =====================================  ========================================

Formats (:func:`~shardsmith.runtime.layers.quant.bank_format`) and the paths they take:

======  ==========================================  ============================================
format  a step with no host sync                    otherwise (one host sync: the ids)
======  ==========================================  ============================================
dense   one token, its K experts gathered by id     on CUDA: the pairs sorted by expert, two grouped
        (at most ``DECODE_GATHER_MAX_BYTES``)       matmuls (``torch._grouped_mm``) over every present
                                                    expert; elsewhere expert by expert, gate and up
                                                    as two matmuls
fp8     never without the kernel (FP8 is kept with  on CUDA the same tile kernel, the FP8 bytes and
        ``fp8="on-the-fly"`` or the kernel)         block scales read in registers; elsewhere expert
                                                    by expert, dequantized per use
fp4     ``T*K <= ExpertMath.batched_pairs`` pairs,  the pairs sorted by expert, two grouped matmuls:
        expanded, two batched matmuls               on CUDA the tile kernel over every present
                                                    expert; else ``GROUP_EXPERTS`` experts expanded
                                                    at a time (``torch._grouped_mm``)
======  ==========================================  ============================================

A prefill chunk routes to nearly every expert: expert by expert it was ~15 launches each (256 experts:
thousands of launches a layer), grouped it is a few per ``GROUP_EXPERTS`` experts; each token still
adds its experts' outputs in ascending expert order, so the result has the loop's bits wherever the
grouped matmul has ``F.linear``'s (on the CPU, in the tests).

On CUDA a resident bank of any format runs steps of at most ``FUSED_TOKENS_MAX`` tokens (a decode
batch) through the Triton kernel :func:`~shardsmith.runtime.layers.kernels.fused_experts` instead
(no host sync, each selected expert read once from the bank, nothing expanded to memory; an FP8
bank then stays FP8 at load); decided once at load by :meth:`ExpertBank.use_kernel_`
(``SHARDSMITH_KERNELS=fused_experts=auto|kernel|reference``). Offloaded experts run the same call over the
expert cache's slot pool, with slot ids for expert ids (:func:`fused_bank`).

The family's arithmetic around the matmuls (SwiGLU clamp, accumulation dtype, pair batching,
gpt-oss's GLU and gate/up layout) is an :class:`ExpertMath`, so offloaded experts compute what the
resident bank computes, bit for bit. The fused kernel computes both gated units (gpt-oss's with its
interleaved rows and gate/up bias, on FP4 and plain banks), as the host kernel does on FP4 banks.
Legend: T = tokens, K = experts per token, P = T*K (token, expert) pairs, n = an expert's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.dtypes import DTYPES
from shardsmith.errors import RuntimeLoadError
from shardsmith.runtime.layers.fused import for_chunks
from shardsmith.runtime.layers.kernels import fused_experts
from shardsmith.runtime.layers.kernels.fused_moe import expand_matrix, grouped_gemm, tile_blocks
from shardsmith.runtime.layers.pairs import expand_pairs, gated, routed_pairs, swiglu
from shardsmith.runtime.layers.parallel import Shards, kernel_on
from shardsmith.runtime.layers.quant import bank_format, dequantize_fp4, expert_weights
from shardsmith.runtime.layers.staging import rows_by_expert

# FP4 experts expanded at once by a grouped step: 32 of V4-Flash's (2 x 2048 x 4096 gate/up, 4096 x 2048
# down) are 1.5 GiB of bf16 scratch.
GROUP_EXPERTS = 32
# A one-token step gathers its dense experts (no host sync) while their bytes are at most this; past
# it the copy (read + write + read) costs more than the one host sync it saves. Not yet tuned on GPU.
DECODE_GATHER_MAX_BYTES = 64 << 20
# Tokens per step up to which a kernel bank runs fused_experts: a decode batch (continuous batching
# gives up to 16 rows): the kernel took 2.6-17x less time than the expanded pairs at T = 1-16 on an
# H200 (RESULTS.md, kernels)
FUSED_TOKENS_MAX = 16
# Whether grouped_experts multiplies through the tile kernel (grouped_gemm: no expert expanded in memory):
# None = FP4 and FP8 banks on CUDA (grouped_path); True = every bank, False = none (benchmarks and tests).
TILE_KERNEL: bool | None = None
# False: many-token steps of every bank (resident, or a streamed prefill chunk) go expert by expert, as before
# grouped matmuls existed (benchmarks compare the two).
GROUPED: bool = True
TILE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, slots=True)
class ExpertMath:
    """A model family's expert arithmetic, shared by its resident bank and its offloaded experts.

    Attributes:
        limit: SwiGLU clamp ``L`` (DeepSeek-V4 ``swiglu_limit``, gpt-oss ``swiglu_limit``): gate
            clamped to at most ``L``, up to ``[-L, L]``; 0 means no clamp (Mixtral / Qwen-MoE).
        accumulate_f32: weight and sum the experts' outputs in float32, cast once at the end
            (DeepSeek-V4); else each weighted output is cast to the activation dtype and summed
            there (the Mixtral family, gpt-oss).
        batched_pairs: up to this many (token, expert) pairs, FP4 experts are gathered per pair and
            applied with two batched matmuls (:func:`routed_pairs`; DeepSeek-V4: 16); 0: never.
        alpha: gpt-oss's GLU, ``(up + 1) * gate * sigmoid(alpha * gate)`` after the clamps (OpenAI's
            gpt-oss ``swiglu``, transformers ``GptOssExperts``: 1.702); None: ``silu(gate) * up``.
        interleaved: ``gate_up`` rows alternate gate and up (row ``2j`` gate channel ``j``, ``2j + 1``
            up channel ``j``: gpt-oss); else gate rows ``[0, I_r)`` then up rows.
    """

    limit: float = 0.0
    accumulate_f32: bool = False
    batched_pairs: int = 0
    alpha: float | None = None
    interleaved: bool = False

    @property
    def plain(self) -> bool:
        """Whether this is the SwiGLU of stacked gate/up rows (no ``alpha``, not interleaved), the only maths
        FP8 banks take (gpt-oss's experts are FP4)."""
        return self.alpha is None and not self.interleaved

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[n, 2*I_r]`` gate/up projection (rows laid out as ``interleaved`` says) -> ``[n, I_r]``."""
        return glu_rows.reference(gate_up, self.limit, self.alpha, self.interleaved)

    def accumulator(self, x: torch.Tensor) -> torch.Tensor:
        """Zeros ``[T, D]`` to :meth:`torch.Tensor.index_add_` contributions into."""
        return torch.zeros(x.shape, dtype=self.sum_dtype(x.dtype), device=x.device)

    def sum_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype contributions are weighted and summed in, for activations in ``dtype``."""
        return torch.float32 if self.accumulate_f32 else dtype

    def contribution(self, y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert output ``y [n, D]`` times its routing weights ``w [n]``, in the accumulator's dtype."""
        return weighted(y, w, dtype, self.accumulate_f32)


def weighted(y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, accumulate_f32: bool) -> torch.Tensor:
    """:meth:`ExpertMath.contribution` from its field: ``y [n, D] * w [n]`` in float32 with ``accumulate_f32``,
    else in ``dtype``."""
    return y.float() * w.float()[:, None] if accumulate_f32 else (y * w[:, None]).to(dtype)



def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, math: ExpertMath,
               gate_up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One expert from whole weights in ``x.dtype``: ``x [n, D] -> [n, D]``, one gate+up matmul.

    Args:
        gate_up: ``[2*I_r, D]`` (rows as ``math.interleaved`` says); down: ``[D, I_r]``;
        gate_up_bias: ``[2*I_r]`` or None (gpt-oss's experts have one; their down bias is the MoE
            layer's, added once after the all-reduce).

    The one place a whole-``gate_up`` expert is written: gpt-oss's resident experts, and every FP4
    expert of a slot or host bank once expanded (:func:`expert_output`).
    """
    bias = None if gate_up_bias is None else gate_up_bias.to(x.dtype)
    return F.linear(math.glu(F.linear(x, gate_up, bias)), down)


def expert_output(arrays: dict[str, torch.Tensor], x: torch.Tensor, block: tuple[int, int] | None,
                  limit: float = 0.0, *, math: ExpertMath | None = None) -> torch.Tensor:
    """One expert on its token rows: ``x [n, D] -> [n, D]`` (``x.dtype``), wherever its arrays live.

    Args:
        arrays: the expert's ``gate_up``, ``down``, scales and (gpt-oss) ``gate_up_bias`` in stored
            format (a bank row, a cache slot or a host bank row); block: FP8 block size;
        limit: SwiGLU clamp (when ``math`` is not given); math: the family's :class:`ExpertMath`.

    FP4 experts (DeepSeek-V4, gpt-oss) expand ``gate_up`` whole and run :func:`expert_mlp`; dense
    and FP8 ones run gate and up as two matmuls (as each family's bank always has).
    """
    math = ExpertMath(limit=limit) if math is None else math
    if bank_format(arrays["gate_up"]) == "fp4":
        gate_up = dequantize_fp4(arrays["gate_up"], arrays["gate_up_scale"], x.dtype)  # [2*I_r, D]
        down = dequantize_fp4(arrays["down"], arrays["down_scale"], x.dtype)  # [D, I_r]
        return expert_mlp(x, gate_up, down, math, arrays.get("gate_up_bias"))
    if not math.plain or "gate_up_bias" in arrays:
        raise RuntimeLoadError(f"expert maths {math} with a {bank_format(arrays['gate_up'])} bank: only FP4 banks "
                               "take interleaved gate/up rows, alpha or a gate/up bias")
    gate, up, down = expert_weights(arrays, x.dtype, block)
    return F.linear(swiglu(F.linear(x, gate), F.linear(x, up), math.limit), down)


def fused_bank(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, arrays: dict[str, torch.Tensor],
               math: ExpertMath, block: tuple[int, int] | None, out_dtype: torch.dtype | None = None,
               **kernel: Any) -> torch.Tensor:
    """:func:`~shardsmith.runtime.layers.kernels.fused_experts` over a bank's arrays: the one kernel
    call of resident banks (``ids`` = expert ids) and of the slot pool (``ids`` = slot ids).

    Args:
        x: ``[T, D]``; ids: ``[T, K]`` rows of ``arrays``; weight: ``[T, K]`` routing weights;
        arrays: ``gate_up``, ``down`` (+ scales) ``[E or S, ...]`` in stored format (FP4, FP8, dense);
        math: the family's :class:`ExpertMath` (its clamp); block: an FP8 bank's scale block;
        out_dtype: of the result (default ``x.dtype``; float32 keeps the float32 sum uncast).
        kernel: more ``fused_experts`` arguments (the in-place offload's ``host``, ``write_slots``,
            ``block_r``, ``block_g``).

    Raises:
        KernelError: arrays that do not fit (see ``fused_experts``).
    """
    return fused_experts(x, ids, weight, arrays["gate_up"], arrays["down"], arrays.get("gate_up_scale"),
                         arrays.get("down_scale"), limit=math.limit, block=block, backend="triton", out_dtype=out_dtype,
                         alpha=math.alpha, interleaved=math.interleaved, gate_up_bias=arrays.get("gate_up_bias"),
                         **kernel)


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes activations like ``x``: on the CPU float32, bf16 or f16 (not
    float64); on CUDA bf16 on compute capability 9.0 or later (its grouped GEMM kernels)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


def grouped_path(x: torch.Tensor, fmt: str = "fp4") -> str | None:
    """How :func:`grouped_experts` multiplies a bank of format ``fmt`` (``fp4``, ``fp8``, ``dense``) for
    activations like ``x``, or None where it does not (the bank goes expert by expert).

    ``tiles``: the tile kernel :func:`~shardsmith.runtime.layers.kernels.fused_moe.grouped_gemm`, the weights
    read as stored (FP4 and FP8 banks on CUDA, bf16/f16/float32 activations, any GPU Triton takes; every
    format where :data:`TILE_KERNEL` is True). ``expanded``: ``torch._grouped_mm`` (:func:`grouped_mm_runs`)
    on FP4 experts expanded to ``x.dtype`` (where the tile kernel does not run: the CPU), or on a dense bank's
    rows as they are (on CUDA: cuBLAS's grouped GEMM). Never while :data:`GROUPED` is off."""
    if not GROUPED:
        return None
    if x.dtype in TILE_DTYPES and (TILE_KERNEL or TILE_KERNEL is None and x.is_cuda and fmt != "dense"):
        return "tiles"
    if (fmt == "fp4" or fmt == "dense" and x.is_cuda) and grouped_mm_runs(x):
        return "expanded"
    return None


def grouped_runs(x: torch.Tensor, fmt: str = "fp4") -> bool:
    """Whether :func:`grouped_experts` runs a bank of format ``fmt`` for activations like ``x`` (:func:`grouped_path`)."""
    return grouped_path(x, fmt) is not None


def grouped_experts(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, arrays: dict[str, torch.Tensor],
                    math: ExpertMath, group: int = GROUP_EXPERTS, *, block: tuple[int, int] | None = None,
                    fetch: Callable[[torch.Tensor, list[int]], Callable[[], dict[str, torch.Tensor]]] | None = None,
                    n_experts: int | None = None, fmt: str | None = None) -> torch.Tensor:
    """Many tokens through an expert bank: the ``P = T*K`` pairs sorted by expert, ``group`` present experts
    at a time run as two grouped matmuls (one run of rows per expert), the outputs weighted and added
    per token in ascending expert order (as the expert-by-expert loop adds them). One host sync (the
    experts' pair counts). The matmuls as :func:`grouped_path` says: the tile kernel
    :func:`~shardsmith.runtime.layers.kernels.fused_moe.grouped_gemm` (the weights read as stored; a resident
    bank is then read in place, one launch per matrix), or ``torch._grouped_mm`` (an FP4 group's experts expanded
    to ``x.dtype`` first; a dense bank read in place, every expert one group, the absent ones empty).

    Args:
        x: ``[T, D]``; index: ``[T, K]`` expert ids; weight: ``[T, K]`` routing weights; arrays: the
            bank's ``gate_up [E, 2*I_r, D(/2)]`` (gate rows then up, or interleaved as ``math`` says),
            ``down [E, D, I_r(/2)]``, with their ``_scale`` arrays when quantized (FP4 int8 with UE8M0
            scales, FP8 with float32 block scales, gate's and up's scale rows stacked) and gpt-oss's
            ``gate_up_bias [E, 2*I_r]``; math: the family's :class:`ExpertMath`;
            group: experts per grouped step (expanded: bf16 scratch ``group x 3 x I_r x D``; each step
            gathers only its own pairs' rows, so beside ``x`` and the ``[P, D]`` outputs a step holds
            ``[n, D]`` inputs and ``[n, 2*I_r]`` gate/up rows for its ``n`` pairs);
            block: an FP8 bank's scale block.
        fetch: where a group's arrays come from when the bank is not ``arrays`` (offloaded experts:
            ``arrays`` is then ``{}``): ``fetch(ids [G] on the device, the same ids on the host)``
            starts bringing those experts' arrays ``[G, ...]`` and returns a call that waits for them and
            returns them; the next group's fetch starts before this group computes, so a copy overlaps
            it. n_experts: E, needed with ``fetch``; fmt: the fetched bank's format (``fp4``, ``fp8``,
            ``dense``; default: from ``arrays``, else ``fp4``).

    Returns:
        ``[T, D]`` in ``x.dtype``.
    """
    T, K = index.shape
    fmt = fmt or (bank_format(arrays["gate_up"]) if arrays else "fp4")
    tiles = grouped_path(x, fmt) == "tiles"
    # a resident bank that needs no expansion (the tile kernel; dense rows for torch._grouped_mm) is read in
    # place, one run per expert, the absent ones empty
    whole = fetch is None and (tiles or fmt == "dense")
    if fetch is None:
        n_experts = arrays["gate_up"].shape[0]
        group = n_experts if tiles or fmt == "dense" else group

        def fetch(ids: torch.Tensor, _ids_h: list[int]) -> Callable[[], dict[str, torch.Tensor]]:
            if whole:  # every expert, empty runs included: no copy of the bank
                return lambda: arrays
            return lambda: {name: a[ids] for name, a in arrays.items()}
    flat = index.flatten()  # [P]
    order = flat.argsort(stable=True)  # pairs by expert, each expert's in token order
    counts = torch.bincount(flat, minlength=n_experts)
    if whole:
        present, sizes = torch.arange(n_experts, device=counts.device), counts
        present_h, sizes_h = list(range(n_experts)), counts.tolist()  # the one host sync
    else:
        present = counts.nonzero().flatten()
        sizes = counts[present]
        present_h, sizes_h = torch.stack((present, sizes)).tolist()  # the one host sync
    ys = x.new_empty((order.shape[0], x.shape[1]))  # [P, D]: each pair's output, sorted by expert
    start = 0
    groups = list(range(0, len(present_h), group))
    pending = fetch(present[:group], present_h[:group]) if groups else None
    for i, g in enumerate(groups):
        ready, n = pending, sum(sizes_h[g:g + group])
        if i + 1 < len(groups):  # the next group's arrays start coming while this one computes
            nxt = groups[i + 1]
            pending = fetch(present[nxt:nxt + group], present_h[nxt:nxt + group])
        got = ready()
        run = _tiles_mm(sizes_h[g:g + group], block) if tiles else _expanded_mm(sizes[g:g + group], block)
        i_r = got["down"].shape[-1] * (2 if bank_format(got["gate_up"]) == "fp4" else 1)
        xs = x[order[start:start + n] // K]  # [n, D]: this group's pairs' rows (not every pair's at once)
        h = run(xs, got["gate_up"], got.get("gate_up_scale"), split=i_r)  # [n, 2I_r]
        if "gate_up_bias" in got:
            h = h + got["gate_up_bias"].to(x.dtype).repeat_interleave(sizes[g:g + group], dim=0)
        h = glu_rows(h, math.limit, math.alpha, math.interleaved)
        ys[start:start + n] = run(h, got["down"], got.get("down_scale"))
        start += n
    by_expert = index.argsort(dim=1, stable=True)  # [T, K]: each token's experts, ascending
    sorted_at = torch.empty_like(order)
    sorted_at[order] = torch.arange(order.shape[0], device=order.device)  # pair t*K+j -> its row of ys
    rows = sorted_at.view(T, K).gather(1, by_expert)  # [T, K]: ys row of token t's k-th expert (ascending)
    return combine_pairs(x, ys, rows, weight.gather(1, by_expert), math.accumulate_f32)


def grouped_experts_reference(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                              arrays: dict[str, torch.Tensor], math: ExpertMath,
                              block: tuple[int, int] | None = None) -> torch.Tensor:
    """The plain PyTorch path :func:`grouped_experts` replaces: each present expert on its rows
    (:func:`expert_output`, dequantized per use), weighted and added in ascending expert order, as
    :class:`ExpertBank` runs a bank with no grouped path. Arguments and result as :func:`grouped_experts`."""
    out = math.accumulator(x)
    for e in index.unique().tolist():
        tok, k = torch.where(index == e)
        y = expert_output({a: t[e] for a, t in arrays.items()}, x[tok], block, math=math)
        out.index_add_(0, tok, math.contribution(y, weight[tok, k], x.dtype))
    return out.to(x.dtype)


def _tiles_mm(sizes_h: list[int], block: tuple[int, int] | None) -> Callable[..., torch.Tensor]:
    """A group's grouped matmul ``(a [n, K], w [G, N, K(/2)], scale, split=None) -> [n, N]`` through the tile kernel."""
    blocks = tile_blocks(sizes_h)
    return lambda a, w, scale, split=None: grouped_gemm(a, w, scale, sizes_h, block=block, split=split,
                                                        backend="triton", **blocks)


def _expanded_mm(sizes: torch.Tensor, block: tuple[int, int] | None) -> Callable[..., torch.Tensor]:
    """The same through ``torch._grouped_mm``, the group's experts expanded to ``a.dtype`` first."""
    offs = sizes.cumsum(0).to(torch.int32)

    def run(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, split: int | None = None) -> torch.Tensor:
        if bank_format(w) == "fp4":
            full = dequantize_fp4(w, scale, a.dtype)
        elif scale is None:  # dense rows as they are
            full = w.to(a.dtype)
        else:
            full = torch.stack([expand_matrix(w[g], scale[g], a.dtype, block, split) for g in range(w.shape[0])])
        return torch._grouped_mm(a, full.transpose(-2, -1), offs=offs)
    return run


@for_chunks
def glu_rows(h: torch.Tensor, limit: float, alpha: float | None, interleaved: bool) -> torch.Tensor:
    """:meth:`ExpertMath.glu` from its fields: ``h [n, 2*I_r]`` gate/up rows (``interleaved``, or gate then
    up) -> ``[n, I_r]``; fused for a chunk's pairs."""
    return gated(h, limit, alpha, interleaved)


@for_chunks
def combine_pairs(x: torch.Tensor, ys: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                  accumulate_f32: bool) -> torch.Tensor:
    """Each token's expert outputs weighted and added in ascending expert order, as the expert-by-expert
    loop adds them: ``out[t] = sum_k weight[t, k] * ys[rows[t, k]]`` (in float32 with
    ``accumulate_f32``, else in ``x.dtype``), ``[T, D]`` in ``x.dtype`` (``x [T, D]`` gives the shape).
    ``ys [P, D]`` the pairs' outputs, ``rows``/``weight`` ``[T, K]``."""
    out = torch.zeros(x.shape, dtype=torch.float32 if accumulate_f32 else x.dtype, device=x.device)
    for k in range(rows.shape[1]):
        out += weighted(ys[rows[:, k]], weight[:, k], x.dtype, accumulate_f32)
    return out.to(x.dtype)


class RoutedExperts(nn.Module):
    """The interface a MoE layer and the decode graphs drive, whatever holds the experts.

    ``forward(x [T, D], index [T, K], weight [T, K]) -> [T, D]``: this rank's partial of the
    selected experts, to be all-reduced by the caller. A decode step split around its experts calls
    :meth:`decode_slots` eagerly (the host part) and, when it returns slots, :meth:`apply_slots`
    (device only, so it can be captured). Implemented by the resident :class:`ExpertBank` and by
    :class:`~shardsmith.runtime.offload.runtime.OffloadedExperts` (a slot pool over host banks).

    Attributes:
        math: the family's :class:`ExpertMath` on resident experts that expert offload may replace
            (:func:`~shardsmith.runtime.offload.attach.attach_offload` swaps every module with one);
            None on the offloaded ones. block: an FP8 bank's scale block, else None.
    """

    math: ExpertMath | None = None
    block: tuple[int, int] | None = None
    kernel = False  # decode-sized steps run fused_experts over the module's own arrays (set once by use_kernel_)

    def decode_sync_free(self) -> bool:
        """Whether a one-token step runs these experts with no host sync (so it can be captured whole)."""
        return False

    def slot_path(self) -> bool:
        """Whether :meth:`decode_slots` may return slots for :meth:`apply_slots` (an expert cache)."""
        return False

    def may_split(self) -> bool:
        """Whether :meth:`decode_slots` may return the third form (slots and a host share)."""
        return False

    def decode_slots(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> tuple:
        """One of three forms: ``(slots [P] int64, None)`` once every pair's expert sits in a slot;
        ``(None, routed [T, D])`` when the experts ran here; ``(slots, pending)`` for a split step
        (offloaded ``hybrid``): the host computes some pairs meanwhile, ``slots`` has those pairs
        masked (negative), and ``pending.add_to(apply_slots(x, weight, slots, masked=True))`` is
        the routed partial."""
        return None, self(x, index, weight)

    def apply_slots(self, x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, *,
                    masked: bool = False) -> torch.Tensor:
        """The routed partial ``[T, D]`` from experts already in ``slots`` (see :meth:`decode_slots`);
        ``masked``: negative slots are pairs computed elsewhere (contribute zero)."""
        raise NotImplementedError(f"{type(self).__name__} has no expert slots")


class ExpertBank(RoutedExperts):
    """One MoE layer's routed experts resident on this rank: buffers ``gate_up``, ``down`` (+ scales).

    Args:
        shards: the rank's plan; layer: bank layer key (``model.layers.3``, ``layers.3``).
        dtype: compute dtype (dense banks are stored in it).
        top_k: K, experts per token (what :meth:`decode_sync_free` is about).
        math: the family's :class:`ExpertMath`; formats: the bank formats the family runs.
        n_experts, expert_shape: what the config implies (E; one source expert tensor's global
            ``(I, D)``), checked against the plan when given.
        why: why the layer must have a bank (for the missing-bank error).

    Raises:
        RuntimeLoadError: the plan has no bank for ``layer``, or its format is not in ``formats``.
    """

    def __init__(self, shards: Shards, layer: str, dtype: torch.dtype, *, top_k: int, math: ExpertMath,
                 formats: tuple[str, ...], n_experts: int | None = None,
                 expert_shape: tuple[int, int] | None = None, why: str = "") -> None:
        super().__init__()
        self.top_k, self.math, self.format, self.block = top_k, math, "dense", None
        for name in ("gate_up", "down"):
            shape_of = None if expert_shape is None else expert_shape if name == "gate_up" else expert_shape[::-1]
            found = shards.bank_shape(layer, name, shape_of, n_experts)
            if found is None:
                raise RuntimeLoadError(f"missing expert bank {layer} {name!r}: {why}")
            shape, dt = found
            scale = shards.bank_shape(layer, name + "_scale")
            self.format = "fp4" if dt == "I8" else "fp8" if dt.startswith("F8") else "dense"
            if (self.format not in formats or (self.format != "dense" and scale is None)
                    or (self.format == "fp4" and scale[1] != "F8_E8M0")):
                raise RuntimeLoadError(f"expert bank {layer} {name!r}: dtype {dt}"
                                       + (f" with {scale[1]} scales" if scale else "")
                                       + f"; this model runs {' or '.join(_FORMAT_NAMES[f] for f in formats)} experts")
            stored = dtype if self.format == "dense" else DTYPES[dt].torch_dtype
            self.register_buffer(name, torch.empty(shape, dtype=stored, device="meta"))
            if self.format != "dense":
                scale_dtype = torch.float32 if self.format == "fp8" else DTYPES[scale[1]].torch_dtype
                self.register_buffer(name + "_scale", torch.empty(scale[0], dtype=scale_dtype, device="meta"))
        if self.format == "fp8":
            self.block = shards.bank_block(layer, "gate_up")

    def use_kernel_(self, device: torch.device) -> None:
        """Run decode-sized steps through :func:`fused_experts` when ``SHARDSMITH_KERNELS``'s ``fused_experts``
        allows on ``device``; an FP8 bank then stays FP8 (:meth:`dequantize_` keeps it)."""
        self.kernel = kernel_on("fused_experts", device)

    def fused(self, tokens: int, k: int) -> bool:
        """Whether ``tokens`` tokens over ``k`` experts each run :func:`fused_experts`."""
        return self.kernel and tokens <= FUSED_TOKENS_MAX

    def arrays(self) -> dict[str, torch.Tensor]:
        """The bank's arrays by name, ``[E, ...]`` each."""
        return dict(self._buffers)

    def dequantize_(self, dtype: torch.dtype) -> None:
        """Dequantize an FP8 bank to ``dtype`` once (at load); scales are dropped. FP4 stays packed,
        and so does FP8 for the kernel (:meth:`use_kernel_`, called first)."""
        if self.format != "fp8" or self.kernel:
            return
        parts = [expert_weights({a: t[e] for a, t in self.arrays().items()}, dtype, self.block)
                 for e in range(self.gate_up.shape[0])]
        self._buffers["gate_up"] = torch.stack([torch.cat((g, u)) for g, u, _ in parts])  # [E, 2*I_r, D]
        self._buffers["down"] = torch.stack([d for _, _, d in parts])  # [E, D, I_r]
        del self._buffers["gate_up_scale"], self._buffers["down_scale"]
        self.format, self.block = "dense", None

    def sync_free(self, tokens: int, k: int) -> bool:
        """Whether ``tokens`` tokens over ``k`` experts each take a path with no host sync (module table)."""
        if self.fused(tokens, k):
            return True
        if self.format == "fp4":
            return tokens * k <= self.math.batched_pairs
        return (self.format == "dense" and tokens == 1
                and k * (self.gate_up[0].nbytes + self.down[0].nbytes) <= DECODE_GATHER_MAX_BYTES)

    def decode_sync_free(self) -> bool:
        return self.sync_free(1, self.top_k)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Partial sum ``[T, D]`` (``x.dtype``) of the selected experts over this rank's share.

        Args:
            x: ``[T, D]``; index: ``[T, K]`` expert ids; weight: ``[T, K]`` routing weights
                (float32, or the activation dtype as the family routes).

        A kernel bank's decode-sized step (:meth:`fused`) is one :func:`fused_experts` call. Otherwise
        a step that :meth:`sync_free` allows gathers its experts by id on the device (no host
        sync, so the host keeps queueing kernels): FP4 per pair (:func:`routed_pairs`), dense for
        one token in ascending expert order with the general path's kernels (so the same bits).
        Otherwise one host sync (the ids), then the bank runs :func:`grouped_experts` where
        :func:`grouped_runs` says so (FP4 banks; FP8 and dense ones on CUDA), else expert by expert in
        ascending order, reading each expert in place (at most one FP4/FP8 expert expanded at a time).
        """
        T, K = index.shape
        if self.fused(T, K):
            return fused_bank(x, index, weight, self.arrays(), self.math, self.block)
        if self.sync_free(T, K) and self.format == "fp4":
            sel = index.flatten()  # [P] expert of each pair, on the device
            return routed_pairs(*expand_pairs({a: t[sel] for a, t in self.arrays().items()}, x.dtype), x, weight,
                                self.math.limit)
        out = self.math.accumulator(x)
        if self.sync_free(T, K):
            ids, order = index[0].sort()  # [K] ascending, as the general path adds them
            w = weight[0, order]  # [K]
            gate_up, down = self.gate_up.index_select(0, ids), self.down.index_select(0, ids)  # [K, 2*I_r, D], [K, D, I_r]
            i_r = gate_up.shape[1] // 2
            for k in range(K):
                y = F.linear(swiglu(F.linear(x, gate_up[k, :i_r]), F.linear(x, gate_up[k, i_r:]), self.math.limit),
                             down[k])  # [1, D]
                out.add_(self.math.contribution(y, w[k: k + 1], x.dtype))
            return out.to(x.dtype)
        if grouped_runs(x, self.format):
            return grouped_experts(x, index, weight, self.arrays(), self.math, block=self.block)
        index_h = index.cpu()  # the one host sync: ids -> rows per expert on the host
        for e, (tok, k) in rows_by_expert(index_h, index_h.unique().tolist(), x.device).items():  # [n], [n]
            y = expert_output({a: t[e] for a, t in self.arrays().items()}, x[tok], self.block, math=self.math)
            out.index_add_(0, tok, self.math.contribution(y, weight[tok, k], x.dtype))
        return out.to(x.dtype)


_FORMAT_NAMES = {"dense": "unquantized", "fp8": "FP8 block", "fp4": "FP4 (I8 packed e2m1 with F8_E8M0 scales)"}
