"""Many tokens through an FP4 expert bank as grouped matmuls (``grouped_experts``) against the expert-by-expert
loop it replaced (``expert_output`` per expert, outputs added per token in ascending expert order).

CPU: DeepSeek-V4's maths (float32 accumulation, SwiGLU clamp) bit for bit at float32 and bf16, with
experts no token picks, groups smaller than the experts present (several grouped steps), and a token
count that is not a multiple of anything; gpt-oss's maths (interleaved gate/up rows, ``alpha``, a gate/up
bias added after the matmul instead of inside it) within float32 rounding. The FP4 tile kernel
(``grouped_gemm``, the FP4 decoded in registers) under Triton's interpreter against its expert-by-expert
reference, and ``grouped_experts`` through it against the loop. GPU (``-m gpu``): V4-Flash's expert shapes in
bf16 through the tile kernel and through cuBLAS's grouped GEMM, within bf16 rounding of the loop.
"""

from __future__ import annotations

import pytest
import torch

from shardsmith.runtime.layers import experts
from shardsmith.runtime.layers.experts import ExpertMath, grouped_experts, grouped_mm_runs
from shardsmith.runtime.layers.kernels import KernelError
from shardsmith.runtime.layers.kernels.fused_moe import grouped_gemm, grouped_gemm_reference, tile_blocks, tile_table
from shardsmith.runtime.layers.kernels.testing import random_bank, random_routing, rel_error

V4_MATH = ExpertMath(limit=10.0, accumulate_f32=True, batched_pairs=16)
GPT_OSS_MATH = ExpertMath(limit=7.0, alpha=1.702, interleaved=True)


loop = experts.grouped_experts_reference  # the expert-by-expert path the grouped one replaces


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [3, 32])
def test_v4_grouped_is_the_loop_bit_for_bit(dtype, group):
    gen = torch.Generator().manual_seed(group)
    arrays = random_bank(12, 64, 32, fp4=True, gen=gen)
    index, weight = random_routing(37, 4, 10, gen=gen)  # experts 10 and 11 never picked
    x = torch.randn(37, 64, generator=gen).to(dtype)
    got = grouped_experts(x, index, weight, arrays, V4_MATH, group=group)
    assert got.dtype == dtype and torch.equal(got, loop(x, index, weight, arrays, V4_MATH))


@pytest.mark.parametrize("math", [V4_MATH, GPT_OSS_MATH], ids=["v4", "gpt-oss"])
def test_fused_chunk_maths_give_the_loop(monkeypatch, math):
    """The SwiGLU of the pairs and the per-token combine compiled (``fused.ENABLED``, Inductor's C++ code):
    the combine's adds keep the loop's order, so it is the reference bit for bit; the whole bank within
    float32 rounding (the SwiGLU's ``exp`` is Inductor's)."""
    from shardsmith.runtime.layers import experts, fused

    gen = torch.Generator().manual_seed(11)
    arrays = random_bank(12, 64, 32, fp4=True, gen=gen)
    index, weight = random_routing(37, 4, 10, gen=gen)
    x = torch.randn(37, 64, generator=gen)
    ys, rows = torch.randn(37 * 4, 64, generator=gen).bfloat16(), torch.randperm(37 * 4, generator=gen).view(37, 4)
    want = experts.combine_pairs.reference(x.bfloat16(), ys, rows, weight, True)
    want_loop = loop(x, index, weight, arrays, math)
    monkeypatch.setattr(fused, "ENABLED", True)
    assert torch.equal(experts.combine_pairs(x.bfloat16(), ys, rows, weight, True), want)
    assert rel_error(grouped_experts(x, index, weight, arrays, math, group=5), want_loop) < 1e-6


def test_gpt_oss_grouped_matches_the_loop():
    gen = torch.Generator().manual_seed(5)
    arrays = random_bank(8, 64, 32, fp4=True, gen=gen)
    arrays["gate_up_bias"] = torch.randn(8, 64, generator=gen)
    index, weight = random_routing(29, 2, 8, gen=gen)
    x = torch.randn(29, 64, generator=gen)
    got = grouped_experts(x, index, weight, arrays, GPT_OSS_MATH, group=3)
    want = loop(x, index, weight, arrays, GPT_OSS_MATH)
    assert rel_error(got, want) < 1e-6


