"""The fused decode kernels against their PyTorch references on small shapes, on CPU.

Without a GPU the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before the kernels are first imported); with one, the same small (ragged) shapes run compiled on
it. The tests skip, saying why, when triton is not installed.
Each check compares kernel and reference with a float64 truth (the reference on float64 inputs)
and with each other: bf16 outputs land near 4e-3 (the interpreter truncates float32 to bf16
where the GPU rounds, which doubles the error), so 1.5e-2 passes and a wrong scale, nibble or
row fails by orders of magnitude. Inputs are fresh random draws (never zeros); a NaN or inf
anywhere fails (``rel_error`` is then inf). GPU shapes are in ``test_kernels_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.kernels import (KernelError, fp8_linear, fp8_linear_reference, fused_experts,
                                               fused_experts_reference, triton_available)
from shardsmith.runtime.layers.kernels.testing import random_bank, random_fp8_linear, random_routing, rel_error

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install "
                                  "'shardsmith[kernels]'); the kernels' reference path is tested without it")
TOL = 1.5e-2


@needs_triton
@pytest.mark.parametrize(("m", "n", "k", "block", "ue8m0", "split_k"), [
    (1, 200, 300, (128, 128), True, None),     # ragged N and K, V4's UE8M0, split-K
    (5, 256, 512, (128, 128), False, 1),       # F32 weight_scale_inv (V3 / Mixtral-FP8), no split
    (16, 96, 160, (32, 32), True, 3),          # 32x32 blocks, ragged last split
    (19, 130, 128, (128, 128), False, None),   # M past one 16-row tile
    (40, 96, 512, (128, 128), True, None),     # M > 16 (the long kernel: runtime M and split), split-K
])
def test_fp8_linear_matches_reference(m, n, k, block, ue8m0, split_k):
    gen = torch.Generator(device=DEV).manual_seed(m * 1000 + n)
    w, scale = random_fp8_linear(n, k, block, ue8m0=ue8m0, gen=gen)
    x = torch.randn(m, k, generator=gen, device=DEV).bfloat16()
    out = fp8_linear(x, w, scale, block, split_k=split_k, backend="triton")
    ref = fp8_linear_reference(x, w, scale, block)
    truth = fp8_linear_reference(x.double(), w, scale, block)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_error(out, truth) < TOL, (rel_error(out, truth), rel_error(ref, truth))
    assert rel_error(out, ref) < TOL


@needs_triton
def test_fp8_linear_keeps_leading_dims_and_float32():
    gen = torch.Generator(device=DEV).manual_seed(7)
    w, scale = random_fp8_linear(64, 256, (128, 128), ue8m0=True, gen=gen)
    x = torch.randn(2, 3, 256, generator=gen, device=DEV)  # float32 activations: a float32 dot
    scale = scale.view(torch.float8_e8m0fnu)  # the dtype a V4 pack stores
    out = fp8_linear(x, w, scale, backend="triton")
    assert out.shape == (2, 3, 64) and out.dtype == torch.float32
    assert rel_error(out, fp8_linear_reference(x.double(), w, scale, (128, 128))) < 1e-5


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (bitwise comparison: -0.0 differs from 0.0, NaN matches itself)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _fp8_launches(x, w, scale, block, **kw) -> tuple[torch.Tensor, list[str]]:
    """``fp8_linear``'s output and the names of the kernels it launched (``gemv`` off unless given;
    ``gemv=None``: the function's own default)."""
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches

    kw = {"gemv": False, **kw}
    if kw["gemv"] is None:
        del kw["gemv"]
    with record_launches(run=True) as keys:
        out = fp8_linear(x, w, scale, block, backend="triton", **kw)
    return out, [key[0] for key in keys]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 17])
