"""Split ``hybrid`` decode steps (issue 15): the host computes its share of the experts while the GPU
runs the rest through the slot path, the host's pairs masked.

CPU, float32 (the "GPU" is the CPU: the slot pool is host memory and nothing is copied over a
link). Runtime level: FP4 (DeepSeek-V4 maths, the expanded pair path and the fused kernel under
Triton's interpreter) and bf16 (Mixtral maths, the kernel) banks, decode batches of 1 and 4 tokens,
eager (``run_layer``) and split as a graph runs it (``decode_slots`` -> ``apply_slots(masked)`` ->
``HostPartial.add_to``), against a float64 reference: equal within float32 rounding (the sums run
in another order than the resident step's); the masked GPU partial alone is exactly the GPU pairs'.
Engine level: the tiny DeepSeek-V4 with ``hybrid`` at world sizes 1 and 2 (gloo), prefill, batched
steps of 4 rows through the decode pieces and one-row steps eagerly and through the pieces,
against the resident model fed the same tokens; the tiny Mixtral the same at world size 1 with the
kernel forced (``slow``: the interpreter).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.experts import ExpertMath
from shardsmith.runtime.layers.kernels import fused_experts_reference, triton_available
from shardsmith.runtime.layers.kernels.testing import random_bank, random_routing
from shardsmith.runtime.offload import OffloadConfig, host_kernel
from shardsmith.testing.ranks import run_gloo

V4 = ExpertMath(limit=3.0, accumulate_f32=True, batched_pairs=16)
MIXTRAL = ExpertMath()
TOP_K, EXPERTS = 4, 24


def _runtime(fmt: str, math: ExpertMath, use_settings, *, kernel: bool):
    """A ``hybrid`` runtime (half the misses on the host, 16 slots) over two layers of random banks."""
    from shardsmith.runtime.offload import OffloadRuntime
    from shardsmith.runtime.offload.host_bank import HostBanks

    use_settings(fused_experts="kernel" if kernel else "reference")
    gen = torch.Generator().manual_seed(7)
    banks = {f"layers.{i}": random_bank(EXPERTS, 64, 32, fp4=fmt == "fp4", gen=gen) for i in range(2)}
    rt = OffloadRuntime(OffloadConfig(backend="hybrid", cache_slots=16, hybrid_fraction=0.5, probe=False, pin="off"),
                        HostBanks(banks), list(banks), device=torch.device("cpu"), dtype=torch.float32, dim=64,
                        block=None, math=math)
    rt.use_kernel_(torch.device("cpu"))
    rt.start()
    return rt, banks


CASES = [("fp4", V4, False), pytest.param("fp4", V4, True, marks=pytest.mark.skipif(not triton_available(),
                                                                                    reason="needs triton")),
         pytest.param("bf16", MIXTRAL, True, marks=pytest.mark.skipif(not triton_available(), reason="needs triton"))]


@pytest.mark.parametrize(("fmt", "math", "kernel"), CASES)
def test_split_steps_equal_the_reference(fmt, math, kernel, use_settings):
    rt, banks = _runtime(fmt, math, use_settings, kernel=kernel)
    assert rt.slot_path() and rt.kernel is kernel
    gen = torch.Generator().manual_seed(3)
    try:
        for layer, tokens in ((0, 1), (1, 4), (0, 4)):
            ids, weights = random_routing(tokens, TOP_K, EXPERTS, gen=gen)
            x = torch.randn(tokens, 64, generator=gen)
            bank = banks[f"layers.{layer}"]
            want = fused_experts_reference(x.double(), ids, weights, **bank, limit=math.limit)
            tol = 2e-6 * want.abs().max().item()
            before = (rt.split_steps, rt.cpu_experts, rt.cpu.calls)
            got = rt.run_layer(layer, x, ids, weights)
            assert rt.split_steps == before[0] + 1 and rt.cpu_experts > before[1], (layer, tokens)
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
            # a new draw, so that some experts miss again: the graph's form of the same step
            ids, weights = random_routing(tokens, TOP_K, EXPERTS, gen=gen)
            want = fused_experts_reference(x.double(), ids, weights, **bank, limit=math.limit)
            slots, pending = rt.decode_slots(layer, x, ids, weights)
            assert slots is not None and pending is not None and rt.split_steps == before[0] + 2
            masked = (slots < 0).view(ids.shape)
            assert masked.any() and not masked.all()
            gpu = rt.apply_slots(x, weights, slots, masked=True)
            assert gpu.dtype == torch.float32  # the float32 sum, cast once after the host's is added
            # the masked pairs add exact zeros: the GPU partial is the GPU pairs' alone
            want_gpu = fused_experts_reference(x.double(), ids, weights * ~masked, **bank, limit=math.limit)
            torch.testing.assert_close(gpu.double(), want_gpu, atol=tol, rtol=0)
            torch.testing.assert_close(pending.add_to(gpu).double(), want, atol=tol, rtol=0)
            assert rt.cpu.calls == before[2] + 2
    finally:
        rt.close()


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_kernel_returns_the_float32_sum_uncast_when_asked():
    """``out_dtype=float32``: the combine's float32 sum before its cast: cast afterwards, the default
    call's bits on the reference path, within one bf16 step on the kernel's (Triton's interpreter
    does not round the combine's cast as torch does)."""
    from shardsmith.runtime.layers.kernels import fused_experts

    gen = torch.Generator().manual_seed(11)
    bank = random_bank(8, 64, 32, fp4=True, gen=gen)
    ids, weights = random_routing(2, TOP_K, 8, gen=gen)
    x = torch.randn(2, 64, generator=gen).bfloat16()
    wide = fused_experts(x, ids, weights, **bank, limit=3.0, backend="triton", out_dtype=torch.float32)
    ref = fused_experts(x, ids, weights, **bank, limit=3.0, backend="reference", out_dtype=torch.float32)
    assert wide.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(wide.bfloat16(), fused_experts(x, ids, weights, **bank, limit=3.0, backend="triton"),
                               atol=0, rtol=2**-7)
    assert (wide - ref).abs().max() <= 1e-2 * ref.abs().max()  # bf16 inputs: the kernel's dot vs the reference's
    assert torch.equal(ref.bfloat16(), fused_experts(x, ids, weights, **bank, limit=3.0, backend="reference"))


def test_host_buffers_are_kept_between_steps(use_settings):
    """The round trip allocates its host buffers once per shape: the second step reuses them."""
    rt, _ = _runtime("fp4", V4, use_settings, kernel=False)
    gen = torch.Generator().manual_seed(5)
    try:
        seen = []
        for _ in range(3):
            ids, weights = random_routing(1, TOP_K, EXPERTS, gen=gen)
            x = torch.randn(1, 64, generator=gen)
            staged = rt.cpu.stage(x, ids, weights)
            assert torch.equal(staged[1], x) and torch.equal(staged[0], ids) and torch.equal(staged[2], weights)
            seen.append(tuple(t.data_ptr() for t in staged))
        assert seen[0] == seen[1] == seen[2] and len(rt.cpu._down) == 1
    finally:
        rt.close()


# ------------------------------------------------------------------ the tiny DeepSeek-V4, engine level

HYBRID = OffloadConfig(backend="hybrid", cache_slots=5, hybrid_fraction=0.5, probe=False)
PROMPTS = ([3, 17, 42, 99, 5], [8, 61, 7], [200, 13, 77, 4, 9, 31], [11, 12])
FORCED = [[21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]]  # tokens fed to the batched steps


def _scenario(path: str, rank: int, world_size: int) -> dict:
    """Rank 0: logits of prefills, batched 4-row steps through the decode pieces (the engine's
    runner: on CPU every piece runs eagerly through its static buffers, as graphs replay them) and
    one-row steps (the plain forward, then the pieces) for resident and hybrid; others follow."""
    from shardsmith.runtime.engine.engine import Engine

    out = {}
    for name, offload in (("resident", None), ("hybrid", HYBRID)):
        eng = Engine.load(path, rank=rank, world_size=world_size, dtype=torch.float32, max_seq_len=32,
                          offload=offload, cuda_graphs=False, max_num_seqs=4)
        if rank != 0:
            eng.follow()
            if eng.offload:
                eng.offload.close()
            continue
        logits = [eng.prefill(s, p) for s, p in enumerate(PROMPTS)]
        starts = [len(p) for p in PROMPTS]
        for step in FORCED:  # 4 rows through the decode pieces (the engine's runner, on every rank)
            logits.append(eng.decode(step, starts, [0, 1, 2, 3]))
            starts = [s + 1 for s in starts]
        logits.append(eng.prefill(1, [55], starts[1]))  # one row, the plain forward (run_layer)
        logits.append(eng.decode([56], [starts[1] + 1], [1]))  # one row, the pieces
        stats = eng.offload.stats() if eng.offload else None
        out[name] = ([t.numpy() for t in logits], stats)
        eng.shutdown()
        if eng.offload:
            eng.offload.close()
    return out


def _check(out: dict) -> None:
    want, _ = out["resident"]
    got, stats = out["hybrid"]
    assert len(got) == len(want) == len(PROMPTS) + 5
    exact = not host_kernel.available()  # without the kernel the host runs the resident expert maths
    for i, (w, g) in enumerate(zip(want, got)):
        w, g = torch.from_numpy(w), torch.from_numpy(g)
        tol = 0 if exact else 1e-4 * w.abs().max().item()
        torch.testing.assert_close(g, w, atol=tol, rtol=0 if exact else 1e-4, msg=f"call {i}")
    assert stats["split_steps"] > 0 and stats["host_experts"] > 0, stats


def test_v4_split_steps_match_resident_world_size_1(tiny_v4_packs: dict[int, Path]):
    _check(_scenario(str(tiny_v4_packs[1]), 0, 1))


def test_v4_split_steps_match_resident_across_ranks(tiny_v4_packs: dict[int, Path]):
    _check(run_gloo(_scenario, 2, str(tiny_v4_packs[2]), timeout=300))


@pytest.mark.slow  # ~30 s: the resident and the offloaded banks both run the kernel under Triton's interpreter
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_mixtral_split_steps_match_resident(tmp_path, use_settings):
    """Tiny Mixtral (bf16 banks: no slot path without the kernel, so it is forced, as on CUDA):
    prefill, a step through the decode pieces and a one-row forward, hybrid vs resident, float32."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.testing import tiny_mixtral
    from shardsmith.writer.split import split_checkpoint

    use_settings(fused_experts="kernel")
    split_checkpoint(tiny_mixtral(tmp_path / "src", experts=8), tmp_path / "tp1", world_size=1)
    out = {}
    for name, offload in (("resident", None), ("hybrid", OffloadConfig(backend="hybrid", cache_slots=3,
                                                                          hybrid_fraction=0.5, probe=False))):
        eng = Engine.load(tmp_path / "tp1", rank=0, world_size=1, dtype=torch.float32, max_seq_len=32,
                          offload=offload, cuda_graphs=False, max_num_seqs=4)
        logits = [eng.prefill(0, [3, 17, 42, 99]), eng.decode([5], [4], [0]), eng.prefill(0, [6], 5)]
        out[name] = (logits, eng.offload.stats() if eng.offload else None)
        if eng.offload:
            assert eng.offload.kernel
            eng.offload.close()
    for want, got in zip(out["resident"][0], out["hybrid"][0]):
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    assert out["hybrid"][1]["split_steps"] > 0 and out["hybrid"][1]["host_experts"] > 0
