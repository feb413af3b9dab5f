"""Routed experts on the host, read in their stored format by a small C++ kernel.

The plain path (:func:`shardsmith.runtime.layers.experts.expert_output`, the reference) expands an
expert to a dense copy, then multiplies: for a DeepSeek-V4-Flash expert at batch 1 that is 12.75 MB
of packed FP4 expanded to 50 MB of bf16, written and read again, about 100x the host's memory floor.
:func:`expert_swiglu_host` runs the whole expert (gate_up, SwiGLU, down; :func:`experts_swiglu_host` a layer's
experts) in one kernel call that decodes the stored bytes in registers instead (``host_kernel*.cpp``: FP4 e2m1 + UE8M0 per 32, FP8
e4m3 + float32 block scales, bf16), shares every decoded vector among up to 8 of the step's tokens,
and accumulates in float32, with rows split over torch's intra-op threads (the rank's share of the
cores, :func:`~shardsmith.runtime.engine.dist.clamp_threads`).

Instruction sets (:func:`isas`, chosen per call; :func:`default_isa` is the best one, or
``SHARDSMITH_TUNING=host_isa``): ``scalar`` (plain C++), ``avx2`` (AVX2 + FMA + F16C: FP4 through a pshufb
table, FP8 -> f16 by bit moves), ``avx512`` (AVX-512F and BW: FP4 through a 16-entry float table per
vpermps, 16 lanes; FP8 decoded 32 bytes at a time on 16-bit lanes, its block scales folded into a
per-thread copy of the activations once per row block, so the inner loop is decode + FMA). One build holds all three (each file targets its set by pragma) and the CPU's
features decide at run time, so the paths can be compared on one host (``benchmarks/host_experts.py
--isa``). Tried and not taken: int8 activations with integer dot products (VNNI / maddubs) and
bf16 dot products (AVX512-BF16) are faster per byte but round the activations, so the result would
no longer equal the resident bank's within float32 rounding.

The FP4 and FP8 rows prefetch their weight stream :func:`prefetch_bytes` ahead (``SHARDSMITH_TUNING=host_prefetch``,
default 2048): a stored row is 1-4 KiB, so the L2 streamer, which stops at every 4 KiB page, re-trains
every row or two; on the H200 host's 16 cores this took an FP4 expert at one token from 0.36 to 0.26
ms and FP8 from 0.49 to 0.38 ms (``benchmarks/RESULTS.md``, 12 experts cycled).

The kernel is compiled once per machine on first use (``torch.utils.cpp_extension``, ``-O3``),
cached by the hash of its sources, the torch version and the CPU's flags under
``$SHARDSMITH_CACHE/host_kernel``. Without a compiler everything still works: :func:`available`
says whether the compiled kernel is loaded and callers fall back to the reference.

Every argument is checked here, in Python, before an operator is called (:func:`check_expert`,
:func:`fp4_linear`, :func:`dense_linear` raise :class:`~shardsmith.errors.UsageError`), so no
runtime path relies on a C++ exception crossing into Python: on the GPU host one raised by a
``TORCH_CHECK`` in this extension killed the process instead (``benchmarks/gpu/
host_kernel_diag.sh`` isolates it). The ``TORCH_CHECK`` calls stay in the C++ as a second line.

Legend: T = tokens, D = hidden, I_r = this rank's intermediate share.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
from pathlib import Path

import torch

from shardsmith import settings
from shardsmith.runtime.layers.quant import bank_format
from shardsmith.runtime.offload.cpu_flags import cpu_flags
from ...errors import UsageError

log = logging.getLogger("shardsmith.runtime.offload")
_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / f for f in ("host_kernel.cpp", "host_kernel_scalar.cpp", "host_kernel_avx2.cpp",
                                     "host_kernel_avx512.cpp"))
HEADER = _HERE / "host_kernel.h"
MAX_PREFETCH_BYTES = settings.MAX_PREFETCH_BYTES  # the kernel's own bound (set_prefetch_bytes in host_kernel.cpp)
PREFETCH_BYTES = 2048  # software prefetch distance of the row functions (set_prefetch_bytes; 0: none;
# benchmarks/RESULTS.md: of 0-8192 bytes, 2048 gave the best FP4 median on the H200 host, FP8 within noise of 4096)


@functools.cache
def available() -> bool:
    """Compile (once per machine, cached) and load the kernel; False, with one warning, if that fails."""
    if not settings.current().host_kernel:
        return False
    # the build records this environment's include and library paths (torch's cpp_extension writes them
    # into build.ninja), so two environments with the same torch get their own folders, not a rebuild each
    h = hashlib.sha256(torch.__version__.encode() + cpu_flags().encode() + sys.prefix.encode() +
                       str(Path(torch.__file__).parent).encode())
    for f in (*SOURCES, HEADER):
        h.update(f.read_bytes())
    key = h.hexdigest()[:16]
    root = settings.current().cache_dir / "host_kernel" / key
    try:
        from torch.utils.cpp_extension import load

        root.mkdir(parents=True, exist_ok=True)
        if not any(root.glob("*.so")):
            log.info("compiling the host expert kernel (once per machine and torch version; cached in %s)", root)
        load(name=f"shardsmith_host_{key}", sources=[str(s) for s in SOURCES], build_directory=str(root),
             is_python_module=False, extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no headers, a failed build: the reference path still works
        log.warning("host expert kernel unavailable (%s: %s); routed experts on the host use the plain path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    try:
        distance = prefetch_bytes()
    except UsageError as exc:  # serve and generate refuse it before ranks start; here, say so and go on
        log.warning("%s; the host kernel prefetches %d bytes ahead", exc, PREFETCH_BYTES)
        distance = PREFETCH_BYTES
    torch.ops.shardsmith_host.set_prefetch_bytes(distance)
    return True


def prefetch_bytes() -> int:
    """The rows' software prefetch distance in bytes: ``SHARDSMITH_TUNING=host_prefetch`` or :data:`PREFETCH_BYTES`.

    Raises:
        UsageError: the variable is not a whole number of bytes in 0 .. 1 MiB (:mod:`shardsmith.settings`).
    """
    value = settings.current().host_prefetch
    return PREFETCH_BYTES if value is None else value


def current_prefetch_bytes() -> int:
    """The distance the loaded kernel uses now (bytes; 0 without the kernel)."""
    return torch.ops.shardsmith_host.prefetch_bytes() if available() else 0


def set_prefetch_bytes(value: int) -> int:
    """Set the rows' software prefetch distance (bytes, 0 for none) for this process; returns the previous.

    Raises:
        UsageError: the kernel is not available, or ``value`` is outside 0 .. 1 MiB.
    """
    if not available():
        raise UsageError("host expert kernel: not available here (see the warning at load)")
    if not 0 <= value <= MAX_PREFETCH_BYTES:
        raise UsageError(f"host expert kernel: prefetch distance {value} bytes is outside 0 .. {MAX_PREFETCH_BYTES}")
    return torch.ops.shardsmith_host.set_prefetch_bytes(value)


def set_row_blocking(on: bool) -> bool:
    """Whether the row functions take several rows per call (the default; at 2-8 tokens each activation
    vector loaded then serves 2-4 rows) or one (the same accumulator chains in the same order, so the
    same bits; the load pattern of the kernel before 2026-12-02, whose FP8 rows at 5-8 tokens kept two
    chains per token where both settings now keep one); returns the setting before. For side-by-side
    timings (``benchmarks/host_experts.py --row-blocking``).

    Raises:
        UsageError: the kernel is not available.
    """
    if not available():
        raise UsageError("host expert kernel: not available here (see the warning at load)")
    return bool(torch.ops.shardsmith_host.set_row_blocking(bool(on)))


@functools.cache
def isas() -> tuple[str, ...]:
    """Instruction sets this build and CPU support, worst first (``scalar``, ``avx2``, ``avx512``); () without the kernel."""
    return tuple(torch.ops.shardsmith_host.isas().split(",")) if available() else ()


def default_isa() -> str:
    """``SHARDSMITH_TUNING=host_isa`` if set, else the best of :func:`isas`.

    Raises:
        UsageError: the variable names a set this CPU or build lacks.
    """
    want = settings.current().host_isa
    if want and want not in isas():
        raise UsageError(f"{settings.spelling('host_isa', repr(want))}: this CPU and build support {', '.join(isas()) or 'no host kernel'}")
    return want or (isas()[-1] if isas() else "")


def supports(arrays: dict[str, torch.Tensor]) -> bool:
    """Whether :func:`expert_swiglu_host` takes these arrays (FP4, FP8 with float32 scales, bf16; host memory)."""
    gu = arrays["gate_up"]
    if gu.device.type != "cpu" or not available():
        return False
    fmt = bank_format(gu)
    if fmt == "fp4":
        return gu.shape[-1] % 16 == 0 and arrays["down"].shape[-1] % 16 == 0
    if fmt == "fp8":
        return arrays["gate_up_scale"].dtype == torch.float32
    return gu.dtype == torch.bfloat16


_CHECKED: set[tuple] = set()  # layouts check_expert has passed


def _fail(errors: list[str]) -> None:
    if errors:
        raise UsageError("host expert kernel: " + "; ".join(sorted(errors)))


def _isa_errors(isa: str) -> list[str]:
    if isa and isa not in isas():
        return [f"instruction set {isa!r} is not available here; this build and CPU support {', '.join(isas()) or 'none'}"]
    return []


def _fp4_errors(name: str, w: torch.Tensor, s: torch.Tensor, cols: int | None) -> list[str]:
    """Problems of an FP4 weight ``[R, C/2]`` bytes with UE8M0 scales ``[R, C/32]`` meeting ``cols`` inputs."""
    out = []
    if w.dim() != 2 or w.element_size() != 1 or (w.numel() and w.stride(1) != 1):
        return [f"{name}: fp4 weight must be [R, C/2] bytes with contiguous rows, got {w.dtype} {list(w.shape)}"]
    if s.dim() != 2 or s.element_size() != 1 or (s.numel() and s.stride(1) != 1):
        return [f"{name}: fp4 scale must be [R, C/32] bytes with contiguous rows, got {s.dtype} {list(s.shape)}"]
    c = 2 * w.shape[1]
    if c % 32 or tuple(s.shape) != (w.shape[0], c // 32):
        out.append(f"{name}: fp4 scale {list(s.shape)} does not match the weight {list(w.shape)} "
                   f"(want [{w.shape[0]}, {c // 32}], C = {c} a multiple of 32)")
    if cols is not None and c != cols:
        out.append(f"{name}: x has {cols} columns, the weight {c}")
    return out


def _dense_errors(name: str, w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
                  cols: int | None) -> list[str]:
    """Problems of an FP8 ``[R, C]`` weight with float32 block scales, or a bf16 one (``scale`` None)."""
    if w.dim() != 2 or (w.numel() and w.stride(1) != 1):
        return [f"{name}: weight must be [R, C] with contiguous rows, got {list(w.shape)}"]
    out = []
    if scale is None:
        if w.dtype != torch.bfloat16:
            out.append(f"{name}: a weight without scale must be bfloat16, got {w.dtype}")
    else:
        if w.element_size() != 1:
            out.append(f"{name}: fp8 weight must be 1 byte per element, got {w.dtype}")
        if block is None or len(block) != 2 or min(block) <= 0:
            return out + [f"{name}: fp8 needs a positive block (rows, cols), got {block}"]
        br, bc = block
        want = (-(-w.shape[0] // br), -(-w.shape[1] // bc))
        if scale.dim() != 2 or scale.dtype != torch.float32 or (scale.numel() and scale.stride(1) != 1):
            out.append(f"{name}: fp8 scale must be float32 [R/BR, C/BC] with contiguous rows, got {scale.dtype} "
                       f"{list(scale.shape)}")
        elif tuple(scale.shape) != want:
            out.append(f"{name}: fp8 scale {list(scale.shape)} does not match the weight {list(w.shape)} in "
                       f"{br}x{bc} blocks (want {list(want)})")
    if cols is not None and w.shape[1] != cols:
        out.append(f"{name}: x has {cols} columns, the weight {w.shape[1]}")
    return out


def _x_errors(x: torch.Tensor) -> list[str]:
    if x.dim() != 2 or x.shape[0] < 1:
        return [f"x must be [T, C] with T >= 1, got {list(x.shape)}"]
    return []


def fp4_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, *, isa: str = "") -> torch.Tensor:
    """``y [T, R] float32 = x [T, C] @ W^T`` for an FP4 weight ``w [R, C/2]`` (uint8, two e2m1 codes a
    byte) with UE8M0 scales ``s [R, C/32]`` (uint8); ``isa`` "" for :func:`default_isa`.

    Raises:
        UsageError: a shape, dtype or layout the kernel does not take, or an instruction set it lacks
            (every problem listed, checked before the operator runs).
    """
    _fail(_x_errors(x) + _fp4_errors("w", w, s, x.shape[-1]) + _isa_errors(isa))
    return torch.ops.shardsmith_host.fp4_linear(x.float().contiguous(), w, s, isa)


def dense_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None, *,
                 isa: str = "") -> torch.Tensor:
    """``y [T, R] float32 = x [T, C] @ W^T`` for an FP8 e4m3 weight ``w [R, C]`` with float32 block
    scales ``scale [ceil(R/BR), ceil(C/BC)]`` (``block = (BR, BC)``), or a bf16 weight (``scale`` None).

    Raises:
        UsageError: as :func:`fp4_linear`.
    """
    _fail(_x_errors(x) + _dense_errors("w", w, scale, block, x.shape[-1]) + _isa_errors(isa))
    br, bc = block if scale is not None else (0, 0)
    return torch.ops.shardsmith_host.dense_linear(x.float().contiguous(), w, scale, br, bc, isa)


def check_expert(arrays: dict[str, torch.Tensor], x: torch.Tensor, block: tuple[int, int] | None,
                 isa: str = "") -> None:
    """Raise unless :func:`expert_swiglu_host` takes these arrays, activations and instruction set.

    Raises:
        UsageError: every problem found (shapes of gate_up, down and their scales against each other
            and against ``x [n, D]``, dtypes, the block, the instruction set), sorted, in one message.
    """
    key = (tuple((k, v.dtype, tuple(v.shape), tuple(v.stride())) for k, v in sorted(arrays.items()) if v is not None),
           x.dim(), tuple(x.shape[1:]), x.dim() == 2 and x.shape[0] >= 1, block, isa)
    if key in _CHECKED:  # one check per layout: every expert of a bank shares it, and this runs per expert
        return
    gu, down = arrays["gate_up"], arrays["down"]
    errors = _x_errors(x) + _isa_errors(isa)
    if errors:
        _fail(errors)
    d = x.shape[1]
    fmt = bank_format(gu)
    if gu.dim() != 2 or gu.shape[0] % 2 or down.dim() != 2:
        _fail([f"gate_up must be [2*I, ...] and down [D, I], got {list(gu.shape)} and {list(down.shape)}"])
    inter = gu.shape[0] // 2
    if fmt == "fp4":
        missing = sorted(k for k in ("gate_up_scale", "down_scale") if arrays.get(k) is None)
        if missing:
            _fail([f"fp4 expert without {', '.join(missing)}"])
        errors += _fp4_errors("gate_up", gu.view(torch.uint8), arrays["gate_up_scale"].view(torch.uint8), d)
        errors += _fp4_errors("down", down.view(torch.uint8), arrays["down_scale"].view(torch.uint8), inter)
    elif fmt == "fp8":
        gus, dns = arrays.get("gate_up_scale"), arrays.get("down_scale")
        if gus is None or dns is None:
            _fail(["fp8 expert without gate_up_scale or down_scale"])
        if block is None:
            _fail(["fp8 expert needs its block size"])
        half = gus.shape[0] // 2 if gus.dim() == 2 else 0
        errors += _dense_errors("gate", gu[:inter], gus[:half].float(), block, d)
        errors += _dense_errors("up", gu[inter:], gus[half:].float(), block, d)
        errors += _dense_errors("down", down, dns.float(), block, inter)
    else:
        errors += _dense_errors("gate_up", gu, None, None, d) + _dense_errors("down", down, None, None, inter)
    if down.shape[0] != d:
        errors.append(f"down has {down.shape[0]} rows, x {d} columns")
    bias = arrays.get("gate_up_bias")
    if bias is not None and tuple(bias.shape) != (2 * inter,):
        errors.append(f"gate_up_bias must be [{2 * inter}] (one per gate_up row), got {list(bias.shape)}")
    _fail(errors)
    _CHECKED.add(key)


def expert_swiglu_host(arrays: dict[str, torch.Tensor], x: torch.Tensor, block: tuple[int, int] | None,
                       limit: float = 0.0, *, alpha: float | None = None, interleaved: bool = False,
                       isa: str | None = None, check: bool = True) -> torch.Tensor:
    """One routed expert on its token rows, ``x [n, D] -> [n, D]`` (``x.dtype``), from its stored arrays.

    ``down(act(gate x, up x))`` with ``act(g, u) = silu(g) * u``, or with ``limit`` L > 0
    ``silu(min(g, L)) * clamp(u, -L, L)`` (DeepSeek-V4), or with ``alpha`` gpt-oss's
    ``(clamp(u, -L, L) + 1) * g * sigmoid(alpha * g)``, ``g = min(g, L)``; a ``gate_up_bias`` is added
    to the projections first (:class:`~shardsmith.runtime.layers.experts.ExpertMath`): the function of
    :func:`~shardsmith.runtime.layers.experts.expert_output` (the reference), computed in float32
    without expanding the weights; equal to the reference within float32 rounding. A layer's experts
    are better computed together (:func:`experts_swiglu_host`).

    Args:
        arrays: one expert's ``gate_up [2*I_r, D]`` (FP4: ``[2*I_r, D/2]``; gate rows, then up rows),
            ``down [D, I_r]`` and, quantized, ``gate_up_scale`` / ``down_scale`` (gate and up scale
            rows stacked like their weights), and (gpt-oss) ``gate_up_bias [2*I_r]``; host tensors,
            see :func:`supports`.
        x: ``[n, D]`` host activations, any n >= 1; block: FP8 block size ``(rows, cols)`` (FP8 only).
        limit: SwiGLU clamp, 0 for none. alpha: gpt-oss's GLU (None: the SwiGLU); interleaved:
            ``gate_up`` rows alternate gate and up (FP4 only). isa: one of :func:`isas` (default
            :func:`default_isa`).
        check: run :func:`check_expert` first; pass False only where the caller has checked this
            layout (every expert of a bank shares it) with these ``D``, ``block`` and ``isa``.

    Raises:
        UsageError: from :func:`check_expert`, before the kernel runs (shapes that do not match, a
            missing scale or block, an instruction set this CPU or build lacks).
    """
    return experts_swiglu_host([arrays], [x], block, limit, alpha=alpha, interleaved=interleaved, isa=isa,
                               check=check)[0]


def experts_swiglu_host(experts: list[dict[str, torch.Tensor]], xs: list[torch.Tensor],
                        block: tuple[int, int] | None, limit: float = 0.0, *, alpha: float | None = None,
                        interleaved: bool = False, isa: str | None = None,
                        check: bool = True) -> list[torch.Tensor]:
    """A layer's routed experts, each on its own token rows, in one kernel call: ``xs[e] [n_e, D] ->
    [n_e, D]`` (``xs[0].dtype``), the function of :func:`expert_swiglu_host` per expert.

    One call runs every expert's gate_up rows in one parallel region, their SwiGLU in a second and
    their down rows in a third, so a decode step pays the threads' wake-up, the barriers and the
    Python around the operator once per layer instead of once per expert (``benchmarks/host_experts.py``
    compares the two per expert).

    Args:
        experts: each expert's arrays, as :func:`expert_swiglu_host` takes them; every one the same
            format and shapes (one bank's experts).
        xs: each expert's ``[n_e, D]`` token rows (n_e >= 1), in the order of ``experts``.
        block, limit, alpha, interleaved, isa, check: as :func:`expert_swiglu_host` (``check`` checks
            every expert).

    Raises:
        UsageError: no experts, ``xs`` of another length or of several dtypes, experts of different
            formats or shapes, or anything :func:`check_expert` finds, before the kernel runs.
    """
    if not experts or len(experts) != len(xs):
        raise UsageError(f"host expert kernel: {len(experts)} experts and {len(xs)} token blocks (want as many, >= 1)")
    if len({x.dtype for x in xs}) > 1:
        kinds = ", ".join(sorted({str(x.dtype) for x in xs}))
        raise UsageError(f"host expert kernel: token blocks of several dtypes ({kinds}); one call returns one dtype")
    isa = default_isa() if isa is None else isa
    gu0 = experts[0]["gate_up"]
    if check:
        for e, (arrays, x) in enumerate(zip(experts, xs)):
            check_expert(arrays, x, block, isa)
            if (arrays["gate_up"].dtype, arrays["gate_up"].shape) != (gu0.dtype, gu0.shape):
                _fail([f"expert {e}'s gate_up is {arrays['gate_up'].dtype} {list(arrays['gate_up'].shape)}, expert 0's "
                       f"{gu0.dtype} {list(gu0.shape)} (one call takes one bank's experts)"])
    fmt = bank_format(gu0)
    if interleaved and fmt != "fp4":
        raise UsageError(f"host expert kernel: interleaved gate/up rows are FP4 experts' (gpt-oss), got {fmt}")
    if len({"gate_up_bias" in a for a in experts}) > 1:
        raise UsageError("host expert kernel: some experts have a gate_up_bias and some not (one call takes one bank's)")
    bias = [a["gate_up_bias"].float().contiguous() for a in experts] if "gate_up_bias" in experts[0] else []
    glu = (bias, float(alpha or 0.0), interleaved)
    rows = [x.shape[0] for x in xs]
    x32 = xs[0].float().contiguous() if len(xs) == 1 else torch.cat([x.float() for x in xs])
    gate_up, down = [a["gate_up"] for a in experts], [a["down"] for a in experts]
    if fmt == "fp4":
        u8 = lambda ts: [t.view(torch.uint8) for t in ts]  # noqa: E731
        y = torch.ops.shardsmith_host.experts(x32, rows, u8(gate_up), u8(a["gate_up_scale"] for a in experts), u8(down),
                                              u8(a["down_scale"] for a in experts), "fp4", 0, 0, limit, *glu, isa)
    elif fmt == "fp8":
        br, bc = block
        y = torch.ops.shardsmith_host.experts(x32, rows, gate_up, [a["gate_up_scale"].float() for a in experts], down,
                                              [a["down_scale"].float() for a in experts], "fp8", br, bc, limit, *glu,
                                              isa)
    else:
        y = torch.ops.shardsmith_host.experts(x32, rows, gate_up, [], down, [], "bf16", 0, 0, limit, *glu, isa)
    return list(y.to(xs[0].dtype).split(rows))
