"""Tensor parallelism in one small module: process-group helpers and the parallel layers.

The model file builds every linear layer through :meth:`Shards.linear`, which picks the layer class
from the resolved plan (the plan is data; this table is the only place a layout becomes code):

=================  ==========  ===========================  ====================================
plan shard_dim     class       weight (rank-local)          communication
=================  ==========  ===========================  ====================================
``None``           Replicated  ``[out, in]``                none
0                  Column      ``[out_r, in]``              none (output features split)
1                  Row         ``[out, in_r]``              all-reduce of partials; bias once after
vocab-parallel     Embedding   ``[V_r, D]``                 masked lookup, all-reduce
vocab-parallel     LM head     ``[V_r, D]``                 all-gather of uneven shares (pad, strip)
=================  ==========  ===========================  ====================================

FP8 block weights (``float8_e4m3fn`` with an F32 ``weight_scale_inv`` per 128x128 block, DeepSeek-V3
``inference/kernel.py`` ``weight_dequant``) are loaded as stored and, by default, dequantized once
at load to the compute dtype on CPU (``Engine.load(fp8="load")``: memory of the compute dtype). On
CUDA they stay FP8 and every call runs the Triton kernel
:func:`~shardsmith.runtime.layers.kernels.fp8_linear` (the pack's bytes on the GPU, no host sync,
so decode graphs capture it): :func:`use_kernels_` decides once at load, ``SHARDSMITH_KERNELS=fp8_dense``
forces a path (``auto``, ``kernel``: also on CPU under ``TRITON_INTERPRET=1``, ``dequantize``: the
old one). With ``fp8="on-the-fly"`` linears without the kernel stay FP8 and are dequantized per
matmul (:func:`~shardsmith.runtime.layers.quant.dequantize_blocks`).

Weights are buffers created on the ``meta`` device; :func:`shardsmith.runtime.models.mixtral.model.assign_weights`
replaces them with the rank's tensors. Legend: T = tokens, D = hidden, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardsmith import settings
from shardsmith.errors import RuntimeLoadError, UsageError, format_problems
from shardsmith.settings import Kernel
from shardsmith.plans.resolve import ResolvedPlan, TensorPlan
from shardsmith.runtime.layers.kernels import fp8_linear, triton_available
from shardsmith.runtime.layers.kernels._common import interpreting
from shardsmith.runtime.layers.quant import dequantize_blocks

# ------------------------------------------------------------------ group helpers


def world_size() -> int:
    """Ranks in the default process group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 when not initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# gloo: up to this many elements, one all-gather + a local sum beats its ring; 0 turns it off
# (``SHARDSMITH_TUNING=gloo_gather_max=...``, read at import: benchmarks/decode.py compares both)
GATHER_REDUCE_MAX_ELEMENTS = settings.current().gloo_gather_max


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over all ranks in place and return it; a no-op at world_size 1.

    On gloo (CPU ranks) a tensor of at most :data:`GATHER_REDUCE_MAX_ELEMENTS` elements (a decode
    step's activations) is all-gathered and summed locally in rank order: one exchange instead of
    the ring's ``2 * (world_size - 1)`` steps, 3-4x less latency for ``[1, 576]`` on two ranks of a
    2-core host (0.5 vs 1.6-1.9 ms, RESULTS.md). Every rank sums the same values in the same order,
    so the result is identical on every rank; at world size 2 it is bitwise gloo's (one rounding of
    ``a + b``), beyond that it rounds once in float32 instead of once per ring step.
    """
    ws = world_size()
    if ws == 1:
        return x
    if x.device.type == "cpu" and x.numel() <= GATHER_REDUCE_MAX_ELEMENTS and dist.get_backend() == "gloo":
        parts = [torch.empty(x.shape, dtype=x.dtype) for _ in range(ws)]  # contiguous, whatever x's strides
        dist.all_gather(parts, x.contiguous())
        return x.copy_(torch.stack(parts).sum(dim=0))
    dist.all_reduce(x)
    return x


def all_gather_uneven(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``x`` ``[T, n_r]`` along dim 1 into ``[T, sum(sizes)]``.

    Shares may differ (``sizes[r]`` = rank r's ``n_r``): each is padded to the largest, gathered,
    and stripped. A no-op at world_size 1.
    """
    if len(sizes) == 1:
        return x
    width = max(sizes)
    padded = F.pad(x, (0, width - x.shape[1])).contiguous()  # [T, width]
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


# ------------------------------------------------------------------ layers


