"""The host expert kernel (``offload/host_kernel*.cpp``) against its reference, ``experts.expert_output``.

Stored formats built with the project's reference quantizers; float32 activations, so the kernel
(float32 accumulation, no expanded copy) must equal the dequantize-then-matmul reference within
float32 rounding, on every instruction set this CPU supports (``scalar`` and ``avx2`` here; the GPU
host adds ``avx512``, ``bash benchmarks/gpu/run.sh tests`` runs this file there).
Bad arguments are refused in Python before the operator runs; the C++ checks behind them are
exercised in a child process. Skipped, saying why, where the kernel cannot be compiled.
"""

from __future__ import annotations

import pytest
import torch

from shardsmith.errors import UsageError
from shardsmith.runtime.offload import cpu_flags, host_kernel
from shardsmith.runtime.layers.experts import expert_output
from shardsmith.runtime.layers.quant import dequantize_fp4
from shardsmith.testing.quant import quantize_fp4_group as quantize_fp4, quantize_fp8_block as quantize_fp8_blocks

pytestmark = pytest.mark.skipif(not host_kernel.available(), reason="host expert kernel could not be compiled here")
ISAS = host_kernel.isas() or ("scalar",)


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


def test_isas_follow_the_cpu_flags() -> None:
    """The best set this CPU has is offered, and is the default (a GPU host with AVX-512 must not
    silently measure the AVX2 path)."""
    flags = set(cpu_flags.cpu_flags().split())
    assert host_kernel.isas()[0] == "scalar"
    assert ("avx2" in host_kernel.isas()) == ({"avx2", "fma", "f16c"} <= flags)
    assert ("avx512" in host_kernel.isas()) == ({"avx2", "fma", "f16c", "avx512f", "avx512bw"} <= flags)
    assert host_kernel.default_isa() == host_kernel.isas()[-1]


def test_isa_variable_chooses_and_is_checked(monkeypatch: pytest.MonkeyPatch, use_settings) -> None:
    use_settings(host_isa="scalar")
    assert host_kernel.default_isa() == "scalar"
    monkeypatch.setenv("SHARDSMITH_TUNING", "host_isa=avx1024")
    with pytest.raises(UsageError, match="SHARDSMITH_TUNING: host_isa='avx1024': expected scalar, avx2 or avx512"):
        host_kernel.default_isa()
    with pytest.raises(UsageError, match="'avx1024' is not available"):
        host_kernel.fp4_linear(torch.randn(1, 32), torch.zeros(1, 16, dtype=torch.uint8),
                               torch.zeros(1, 1, dtype=torch.uint8), isa="avx1024")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 13, 21])
