"""Fused routed experts for decode: gate_up + SwiGLU (clamped) + down, weighted and summed per token.

Reference: :func:`fused_experts_reference` (the DeepSeek-V4 pair path: gather each pair's expert,
``expand_pairs``, ``routed_pairs``); :func:`fused_experts` is the Triton kernel that replaces it,
by one of two paths (``_moe_triton.py``): ``grouped`` sorts the (token, expert) pairs by expert and
runs each expert's tokens through ``tl.dot`` (each expert's bytes read once per call), ``pairs``
gives each pair its own programs and multiply-adds on CUDA cores (an expert chosen by several tokens
is read once per pair, mostly from L2; faster for FP4 decode, whose tensor-core upcast costs more
than the bytes: benchmarks/RESULTS.md, h200x1j). :func:`pick_path` chooses per format and batch.

A bank is indexed by expert id (the resident bank) or by slot id (the GPU slot pool of the expert
cache): one layout, one code path. Bank arrays (``runtime/layers/experts.py``; FP4 stays packed,
two e2m1 codes per byte, element ``2i`` in the low nibble, 1x32 UE8M0 scales, as
``runtime/layers/quant.py`` ``dequantize_fp4`` reads them):

=================  ================================  ==============================  ==========================
array              FP4 (DeepSeek-V4)                 FP8 block (Mixtral-FP8, V3)      bf16 (Mixtral family)
=================  ================================  ==============================  ==========================
``gate_up``        ``[E, 2*I_r, D/2]`` int8/uint8    ``[E, 2*I_r, D]`` e4m3           ``[E, 2*I_r, D]``; rows
                                                                                     ``[0, I_r)`` gate (w1),
                                                                                     ``[I_r, 2*I_r)`` up (w3)
``gate_up_scale``  ``[E, 2*I_r, D/32]`` UE8M0        F32 ``[E, 2*ceil(I_r/b0),``      -
                                                     ``ceil(D/b1)]``: gate's, then up's
``down``           ``[E, D, I_r/2]`` int8/uint8      ``[E, D, I_r]`` e4m3             ``[E, D, I_r]`` (w2 shard)
``down_scale``     ``[E, D, I_r/32]`` UE8M0          F32 ``[E, ceil(D/b0),``          -
                                                     ``ceil(I_r/b1)]``
=================  ================================  ==============================  ==========================

FP8 scales are the checkpoints' ``weight_scale_inv`` blocks of ``(b0, b1)`` elements (``block``;
ragged last blocks allowed), stacked as the bank stacks them (``runtime/layers/quant.py``
``expert_weights``); a weight is scaled in float32 and cast to the activation dtype, as there.

Each expert is ``down(silu(min(gate x, L)) * clamp(up x, -L, L))`` (no clamp when ``L = 0``), the
output of pair ``(t, k)`` is scaled by ``weights[t, k]`` and the K pairs of a token are summed in
float32 in k order. gpt-oss's experts (FP4 or plain banks) differ in three ways the kernels take as
arguments: ``gate_up`` rows interleave gate and up (row ``2j`` gate channel ``j``, ``2j + 1`` up),
a ``gate_up_bias [E, 2*I_r]`` is added to the projection, and the gated unit is
``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, L)``.
Legend: T = tokens, K = experts per token, P = T*K pairs, E = experts (or slots), D = hidden,
I_r = this rank's intermediate share (TP-within-expert).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shardsmith.runtime.layers.kernels._common import KernelError, interpreting, use_triton

BLOCK_M = 16  # token rows per expert tile: tl.dot's smallest M; a decode batch is at most 16 tokens


def fused_experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                            down: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                            down_scale: torch.Tensor | None = None, *, limit: float = 0.0,
                            block: tuple[int, int] | None = None, out_dtype: torch.dtype | None = None,
                            alpha: float | None = None, interleaved: bool = False,
                            gate_up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch path :func:`fused_experts` replaces: gather each pair's expert, expand FP4 (or
    FP8, expert by expert with ``expert_weights``) to ``x.dtype`` in memory, two batched matmuls,
    the float32 combine (V4 ``routed_pairs``; gpt-oss's GLU with ``alpha``, ``interleaved``, ``gate_up_bias``).

    Shapes and formats as :func:`fused_experts`.
    """
    from shardsmith.runtime.layers.pairs import expand_pairs, routed_pairs
    from shardsmith.runtime.layers.quant import expert_weights

    sel = ids.flatten()  # [P]
    if gate_up_scale is None:
        gu, dn = gate_up[sel].to(x.dtype), down[sel].to(x.dtype)
    elif gate_up.dtype == torch.float8_e4m3fn:
        parts = [expert_weights({"gate_up": gate_up[e], "gate_up_scale": gate_up_scale[e], "down": down[e],
                                 "down_scale": down_scale[e]}, x.dtype, block) for e in sel.tolist()]
        gu = torch.stack([torch.cat((g, u)) for g, u, _ in parts])  # [P, 2*I_r, D]
        dn = torch.stack([d for _, _, d in parts])  # [P, D, I_r]
    else:
        gu, dn = expand_pairs({"gate_up": gate_up[sel], "gate_up_scale": gate_up_scale[sel], "down": down[sel],
                               "down_scale": down_scale[sel]}, x.dtype)
    bias = None if gate_up_bias is None else gate_up_bias[sel]  # [P, 2*I_r]
    return routed_pairs(gu, dn, x, weights.float(), limit, out_dtype, alpha=alpha, interleaved=interleaved,
                        gate_up_bias=bias)