def kernel_on(switch: str, device: torch.device) -> bool:
    """Whether a Triton kernel path is on for modules on ``device`` under its switch, the
    :class:`~shardsmith.settings.Settings` field ``switch`` (a :class:`~shardsmith.settings.Kernel`):
    ``auto`` on for CUDA with Triton installed, ``kernel`` on (on CPU only under
    ``TRITON_INTERPRET=1``, for tests), ``reference`` the PyTorch path. Decided once, at load.

    Raises:
        UsageError: a malformed setting, or ``kernel`` where the kernel cannot run.
    """
    mode, name = getattr(settings.current(), switch), settings.spelling(switch)
    if mode is Kernel.OFF:
        return False
    runnable = triton_available() and (torch.device(device).type == "cuda" or mode is Kernel.KERNEL and interpreting())
    if mode is Kernel.KERNEL and not runnable:
        raise UsageError(f"{name}=kernel cannot run on {device}: it needs triton (pip install 'shardsmith[kernels]') "
                         "and a CUDA device, or TRITON_INTERPRET=1 on CPU")
    return runnable


def merge_rows(linears: list["_Linear"], name: str) -> torch.Tensor:
    """Buffer ``name`` (``weight`` or ``weight_scale_inv``) of ``linears`` concatenated on rows (dim 0),
    as one tensor a single launch reads; each linear's buffer becomes a view of its own rows, so the
    merge costs no memory and the linears still run alone. Callers merge only linears that take the
    same input, with the same format and no bias (a model's ``fuse_projections_``)."""
    merged = torch.cat([m._buffers[name] for m in linears])
    at = 0
    for m in linears:
        rows = m._buffers[name].shape[0]
        m._buffers[name] = merged[at:at + rows]
        at += rows
    return merged


def use_kernels_(model: nn.Module, device: torch.device) -> None:
    """Switch every module of ``model`` with a ``use_kernel_(device)`` method to its Triton kernel where
    its switch allows (``SHARDSMITH_KERNELS`` items: FP8 linears ``fp8_dense``; expert banks ``fused_experts``;
    DeepSeek-V4's decode attention ``decode_attention``).
    Once, at load, before :func:`~shardsmith.runtime.layers.quant.dequantize_fp8_` (which then keeps
    the kernel linears FP8)."""
    for m in model.modules():
        if hasattr(m, "use_kernel_"):
            m.use_kernel_(device)


