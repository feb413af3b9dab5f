"""Random inputs in the checkpoints' formats, an error measure and GPU-like bf16 rounding under the interpreter,
for the kernel tests and benchmarks.

Values are drawn fresh from a seeded generator on its own device (a CUDA generator makes a
multi-gigabyte bank in milliseconds), never zeros (they hide unwritten outputs), and are scaled
so a layer's outputs stay O(1): UE8M0 scale bytes vary around ``bias`` per block or group, so a
wrong scale index shows as a large error.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

E2M1_RMS = 3.0  # root-mean-square of the 16 e2m1 codes' values, about 2.9


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (NaN or inf anywhere gives inf)."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


@contextlib.contextmanager
def interpreter_rounds_bf16() -> Iterator[None]:
    """Within the block, Triton's CPU interpreter casts float32 to bfloat16 rounding to nearest even,
    as the GPU's ``cvt.rn.bf16.f32`` does (Triton 3.x's interpreter truncates: its ``_convert_float``
    drops the low 16 bits), so a test can hold a kernel's bf16 outputs to PyTorch's bits. A no-op
    when the interpreter is off (kernels on a GPU round by themselves).

    Raises:
        RuntimeError: this Triton's interpreter has no ``_convert_float`` to patch.
    """
    from shardsmith.runtime.layers.kernels._common import interpreting

    if not interpreting():
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    real = getattr(interpreter, "_convert_float", None)
    if real is None:
        raise RuntimeError("triton.runtime.interpreter._convert_float is gone: update interpreter_rounds_bf16")

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return real(data, src, dst, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = real


def _ue8m0(shape: tuple[int, ...], centre: float, gen: torch.Generator) -> torch.Tensor:
    """UE8M0 bytes ``round(127 + centre) + {-1, 0, 1}`` as uint8."""
    base = 127 + round(centre)
    return (torch.randint(-1, 2, shape, generator=gen, device=gen.device, dtype=torch.int16) + base).to(torch.uint8)


def random_fp8_linear(n: int, k: int, block: tuple[int, int], *, ue8m0: bool,
                      gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w [N, K] float8_e4m3fn, scale [ceil(N/b0), ceil(K/b1)])``, scale UE8M0 (uint8) or float32,
    sized so ``x @ W.T`` of unit-variance ``x`` has outputs of about unit size."""
    w = torch.randn(n, k, generator=gen, device=gen.device).to(torch.float8_e4m3fn)
    shape = (-(-n // block[0]), -(-k // block[1]))
    centre = -0.5 * math.log2(k)
    if ue8m0:
        return w, _ue8m0(shape, centre, gen)
    return w, 2.0 ** centre * (0.5 + torch.rand(shape, generator=gen, device=gen.device))


def random_bank(experts: int, dim: int, inter: int, *, fp4: bool, gen: torch.Generator,
                dtype: torch.dtype = torch.bfloat16, gate_rms: float = 2.0,
                fp8_block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """One layer's bank ``{gate_up, down[, gate_up_scale, down_scale]}`` in the layout of
    :mod:`~shardsmith.runtime.layers.kernels.fused_moe`; gate/up pre-activations of unit-variance
    inputs have about ``gate_rms`` root-mean-square (so a clamp of a few units bites). With
    ``fp8_block=(b0, b1)`` (and ``fp4=False``): FP8 e4m3 with float32 block scales varying by block,
    gate's and up's scale rows stacked as a bank stacks them."""
    if fp8_block is not None and not fp4:
        b0, b1 = fp8_block
        cd = lambda a, b: -(-a // b)  # noqa: E731

        def scales(rows: int, cols: int, fan_in: int, rms: float) -> torch.Tensor:
            return rms / fan_in ** 0.5 * (0.5 + torch.rand(rows, cols, generator=gen, device=gen.device))

        def codes(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=gen.device).to(torch.float8_e4m3fn)

        gs = torch.stack([torch.cat((scales(cd(inter, b0), cd(dim, b1), dim, gate_rms),
                                     scales(cd(inter, b0), cd(dim, b1), dim, gate_rms))) for _ in range(experts)])
        ds = torch.stack([scales(cd(dim, b0), cd(inter, b1), inter, 1.0) for _ in range(experts)])
        return {"gate_up": codes(experts, 2 * inter, dim), "gate_up_scale": gs,
                "down": codes(experts, dim, inter), "down_scale": ds}
    if not fp4:
        gu = torch.randn(experts, 2 * inter, dim, generator=gen, device=gen.device, dtype=dtype)
        dn = torch.randn(experts, dim, inter, generator=gen, device=gen.device, dtype=dtype)
        return {"gate_up": gu.mul_(gate_rms / dim ** 0.5), "down": dn.mul_(1.0 / inter ** 0.5)}
    gen_codes = lambda *shape: torch.randint(-128, 128, shape, generator=gen, device=gen.device,  # noqa: E731
                                             dtype=torch.int8)
    log2 = math.log2
    return {"gate_up": gen_codes(experts, 2 * inter, dim // 2),
            "gate_up_scale": _ue8m0((experts, 2 * inter, dim // 32), log2(gate_rms / E2M1_RMS) - 0.5 * log2(dim),
                                    gen),
            "down": gen_codes(experts, dim, inter // 2),
            "down_scale": _ue8m0((experts, dim, inter // 32), -log2(E2M1_RMS) - 0.5 * log2(inter), gen)}


def random_routing(tokens: int, top_k: int, experts: int, *,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, K] int64, weights [T, K] float32)``: K distinct experts per token, weights summing to 1."""
    scores = torch.rand(tokens, experts, generator=gen, device=gen.device)
    ids = scores.topk(top_k, dim=-1).indices  # K distinct, uniformly drawn experts per token
    w = torch.rand(tokens, top_k, generator=gen, device=gen.device) + 0.1
    return ids, w / w.sum(-1, keepdim=True)