def _check(x, ids, weights, gate_up, down, gate_up_scale, down_scale, block, gate_up_bias=None,
           gpt_oss: bool = False) -> str:
    """Validate the inputs and return the bank's format (``fp4``, ``fp8``, ``dense``); every problem
    is listed at once."""
    problems = []
    fp4 = gate_up.dtype in (torch.int8, torch.uint8)
    fp8 = gate_up.dtype == torch.float8_e4m3fn
    if fp8 and (gpt_oss or gate_up_bias is not None):
        problems.append("gpt-oss's GLU (alpha, interleaved rows, gate_up_bias) takes FP4 and plain banks, not FP8")
    if gate_up_bias is not None and (gate_up_bias.dim() != 2 or gate_up_bias.shape != gate_up.shape[:2]
                                     or gate_up_bias.stride(-1) != 1):
        problems.append(f"gate_up_bias must be [E, 2*I_r] = {list(gate_up.shape[:2])} with contiguous rows, got "
                        f"{list(gate_up_bias.shape)} strides {gate_up_bias.stride()}")
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        problems.append(f"x must be [T, D] bf16/f16/f32, got {tuple(x.shape)} {x.dtype}")
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64) or tuple(weights.shape) != tuple(ids.shape):
        problems.append(f"ids [T, K] int32/int64 and weights [T, K] expected, got {tuple(ids.shape)} {ids.dtype}, "
                        f"{tuple(weights.shape)}")
    elif x.dim() == 2 and ids.shape[0] != x.shape[0]:
        problems.append(f"ids has {ids.shape[0]} tokens, x {x.shape[0]}")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        problems.append(f"gate_up [E, 2*I_r, .] and down [E, D, .] expected, got {tuple(gate_up.shape)}, "
                        f"{tuple(down.shape)}")
    elif x.dim() == 2:
        D, I = x.shape[1], gate_up.shape[1] // 2
        pack = 2 if fp4 else 1
        want_gu, want_dn = (2 * I, D // pack), (D, I // pack)
        if gate_up.shape[1] % 2 or tuple(gate_up.shape[1:]) != want_gu or tuple(down.shape[1:]) != want_dn:
            problems.append(f"bank {tuple(gate_up.shape)}, {tuple(down.shape)} does not fit D={D}: expected "
                            f"[E, {want_gu[0]}, {want_gu[1]}] and [E, {want_dn[0]}, {want_dn[1]}]")
        if fp4:
            if D % 32 or I % 32:
                problems.append(f"FP4 needs D ({D}) and I_r ({I}) divisible by 32 (1x32 scale groups)")
            elif gate_up_scale is None or down_scale is None or \
                    tuple(gate_up_scale.shape) != (gate_up.shape[0], 2 * I, D // 32) or \
                    tuple(down_scale.shape) != (down.shape[0], D, I // 32):
                problems.append("FP4 bank needs gate_up_scale [E, 2*I_r, D/32] and down_scale [E, D, I_r/32], got "
                                f"{None if gate_up_scale is None else tuple(gate_up_scale.shape)}, "
                                f"{None if down_scale is None else tuple(down_scale.shape)}")
        elif fp8:
            problems += _check_fp8(gate_up, down, gate_up_scale, down_scale, block, D, I)
        elif gate_up.dtype != down.dtype or gate_up.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            problems.append(f"bank dtype {gate_up.dtype}/{down.dtype}: FP4 (int8/uint8 + UE8M0), FP8 e4m3 + F32 "
                            "block scales, or one float dtype")
    for name, t in (("ids", ids), ("weights", weights), ("gate_up", gate_up), ("down", down),
                    ("gate_up_scale", gate_up_scale), ("down_scale", down_scale), ("gate_up_bias", gate_up_bias)):
        if t is not None and t.device != x.device:
            problems.append(f"{name} is on {t.device}, x on {x.device}: one device")
        if t is not None and name not in ("ids", "weights") and t.stride(-1) != 1:
            problems.append(f"{name} rows must be contiguous (last stride 1, got {t.stride(-1)})")
    if problems:
        raise KernelError("fused_experts: " + "; ".join(problems))
    return "fp4" if fp4 else "fp8" if fp8 else "dense"


def _check_fp8(gate_up, down, gate_up_scale, down_scale, block, D: int, I: int) -> list[str]:
    """The FP8 bank's problems: ``block``, the two scale shapes (F32, gate's rows then up's)."""
    if block is None or len(block) != 2 or min(block) < 1:
        return [f"an FP8 bank needs block=(b0, b1) (its weight_scale_inv block), got {block}"]
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    b0, b1 = block
    want = ((gate_up.shape[0], 2 * cdiv(I, b0), cdiv(D, b1)), (down.shape[0], cdiv(D, b0), cdiv(I, b1)))
    got = tuple(None if s is None else (tuple(s.shape), s.dtype) for s in (gate_up_scale, down_scale))
    if down.dtype != torch.float8_e4m3fn or got != tuple((w, torch.float32) for w in want):
        return [f"FP8 bank (down {down.dtype}) with block {tuple(block)} needs F32 gate_up_scale {list(want[0])} and "
                f"down_scale {list(want[1])}, got {got}"]
    return []


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None, *, limit: float = 0.0,
                  block: tuple[int, int] | None = None, block_i: int | None = None,
                  block_n: int | None = None, block_k: int = 128, num_warps: int | None = None, num_stages: int = 3,
                  scaled_dot: bool | None = None, backend: str = "auto", path: str = "auto",
                  block_r: int = 16, block_g: int | None = None,
                  out_dtype: torch.dtype | None = None, host: dict[str, torch.Tensor] | None = None,
                  write_slots: torch.Tensor | None = None, alpha: float | None = None, interleaved: bool = False,
                  gate_up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's weighted sum of its K experts ``[T, D]``, over this rank's intermediate share.

    Experts are read straight from the (packed) bank: nothing is gathered or expanded to memory (the
    grouped path reads each selected expert once per call, the pair path once per pair). The launch
    shapes depend on T*K alone and nothing syncs with the host, so a decode step can be captured in
    a CUDA graph. Ids are not range-checked (that would sync): an id outside ``[0, E)`` reads out of
    bounds. On the pair path a token's result does not depend on the other tokens of the call.

    Compiles (the grouped path): a variant per ``BLOCK_P = next_pow2(T*K)`` and class of ``P`` (1, a
    multiple of 16, other), at most 7 per bank over T = 1..16, the tokens callers pass
    (``experts.FUSED_TOKENS_MAX``); the engine's warm-up launches T = 1..16 at start.

    Args:
        x: ``[T, D]`` activations (T = 1..16 for decode; more works, unoptimised).
        ids: ``[T, K]`` expert (or slot) ids; weights: ``[T, K]`` routing weights (float32).
        gate_up, down, gate_up_scale, down_scale: the bank (module table); scales for FP4 and FP8.
        limit: SwiGLU clamp ``L`` (DeepSeek-V4's ``swiglu_limit``; 0 = none).
        block: an FP8 bank's scale block ``(b0, b1)`` in elements (rows, columns); unused otherwise.
        block_i, block_n: intermediate rows per gate_up program, hidden rows per down program
            (default 64, 128 for FP4 and 32, 64 for bf16 and FP8: the H200 sweep's fastest for FP4 and bf16);
        block_k: elements of the reduction dim (D, then I_r) per loop step;
        num_warps, num_stages: Triton launch options (warps: 4; 8 on the pair path with a plain
            bank); scaled_dot: FP4 through ``tl.dot_scaled``
            instead of the in-register decode (default: on when compiled with bf16 ``x``, 1.1-1.5x
            faster on the H200; off for float16/float32 ``x``, which ``tl.dot_scaled`` does not take
            here, and under the interpreter, which lacks it).
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.
        path: the Triton kernels: ``grouped`` (pairs sorted by expert, each expert's run of up to
            16 tokens through ``tl.dot``), ``pairs`` (one program row per (token, expert) pair,
            float32 multiply-adds on CUDA cores; FP4 and plain banks) or ``auto`` (:func:`pick_path`).
        block_r, block_g: the pair path's output rows per program and scale groups (FP4; plain:
            elements) per loop step (default 8 groups, 256 elements).
        out_dtype: the result's dtype (default ``x.dtype``): float32 returns the float32 sum uncast
            (a split hybrid step adds the host's partial to it before the one cast).
        host: the layer's host bank (``gate_up``, ``down`` and FP4 scales ``[E_host, ...]``, the
            bank's format and row layout, in page-locked host memory: mapped into the device's
            address space under unified addressing, CUDA runtime API ``cudaHostRegister``): a
            negative id ``-1 - e`` reads expert ``e`` of it in place over the link (no copy); the
            pair path only, FP4 and plain banks (the offloaded step with no host sync).
        write_slots: ``[P]`` int64 with ``host``: pair ``p``'s bytes (read from the host) are also
            written to bank row ``write_slots[p]`` when it is >= 0 (the cache admitting the expert
            while the step uses it; one writer per row per call, so callers give each row to one pair).
        alpha: gpt-oss's gated unit ``(up + 1) * g * sigmoid(alpha * g)`` (None: ``silu(gate) * up``);
        interleaved: ``gate_up`` rows alternate gate and up (gpt-oss) instead of gate rows then up rows;
        gate_up_bias: ``[E, 2*I_r]`` added to each gate/up row before the clamp (gpt-oss; a ``host`` bank
            then has its own, read and written through like the weights). FP4 and plain banks only.

    Returns:
        ``[T, D]`` in ``out_dtype``.

    Raises:
        KernelError: shapes, dtypes or strides do not fit (every problem listed), or the backend
            cannot run.

    Example:
        >>> y = fused_experts(x, index, weight, bank.gate_up, bank.down, bank.gate_up_scale,
        ...                   bank.down_scale, limit=args.swiglu_limit)  # doctest: +SKIP
    """
    glu = GLU(float(limit), alpha, interleaved, gate_up_bias)
    fmt = _check(x, ids, weights, gate_up, down, gate_up_scale, down_scale, block, gate_up_bias,
                 alpha is not None or interleaved)
    fp4 = fmt == "fp4"
    bank = {"gate_up": gate_up, "down": down, "gate_up_scale": gate_up_scale, "down_scale": down_scale,
            "gate_up_bias": gate_up_bias}
    if host is not None:
        _check_host(fmt, bank, host, ids, write_slots, path)
    if not use_triton(x, backend):
        if host is not None:
            return _host_reference(x, ids, weights, bank, host, write_slots, glu, out_dtype)
        return fused_experts_reference(x, ids, weights, gate_up, down, gate_up_scale, down_scale, limit=limit,
                                       block=block, out_dtype=out_dtype, alpha=alpha, interleaved=interleaved,
                                       gate_up_bias=gate_up_bias)
    import triton

    if scaled_dot and (interpreting() or x.dtype != torch.bfloat16):
        raise KernelError("fused_experts: scaled_dot needs a GPU (Triton's interpreter has no dot_scaled) and bf16 "
                          f"activations, got {x.dtype}")
    if host is not None or _pick(path, fmt, x.shape[0]) == "pairs":
        return _pairs(x, ids, weights, gate_up, down, gate_up_scale, down_scale, fp4, glu, block_r,
                      block_g or (8 if fp4 else 256), num_warps or (4 if fp4 else 8), out_dtype, host, write_slots)
    scaled_dot = not interpreting() and x.dtype == torch.bfloat16 if scaled_dot is None else scaled_dot
    block_i, num_warps = block_i or (64 if fp4 else 32), num_warps or 4
    block_n = block_n or (128 if fp4 else 64)

    from shardsmith.runtime.layers.kernels import _moe_triton as k

    (T, D), TOP_K = x.shape, ids.shape[1]
    I, P = gate_up.shape[1] // 2, T * TOP_K
    sorted_ids, order = ids.flatten().to(torch.int32).sort(stable=True)  # [P] each, on the device
    order = order.to(torch.int32)
    route = weights.float().flatten().contiguous()  # [P]
    x, gate_up, down, gs, ds, h, y, out = _operands(fmt, x, gate_up, down, gate_up_scale, down_scale, P, out_dtype)
    b0, b1 = block if fmt == "fp8" else (1, 1)
    common = dict(FP4=fp4, FP8=fmt == "fp8", B0=b0, B1=b1, S_R=gs.shape[1] // 2, SCALED_DOT=scaled_dot and fp4,
                  DOT_F32=x.dtype == torch.float32 or interpreting(),
                  BLOCK_P=triton.next_power_of_2(P),
                  BLOCK_M=BLOCK_M, num_warps=num_warps, num_stages=num_stages)
    bias = gate_up if gate_up_bias is None else gate_up_bias  # a stand-in pointer without a bias
    k._gate_up_kernel[(P, triton.cdiv(I, block_i))](
        x, sorted_ids, order, gate_up, gs, bias, h, P, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        gs.stride(0), gs.stride(1), bias.stride(0), glu.limit, glu.alpha_value, TOP_K=TOP_K, D=D, I=I,
        BLOCK_I=block_i, BLOCK_D=min(block_k, triton.next_power_of_2(D)), **glu.flags(), **common)
    k._down_kernel[(P, triton.cdiv(D, block_n))](
        h, sorted_ids, order, down, ds, route, y, P, down.stride(0), down.stride(1), ds.stride(0), ds.stride(1),
        D=D, I=I, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(I)), **common)
    k._combine_kernel[(T, triton.cdiv(D, 1024))](y, out, D=D, TOP_K=TOP_K, BLOCK=1024, num_warps=4)
    return out


def expand_matrix(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, block: tuple[int, int] | None = None,
                  split: int | None = None) -> torch.Tensor:
    """One expert matrix of :func:`grouped_gemm` in ``dtype``: ``[N, K]`` from FP4 ``w [N, K/2]`` and its UE8M0
    ``scale [N, K/32]``, FP8 ``w [N, K]`` and its float32 ``scale`` in ``block`` (rows below ``split`` and from
    ``split`` on each with their own scale rows, the first half and the second: a stacked gate and up), or
    plain ``w`` (``scale`` None)."""
    from shardsmith.runtime.layers.quant import dequantize_blocks, dequantize_fp4

    if w.dtype in (torch.int8, torch.uint8):
        return dequantize_fp4(w, scale, dtype)
    if w.dtype != torch.float8_e4m3fn:
        return w.to(dtype)
    if split is None or split >= w.shape[0]:
        return dequantize_blocks(w, scale, block, dtype)
    s_r = scale.shape[0] // 2
    return torch.cat((dequantize_blocks(w[:split], scale[:s_r], block, dtype),
                      dequantize_blocks(w[split:], scale[s_r:], block, dtype)))


def grouped_gemm_reference(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, sizes: list[int], *,
                           block: tuple[int, int] | None = None, split: int | None = None) -> torch.Tensor:
    """The plain PyTorch path :func:`grouped_gemm` replaces: expert by expert, its matrix expanded to
    ``a.dtype`` in memory (:func:`expand_matrix`), then ``F.linear`` on its run of rows. Arguments as
    :func:`grouped_gemm`."""
    out, start = a.new_empty((a.shape[0], w.shape[1])), 0
    for g, n in enumerate(sizes):
        wg = expand_matrix(w[g], None if scale is None else scale[g], a.dtype, block, split)
        out[start:start + n] = torch.nn.functional.linear(a[start:start + n], wg)
        start += n
    return out


def tile_table(sizes: list[int], block_m: int) -> list[int]:
    """``[expert, r0, r1] * tiles`` (flat) for runs of ``sizes[g]`` rows one after another: each run cut in
    blocks of ``block_m`` rows, empty runs left out.

    >>> tile_table([3, 0, 5], 4)
    [0, 0, 3, 2, 3, 7, 2, 7, 8]
    """
    table, start = [], 0
    for g, n in enumerate(sizes):
        for r in range(start, start + n, block_m):
            table += [g, r, min(r + block_m, start + n)]
        start += n
    return table


def tile_blocks(sizes: list[int]) -> dict[str, int]:
    """:func:`grouped_gemm`'s block shape for runs of ``sizes`` rows: tall tiles (128 rows of a run,
    64-element reduction steps, 8 warps) once the present runs average 128 rows or more (a long chunk:
    each expert's bytes are decoded once per 128 rows instead of per 64), else the default 64-row tiles
    (a short chunk's runs would leave most of a tall tile empty)."""
    present = [n for n in sizes if n]
    if present and sum(present) >= 128 * len(present):
        return {"block_m": 128, "block_k": 64, "num_warps": 8}
    return {}


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, sizes: list[int], *,
                 block: tuple[int, int] | None = None, split: int | None = None, block_m: int = 64,
                 block_n: int = 128, block_k: int = 128, num_warps: int = 4, num_stages: int = 3,
                 scaled_dot: bool | None = None, backend: str = "auto") -> torch.Tensor:
    """Runs of rows through their own expert matrix: ``out[run g] = a[run g] @ W[g].T``, the runs one after
    another in ``a`` (a prefill chunk's (token, expert) pairs sorted by expert), ``W[g]`` FP4, FP8
    block-scaled or plain.

    The grouped GEMM of a chunk's routed experts with the dequantization inside the kernel: each expert's
    stored bytes and scales are read from HBM and expanded in registers, never written out in ``a.dtype``
    (expanding FP4 first writes and reads 4x its bytes per expert, the larger part of a chunk's expert
    time with 256 experts). Tiles of ``block_m`` rows of one run (the last one ragged) times ``block_n``
    output rows; the tile table is built on the host from ``sizes`` (a prefill's expert counts are on the
    host already), so this is not for captured decode steps.

    Args:
        a: ``[n, K]`` bf16, f16 or float32 rows (``n = sum(sizes)``), contiguous rows.
        w: ``[G, N, K/2]`` int8 or uint8 FP4, two e2m1 codes per byte (element ``2i`` in the low nibble),
            with ``scale [G, N, K/32]`` UE8M0 (float8_e8m0fnu or its uint8 bytes); or ``[G, N, K]``
            ``float8_e4m3fn`` with ``scale [G, R_s, ceil(K/b1)]`` float32 in ``block`` ``(b0, b1)``
            (``R_s = ceil(N/b0)``, or with ``split`` two stacked halves of ``ceil(split/b0)`` rows
            and ``ceil((N-split)/b0)``); or ``[G, N, K]`` bf16/f16/float32 with ``scale`` None. Rows contiguous.
        sizes: ``[G]`` rows of each run (0 allowed), on the host.
        block: an FP8 bank's scale block; split: FP8 output rows from ``split`` on read the second half
            of the scale rows (a stacked gate ``[0, split)`` and up; default N: one matrix).
        block_m, block_n, block_k: rows of a tile, output rows per program, reduction elements per step
            (``block_k`` a multiple of 32, capped at K's next power of two); num_warps, num_stages: Triton's.
        scaled_dot: the FP4 product through ``tl.dot_scaled`` (default: on with bf16 ``a`` on a GPU, as
            :func:`fused_experts`); backend: ``auto``, ``triton`` or ``reference`` (:func:`grouped_gemm_reference`).

    Returns:
        ``[n, N]`` in ``a.dtype`` (float32 accumulation; FP8 weights scaled in float32 and cast to
        ``a.dtype`` before the product, as :func:`~shardsmith.runtime.layers.quant.dequantize_blocks` does).

    Raises:
        KernelError: shapes, dtypes or devices that do not fit (every problem listed), or a backend that
            cannot run.
    """
    fp4 = w.dtype in (torch.int8, torch.uint8)
    fp8 = w.dtype == torch.float8_e4m3fn
    problems = []
    if a.dim() != 2 or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        problems.append(f"a must be [n, K] bf16/f16/f32, got {tuple(a.shape)} {a.dtype}")
    if w.dim() != 3 or w.dtype not in (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float16,
                                       torch.float32):
        problems.append(f"w must be [G, N, K] FP8/bf16/f16/f32 or [G, N, K/2] int8/uint8 FP4, got {tuple(w.shape)} "
                        f"{w.dtype}")
    elif a.dim() == 2:
        K, (G, N) = a.shape[1], w.shape[:2]
        if fp4 and (K % 32 or w.shape[2] != K // 2 or scale is None or tuple(scale.shape) != (G, N, K // 32)):
            problems.append(f"a has K={K} (a multiple of 32 needed): w must be [G, N, {K // 2}] and scale "
                            f"[G, N, {K // 32}], got {tuple(w.shape)}, {None if scale is None else tuple(scale.shape)}")
        if not fp4 and w.shape[2] != K:
            problems.append(f"a has K={K}: w must be [G, N, {K}], got {tuple(w.shape)}")
        if fp8:
            b0, b1 = block or (0, 0)
            rows = (-(-N // b0) if split is None or split >= N else -(-split // b0) * 2) if b0 > 0 else -1
            if not (b0 > 0 and b1 > 0) or scale is None or scale.dim() != 3 or tuple(scale.shape[:2]) != (G, rows) \
                    or scale.shape[2] != -(-K // max(b1, 1)) or scale.dtype != torch.float32:
                problems.append(f"FP8 w needs block (b0, b1) and float32 scale [G, ceil(N/b0) (or two stacked "
                                f"halves with split), ceil(K/b1)], got block {block}, split {split}, scale "
                                f"{None if scale is None else (tuple(scale.shape), scale.dtype)}")
            if split is not None and split < N and (N - split != split):
                problems.append(f"split {split} must halve N={N} (a stacked gate and up)")
        if not (fp4 or fp8) and scale is not None:
            problems.append(f"a plain {w.dtype} w takes no scale")
        if len(sizes) != G or sum(sizes) != a.shape[0] or min(sizes, default=0) < 0:
            problems.append(f"sizes must give each of the {G} matrices its rows of a ({a.shape[0]} in all), "
                            f"got {len(sizes)} runs of {sum(sizes)} rows")
    for name, t in (("w", w), ("scale", scale)):
        if t is None:
            continue
        if t.device != a.device:
            problems.append(f"{name} is on {t.device}, a on {a.device}: one device")
        if t.stride(-1) != 1:
            problems.append(f"{name} rows must be contiguous (last stride 1, got {t.stride(-1)})")
    if block_k % 32 or min(block_m, block_n) < 16:
        problems.append(f"block_k {block_k} must be a multiple of 32, block_m {block_m} and block_n {block_n} >= 16")
    if problems:
        raise KernelError("grouped_gemm: " + "; ".join(problems))
    if not use_triton(a, backend):
        return grouped_gemm_reference(a, w, scale, sizes, block=block, split=split)
    import triton

    from shardsmith.runtime.layers.kernels import _moe_triton as k
    from shardsmith.runtime.layers.staging import to_device

    if scaled_dot and (interpreting() or a.dtype != torch.bfloat16 or not fp4):
        raise KernelError("grouped_gemm: scaled_dot needs a GPU (Triton's interpreter has no dot_scaled), bf16 "
                          f"activations and FP4 weights, got {a.dtype} and {w.dtype}")
    scaled_dot = fp4 and not interpreting() and a.dtype == torch.bfloat16 if scaled_dot is None else scaled_dot
    (n, K), N = a.shape, w.shape[1]
    out = torch.empty((n, N), dtype=a.dtype, device=a.device)
    table = tile_table(sizes, block_m)
    if not table:
        return out
    (tiles,) = to_device([torch.tensor(table, dtype=torch.int32)], a.device)  # one asynchronous copy
    a = a if a.stride(-1) == 1 else a.contiguous()
    if fp4:
        w, scale = w.view(torch.uint8), scale.view(torch.uint8)
    s = scale if scale is not None else w  # a plain matrix reads no scale: any pointer
    b0, b1 = block if fp8 else (1, 1)
    split = N if split is None else split
    k._tiles_mm_kernel[(len(table) // 3 * triton.cdiv(N, block_n),)](
        a, tiles, w, s, out, a.stride(0), out.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        N=N, KDIM=K, FP4=fp4, FP8=fp8, B0=b0, B1=b1, SPLIT=split, S_R=s.shape[1] // 2 if fp8 else 0,
        SCALED_DOT=scaled_dot, DOT_F32=a.dtype == torch.float32 or interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(K)), num_warps=num_warps,
        num_stages=num_stages)
    return out


PATHS = ("auto", "grouped", "pairs")


def pick_path(fmt: str, tokens: int) -> str:
    """The kernel path ``auto`` takes for a bank format (``fp4``, ``fp8``, ``dense``) and batch size.

    From the H200 sweep (benchmarks/RESULTS.md, h200x1j): FP4 takes the pair path at every decode
    batch up to 16 tokens (1.7x the grouped path at T = 1, 1.15x at T = 16); bf16 only up to 4
    tokens (1.1x), past that the grouped ``tl.dot`` reads each shared expert once and wins; FP8 and
    longer batches (prefill: the pair path would read an expert once per token) stay grouped.

    >>> pick_path("fp4", 1), pick_path("fp4", 16), pick_path("fp4", 17), pick_path("dense", 8)
    ('pairs', 'pairs', 'grouped', 'grouped')
    """
    if fmt == "fp4" and tokens <= 16 or fmt == "dense" and tokens <= 4:
        return "pairs"
    return "grouped"


def _pick(path: str, fmt: str, tokens: int) -> str:
    if path == "auto":
        path = pick_path(fmt, tokens)
    if path not in PATHS:
        raise KernelError(f"fused_experts: path {path!r}: expected one of {', '.join(PATHS)}")
    if path == "pairs" and fmt == "fp8":
        return "grouped"  # the pair path reads FP4 and plain banks; FP8 block scales stay grouped
    return path


def _operands(fmt: str, x, gate_up, down, gate_up_scale, down_scale, P: int, out_dtype) -> tuple:
    """What both paths' kernels take: ``x`` with contiguous rows, the bank as the kernels read it
    (FP4 bytes and UE8M0 scales as uint8; a plain bank's scale pointers are unused stand-ins), and
    the buffers ``h [P, I_r]`` (x's dtype), ``y [P, D]`` (float32) and ``out [T, D]``."""
    (T, D), I = x.shape, gate_up.shape[1] // 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    if fmt == "fp4":
        gate_up, down = gate_up.view(torch.uint8), down.view(torch.uint8)
        gs, ds = gate_up_scale.view(torch.uint8), down_scale.view(torch.uint8)
    elif fmt == "fp8":
        gs, ds = gate_up_scale, down_scale
    else:
        gs, ds = gate_up, down  # unused pointers
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)
    y = torch.empty((P, D), dtype=torch.float32, device=x.device)
    out = torch.empty((T, D), dtype=out_dtype or x.dtype, device=x.device)
    return x, gate_up, down, gs, ds, h, y, out


class GLU(NamedTuple):
    """The gated unit's arguments (:func:`fused_experts`' ``limit``, ``alpha``, ``interleaved``, ``gate_up_bias``)."""

    limit: float
    alpha: float | None
    interleaved: bool
    bias: torch.Tensor | None

    @property
    def alpha_value(self) -> float:
        """``alpha`` as the kernels take it (unused without ``HAS_ALPHA``)."""
        return 1.0 if self.alpha is None else float(self.alpha)

    def flags(self) -> dict[str, bool]:
        """The kernels' compile-time switches."""
        return {"HAS_LIMIT": bool(self.limit), "INTERLEAVED": self.interleaved, "HAS_BIAS": self.bias is not None,
                "HAS_ALPHA": self.alpha is not None}


def _pairs(x, ids, weights, gate_up, down, gate_up_scale, down_scale, fp4: bool, glu: GLU, block_r: int,
           block_g: int, num_warps: int, out_dtype, host=None, write_slots=None) -> torch.Tensor:
    """The pair path of :func:`fused_experts` (inputs checked there)."""
    import triton

    from shardsmith.runtime.layers.kernels import _moe_triton as k

    (T, D), TOP_K = x.shape, ids.shape[1]
    I, P = gate_up.shape[1] // 2, T * TOP_K
    ids, route = ids.contiguous(), weights.float().contiguous()
    x, gate_up, down, gs, ds, h, y, out = _operands("fp4" if fp4 else "dense", x, gate_up, down, gate_up_scale,
                                                    down_scale, P, out_dtype)
    g_max = triton.next_power_of_2(max(1, min(D, I) // 32 if fp4 else min(D, I)))
    G = min(block_g, g_max)
    bias = gate_up if glu.bias is None else glu.bias  # a stand-in pointer without a bias
    deltas, dst, bias_delta = (0, 0, 0, 0), ids, 0
    if host is not None:
        deltas, dst = _host_deltas(fp4, (gate_up, gs, down, ds), host), write_slots.contiguous()
        bias_delta = 0 if glu.bias is None else _delta("gate_up_bias", glu.bias, host["gate_up_bias"])
    k._pair_gate_up_kernel[(P, triton.cdiv(I, block_r))](
        x, ids, gate_up, gs, bias, h, x.stride(0), gate_up.stride(0), gate_up.stride(1), gs.stride(0), gs.stride(1),
        bias.stride(0), glu.limit, glu.alpha_value, dst, deltas[0], deltas[1], bias_delta, TOP_K=TOP_K, D=D, I=I,
        FP4=fp4, BLOCK_R=block_r, G=G, HOST=host is not None, num_warps=num_warps, **glu.flags())
    k._pair_down_kernel[(P, triton.cdiv(D, block_r))](
        h, ids, down, ds, route, y, down.stride(0), down.stride(1), ds.stride(0), ds.stride(1), dst, deltas[2],
        deltas[3], D=D, I=I, FP4=fp4, BLOCK_R=block_r, G=G, HOST=host is not None, num_warps=num_warps)
    k._combine_kernel[(T, triton.cdiv(D, 1024))](y, out, D=D, TOP_K=TOP_K, BLOCK=1024, num_warps=4)
    return out


HOST_ARRAYS = ("gate_up", "gate_up_scale", "down", "down_scale", "gate_up_bias")


def _check_host(fmt: str, bank: dict, host: dict, ids: torch.Tensor, write_slots: torch.Tensor | None,
                path: str) -> None:
    """A host bank must match the device bank array for array (dtype, row layout, expert stride)."""
    problems = []
    if fmt == "fp8":
        problems.append("host experts read in place: FP4 and plain banks only (the pair path), got FP8")
    if path == "grouped":
        problems.append("host experts read in place need the pair path, got path='grouped'")
    for name in HOST_ARRAYS:
        b, h = bank.get(name), host.get(name)
        if (b is None) != (h is None):
            problems.append(f"host {name}: {'missing' if h is None else 'given'}, the bank's is "
                            f"{'missing' if b is None else 'given'}")
        elif b is not None and (h.dtype != b.dtype or tuple(h.shape[1:]) != tuple(b.shape[1:])
                                or h.stride() != (h.shape[1:].numel(),) + b.stride()[1:] or b.stride(0) != h.stride(0)):
            problems.append(f"host {name} {tuple(h.shape)} {h.dtype} strides {h.stride()} against the bank's "
                            f"{tuple(b.shape)} {b.dtype} strides {b.stride()}: one layout")
    if write_slots is None or write_slots.dtype != torch.int64 or write_slots.numel() != ids.numel():
        problems.append(f"host experts need write_slots [P={ids.numel()}] int64 (-1: no write), got "
                        f"{None if write_slots is None else (tuple(write_slots.shape), write_slots.dtype)}")
    elif write_slots.device != ids.device:
        problems.append(f"write_slots on {write_slots.device}, ids on {ids.device}: one device")
    if problems:
        raise KernelError("fused_experts: " + "; ".join(problems))


def _host_deltas(fp4: bool, arrays: tuple, host: dict) -> tuple[int, int, int, int]:
    """Element offsets from each bank array the kernels read (``gate_up``, its scales, ``down``, its
    scales) to the host bank's (a plain bank's scale pointers are stand-ins: offset 0)."""
    names = HOST_ARRAYS[:4] if fp4 else ("gate_up", None, "down", None)
    return tuple(0 if name is None else _delta(name, a, host[name]) for name, a in zip(names, arrays))


def _delta(name: str, a: torch.Tensor, host: torch.Tensor) -> int:
    """Elements of ``a``'s dtype from bank array ``a`` to its host twin (one pointer reaches both)."""
    h = host.view(a.dtype)
    diff = h.data_ptr() - a.data_ptr()
    if diff % a.element_size():
        raise KernelError(f"fused_experts: host {name} at {h.data_ptr():#x} is not {a.element_size()}-byte "
                          f"aligned against the bank's {a.data_ptr():#x}")
    return diff // a.element_size()


def _host_reference(x, ids, weights, bank: dict, host: dict, write_slots, glu: GLU, out_dtype) -> torch.Tensor:
    """:func:`fused_experts` with a host bank in PyTorch: each pair's expert from the bank (id >= 0)
    or the host bank (``-1 - id``), the reference maths, then the write-through copies."""
    sel = ids.flatten().tolist()
    arrays = {name: torch.stack([bank[name][e] if e >= 0 else host[name][-1 - e].to(bank[name].device)
                                 for e in sel]) for name in HOST_ARRAYS if bank.get(name) is not None}
    idx = torch.arange(len(sel), device=x.device).view(ids.shape)
    out = fused_experts_reference(x, idx, weights, arrays["gate_up"], arrays["down"], arrays.get("gate_up_scale"),
                                  arrays.get("down_scale"), limit=glu.limit, out_dtype=out_dtype, alpha=glu.alpha,
                                  interleaved=glu.interleaved, gate_up_bias=arrays.get("gate_up_bias"))
    for p, (e, d) in enumerate(zip(sel, write_slots.tolist())):
        if e < 0 and d >= 0:
            for name, a in arrays.items():
                bank[name][d].copy_(a[p])
    return out