class _Linear(nn.Module):
    """``y = x @ W.T (+ b)`` over a rank-local weight; FP8 blocks through :func:`fp8_linear` (``kernel``)
    or dequantized (at load, or per call)."""

    kernel = False  # FP8 weight kept and multiplied by fp8_linear (set once by use_kernel_)

    def __init__(self, shape: tuple[int, int], *, bias: bool, dtype: torch.dtype,
                 fp8_block: tuple[int, int] | None = None, reduce: bool = True) -> None:
        super().__init__()
        self.block, self.reduce = fp8_block, reduce
        self.register_buffer("weight", _meta(shape, torch.float8_e4m3fn if fp8_block else dtype))
        if fp8_block:
            rows, cols = (-(-shape[0] // fp8_block[0]), -(-shape[1] // fp8_block[1]))
            self.register_buffer("weight_scale_inv", _meta((rows, cols), torch.float32))
        self.register_buffer("bias", _meta(shape[:1], dtype) if bias else None)

    def use_kernel_(self, device: torch.device) -> None:
        """Keep an FP8 weight FP8 and run :func:`fp8_linear` when ``SHARDSMITH_KERNELS=fp8_dense`` allows on ``device``."""
        self.kernel = self.block is not None and kernel_on("fp8_dense", device)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (FP8 dequantized now)."""
        if self.block is None:
            return self.weight
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    def dequantize_(self, dtype: torch.dtype) -> None:
        """Replace an FP8 weight and its scale by the dequantized weight in ``dtype`` (once, at load);
        a kernel linear stays FP8."""
        if self.block is not None and not self.kernel:
            self._buffers["weight"] = self.dense_weight(dtype)
            del self._buffers["weight_scale_inv"]
            self.block = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out], no bias, no reduce
        if self.kernel:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, backend="triton")
        return F.linear(x, self.dense_weight(x.dtype))

    def grouped(self, x: torch.Tensor) -> torch.Tensor:  # [T, G, in/G] -> [T, G*o]
        """Block-diagonal product: group g's input ``x[:, g]`` times weight rows ``[g*o, (g+1)*o)``
        (DeepSeek-V4's grouped ``wo_a``; o = out / G).

        A kernel linear with ``T*G <= 16`` (decode) runs one grouped :func:`fp8_linear`, reading the
        FP8 weight once (one token: each row against its own group's rows in the GEMV; more: all
        ``T*G`` rows in one 16-row tile, the diagonal blocks kept); otherwise the weight in
        ``x.dtype`` and one einsum.
        """
        T, G, _ = x.shape
        o = self.weight.shape[0] // G
        if self.kernel and T * G <= 16:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, groups=G, backend="triton")
        return torch.einsum("tgi,goi->tgo", x, self.dense_weight(x.dtype).view(G, o, -1)).reshape(T, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if not self.kernel:
            return F.linear(x, self.dense_weight(x.dtype), self.bias)
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(_Linear):
    """Whole weight ``[out, in]`` on every rank; no communication."""


class ColumnParallelLinear(_Linear):
    """Output features split: weight ``[out_r, in]`` (dim 0), bias ``[out_r]``; no communication."""


class RowParallelLinear(_Linear):
    """Input features split: weight ``[out, in_r]`` (dim 1); partial outputs are all-reduced.

    The bias ``[out]`` is added once, after the all-reduce. With ``reduce=False`` the partial sum
    is returned (no bias) so a caller can add several partials before one all-reduce.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in_r] -> [T, out]
        y = self.matmul(x)
        if not self.reduce:
            return y
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary: rank r holds ids ``[start, start + n_r)`` (uneven shares).

    Ids outside the rank's share look up zeros; the all-reduce sums the one non-zero row.
    """

    def __init__(self, start: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.start, self.rows = start, shape[0]
        self.register_buffer("weight", _meta(shape, dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        return all_reduce(x)


class ParallelLMHead(nn.Module):
    """LM head rows split by vocabulary: ``[T, D] -> [T, V_r]`` locally, all-gathered to ``[T, V]``.

    Shares may be uneven (``sizes``); tied embeddings share the embedding's buffer.
    """

    def __init__(self, sizes: list[int], shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.sizes = sizes
        self.register_buffer("weight", _meta(shape, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, V] float32
        return all_gather_uneven(F.linear(x, self.weight).float(), self.sizes)


# ------------------------------------------------------------------ the plan, for this rank


@dataclass(frozen=True, slots=True)
class HeadShard:
    """This rank's attention heads.

    Attributes:
        n_heads: local query heads; n_kv_heads: local KV heads (copies included).
        kv_index: per local query head, the local KV head it reads (GQA mapping).
    """

    n_heads: int
    n_kv_heads: int
    kv_index: tuple[int, ...]


class Shards:
    """The resolved plan seen from one rank: builds parallel layers with rank-local shapes.

    When a caller passes the global ``shape`` the config implies, a missing or mis-shaped source
    tensor is recorded in :attr:`problems` (and a placeholder built) instead of raised, so that
    :meth:`raise_problems` can report every bad tensor at once.

    Args:
        plan: the resolved plan (each ``fp8-block`` tensor keeps its block size,
            :attr:`~shardsmith.plans.resolve.TensorPlan.block`); rank: this rank; dtype: compute
            dtype of unquantized weights.
    """

    def __init__(self, plan: ResolvedPlan, rank: int, dtype: torch.dtype) -> None:
        self.plan, self.rank, self.dtype = plan, rank, dtype
        self.problems: list[str] = []
        self._banks: dict | None = None

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> TensorPlan | None:
        """The plan of source tensor ``name``; with ``shape``, problems are recorded and ``None``
        is returned for a missing tensor.

        Raises:
            RuntimeLoadError: ``name`` is missing and no ``shape`` was given.
        """
        tp = self.plan.tensors.get(name)
        if tp is None:
            msg = f"missing tensor {name!r}: the model needs it" + (f" {list(shape)}" if shape else "")
            if shape is None:
                raise RuntimeLoadError(f"{msg} (plan {self.plan.family}, world_size={self.plan.world_size})")
            self.problems.append(msg)
        elif shape is not None and tuple(tp.shape) != tuple(shape):
            self.problems.append(f"tensor {name!r}: shape {list(tp.shape)} in the source, the config implies {list(shape)}")
        return tp

    def raise_problems(self) -> None:
        """Raise every recorded problem at once.

        Raises:
            RuntimeLoadError: listing each missing or mis-shaped tensor, sorted.
        """
        if self.problems:
            raise RuntimeLoadError(format_problems(f"rank {self.rank}: the weights do not fit the config", self.problems))

    def linear(self, prefix: str, *, bias: bool = False, reduce: bool = True,
               shape: tuple[int, int] | None = None) -> _Linear:
        """The parallel linear for ``{prefix}.weight`` (class by its shard dim, see the table).

        Args:
            shape: the global ``(out, in)`` the config implies (checked when given).
        """
        tp = self.tensor(prefix + ".weight", shape)
        if bias:
            self.tensor(prefix + ".bias", shape[:1] if shape else None)
        if tp is None or (shape is not None and tuple(tp.shape) != tuple(shape)):
            return ReplicatedLinear(shape, bias=bias, dtype=self.dtype)  # placeholder; never loaded
        if tp.quant not in ("none", "fp8-block"):
            raise RuntimeLoadError(f"{tp.name}: {tp.quant} weights are not supported by this runtime")
        cls = {None: ReplicatedLinear, 0: ColumnParallelLinear, 1: RowParallelLinear}[tp.shard_dim]
        fp8 = tuple(tp.block) if tp.quant == "fp8-block" else None
        return cls(tp.local_shape(self.rank), bias=bias, dtype=self.dtype, fp8_block=fp8, reduce=reduce)

    def embedding(self, name: str, shape: tuple[int, int] | None = None) -> VocabParallelEmbedding:
        """The vocab-parallel embedding of ``name`` (``model.embed_tokens.weight``, global ``[V, D]``)."""
        tp = self.tensor(name, shape)
        if tp is None:
            return VocabParallelEmbedding(0, shape, self.dtype)
        return VocabParallelEmbedding(tp.ranges[self.rank][0][0], tp.local_shape(self.rank), self.dtype)

    def lm_head(self, name: str, shape: tuple[int, int] | None = None) -> ParallelLMHead:
        """The vocab-parallel LM head over ``name`` (``lm_head.weight``, or the embedding when tied)."""
        tp = self.tensor(name, shape)
        if tp is None:
            return ParallelLMHead([shape[0]], shape, self.dtype)
        sizes = [tp.local_shape(r)[0] for r in range(self.plan.world_size)] if tp.shard_dim == 0 else [tp.shape[0]]
        return ParallelLMHead(sizes, tp.local_shape(self.rank), self.dtype)

    def heads(self, prefix: str, head_dim: int, group: int) -> HeadShard:
        """Local query/KV heads of attention ``prefix`` and the query -> KV head mapping.

        Local query head ``j`` is global head ``h0 + j``; it reads global KV head
        ``(h0 + j) // group``, held locally at index ``(h0 + j) // group - k0`` where ``h0``/``k0``
        are the first query/KV heads of the rank's shares (covers whole-group, kv-copies and
        replicated attention alike).
        """
        q, k = self.tensor(prefix + ".q_proj.weight"), self.tensor(prefix + ".k_proj.weight")
        (q0, qn), = q.ranges[self.rank]  # replicated: ((0, rows),)
        (k0, kn), = k.ranges[self.rank]
        h0, n_q, kv0, n_kv = q0 // head_dim, qn // head_dim, k0 // head_dim, kn // head_dim
        index = tuple((h0 + j) // group - kv0 for j in range(n_q))
        if any(not 0 <= i < n_kv for i in index):
            raise RuntimeLoadError(f"{prefix}: rank {self.rank}'s query heads [{h0}, {h0 + n_q}) read KV heads "
                                   f"outside its share [{kv0}, {kv0 + n_kv})")
        return HeadShard(n_q, n_kv, index)

    def bank_shape(self, layer: str, array: str, expert_shape: tuple[int, int] | None = None,
                   n_experts: int | None = None) -> tuple[tuple[int, ...], str] | None:
        """Shape ``[E, rows, cols]`` and safetensors dtype of bank ``array`` of MoE ``layer``, if any.

        With ``expert_shape`` (one source expert tensor's global shape) and ``n_experts``, a
        mismatch with the source is recorded in :attr:`problems`.
        """
        from shardsmith.pack.banks import bank_specs

        if self._banks is None:
            self._banks = {(s.layer, s.name): s for specs in bank_specs(self.plan, self.rank).values() for s in specs}
        spec = self._banks.get((layer, array))
        if spec is None:
            return None
        if n_experts is not None and spec.shape[0] != n_experts:
            self.problems.append(f"{layer} expert bank {array!r}: {spec.shape[0]} experts in the source, "
                                 f"the config says {n_experts}")
        if expert_shape is not None:
            for name in sorted(spec.members.values()):
                if tuple(self.plan.tensors[name].shape) != tuple(expert_shape):
                    self.problems.append(f"tensor {name!r}: shape {list(self.plan.tensors[name].shape)} in the "
                                         f"source, the config implies {list(expert_shape)}")
        return spec.shape, spec.dtype

    def bank_block(self, layer: str, array: str) -> tuple[int, ...]:
        """The quantization block of bank ``array`` of ``layer``'s member tensors (``()`` unquantized).

        Raises:
            RuntimeLoadError: the bank's experts were planned with different blocks.
        """
        self.bank_shape(layer, array)
        spec = self._banks.get((layer, array))
        blocks = sorted({tuple(self.plan.tensors[n].block) for n in spec.members.values()}) if spec else []
        if len(blocks) > 1:
            raise RuntimeLoadError(f"{layer} expert bank {array!r}: its experts have different blocks {blocks}")
        return blocks[0] if blocks else ()