@pytest.mark.parametrize(("n", "k", "block", "split_k"), [
    (200, 300, (128, 128), 3),   # ragged N and K: 3 splits, the last one 44 of K
    (72, 300, (32, 32), 4),      # 4 splits of 96, a ragged N tile, the last split 12 of K
    (48, 256, (32, 64), 8),      # split_k past K's blocks: 4 splits of one 64-wide block
])
def test_fp8_linear_fused_split_sum_is_the_two_kernel_sum(dtype, m, n, k, block, split_k):
    """The split sum folded into the one launch (the last program of a tile adds the partials) gives
    the two-kernel path's bits, from one launch instead of two; twice in a row (the counters were
    set back to 0) the same bits again, and the counters are all zero after."""
    from shardsmith.runtime.layers.kernels.fp8_linear import split_counters

    gen = torch.Generator(device=DEV).manual_seed(m * 100 + n + k)
    w, scale = random_fp8_linear(n, k, block, ue8m0=m % 2 == 1, gen=gen)
    x = torch.randn(m, k, generator=gen, device=DEV).to(dtype)
    kernel = "_fp8_linear_kernel" if m <= 16 else "_fp8_linear_long_kernel"
    two, two_names = _fp8_launches(x, w, scale, block, split_k=split_k, fused_sum=False)
    assert two_names == [kernel, "_sum_splits" if m <= 16 else "_sum_splits_long"]
    fused, names = _fp8_launches(x, w, scale, block, split_k=split_k, fused_sum=True)
    assert names == [kernel]
    assert fused.dtype == dtype and torch.equal(_bits(fused), _bits(two))
    again = fp8_linear(x, w, scale, block, split_k=split_k, fused_sum=True, gemv=False, backend="triton")
    assert torch.equal(_bits(again), _bits(fused)), "a counter left non-zero by the first call"
    assert not split_counters(x.device, 0).any()
    truth = fp8_linear_reference(x.double(), w, scale, block)
    assert rel_error(fused, truth) < (1e-5 if dtype == torch.float32 else TOL)
    assert rel_error(fused, fp8_linear_reference(x, w, scale, block)) < (1e-5 if dtype == torch.float32 else TOL)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "block", "groups", "split_k", "ue8m0"), [
    (200, 300, (128, 128), 1, None, True),   # ragged N and K (a ragged last column tile and K step)
    (256, 1024, (128, 128), 1, 3, False),    # F32 scales, 3 splits: the last one short
    (96, 160, (32, 32), 1, 2, True),         # 32x32 blocks: a scale column every 32 of K inside a step
    (512, 640, (128, 128), 4, None, True),   # grouped (V4's wo_a): each input row feeds its own 128 rows
    (64, 4096, (128, 128), 1, 64, True),     # more splits than K steps: clamped to the steps
])
def test_fp8_gemv_matches_reference_and_the_dot_kernel(dtype, n, k, block, groups, split_k, ue8m0):
    """One token takes the GEMV kernel (one launch, the split sum folded in): float32 results within
    float32 rounding of the float64 truth and of the dot kernel's, bf16 within bf16's; twice in a
    row the same bits (its counters were set back to 0)."""
    from shardsmith.runtime.layers.kernels.fp8_linear import split_counters

    gen = torch.Generator(device=DEV).manual_seed(n + k + groups)
    w, scale = random_fp8_linear(n, k, block, ue8m0=ue8m0, gen=gen)
    x = torch.randn(groups, k, generator=gen, device=DEV).to(dtype)
    x = x[None] if groups > 1 else x
    out, names = _fp8_launches(x, w, scale, block, groups=groups, split_k=split_k, gemv=True)
    assert names == ["_fp8_gemv_kernel"] and out.shape == (1, n) and out.dtype == dtype
    dot, dot_names = _fp8_launches(x, w, scale, block, groups=groups, split_k=split_k, gemv=False)
    assert dot_names == ["_fp8_linear_kernel"]
    again = fp8_linear(x, w, scale, block, groups=groups, split_k=split_k, gemv=True, backend="triton")
    assert torch.equal(_bits(again), _bits(out)) and not split_counters(x.device, 0).any()
    truth = fp8_linear_reference(x.double(), w, scale, block, groups)
    tol = 1e-6 if dtype == torch.float32 else TOL
    assert rel_error(out, truth) < tol and rel_error(dot, truth) < tol
    assert rel_error(out, fp8_linear_reference(x, w, scale, block, groups)) < tol


