"""The host expert kernel (``offload/host_kernel.cpp``) against its reference, ``compute.expert_output``.

Stored formats built with the project's reference quantizers; float32 activations, so the kernel
(float32 accumulation, no expanded copy) must equal the dequantize-then-matmul reference within
float32 rounding. Skipped, saying why, where the kernel cannot be compiled.
"""

from __future__ import annotations

import pytest
import torch

from shardsmith.runtime.offload import host_kernel
from shardsmith.runtime.layers.experts import expert_output
from shardsmith.testing.quant import quantize_fp4_group as quantize_fp4, quantize_fp8_block as quantize_fp8_blocks

pytestmark = pytest.mark.skipif(not host_kernel.available(), reason="host expert kernel could not be compiled here")


def _fp4_expert(g: torch.Generator, inter: int, dim: int) -> dict[str, torch.Tensor]:
    gu, gus = quantize_fp4(torch.randn(2 * inter, dim, generator=g))
    dn, dns = quantize_fp4(torch.randn(dim, inter, generator=g))
    return {"gate_up": gu, "gate_up_scale": gus, "down": dn, "down_scale": dns}


def _fp8_expert(g: torch.Generator, inter: int, dim: int, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    gate, gs = quantize_fp8_blocks(torch.randn(inter, dim, generator=g), block)
    up, us = quantize_fp8_blocks(torch.randn(inter, dim, generator=g), block)
    dn, dns = quantize_fp8_blocks(torch.randn(dim, inter, generator=g), block)
    return {"gate_up": torch.cat([gate, up]), "gate_up_scale": torch.cat([gs, us]), "down": dn, "down_scale": dns}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= 2e-5 * scale, f"max |kernel - reference| = {err:.3g} against max |reference| = {scale:.3g}"


@pytest.mark.parametrize("tokens", [1, 3, 16, 21])
@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_fp4_expert_equals_reference(tokens: int, limit: float) -> None:
    g = torch.Generator().manual_seed(tokens)
    arrays = _fp4_expert(g, inter=96, dim=160)
    assert host_kernel.supports(arrays)
    x = torch.randn(tokens, 160, generator=g)
    _close(host_kernel.expert_swiglu_host(arrays, x, None, limit), expert_output(arrays, x, None, limit))


@pytest.mark.parametrize("block", [(128, 128), (32, 32), (16, 48)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_fp8_ragged_blocks_equal_reference(block: tuple[int, int], tokens: int) -> None:
    g = torch.Generator().manual_seed(7)
    arrays = _fp8_expert(g, inter=72, dim=200, block=block)  # 72 and 200 cut the blocks: ragged edges
    assert host_kernel.supports(arrays)
    x = torch.randn(tokens, 200, generator=g)
    _close(host_kernel.expert_swiglu_host(arrays, x, block), expert_output(arrays, x, block))


def test_bf16_expert_equals_reference_and_keeps_dtype() -> None:
    g = torch.Generator().manual_seed(3)
    arrays = {"gate_up": torch.randn(2 * 40, 67, generator=g).bfloat16(), "down": torch.randn(67, 40, generator=g).bfloat16()}
    x = torch.randn(4, 67, generator=g)
    want = expert_output({k: v.float() for k, v in arrays.items()}, x, None)  # exact bf16 values, float32 maths
    _close(host_kernel.expert_swiglu_host(arrays, x, None), want)
    assert host_kernel.expert_swiglu_host(arrays, x.bfloat16(), None).dtype == torch.bfloat16


def test_fp4_special_scales_and_codes() -> None:
    """Every e2m1 code (incl. -0) under the smallest and largest normal UE8M0 scales."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(2, 1)  # [2, 256] bytes: 512 columns, all pairs
    scale = torch.tensor([[1] * 16, [200] * 16], dtype=torch.uint8)  # 2^-126 (smallest normal), 2^73
    arrays = {"gate_up": codes.view(torch.int8), "gate_up_scale": scale.view(torch.float8_e8m0fnu),
              "down": torch.zeros(512, 1, dtype=torch.int8), "down_scale": torch.full((512, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)}
    x = torch.full((1, 512), 2.0 ** -100)
    got = torch.ops.shardsmith_host.fp4_linear(x, arrays["gate_up"].view(torch.uint8), scale)
    from shardsmith.runtime.layers.quant import dequantize_fp4
    want = x @ dequantize_fp4(arrays["gate_up"], arrays["gate_up_scale"], torch.float32).T
    _close(got, want)


def test_shape_mismatch_is_refused() -> None:
    x = torch.randn(1, 64)
    w = torch.zeros(8, 16, dtype=torch.uint8)  # 32 columns, x has 64
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.shardsmith_host.fp4_linear(x, w, torch.zeros(8, 1, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="tokens"):
        torch.ops.shardsmith_host.fp4_linear(torch.randn(17, 32), w, torch.zeros(8, 1, dtype=torch.uint8))