@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_fp4_expert_equals_reference(isa: str, tokens: int, limit: float) -> None:
    g = torch.Generator().manual_seed(tokens)
    arrays = _fp4_expert(g, inter=96, dim=160)  # 3 and 5 groups of 32: odd counts for the 2-group unroll
    assert host_kernel.supports(arrays)
    x = torch.randn(tokens, 160, generator=g)
    _close(host_kernel.expert_swiglu_host(arrays, x, None, limit, isa=isa), expert_output(arrays, x, None, limit))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_fp4_expert_with_gpt_oss_maths_equals_reference(isa: str, tokens: int) -> None:
    """gpt-oss's expert: interleaved gate/up rows (row 2j gate, 2j+1 up), a gate/up bias added before the
    clamps, ``(clamp(u) + 1) * g * sigmoid(alpha * g)``; the reference's maths within float32 rounding, and
    each part moves the result (the kernel does not compute the plain SwiGLU by mistake)."""
    from shardsmith.runtime.layers.experts import ExpertMath

    g = torch.Generator().manual_seed(11 + tokens)
    arrays = _fp4_expert(g, inter=96, dim=160)
    arrays["gate_up_bias"] = torch.randn(2 * 96, generator=g).bfloat16()
    math = ExpertMath(limit=7.0, alpha=1.702, interleaved=True)
    assert host_kernel.supports(arrays)
    x = torch.randn(tokens, 160, generator=g)
    got = host_kernel.expert_swiglu_host(arrays, x, None, 7.0, alpha=1.702, interleaved=True, isa=isa)
    _close(got, expert_output(arrays, x, None, math=math))
    for other in (ExpertMath(limit=7.0, alpha=1.702), ExpertMath(limit=7.0, interleaved=True)):
        assert (got - expert_output(arrays, x, None, math=other)).abs().max() > 1e-2
    plain = {k: v for k, v in arrays.items() if k != "gate_up_bias"}
    assert (got - host_kernel.expert_swiglu_host(plain, x, None, 7.0, alpha=1.702, interleaved=True,
                                                 isa=isa)).abs().max() > 1e-2
    with pytest.raises(UsageError, match=r"gate_up_bias must be \[192\]"):
        host_kernel.expert_swiglu_host({**arrays, "gate_up_bias": arrays["gate_up_bias"][:64]}, x, None, isa=isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block", [(128, 128), (32, 32), (16, 48), (8, 40)])
@pytest.mark.parametrize("tokens", [1, 2, 5, 9])
def test_fp8_ragged_blocks_equal_reference(isa: str, block: tuple[int, int], tokens: int) -> None:
    g = torch.Generator().manual_seed(7)
    arrays = _fp8_expert(g, inter=72, dim=200, block=block)  # 72 and 200 cut the blocks: ragged edges
    assert host_kernel.supports(arrays)
    x = torch.randn(tokens, 200, generator=g)
    _close(host_kernel.expert_swiglu_host(arrays, x, block, isa=isa), expert_output(arrays, x, block))


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_every_code_and_nan(isa: str) -> None:
    """All 254 finite e4m3fn bytes (subnormals, -0) decode exactly as torch does, under two block
    scales and in every lane position; each NaN byte gives NaN wherever it sits."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # [254]
    w = torch.stack([finite.roll(k) for k in (0, 5, 17)]).view(torch.float8_e4m3fn)  # [3, 254]
    scale = torch.tensor([[0.5, 2.0]] * 3)  # [3, 2]: blocks of 1 row x 128 columns
    got = torch.ops.shardsmith_host.dense_linear(torch.eye(254), w, scale, 1, 128, isa)  # [254, 3]: y[c, r] = W[r, c]
    assert torch.equal(got.T, w.float() * scale.repeat_interleave(128, 1)[:, :254])
    for nan in (0x7F, 0xFF):
        for pos in (0, 7, 8, 15, 16, 100, 253):
            row = torch.full((1, 254), 0x38, dtype=torch.uint8)  # 1.0
            row[0, pos] = nan
            y = torch.ops.shardsmith_host.dense_linear(torch.ones(1, 254), row.view(torch.float8_e4m3fn),
                                                       torch.ones(1, 2), 1, 128, isa)
            assert y.isnan().all(), (nan, pos)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_expert_equals_reference_and_keeps_dtype(isa: str) -> None:
    g = torch.Generator().manual_seed(3)
    arrays = {"gate_up": torch.randn(2 * 40, 67, generator=g).bfloat16(), "down": torch.randn(67, 40, generator=g).bfloat16()}
    for tokens in (1, 4, 11):
        x = torch.randn(tokens, 67, generator=g)
        want = expert_output({k: v.float() for k, v in arrays.items()}, x, None)  # exact bf16 values, float32 maths
        _close(host_kernel.expert_swiglu_host(arrays, x, None, isa=isa), want)
    assert host_kernel.expert_swiglu_host(arrays, x.bfloat16(), None, isa=isa).dtype == torch.bfloat16


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["fp4", "fp8", "bf16"])
def test_layer_call_equals_each_expert_alone(isa: str, fmt: str) -> None:
    """A layer's experts in one call (one parallel region per phase, token blocks of 1, 3, 9 and 2
    rows: a single row, a short tile, more than one 8-token tile) equal each expert computed alone,
    bitwise (the same rows function on the same rows), and the reference within float32 rounding."""
    g = torch.Generator().manual_seed(5)
    block = (16, 48) if fmt == "fp8" else None
    if fmt == "fp4":
        experts = [_fp4_expert(g, inter=96, dim=160) for _ in range(4)]
    elif fmt == "fp8":
        experts = [_fp8_expert(g, inter=72, dim=160, block=block) for _ in range(4)]
    else:
        experts = [{"gate_up": torch.randn(2 * 40, 160, generator=g).bfloat16(),
                    "down": torch.randn(160, 40, generator=g).bfloat16()} for _ in range(4)]
    xs = [torch.randn(n, 160, generator=g) for n in (1, 3, 9, 2)]
    got = host_kernel.experts_swiglu_host(experts, xs, block, 1.5, isa=isa)
    assert [y.shape for y in got] == [x.shape for x in xs]
    for arrays, x, y in zip(experts, xs, got):
        assert torch.equal(y, host_kernel.expert_swiglu_host(arrays, x, block, 1.5, isa=isa))
        want = expert_output(arrays if fmt != "bf16" else {k: v.float() for k, v in arrays.items()}, x, block, 1.5)
        _close(y, want)


@pytest.mark.parametrize("isa", ISAS)
def test_prefetch_distance_changes_no_bit(isa: str) -> None:
    """The rows' software prefetch only moves lines into the cache early: every distance gives the
    same bits (FP4 and FP8 rows of V4 width, 1 and 3 tokens), and the setting is checked."""
    g = torch.Generator().manual_seed(9)
    fp4 = _fp4_expert(g, inter=256, dim=4096)
    fp8 = _fp8_expert(g, inter=256, dim=4096, block=(128, 128))
    before = host_kernel.set_prefetch_bytes(0)
    assert before == host_kernel.prefetch_bytes()  # the load set the configured distance in the kernel
    try:
        for arrays, block in ((fp4, None), (fp8, (128, 128))):
            for tokens in (1, 3):
                x = torch.randn(tokens, 4096, generator=g)
                host_kernel.set_prefetch_bytes(0)
                want = host_kernel.expert_swiglu_host(arrays, x, block, isa=isa)
                for distance in (64, 1024, 65536):
                    host_kernel.set_prefetch_bytes(distance)
                    assert torch.equal(host_kernel.expert_swiglu_host(arrays, x, block, isa=isa), want), distance
        with pytest.raises(UsageError, match="outside 0"):
            host_kernel.set_prefetch_bytes(-1)
    finally:
        host_kernel.set_prefetch_bytes(before)


@pytest.mark.parametrize("isa", ISAS)
def test_row_blocking_changes_no_bit(isa: str) -> None:
    """Several rows per call share each activation load; each row's sums keep their order (the scalar
    column tails too: explicit fma, not left to the compiler's contraction), so one row per call gives
    the same bits (every format, every token tile size up to 8, and past it), and the rows equal the
    reference."""
    g = torch.Generator().manual_seed(10)
    experts = {"fp4": (_fp4_expert(g, inter=96, dim=512), None),  # down rows of 72 and 40 columns: the
               "fp8": (_fp8_expert(g, inter=72, dim=512, block=(128, 128)), (128, 128)),  # scalar tails
               "bf16": ({"gate_up": torch.randn(2 * 40, 512, generator=g).bfloat16(),
                         "down": torch.randn(512, 40, generator=g).bfloat16()}, None)}
    threads = torch.get_num_threads()
    try:
        for name, (arrays, block), n_threads in ((*item, n) for item in experts.items() for n in (threads, 3)):
            torch.set_num_threads(n_threads)  # 3 threads: chunks of rows that start and end off a multiple of 4
            for tokens in (1, 2, 3, 4, 5, 8, 11):
                x = torch.randn(tokens, 512, generator=g)
                host_kernel.set_row_blocking(True)
                blocked = host_kernel.expert_swiglu_host(arrays, x, block, isa=isa)
                host_kernel.set_row_blocking(False)
                single = host_kernel.expert_swiglu_host(arrays, x, block, isa=isa)
                assert torch.equal(blocked, single), (name, tokens, n_threads)
                exact = arrays if name != "bf16" else {k: v.float() for k, v in arrays.items()}
                _close(blocked, expert_output(exact, x, block))
    finally:
        host_kernel.set_row_blocking(True)
        torch.set_num_threads(threads)


def test_prefetch_variable_is_checked(monkeypatch: pytest.MonkeyPatch, use_settings) -> None:
    use_settings(host_prefetch="2048")
    assert host_kernel.prefetch_bytes() == 2048
    monkeypatch.setenv("SHARDSMITH_TUNING", "host_prefetch=lots")
    with pytest.raises(UsageError, match="SHARDSMITH_TUNING: host_prefetch='lots'"):
        host_kernel.prefetch_bytes()
    monkeypatch.delenv("SHARDSMITH_TUNING")
    assert host_kernel.prefetch_bytes() == host_kernel.PREFETCH_BYTES


def test_layer_call_refuses_mixed_or_missing_experts() -> None:
    g = torch.Generator().manual_seed(6)
    a, b = _fp4_expert(g, inter=32, dim=64), _fp4_expert(g, inter=64, dim=64)
    x = torch.randn(2, 64)
    with pytest.raises(UsageError, match="2 experts and 1 token blocks"):
        host_kernel.experts_swiglu_host([a, a], [x], None)
    with pytest.raises(UsageError, match="0 experts and 0 token blocks"):
        host_kernel.experts_swiglu_host([], [], None)
    with pytest.raises(UsageError, match=r"expert 1's gate_up is torch.int8 \[128, 32\], expert 0's torch.int8 \[64, 32\]"):
        host_kernel.experts_swiglu_host([a, b], [x, x], None)
    with pytest.raises(UsageError, match="several dtypes \\(torch.bfloat16, torch.float32\\)"):
        host_kernel.experts_swiglu_host([a, a], [x, x.bfloat16()], None)


@pytest.mark.parametrize("isa", ISAS)
def test_fp4_special_scales_and_codes(isa: str) -> None:
    """Every e2m1 code (incl. -0) under the smallest and largest normal UE8M0 scales."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(2, 1)  # [2, 256] bytes: 512 columns, all pairs
    scale = torch.tensor([[1] * 16, [200] * 16], dtype=torch.uint8)  # 2^-126 (smallest normal), 2^73
    x = torch.full((1, 512), 2.0 ** -100)
    got = torch.ops.shardsmith_host.fp4_linear(x, codes, scale, isa)
    want = x @ dequantize_fp4(codes.view(torch.int8), scale.view(torch.float8_e8m0fnu), torch.float32).T
    _close(got, want)