@needs_triton
def test_fp8_gemv_default_and_fallback():
    """One token takes the GEMV by default and the dot kernel with ``gemv=False``; a block that a GEMV
    tile cannot sit inside (16 rows) and more than one token keep the dot kernel; a grouped call of 2
    tokens runs the dot kernel over all rows and keeps the diagonal."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    w, scale = random_fp8_linear(64, 256, (128, 128), ue8m0=True, gen=gen)
    x = torch.randn(1, 256, generator=gen, device=DEV).bfloat16()
    assert _fp8_launches(x, w, scale, (128, 128), gemv=True)[1] == ["_fp8_gemv_kernel"]
    assert _fp8_launches(x.expand(2, 256), w, scale, (128, 128), gemv=True)[1] == ["_fp8_linear_kernel"]
    assert _fp8_launches(x, w, scale, (128, 128), gemv=False)[1] == ["_fp8_linear_kernel"]
    assert _fp8_launches(x, w, scale, (128, 128), gemv=None)[1] == ["_fp8_gemv_kernel"]  # the default
    w16, s16 = random_fp8_linear(64, 256, (16, 128), ue8m0=True, gen=gen)
    assert _fp8_launches(x, w16, s16, (16, 128), gemv=True)[1] == ["_fp8_linear_kernel"]
    xg = torch.randn(2, 4, 256, generator=gen, device=DEV)
    out, names = _fp8_launches(xg, w, scale, (128, 128), groups=4, gemv=True)
    assert names == ["_fp8_linear_kernel"] and out.shape == (2, 64)
    assert rel_error(out, fp8_linear_reference(xg.double(), w, scale, (128, 128), 4)) < 1e-6
    with pytest.raises(KernelError, match="groups=3"):
        fp8_linear(xg, w, scale, groups=3, backend="triton")


def test_split_counters_growth(monkeypatch):
    """The split-K counters grow (at least doubling) when a launch needs more tiles, keeping the old buffer."""
    import sys

    mod = sys.modules["shardsmith.runtime.layers.kernels.fp8_linear"]
    split_counters = mod.split_counters
    monkeypatch.setattr(mod, "_COUNTERS", {})
    monkeypatch.setattr(mod, "_RETIRED", [])
    monkeypatch.setattr(mod, "COUNTERS_MIN", 4)
    first = split_counters(torch.device("cpu"), 3)
    assert first.numel() == 4 and first.dtype == torch.int32 and split_counters(torch.device("cpu"), 4) is first
    grown = split_counters(torch.device("cpu"), 5)
    assert grown.numel() == 8 and not grown.any() and mod._RETIRED == [first]
    assert split_counters(torch.device("cpu"), 20).numel() == 20


def _bank_case(fp4: bool, tokens: int, top_k: int, experts: int, dim: int, inter: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    bank = random_bank(experts, dim, inter, fp4=fp4, gen=gen)
    ids, weights = random_routing(tokens, top_k, experts, gen=gen)
    return bank, ids, weights, torch.randn(tokens, dim, generator=gen, device=DEV).bfloat16()


@needs_triton
@pytest.mark.parametrize(("fp4", "tokens", "limit", "path"), [
    (True, 1, 3.0, "grouped"), (True, 16, 3.0, "grouped"), (False, 5, 0.0, "grouped"), (False, 3, 3.0, "grouped"),
    (True, 2, 3.0, "pairs"), (False, 3, 3.0, "pairs"),  # one program row per (token, expert) pair
])
def test_fused_experts_matches_reference(fp4, tokens, limit, path):
    bank, ids, weights, x = _bank_case(fp4, tokens, top_k=3, experts=8, dim=128, inter=64, seed=tokens)
    out = fused_experts(x, ids, weights, **bank, limit=limit, backend="triton", path=path)
    ref = fused_experts_reference(x, ids, weights, **bank, limit=limit)
    truth = fused_experts_reference(x.double(), ids, weights, **bank, limit=limit)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_error(out, truth) < TOL, (rel_error(out, truth), rel_error(ref, truth))
    assert rel_error(out, ref) < TOL
    if path == "pairs":  # float32 activations: the same sums as the float64 truth up to float32 rounding
        f32 = fused_experts(x.float(), ids, weights, **bank, limit=limit, backend="triton", path=path)
        assert rel_error(f32, truth) < 1e-5
        alone = fused_experts(x[1:2], ids[1:2], weights[1:2], **bank, limit=limit, backend="triton", path=path)
        assert torch.equal(out[1:2], alone), "a pair's result must not depend on the rest of the batch"
    if limit:  # the clamp matters on these inputs, so dropping it would fail the check above
        assert rel_error(fused_experts_reference(x.double(), ids, weights, **bank, limit=0.0), truth) > 10 * TOL


@needs_triton
def test_fused_experts_long_run_and_slot_pool_view():
    """18 tokens all choosing expert 5 (two 16-row chunks of one run), from a strided slot-pool view
    with the pack's scale dtype (float8_e8m0fnu)."""
    bank, ids, weights, x = _bank_case(True, tokens=18, top_k=2, experts=16, dim=64, inter=32, seed=3)
    ids[:, 0] = 5
    ids[:, 1] = torch.where(ids[:, 1] == 5, 6, ids[:, 1])
    bank = {name: t.view(torch.float8_e8m0fnu) if name.endswith("_scale") else t for name, t in bank.items()}
    pool = {name: t[::2] for name, t in bank.items()}  # slots 0..7 = experts 0, 2, ..., 14; rows contiguous
    slot_ids = ids // 2
    truth = fused_experts_reference(x.double(), slot_ids, weights, **pool)
    for path in ("grouped", "pairs"):
        out = fused_experts(x, slot_ids, weights, **pool, backend="triton", path=path)
        assert rel_error(out, truth) < TOL, path