def test_a_resident_bank_takes_the_grouped_path_past_the_pair_budget(monkeypatch):
    """``ExpertBank.forward`` of an FP4 bank: ``T*K`` past ``batched_pairs`` runs ``grouped_experts``."""
    from shardsmith.runtime.layers import experts

    calls = []
    real = experts.grouped_experts
    monkeypatch.setattr(experts, "grouped_experts", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    bank = experts.ExpertBank.__new__(experts.ExpertBank)
    torch.nn.Module.__init__(bank)
    gen = torch.Generator().manual_seed(2)
    for name, t in random_bank(6, 64, 32, fp4=True, gen=gen).items():
        bank.register_buffer(name, t)
    bank.top_k, bank.math, bank.format, bank.block = 2, V4_MATH, "fp4", None
    x = torch.randn(20, 64, generator=gen)
    index, weight = random_routing(20, 2, 6, gen=gen)
    assert torch.equal(bank(x, index, weight), loop(x, index, weight, bank.arrays(), V4_MATH))
    assert calls == [(20, 2)]
    bank(x[:8], index[:8], weight[:8])  # 16 pairs: the batched pairs, no sync
    assert calls == [(20, 2)]
    assert torch.equal(bank(x.double(), index, weight), loop(x.double(), index, weight, bank.arrays(), V4_MATH))
    assert calls == [(20, 2)]  # float64 (parity runs): the loop, which grouped_mm does not take


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_the_tile_kernel_is_its_reference(dtype, tol):
    """Runs of 0, 1, 16, 70 and 3 rows (several tiles of one run, a ragged last tile, an empty run), K not a
    multiple of the reduction step (96 in steps of 64) and N not a multiple of the output block (a
    96-row matrix in 64-row blocks). bf16 within bf16's rounding of the float32 reference."""
    gen = torch.Generator().manual_seed(3)
    bank = random_bank(5, 96, 48, fp4=True, gen=gen)  # gate_up [5, 96, 48]: N = 96, K = 96
    sizes = [0, 1, 16, 70, 3]
    a = torch.randn(sum(sizes), 96, generator=gen)
    truth = grouped_gemm_reference(a, bank["gate_up"], bank["gate_up_scale"], sizes)
    got = grouped_gemm(a.to(dtype), bank["gate_up"], bank["gate_up_scale"], sizes, block_m=16, block_n=64,
                         block_k=64, backend="triton")
    assert got.dtype == dtype and got.shape == (90, 96)
    assert rel_error(got, truth) < tol
    assert tile_table(sizes, 16) == [1, 0, 1, 2, 1, 17, 3, 17, 33, 3, 33, 49, 3, 49, 65, 3, 65, 81, 3, 81, 87,
                                     4, 87, 90]


def test_long_runs_take_tall_tiles_with_the_same_result():
    """Runs that average 128 rows or more (a long chunk's experts) take 128-row tiles with 64-element
    reduction steps; the result is the reference's, ragged tall tiles included."""
    assert tile_blocks([0, 48, 48]) == {} and tile_blocks([]) == {}
    assert tile_blocks([0, 100, 156, 0]) == {"block_m": 128, "block_k": 64, "num_warps": 8}
    gen = torch.Generator().manual_seed(5)
    bank = random_bank(3, 64, 32, fp4=True, gen=gen)  # gate_up [3, 64, 32]: N = 64, K = 64
    sizes = [130, 0, 200]
    a = torch.randn(sum(sizes), 64, generator=gen)
    truth = grouped_gemm_reference(a, bank["gate_up"], bank["gate_up_scale"], sizes)
    got = grouped_gemm(a, bank["gate_up"], bank["gate_up_scale"], sizes, block_n=32, backend="triton",
                         **tile_blocks(sizes))
    assert rel_error(got, truth) < 1e-6


@pytest.mark.parametrize("case", ["fp8-gate-up", "fp8-down", "bf16", "f32"])
def test_the_tile_kernel_takes_fp8_and_plain_weights(case):
    """FP8 block-scaled matrices, the FP8 bytes and float32 block scales read in the kernel: a stacked gate
    and up of 40 rows each in 32-row scale blocks (each half with its own ragged last block row), and a down
    matrix whose K (40) ends inside a scale block; bf16 and float32 weights as stored. Runs of 0, 19, 70 rows."""
    gen = torch.Generator().manual_seed(6)
    bank = random_bank(3, 64, 40, fp4=False, gen=gen, fp8_block=(32, 32)) if case.startswith("fp8") else \
        random_bank(3, 64, 40, fp4=False, gen=gen, dtype=torch.bfloat16 if case == "bf16" else torch.float32)
    name, split = ("down", None) if case == "fp8-down" else ("gate_up", 40 if case == "fp8-gate-up" else None)
    w, scale = bank[name], bank.get(name + "_scale")
    block = (32, 32) if case.startswith("fp8") else None
    sizes = [0, 19, 70]
    a = torch.randn(sum(sizes), w.shape[2], generator=gen)
    truth = grouped_gemm_reference(a, w, scale, sizes, block=block, split=split)
    got = grouped_gemm(a, w, scale, sizes, block=block, split=split, block_m=16, block_n=32, block_k=32,
                       backend="triton")
    assert got.shape == (89, w.shape[1]) and rel_error(got, truth) < 1e-6
    if split is not None:  # the stacked halves' scale rows, by hand (experts 1 and 2 hold the runs)
        by_hand = torch.cat((torch.nn.functional.linear(a[:19], _dequant_stacked(w[1], scale[1])),
                             torch.nn.functional.linear(a[19:], _dequant_stacked(w[2], scale[2]))))
        assert rel_error(got, by_hand) < 1e-6


def _dequant_stacked(w, scale):
    """Gate rows [0, 40) with scale rows [0, 2), up rows with [2, 4): a stacked FP8 gate/up by hand."""
    s = torch.cat([scale[:2].repeat_interleave(32, 0)[:40], scale[2:].repeat_interleave(32, 0)[:40]])
    return w.float() * s.repeat_interleave(32, 1)[:, :w.shape[1]]


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_fp8_and_dense_banks_through_the_tile_kernel_are_the_loop(monkeypatch, fmt):
    """A Mixtral-family bank (plain SwiGLU) of FP8 block-scaled or bf16 experts: ``grouped_experts`` through
    the tile kernel equals the expert-by-expert loop (float32 activations); a resident bank takes it past
    the decode-sized steps when the tile kernel runs (on CUDA; here forced) and not on the CPU otherwise."""
    gen = torch.Generator().manual_seed(12)
    block = (32, 32) if fmt == "fp8" else None
    arrays = random_bank(8, 64, 40, fp4=False, gen=gen, fp8_block=block, dtype=torch.float32)
    math = ExpertMath(limit=0.0)
    index, weight = random_routing(29, 2, 8, gen=gen)
    x = torch.randn(29, 64, generator=gen)
    want = loop(x, index, weight, arrays, math, block)
    monkeypatch.setattr(experts, "TILE_KERNEL", True)
    assert experts.grouped_runs(x, fmt) and rel_error(grouped_experts(x, index, weight, arrays, math, block=block),
                                                      want) < 1e-6
    bank = experts.ExpertBank.__new__(experts.ExpertBank)
    torch.nn.Module.__init__(bank)
    for name, t in arrays.items():
        bank.register_buffer(name, t)
    bank.top_k, bank.math, bank.format, bank.block = 2, math, "fp8" if fmt == "fp8" else "dense", block
    calls = []
    real = experts.grouped_experts
    monkeypatch.setattr(experts, "grouped_experts", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    assert rel_error(bank(x, index, weight), want) < 1e-6 and calls == [(29, 2)]
    monkeypatch.setattr(experts, "TILE_KERNEL", None)  # the CPU's default: FP8 and bf16 banks keep the loop
    assert not experts.grouped_runs(x, bank.format)
    assert rel_error(bank(x, index, weight), want) < 1e-6 and calls == [(29, 2)]


def test_the_grouped_path_each_format_takes(monkeypatch):
    """On the CPU: FP4 banks expand for ``torch._grouped_mm``, FP8 and dense banks go expert by expert, float64
    (parity runs) always does; the tile kernel forced takes every format; ``GROUPED`` off, none. A dense
    bank's ``expanded`` matmul (CUDA's dense path) multiplies its rows as they are."""
    x = torch.zeros(4, 64)
    assert [experts.grouped_path(x, f) for f in ("fp4", "fp8", "dense")] == ["expanded", None, None]
    assert [experts.grouped_path(x.double(), f) for f in ("fp4", "fp8", "dense")] == [None, None, None]
    monkeypatch.setattr(experts, "TILE_KERNEL", True)
    assert [experts.grouped_path(x, f) for f in ("fp4", "fp8", "dense")] == ["tiles"] * 3
    monkeypatch.setattr(experts, "GROUPED", False)
    assert [experts.grouped_runs(x, f) for f in ("fp4", "fp8", "dense")] == [False] * 3
    gen = torch.Generator().manual_seed(8)
    bank = random_bank(3, 64, 32, fp4=False, gen=gen, dtype=torch.float32)
    sizes = [5, 0, 9]
    a = torch.randn(14, 64, generator=gen)
    got = experts._expanded_mm(torch.tensor(sizes), None)(a, bank["gate_up"], None)
    assert torch.allclose(got, grouped_gemm_reference(a, bank["gate_up"], None, sizes), atol=1e-5)


def test_a_dense_bank_goes_to_grouped_mm_in_place(monkeypatch):
    """A resident dense bank through ``torch._grouped_mm`` (CUDA's path for dense banks; forced here): the bank
    itself, every expert one group (the absent ones empty), no gathered copy; the loop's result."""
    gen = torch.Generator().manual_seed(13)
    arrays = random_bank(9, 64, 40, fp4=False, gen=gen, dtype=torch.float32)
    math = ExpertMath(limit=0.0)
    index, weight = random_routing(23, 2, 6, gen=gen)  # experts 6, 7, 8 absent
    x = torch.randn(23, 64, generator=gen)
    seen = []
    real = torch._grouped_mm
    monkeypatch.setattr(experts, "grouped_path", lambda x, fmt="fp4": "expanded")
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: seen.append((b.shape[0], b.data_ptr(), offs.tolist()))
                        or real(a, b, offs=offs))
    got = grouped_experts(x, index, weight, arrays, math)
    assert rel_error(got, loop(x, index, weight, arrays, math)) < 1e-6
    assert [s[:2] for s in seen] == [(9, arrays["gate_up"].data_ptr()), (9, arrays["down"].data_ptr())]
    assert seen[0][2][-4:] == [46, 46, 46, 46]  # 23 x 2 pairs; the last three experts' runs empty


def test_the_tile_kernel_names_what_does_not_fit():
    gen = torch.Generator().manual_seed(4)
    bank = random_bank(3, 64, 32, fp4=True, gen=gen)
    a = torch.randn(10, 64, generator=gen)
    with pytest.raises(KernelError, match=r"sizes must give each of the 3 matrices its rows of a \(10 in all\), got 2"):
        grouped_gemm(a, bank["gate_up"], bank["gate_up_scale"], [4, 6])
    with pytest.raises(KernelError, match=r"a has K=48 .* w must be \[G, N, 24\]"):
        grouped_gemm(a[:, :48], bank["gate_up"], bank["gate_up_scale"], [4, 6, 0])
    with pytest.raises(KernelError, match="block_k 48 must be a multiple of 32"):
        grouped_gemm(a, bank["gate_up"], bank["gate_up_scale"], [4, 6, 0], block_k=48)
    with pytest.raises(KernelError, match=r"FP8 w needs block \(b0, b1\) and float32 scale"):
        fp8 = random_bank(3, 64, 32, fp4=False, gen=gen, fp8_block=(32, 32))
        grouped_gemm(a, fp8["gate_up"], fp8["gate_up_scale"], [4, 6, 0])
    with pytest.raises(KernelError, match="split 20 must halve N=64"):
        grouped_gemm(a, fp8["gate_up"], fp8["gate_up_scale"], [4, 6, 0], block=(32, 32), split=20)
    with pytest.raises(KernelError, match="a plain torch.float32 w takes no scale"):
        grouped_gemm(a, fp8["gate_up"].float(), fp8["gate_up_scale"], [4, 6, 0])


@pytest.mark.parametrize("math", [V4_MATH, GPT_OSS_MATH], ids=["v4", "gpt-oss"])
def test_grouped_through_the_tile_kernel_is_the_loop(monkeypatch, math):
    """``grouped_experts`` with the tile kernel (as on CUDA): a resident bank read in place, every expert one
    run (the absent ones empty); a fetched bank (the offloaded chunk path) keeps its groups of present experts."""
    gen = torch.Generator().manual_seed(9)
    arrays = random_bank(12, 64, 32, fp4=True, gen=gen)
    if math.interleaved:
        arrays["gate_up_bias"] = torch.randn(12, 64, generator=gen)
    index, weight = random_routing(37, 4, 10, gen=gen)
    x = torch.randn(37, 64, generator=gen)
    want = loop(x, index, weight, arrays, math)
    calls = []
    real = experts.grouped_gemm
    ptrs = []
    monkeypatch.setattr(experts, "grouped_gemm",
                        lambda a, w, *r, **k: calls.append(w.shape[0]) or ptrs.append(w.data_ptr()) or real(a, w, *r, **k))
    monkeypatch.setattr(experts, "TILE_KERNEL", True)
    assert rel_error(grouped_experts(x, index, weight, arrays, math, group=3), want) < 1e-6
    assert calls == [12, 12]  # the resident bank as it is (10 present experts, 2 empty runs): gate_up, then down
    assert ptrs == [arrays["gate_up"].data_ptr(), arrays["down"].data_ptr()]  # read in place, not gathered

    def fetch(ids, ids_h):
        return lambda: {name: a[ids] for name, a in arrays.items()}
    calls.clear()
    got = grouped_experts(x, index, weight, {}, math, group=4, fetch=fetch, n_experts=12)
    assert rel_error(got, want) < 1e-6 and calls == [4, 4, 4, 4, 2, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scaled_dot", [False, True])
def test_the_tile_kernel_at_v4_flash_shapes(scaled_dot):
    """gate_up ``[32, 4096, 2048]`` and down ``[32, 4096, 1024]`` (I_r = 2048), ragged runs, bf16 within bf16's
    rounding of the float32 reference."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    bank = random_bank(32, 4096, 2048, fp4=True, gen=gen)
    sizes = torch.randint(0, 300, (32,), generator=gen, device="cuda").tolist()
    for w, s, k in ((bank["gate_up"], bank["gate_up_scale"], 4096), (bank["down"], bank["down_scale"], 2048)):
        a = torch.randn(sum(sizes), k, generator=gen, device="cuda")
        truth = grouped_gemm_reference(a, w, s, sizes)
        got = grouped_gemm(a.bfloat16(), w, s, sizes, scaled_dot=scaled_dot)
        assert rel_error(got, truth) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_fp4_and_fp8_take_the_tile_kernel_and_dense_cublas():
    x = torch.zeros(4, 64, device="cuda", dtype=torch.bfloat16)
    dense = "expanded" if experts.grouped_mm_runs(x) else None
    assert [experts.grouped_path(x, f) for f in ("fp4", "fp8", "dense")] == ["tiles", "tiles", dense]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block", [(128, 128)], ids=["fp8-128x128"])
def test_fp8_tile_kernel_at_v3_shapes_on_cuda_within_bf16(block):
    """DeepSeek-V3's expert shapes (D 7168, I 2048 at TP=1), 64 experts, 512 tokens x 8: the tile kernel's FP8
    grouped experts against the float32 loop, as close as the bf16 loop is."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    arrays = random_bank(64, 7168, 2048, fp4=False, gen=gen, fp8_block=block)
    math = ExpertMath(limit=0.0)
    index, weight = random_routing(512, 8, 64, gen=gen)
    x = torch.randn(512, 7168, generator=gen, device="cuda").bfloat16()
    assert experts.grouped_path(x, "fp8") == "tiles"
    got = grouped_experts(x, index, weight, arrays, math, block=block)
    truth, want = (loop(xx, index, weight, arrays, math, block) for xx in (x.float(), x))
    assert rel_error(got, truth) <= 2 * rel_error(want, truth) + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tiles", [True, False], ids=["tile-kernel", "expanded"])
def test_v4_shapes_on_cuda_within_bf16(monkeypatch, tiles):
    monkeypatch.setattr(experts, "TILE_KERNEL", tiles)
    gen = torch.Generator(device="cuda").manual_seed(7)
    arrays = random_bank(40, 4096, 2048, fp4=True, gen=gen)
    index, weight = random_routing(512, 6, 40, gen=gen)
    x = torch.randn(512, 4096, generator=gen, device="cuda").bfloat16()
    assert grouped_mm_runs(x)
    got = grouped_experts(x, index, weight, arrays, V4_MATH)
    truth = loop(x.float(), index, weight, {a: t for a, t in arrays.items()}, V4_MATH)
    want = loop(x, index, weight, arrays, V4_MATH)
    assert rel_error(got, truth) <= 2 * rel_error(want, truth) + 1e-3