def test_isas_agree_with_each_other() -> None:
    """Each set against the scalar one on V4-sized rows (4096 columns, a 2-token tile)."""
    g = torch.Generator().manual_seed(11)
    w, s = quantize_fp4(torch.randn(64, 4096, generator=g))
    x = torch.randn(2, 4096, generator=g)
    base = torch.ops.shardsmith_host.fp4_linear(x, w.view(torch.uint8), s.view(torch.uint8), "scalar")
    for isa in ISAS:
        _close(torch.ops.shardsmith_host.fp4_linear(x, w.view(torch.uint8), s.view(torch.uint8), isa), base)


def test_shape_mismatch_is_refused_before_the_kernel() -> None:
    """Every bad argument is refused in Python (UsageError), each problem named; no C++ exception."""
    x = torch.randn(1, 64)
    w = torch.zeros(8, 16, dtype=torch.uint8)  # 32 columns, x has 64
    with pytest.raises(UsageError, match="x has 64 columns, the weight 32"):
        host_kernel.fp4_linear(x, w, torch.zeros(8, 1, dtype=torch.uint8))
    with pytest.raises(UsageError, match=r"fp4 scale \[8, 2\] does not match the weight \[8, 16\]"):
        host_kernel.fp4_linear(torch.randn(1, 32), w, torch.zeros(8, 2, dtype=torch.uint8))
    with pytest.raises(UsageError, match=r"fp8 scale \[2, 2\] does not match .* \(want \[1, 2\]\)"):
        host_kernel.dense_linear(torch.randn(1, 32), torch.zeros(8, 32, dtype=torch.uint8), torch.ones(2, 2), (8, 16))
    with pytest.raises(UsageError, match="without a scale must be bfloat16|without scale must be bfloat16"):
        host_kernel.dense_linear(torch.randn(1, 32), torch.zeros(8, 32), None, None)
    g = torch.Generator().manual_seed(0)
    arrays = _fp4_expert(g, inter=32, dim=64)
    with pytest.raises(UsageError, match="fp4 expert without down_scale, gate_up_scale"):
        host_kernel.expert_swiglu_host({"gate_up": arrays["gate_up"], "down": arrays["down"]}, x, None)
    with pytest.raises(UsageError, match="down has 64 rows, x 96 columns; gate_up: x has 96 columns, the weight 64"):
        host_kernel.expert_swiglu_host(arrays, torch.randn(2, 96), None)
    with pytest.raises(UsageError, match=r"T >= 1, got \[0, 64\]"):
        host_kernel.expert_swiglu_host(arrays, torch.randn(0, 64), None)
    fp8 = _fp8_expert(g, inter=32, dim=64, block=(16, 16))
    with pytest.raises(UsageError, match="needs its block size"):
        host_kernel.expert_swiglu_host(fp8, x, None)
    with pytest.raises(UsageError, match=r"scale \[2, 4\] does not match the weight \[32, 64\] in 8x16 blocks"):
        host_kernel.expert_swiglu_host(fp8, x, (8, 16))


_RAISE = """
import sys, torch
from shardsmith.runtime.offload import host_kernel
assert host_kernel.available()
torch.ops.shardsmith_host.fp4_linear(torch.randn(2, 32), torch.zeros(8, 16, dtype=torch.uint8),
                                     torch.zeros(8, 1, dtype=torch.uint8), "")  # start the threads first
try:
    torch.ops.shardsmith_host.fp4_linear(torch.randn(1, 64), torch.zeros(8, 16, dtype=torch.uint8),
                                         torch.zeros(8, 1, dtype=torch.uint8), "")
except RuntimeError as e:
    print("caught:", str(e).splitlines()[0])
    sys.exit(0)
sys.exit(3)
"""


def test_kernel_check_reaches_python_as_runtime_error() -> None:
    """The C++ checks (the second line) raise a catchable RuntimeError, in a child process so a crash
    there (issue 15: a segfault on the GPU host) fails this test instead of killing the session."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _RAISE], capture_output=True, text=True,
                          timeout=300, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, f"rc {proc.returncode} (negative: killed by that signal)\n{proc.stderr[-3000:]}"
    assert "x has 64 columns, the weight 32" in proc.stdout