@needs_triton
@pytest.mark.parametrize("fp4", [True, False])
def test_fused_experts_reads_host_experts_in_place_and_writes_through(fp4):
    """Offloaded experts with no copy (issue 12): a negative id ``-1 - e`` reads expert ``e`` of the
    host bank in place, ``write_slots`` stores the bytes read into a cache slot in the same launch.
    The result is the all-resident call's, bit for bit (the same bytes through the same arithmetic);
    the written slots hold the host experts' bytes exactly; the reference backend agrees."""
    host, ids, weights, x = _bank_case(fp4, tokens=3, top_k=3, experts=8, dim=64, inter=32, seed=7)
    ids = torch.tensor([[3, 6, 1], [5, 6, 3], [1, 0, 5]], device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(1)
    fresh = lambda t: (torch.randint(0, 255, (4,) + t.shape[1:], generator=gen, device=DEV, dtype=torch.uint8)  # noqa: E731
                       .view(t.dtype) if t.element_size() == 1 else torch.randn((4,) + t.shape[1:], generator=gen,
                                                                                device=DEV).to(t.dtype))
    pool = {name: fresh(t) for name, t in host.items()}  # 4 slots of noise, then experts 3 and 5 cached
    for name in pool:
        pool[name][0].copy_(host[name][3])
        pool[name][1].copy_(host[name][5])
    slot_of = {3: 0, 5: 1}
    src = torch.tensor([[slot_of.get(e, -1 - e) for e in row] for row in ids.tolist()], device=DEV)
    dst = torch.tensor([-1, 2, 3, -1, -1, -1, -1, -1, -1], device=DEV)  # 6 -> slot 2, 1 -> slot 3 (first pairs)
    want = fused_experts(x, ids, weights, **host, backend="triton", path="pairs")
    truth = fused_experts_reference(x.double(), ids, weights, **host)
    before = {name: t.clone() for name, t in pool.items()}
    out = fused_experts(x, src, weights, **pool, host=host, write_slots=dst, backend="triton")
    assert torch.equal(out, want) and rel_error(out, truth) < TOL
    for name, t in pool.items():
        assert torch.equal(t[2], host[name][6]) and torch.equal(t[3], host[name][1]), name
        assert torch.equal(t[:2], before[name][:2]), name
    ref_pool = {name: t.clone() for name, t in before.items()}
    ref = fused_experts(x, src, weights, **ref_pool, host=host, write_slots=dst, backend="reference")
    assert rel_error(ref, truth) < TOL
    assert all(torch.equal(ref_pool[n], pool[n]) for n in pool)
    with pytest.raises(KernelError, match=r"path='grouped'.*write_slots \[P=9\]"):
        fused_experts(x, src, weights, **pool, host=host, path="grouped", backend="reference")
    with pytest.raises(KernelError, match="host down .* one layout"):
        fused_experts(x, src, weights, **pool, host={**host, "down": host["down"][:, :16]}, write_slots=dst,
                      backend="reference")


def _gpt_oss_truth(x, ids, weights, bank, bias, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's experts written out as transformers' ``GptOssExperts`` computes them, in float64, one pair at
    a time: ``gate_up = W x + b``, gate the even rows and up the odd ones, both clamped,
    ``(up + 1) * gate * sigmoid(alpha * gate)``, then down; the pairs weighted and summed."""
    from shardsmith.runtime.layers.quant import dequantize_fp4

    def expert(name: str, e: int) -> torch.Tensor:
        w = bank[name][e]
        scale = bank.get(name + "_scale")
        return (w if scale is None else dequantize_fp4(w, scale[e], torch.float64)).double()

    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = expert("gate_up", e) @ x[t].double() + bias[e].double()
            gate, up = h[::2].clamp(max=limit), h[1::2].clamp(min=-limit, max=limit)
            out[t] += float(weights[t, k]) * (expert("down", e) @ ((up + 1) * gate * torch.sigmoid(alpha * gate)))
    return out


@needs_triton
@pytest.mark.parametrize(("fp4", "tokens", "path"), [(True, 3, "grouped"), (True, 2, "pairs"), (False, 4, "grouped"),
                                                     (False, 3, "pairs")])
def test_fused_experts_computes_gpt_oss_glu(fp4, tokens, path):
    """gpt-oss's experts (interleaved gate/up rows, a gate/up bias, ``alpha``, the clamp) through both Triton
    paths against the formula written out by hand, in float32 (near float64) and bf16; dropping any one of
    the three differences moves the result far past the tolerance."""
    bank, ids, weights, x = _bank_case(fp4, tokens, top_k=2, experts=6, dim=64, inter=64, seed=11 + tokens)
    bias = torch.randn(6, 128, generator=torch.Generator(device=DEV).manual_seed(5), device=DEV).bfloat16()
    glu = {"limit": 1.5, "alpha": 1.702, "interleaved": True, "gate_up_bias": bias}
    truth = _gpt_oss_truth(x, ids, weights, bank, bias, 1.5, 1.702)
    out = fused_experts(x, ids, weights, **bank, **glu, backend="triton", path=path)
    f32 = fused_experts(x.float(), ids, weights, **bank, **glu, backend="triton", path=path)
    ref = fused_experts_reference(x.double(), ids, weights, **bank, **glu)
    assert rel_error(ref, truth) < 1e-6  # the reference sums the pairs in float32
    assert out.dtype == torch.bfloat16 and rel_error(out, truth) < TOL, rel_error(out, truth)
    assert rel_error(f32, truth) < 1e-5, rel_error(f32, truth)
    for drop in ({"alpha": None}, {"interleaved": False}, {"gate_up_bias": None}):
        assert rel_error(fused_experts_reference(x.double(), ids, weights, **bank, **{**glu, **drop}), truth) > 10 * TOL


@needs_triton
def test_gpt_oss_host_experts_are_read_in_place_with_their_bias():
    """The in-place offload with gpt-oss's bank: a host expert's gate/up bias is read from the host bank with its
    weights and written through to the slot beside them; the result is the all-resident call's, bit for bit."""
    host, ids, weights, x = _bank_case(True, tokens=2, top_k=2, experts=6, dim=64, inter=32, seed=21)
    gen = torch.Generator(device=DEV).manual_seed(2)
    host["gate_up_bias"] = torch.randn(6, 64, generator=gen, device=DEV).bfloat16()
    ids = torch.tensor([[4, 1], [2, 4]], device=DEV)
    glu = {"limit": 2.0, "alpha": 1.702, "interleaved": True}
    pool = {name: torch.zeros((3,) + t.shape[1:], dtype=t.dtype, device=DEV) for name, t in host.items()}
    for name in pool:
        pool[name][0].copy_(host[name][2])  # expert 2 cached in slot 0
    src = torch.tensor([[-5, -2], [0, -5]], device=DEV)
    dst = torch.tensor([1, 2, -1, -1], device=DEV)  # expert 4 -> slot 1, expert 1 -> slot 2
    want = fused_experts(x, ids, weights, **{k: v for k, v in host.items() if k != "gate_up_bias"}, **glu,
                         gate_up_bias=host["gate_up_bias"], backend="triton", path="pairs")
    out = fused_experts(x, src, weights, **{k: v for k, v in pool.items() if k != "gate_up_bias"}, **glu,
                        gate_up_bias=pool["gate_up_bias"], host=host, write_slots=dst, backend="triton")
    assert torch.equal(out, want)
    for name, t in pool.items():
        assert torch.equal(t[1], host[name][4]) and torch.equal(t[2], host[name][1]), name
    assert rel_error(out, _gpt_oss_truth(x, ids, weights, host, host["gate_up_bias"], 2.0, 1.702)) < TOL
    with pytest.raises(KernelError, match="host gate_up_bias: missing"):
        fused_experts(x, src, weights, **{k: v for k, v in pool.items() if k != "gate_up_bias"}, **glu,
                      gate_up_bias=pool["gate_up_bias"], host={k: v for k, v in host.items() if k != "gate_up_bias"},
                      write_slots=dst, backend="reference")
    with pytest.raises(KernelError, match=r"gate_up_bias must be \[E, 2\*I_r\] = \[6, 64\]"):
        fused_experts(x, ids, weights, **{k: v for k, v in host.items() if k != "gate_up_bias"},
                      gate_up_bias=host["gate_up_bias"][:, :32], backend="reference")


def test_kernels_refuse_bad_inputs_listing_every_problem():
    w = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(KernelError, match=r"x's last dim \(128\).*scale shape \(1, 1\) != \(1, 2\)"):
        fp8_linear(torch.ones(1, 128), w, torch.ones(1, 1), backend="reference")
    bank = random_bank(4, 64, 32, fp4=True, gen=torch.Generator().manual_seed(0))
    ids, weights = torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2)
    with pytest.raises(KernelError, match=r"ids has 2 tokens, x 3.*needs gate_up_scale"):
        fused_experts(torch.ones(3, 64), ids, weights, bank["gate_up"], bank["down"], backend="reference")
    with pytest.raises(KernelError, match="backend 'fast'"):
        fused_experts(torch.ones(2, 64), ids, weights, **bank, backend="fast")


def test_auto_path_by_format_and_batch():
    """``auto``: the pair path for FP4 decode batches (<= 16 tokens) and bf16 up to 4, grouped
    otherwise (FP8 always); an explicit path is taken, FP8 staying grouped; a bad one is refused."""
    from shardsmith.runtime.layers.kernels.fused_moe import _pick, pick_path

    assert [pick_path("fp4", t) for t in (1, 8, 16, 17)] == ["pairs", "pairs", "pairs", "grouped"]
    assert [pick_path("dense", t) for t in (1, 4, 5)] == ["pairs", "pairs", "grouped"]
    assert pick_path("fp8", 1) == "grouped"
    assert _pick("auto", "fp4", 1) == "pairs" and _pick("grouped", "fp4", 1) == "grouped"
    assert _pick("pairs", "dense", 16) == "pairs" and _pick("pairs", "fp8", 1) == "grouped"  # FP8 has no pair path
    with pytest.raises(KernelError, match="path 'fastest'"):
        _pick("fastest", "fp4", 1)
    with pytest.raises(KernelError, match="path 'fast'"):
        _pick("fast", "fp4", 1)


def test_reference_backend_needs_no_triton():
    """``backend='reference'`` (and ``auto`` off CUDA without the interpreter) is the plain PyTorch path."""
    bank, ids, weights, x = _bank_case(True, tokens=2, top_k=2, experts=4, dim=64, inter=32, seed=1)
    out = fused_experts(x, ids, weights, **bank, limit=3.0, backend="reference")
    assert torch.equal(out, fused_experts_reference(x, ids, weights, **bank, limit=3.0))


@needs_triton
@pytest.mark.parametrize(("m", "iters", "tokens"), [(4, 20, 1), (4, 20, 8), (3, 5, 2)])  # V4: m=4, 20 rounds
def test_hc_mix_matches_reference(m, iters, tokens):
    from shardsmith.runtime.layers.kernels.deepseek_v4.hc_mix import hc_mix, hc_mix_reference

    gen = torch.Generator(device=DEV).manual_seed(m * 100 + tokens)
    width = (2 + m) * m
    f = torch.randn(tokens, width, generator=gen, device=DEV) * 3
    base, scale = torch.randn(width, generator=gen, device=DEV), torch.rand(3, generator=gen, device=DEV) * 2
    got = hc_mix(f, base, scale, m, iters, 1e-6, backend="triton")
    want = hc_mix_reference(f, base, scale, m, iters, 1e-6)
    for name, a, b in zip(("pre", "post", "comb"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    comb = got[2].double()  # doubly stochastic after Sinkhorn: rows and columns sum to ~1
    assert torch.allclose(comb.sum(-2), torch.ones_like(comb.sum(-2)), atol=1e-4)
    with pytest.raises(KernelError, match=r"hc_mix: f must be \[T, 24\]"):
        hc_mix(f[:, :5].contiguous(), base, scale, 4, iters, 1e-6)


@needs_triton
@pytest.mark.parametrize("groups", [1, 4])
def test_fp8_linear_prefill_chunks_run_the_dequantized_gemm(groups):
    """From ``DENSE_M`` tokens on, ``fp8_linear`` launches no Triton kernel: the weight is dequantized
    once and multiplied as a dense GEMM (grouped: the diagonal blocks only), the reference's bits;
    one token fewer still runs the dot kernel, within rounding of it."""
    from shardsmith.runtime.layers.kernels.fp8_linear import DENSE_M

    gen = torch.Generator(device=DEV).manual_seed(groups)
    k = 512
    w, scale = random_fp8_linear(256, k, (128, 128), ue8m0=True, gen=gen)
    for m, want in ((DENSE_M, []), (DENSE_M - 1, ["_fp8_linear_long_kernel"])):
        x = torch.randn(m, groups, k, generator=gen, device=DEV) if groups > 1 else \
            torch.randn(m, k, generator=gen, device=DEV)
        out, names = _fp8_launches(x, w, scale, (128, 128), groups=groups)
        assert names == want
        ref = fp8_linear_reference(x, w, scale, (128, 128), groups)
        assert torch.equal(out, ref) if not want else rel_error(out, ref) < 1e-5


def test_dequantize_blocks_broadcasts_whole_blocks_as_the_ragged_path_does():
    from shardsmith.runtime.layers.kernels.fp8_linear import scale_as_float
    from shardsmith.runtime.layers.quant import dequantize_blocks

    gen = torch.Generator().manual_seed(9)
    w, scale = random_fp8_linear(256, 384, (128, 128), ue8m0=False, gen=gen)
    s = scale_as_float(scale)
    whole = dequantize_blocks(w, s, (128, 128), torch.bfloat16)  # the broadcast path
    ragged = dequantize_blocks(torch.cat((w, w[:5])), torch.cat((s, s[:1])), (128, 128), torch.bfloat16)[:256]
    assert torch.equal(whole, ragged)
