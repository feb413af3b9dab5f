"""Block-scaled FP8 linear for decode: ``y = x @ dequant(W).T`` without a dequantized copy of ``W``.

Reference: :func:`fp8_linear_reference` (dequantize with ``runtime/layers`` ``dequantize_blocks``,
then ``F.linear``); :func:`fp8_linear` is the Triton kernel that replaces it.

=================  =================================  ==========================================
tensor             shape                              format
=================  =================================  ==========================================
``x``              ``[..., K]`` bf16 (or f16 / f32)   activations; M = tokens = prod(leading dims)
``w``              ``[N, K]`` ``float8_e4m3fn``       row-major, the checkpoint's ``weight``
``scale``          ``[ceil(N/b0), ceil(K/b1)]``        F32 ``weight_scale_inv`` (DeepSeek-V3,
                                                      Mixtral-FP8) or UE8M0 ``float8_e8m0fnu`` /
                                                      its uint8 bytes (DeepSeek-V4: ``2^(s-127)``)
``y``              ``[..., N]`` in ``x.dtype``        float32 accumulation
=================  =================================  ==========================================

Ragged edges (N or K not a multiple of the block) are masked: the last block row/column of
``scale`` covers the remainder, as in the checkpoints. Formats: DeepSeek-V3/V4 ``inference/``
(``weight_dequant``), the V4 release headers. Legend: M = tokens, N = output features, K = input
features, (b0, b1) = block shape in elements.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from shardsmith.runtime.layers.kernels._common import DECODE_M, KernelError, interpreting, sm_count, use_triton

BLOCK_K_MAX = 128
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS, GEMV_STAGES = 32, 256, 4, 3  # GEMV launch defaults
GEMV_PROGRAMS_PER_SM = 4  # split-K of the GEMV aims at about this many programs per multiprocessor
DENSE_M = 256  # rows from which fp8_linear dequantizes the weight and multiplies on cuBLAS (prefill chunks)
COUNTERS_MIN = 4096  # split-K tile counters first allocated (16 KiB): decode at N <= 131072, block_n 32

# Split-K tile counters (``_fp8_triton``'s fused sum): one int32 buffer per device, zero between
# launches (each launch sets the counters it used back to 0). Keyed by device, not by (device,
# stream): the runtime runs FP8 linears on one stream per device at a time. Decode pieces warm up
# and capture on the GraphPool's stream, which waits for the current stream before and is waited
# for after (``engine/cuda_graphs.py``); graphs replay on the current stream, in order with the
# eager pieces; the other streams (expert cache, link probes) only copy. Per-stream buffers would
# not isolate graphs anyway: a graph keeps the capture stream's buffer and replays on another.
# Two fp8_linear launches overlapping on two streams would count on the same tiles and could add
# each other's partials: a caller that overlaps them passes ``fused_sum=False``.
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers, kept alive: a captured graph may still count in one


def auto_split(m: int, n_tiles: int, k_blocks: int, sms: int) -> int:
    """K splits for ``m`` rows over ``n_tiles`` column tiles and ``k_blocks`` K blocks, aiming at two
    waves of ``sms`` multiprocessors.

    Decode (``m <= 16``, one 16-row tile): from the weight's tiles alone. Longer: one of two values
    per weight, so the split (a constexpr of the kernel) does not compile a variant per prompt
    length: no split once the row tiles fill two waves, else the split of 17-32 rows (up to
    ``m_tiles / 2`` times the programs an exact split would give; the extra float32 partials are
    small next to the weight read).
    """
    waves = 2 * sms
    m_tiles = 1 if m <= DECODE_M else 2
    if m > DECODE_M and n_tiles * -(-m // 16) >= waves:
        return 1
    return max(1, min(k_blocks, -(-waves // (n_tiles * m_tiles))))


def k_splits(m: int, n: int, k: int, *, block_k: int, block_n: int, split_k: int | None, sms: int) -> tuple[int, int]:
    """``(splits, K elements per split)`` of an ``[m, k] x [n, k]`` launch: ``split_k`` (default
    :func:`auto_split`) rounded to whole ``block_k`` blocks per split; the last split may be short."""
    k_blocks = -(-k // block_k)
    if split_k is None:
        split_k = auto_split(m, -(-n // block_n), k_blocks, sms)
    k_per_split = -(-k_blocks // max(1, split_k)) * block_k
    return -(-k // k_per_split), k_per_split


def warmup_rows(max_rows: int) -> list[int]:
    """Row counts M whose :func:`fp8_linear` launches compile every kernel variant that any M in
    ``1..max_rows`` uses, for any weight (default launch options): each decode M (the split-sum's size ``M*N`` is specialised too), then 17 and
    the largest M below :data:`DENSE_M` (from there on the call runs on cuBLAS; :func:`auto_split`
    splits up to some M, so these two give both long variants). The same
    launches, run before any CUDA graph capture (the engine's warm-up), grow the split-K counters
    (:func:`split_counters`) to the most tiles a split launch of those weights uses.
    """
    rows = list(range(1, min(DECODE_M, max_rows) + 1))
    return rows + sorted({m for m in (DECODE_M + 1, min(max_rows, DENSE_M - 1)) if DECODE_M < m <= max_rows})


def split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's split-K tile counters: int32, zero, at least ``tiles`` of them (one per output
    tile of a split launch), allocated on first use and reallocated larger (at least twice) when a
    launch needs more; ``None`` when they would have to grow while the current stream captures a
    CUDA graph (an allocation there would come from the graph's pool and its zeroing would become
    a replayed launch): the caller then adds the splits with the second kernel. The engine's
    warm-up grows them before any capture and before the decode pieces' ``torch.compile`` trace
    (:func:`warmup_rows`); a growth while dynamo traces costs one graph break (the capture check
    returns a bool it cannot trace) and a recompile once grown.
    """
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= tiles:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    size = max(COUNTERS_MIN, tiles)
    if buf is not None:
        _RETIRED.append(buf)
        size = max(size, 2 * buf.numel())
    _COUNTERS[key] = buf = torch.zeros(size, dtype=torch.int32, device=device)
    return buf


def scale_as_float(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32: F32 unchanged, UE8M0 (``float8_e8m0fnu`` or uint8) as ``2^(s-127)``, exact."""
    if scale.dtype == torch.float32:
        return scale
    return torch.exp2(scale.view(torch.uint8).float() - 127.0)


def fp8_linear_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                         groups: int = 1) -> torch.Tensor:
    """The PyTorch path :func:`fp8_linear` replaces: dequantize ``w`` to ``x.dtype``, then ``F.linear``
    (``groups > 1``: one einsum over the block-diagonal groups).

    Shapes and formats as :func:`fp8_linear`.
    """
    from shardsmith.runtime.layers.quant import dequantize_blocks
    dense = dequantize_blocks(w, scale_as_float(scale), block, x.dtype)
    if groups == 1:
        return F.linear(x, dense)
    lead = x.shape[:-2]
    y = torch.einsum("tgi,goi->tgo", x.reshape(-1, groups, x.shape[-1]), dense.view(groups, -1, w.shape[1]))
    return y.reshape(*lead, w.shape[0])


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], groups: int = 1) -> None:
    problems = []
    if w.dim() != 2 or w.dtype != torch.float8_e4m3fn:
        problems.append(f"w must be [N, K] float8_e4m3fn, got {tuple(w.shape)} {w.dtype}")
    elif x.shape[-1] != w.shape[1]:
        problems.append(f"x's last dim ({x.shape[-1]}) != w's K ({w.shape[1]})")
    elif groups != 1 and (groups < 1 or x.dim() < 2 or x.shape[-2] != groups or w.shape[0] % groups):
        problems.append(f"groups={groups}: x must be [..., groups, K] and w's N ({w.shape[0]}) a multiple of "
                        f"groups, got x {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        problems.append(f"x dtype {x.dtype}: expected bfloat16, float16 or float32")
    b0, b1 = block
    if b0 < 1 or b1 < 16 or b1 & (b1 - 1):
        problems.append(f"block {block}: rows >= 1, columns a power of two >= 16")
    elif w.dim() == 2:
        want = (-(-w.shape[0] // b0), -(-w.shape[1] // b1))
        if tuple(scale.shape) != want:
            problems.append(f"scale shape {tuple(scale.shape)} != {want} for w {tuple(w.shape)} and block {block}")
    if scale.dtype not in (torch.float32, torch.uint8, getattr(torch, "float8_e8m0fnu", torch.float32)):
        problems.append(f"scale dtype {scale.dtype}: expected float32 or UE8M0 (float8_e8m0fnu / uint8)")
    if x.device != w.device or w.device != scale.device:
        problems.append(f"x, w, scale on {x.device}, {w.device}, {scale.device}: one device")
    if problems:
        raise KernelError("fp8_linear: " + "; ".join(problems))


def gemv_splits(n: int, k: int, *, block_n: int, block_k: int, sms: int,
                split_k: int | None = None) -> tuple[int, int]:
    """``(splits, K elements per split)`` of a one-token GEMV over ``[n, k]``: ``split_k`` (default:
    about :data:`GEMV_PROGRAMS_PER_SM` programs per multiprocessor over the ``ceil(n / block_n)`` column
    tiles) rounded to whole ``block_k`` steps per split; the last split may be short."""
    k_steps = -(-k // block_k)
    if split_k is None:
        split_k = -(-GEMV_PROGRAMS_PER_SM * sms // -(-n // block_n))
    k_per_split = -(-k_steps // max(1, min(k_steps, split_k))) * block_k
    return -(-k // k_per_split), k_per_split


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128), *,
               groups: int = 1, split_k: int | None = None, block_n: int | None = None, block_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None, fused_sum: bool = True,
               gemv: bool = True, backend: str = "auto") -> torch.Tensor:
    """``x @ (w * scale).T`` with the FP8 weight read once and never dequantized to memory.

    Built for decode. A prefill chunk (at least :data:`DENSE_M` tokens) is compute-bound: it runs the
    reference, the weight dequantized to ``x.dtype`` once per call (FP8 times a UE8M0 scale is exact in
    bf16) and multiplied on cuBLAS's tensor cores, the same bits as a load-time dequantized linear
    (``groups``: one batched GEMM over the diagonal blocks, not all of them). One token (``M = 1``, or one token's ``groups`` rows) runs the GEMV kernel
    (``_fp8_triton._fp8_gemv_kernel``: element-wise float32 multiply-adds, the block scale applied to
    the activations, split-K over about :data:`GEMV_PROGRAMS_PER_SM` programs per multiprocessor);
    ``M = 2..16`` runs the dot kernel in one 16-row tile; larger M runs in 16-row tiles, correct but
    not tuned, through kernels that compile the same two variants per weight for every M > 16
    (:func:`auto_split`; :func:`warmup_rows` lists the M that compile them all). Split-K spreads K
    over programs until about two waves of the device's multiprocessors are busy; partials are
    summed in split order (deterministic), in the same launch by the last program of each output
    tile or by a second kernel, with the same bits. No host sync and shapes fixed by the inputs,
    so calls can be captured in a CUDA graph. The fused sum counts on per-device counters
    (:func:`split_counters`): calls must not overlap on two streams of one device.

    Args:
        x: ``[..., K]`` activations (``[..., G, K]`` with ``groups = G``); w: ``[N, K]`` float8_e4m3fn;
            scale: ``[ceil(N/b0), ceil(K/b1)]`` float32 or UE8M0; block: ``(b0, b1)`` elements.
        groups: ``G > 1`` multiplies block-diagonally, as DeepSeek-V4's grouped ``wo_a``: input group
            ``g`` times weight rows ``[g * N/G, (g+1) * N/G)``, output ``[..., N]``. One token reads the
            weight once in the GEMV; more tokens run all ``T * G`` rows against the whole weight in
            the dot kernel (one read, ``T * G <= 16``) and keep the diagonal blocks.
        split_k: K splits (default: from the multiprocessor count); block_n: output features per
            program; block_k: K elements per step of the GEMV (the dot kernel takes ``min(128, b1)``);
            num_warps, num_stages: Triton launch options (defaults: the fastest of the H200 sweeps in
            ``benchmarks/decode_kernels.py``, per kernel).
        fused_sum: add the split-K partials in the kernel's launch (True) or in a second kernel
            (False; bitwise the same result; the GEMV always adds them in its launch).
        gemv: run one-token calls through the GEMV kernel (False: the dot kernel); it needs
            ``block_n`` to divide ``b0`` (and ``N/G``), else the dot kernel.
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        KernelError: shapes, dtypes, block, groups or devices do not fit (every problem listed), the
            backend cannot run, or a setting holds
            another word.

    Example:
        >>> y = fp8_linear(x, layer.weight, layer.weight_scale_inv, (128, 128))  # doctest: +SKIP
    """
    _check(x, w, scale, block, groups)
    if not use_triton(x, backend) or x.numel() // x.shape[-1] >= DENSE_M * groups:
        return fp8_linear_reference(x, w, scale, block, groups)
    from shardsmith.runtime.layers.kernels import _fp8_triton

    N, K = w.shape
    lead = x.shape[:-2] if groups > 1 else x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    ue8m0 = scale.dtype != torch.float32
    scale = (scale.view(torch.uint8) if ue8m0 else scale).contiguous()
    sms = sm_count(x.device)
    group_n = N // groups
    gemv_n = block_n or GEMV_BLOCK_N
    if x2.shape[0] == groups and block[0] % gemv_n == 0 and (groups == 1 or group_n % gemv_n == 0) and \
            gemv:
        block_k = block_k or GEMV_BLOCK_K
        splits, k_per_split = gemv_splits(N, K, block_n=gemv_n, block_k=block_k, sms=sms, split_k=split_k)
        out = torch.empty(N, dtype=x.dtype, device=x.device)
        ws = torch.empty((splits, N), dtype=torch.float32, device=x.device) if splits > 1 else out
        counters = split_counters(x.device, -(-N // gemv_n)) if splits > 1 else None
        if splits == 1 or counters is not None:
            _fp8_triton.launch_gemv(x2, w, scale, out, ws, counters, block=block, ue8m0=ue8m0, splits=splits,
                                    k_per_split=k_per_split, group_n=group_n, block_n=gemv_n, block_k=block_k,
                                    num_warps=num_warps or GEMV_WARPS, num_stages=num_stages or GEMV_STAGES)
            return out.view(*lead, N)
    block_n = block_n or 32
    block_k = min(BLOCK_K_MAX, block[1])
    M = x2.shape[0]
    splits, k_per_split = k_splits(M, N, K, block_k=block_k, block_n=block_n, split_k=split_k, sms=sms)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    ws = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else out
    counters = None
    if splits > 1 and fused_sum:
        counters = split_counters(x.device, -(-N // block_n) * -(-M // 16))
    _fp8_triton.launch(x2, w, scale, out, ws, counters, block=block, ue8m0=ue8m0, splits=splits,
                       k_per_split=k_per_split, block_n=block_n, block_k=block_k, num_warps=num_warps or 4,
                       num_stages=num_stages or 4, dot_f32=x.dtype == torch.float32 or interpreting())
    if groups > 1:  # every row against every group's weight rows: keep the diagonal blocks
        T = M // groups
        return out.view(T, groups, groups, group_n).diagonal(dim1=1, dim2=2).transpose(1, 2).reshape(*lead, N)
    return out.view(*lead, N)
