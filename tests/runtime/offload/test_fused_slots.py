"""Offloaded experts through the fused kernel (issue 12): the slot pool is a bank indexed by slot id.

CPU: the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton
loads). Checked here: the FP8 expert kernel against its PyTorch reference (128x128 and ragged
blocks, bf16 and float32); for FP4, FP8 and bf16 banks and decode batches of T = 1..16 tokens, the
kernel over a slot pool (experts at shuffled slots) against the kernel over the resident bank and
against the reference; the offload runtime's slot steps (misses copied, then ``fused_bank`` over
the pool, eager and through ``decode_slots`` / ``apply_slots``) against the resident bank's kernel
call; the switch. GPU (``-m gpu``): the same at DeepSeek-V4-Flash's expert shapes, captured in one
CUDA graph, and the tiny DeepSeek-V4 offloaded and graphed with the kernel against the resident
kernel model.
"""

from __future__ import annotations

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.experts import ExpertMath, fused_bank
from shardsmith.runtime.layers.kernels import KernelError, fused_experts, fused_experts_reference, triton_available
from shardsmith.runtime.layers.kernels.testing import random_bank, random_routing, rel_error

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install "
                                  "'shardsmith[kernels]')")
TOL = 1.5e-2  # bf16 against a float64 truth (test_kernels.py says why)
V4 = ExpertMath(limit=3.0, accumulate_f32=True, batched_pairs=16)


def _bank(fmt: str, experts: int, dim: int, inter: int, gen: torch.Generator, block=(32, 32)) -> dict:
    return random_bank(experts, dim, inter, fp4=fmt == "fp4", gen=gen, fp8_block=block if fmt == "fp8" else None)


def _pool(bank: dict, perm: torch.Tensor, slots: int) -> dict:
    """A slot pool of ``slots`` slots holding expert ``perm[s]`` at slot ``s`` (the rest: other experts)."""
    return {name: t[perm[:slots]].clone() for name, t in bank.items()}


@needs_triton
@pytest.mark.parametrize(("block", "dim", "inter", "tokens", "dtype"), [
    ((128, 128), 256, 128, 1, torch.bfloat16),   # V3 / Mixtral-FP8 blocks, one token
    ((128, 128), 128, 64, 16, torch.bfloat16),    # blocks past I_r and D (one scale block each)
    ((48, 40), 96, 72, 5, torch.float32),         # ragged blocks: I_r and D not multiples of them
])
def test_fp8_experts_match_reference(block, dim, inter, tokens, dtype):
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    bank = _bank("fp8", 8, dim, inter, gen, block)
    ids, weights = random_routing(tokens, 3, 8, gen=gen)
    x = torch.randn(tokens, dim, generator=gen, device=DEV).to(dtype)
    out = fused_experts(x, ids, weights, **bank, limit=3.0, block=block, backend="triton")
    ref = fused_experts_reference(x, ids, weights, **bank, limit=3.0, block=block)
    truth = fused_experts_reference(x.double(), ids, weights, **bank, limit=3.0, block=block)
    tol = TOL if dtype == torch.bfloat16 else 1e-5
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_error(out, truth) < tol, (rel_error(out, truth), rel_error(ref, truth))
    # a wrong scale row (gate's for up's) or column shows: the scales vary by block by up to 3x
    wrong = dict(bank, gate_up_scale=bank["gate_up_scale"].flip(1))
    wrong_out = fused_experts_reference(x.double(), ids, weights, **wrong, limit=3.0, block=block)
    assert rel_error(wrong_out, truth) > 10 * tol


def test_fp8_bank_needs_its_block_and_f32_scales():
    bank = _bank("fp8", 4, 64, 32, torch.Generator().manual_seed(0))
    ids, weights, x = torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2), torch.ones(1, 64)
    with pytest.raises(KernelError, match=r"FP8 bank needs block=\(b0, b1\)"):
        fused_experts(x, ids, weights, **bank, backend="reference")
    with pytest.raises(KernelError, match=r"needs F32 gate_up_scale \[4, 2, 2\] and down_scale \[4, 2, 1\]"):
        fused_experts(x, ids, weights, **dict(bank, down_scale=bank["down_scale"][:, :1]), block=(32, 32),
                      backend="reference")


@needs_triton
@pytest.mark.parametrize(("fmt", "tokens"), [("fp4", 1), ("fp4", 16), ("fp8", 1), ("fp8", 16), ("bf16", 16)])
def test_slot_pool_equals_resident_bank(fmt, tokens):
    """The kernel over a pool (experts at shuffled slots, slot ids for expert ids) gives the resident
    bank's bits: each expert's arithmetic is the same, only which program leads differs."""
    gen = torch.Generator(device=DEV).manual_seed(100 + tokens)
    experts, top_k = 40, 6
    bank = _bank(fmt, experts, 64, 32, gen)
    ids, weights = random_routing(tokens, top_k, experts, gen=gen)
    used = ids.unique()
    perm = torch.cat([used[torch.randperm(used.numel(), generator=torch.Generator().manual_seed(1))],
                      torch.tensor([e for e in range(experts) if e not in set(used.tolist())], device=ids.device)])
    pool = _pool(bank, perm, used.numel() + 3)
    slot_of = torch.empty(experts, dtype=torch.int64, device=ids.device)
    slot_of[perm] = torch.arange(experts, device=ids.device)
    slots = slot_of[ids]  # [T, K]
    x = torch.randn(tokens, 64, generator=gen, device=DEV).bfloat16()
    block = (32, 32) if fmt == "fp8" else None
    resident = fused_bank(x, ids, weights, bank, V4, block)
    offloaded = fused_bank(x, slots, weights, pool, V4, block)
    assert torch.equal(offloaded, resident)
    truth = fused_experts_reference(x.double(), ids, weights, **bank, limit=V4.limit, block=block)
    assert rel_error(offloaded, truth) < TOL


# ------------------------------------------------------------------ the offload runtime's slot steps


def _runtime(fmt: str, use_settings, *, slots: int, kernel: bool, layers: int = 2, experts: int = 24):
    """An offload runtime over random host banks (CPU pool), and those banks."""
    from shardsmith.runtime.offload import OffloadConfig, OffloadRuntime
    from shardsmith.runtime.offload.host_bank import HostBanks

    use_settings(fused_experts="kernel" if kernel else "reference")
    gen = torch.Generator(device=DEV).manual_seed(7)
    banks = {f"layers.{i}": _bank(fmt, experts, 64, 32, gen) for i in range(layers)}
    host = HostBanks({k: {n: t.cpu() for n, t in b.items()} for k, b in banks.items()})
    rt = OffloadRuntime(OffloadConfig(backend="gpu", cache_slots=slots, probe=False, pin="off"), host, list(banks),
                        device=torch.device(DEV), dtype=torch.bfloat16, dim=64,
                        block=(32, 32) if fmt == "fp8" else None, math=V4)
    rt.use_kernel_(torch.device(DEV))
    rt.start()
    return rt, banks


@needs_triton
@pytest.mark.parametrize("fmt", ["fp4", "fp8", "bf16"])
def test_offloaded_slot_steps_equal_resident_kernel(fmt, use_settings):
    """Decode batches of 1 and 4 tokens over two layers: first eager (``run_layer``: misses copied,
    then the kernel over the pool), then split as a graph runs it (``decode_slots``: all hits, then
    ``apply_slots``); each the resident kernel call's bits. Slots hold the stored format."""
    rt, banks = _runtime(fmt, use_settings, slots=24, kernel=True)
    assert rt.kernel and rt.slot_path()
    block = (32, 32) if fmt == "fp8" else None
    gen = torch.Generator(device=DEV).manual_seed(3)
    seen: dict[int, set[int]] = {0: set(), 1: set()}  # 24 slots hold every expert: nothing is evicted
    for layer, tokens in ((0, 1), (1, 1), (0, 4)):
        ids, weights = random_routing(tokens, 6, 24, gen=gen)
        x = torch.randn(tokens, 64, generator=gen, device=DEV).bfloat16()
        want = fused_bank(x, ids, weights, banks[f"layers.{layer}"], V4, block)
        misses = rt.cache.table.misses
        assert torch.equal(rt.run_layer(layer, x, ids, weights), want), (fmt, tokens, layer)
        new = set(ids.unique().tolist()) - seen[layer]
        assert rt.cache.table.misses - misses == len(new) > 0  # the layer's new experts were copied
        seen[layer] |= new
        slots, routed = rt.decode_slots(layer, x, ids, weights)
        assert routed is None and slots.shape == (tokens * 6,)
        assert rt.cache.table.misses - misses == len(new)  # the same experts again: all hits
        assert torch.equal(rt.apply_slots(x, weights, slots), want)
    st = rt.stats()
    assert st["hits"] > 0 and st["bytes_copied"] == st["misses"] * st["slot_bytes"]
    assert rt.cache.pool["gate_up"].dtype == banks["layers.0"]["gate_up"].dtype  # stored format in the slots


@needs_triton
def test_too_many_experts_for_the_slots_take_the_general_path(use_settings):
    """16 tokens over more distinct experts than slots: no slot step (the host's waves), same result
    within rounding (expert by expert, expanded)."""
    rt, banks = _runtime("fp4", use_settings, slots=8, kernel=True, layers=1)
    gen = torch.Generator(device=DEV).manual_seed(5)
    ids, weights = random_routing(16, 6, 24, gen=gen)
    x = torch.randn(16, 64, generator=gen, device=DEV).bfloat16()
    slots, routed = rt.decode_slots(0, x, ids, weights)
    assert slots is None
    want = fused_experts_reference(x.double(), ids, weights, **banks["layers.0"], limit=V4.limit)
    assert rel_error(routed, want) < TOL


def test_switch_off_keeps_the_fp4_pair_path_only(use_settings):
    """``SHARDSMITH_KERNELS=fused_experts=reference``: FP4 pools keep the expanded pair path for slot steps; bf16
    and FP8 pools have none (the general path), as before the kernel."""
    for fmt, slot_path in (("fp4", True), ("bf16", False), ("fp8", False)):
        rt, _ = _runtime(fmt, use_settings, slots=24, kernel=False, layers=1)
        assert not rt.kernel and rt.slot_path() is slot_path, fmt


@needs_triton
@pytest.mark.slow  # ~2-3 min under the interpreter on 2 cores
def test_tiny_v4_offloaded_through_the_kernel_equals_resident_on_cpu(tiny_v4_packs, use_settings):
    """The engine-level CPU twin of the GPU check below, in float32: the tiny DeepSeek-V4 with the
    kernel forced on, offloaded to a 12-slot cache, gives the resident kernel bank's logits bit for
    bit (8-token prefill: 16 pairs through the pool) and its first decode step's."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.offload import OffloadConfig

    use_settings(fused_experts="kernel")
    prompt = [3, 17, 42, 99, 5, 8, 61, 7]
    got = {}
    for name, cfg in (("resident", None), ("offload", OffloadConfig(backend="gpu", cache_slots=12, probe=False))):
        eng = Engine.load(tiny_v4_packs[1], rank=0, world_size=1, device="cpu", dtype=torch.float32, max_seq_len=32,
                          offload=cfg)
        model = eng.model
        first = model(torch.tensor(prompt), 0, last_only=False)
        step = model(first[-1:].argmax(-1), len(prompt))
        got[name] = (first, step, eng.offload and dict(eng.offload.stats(), kernel=eng.offload.kernel))
        if eng.offload:
            eng.offload.close()
        eng.shutdown()
    stats = got["offload"][2]
    assert stats["kernel"] and stats["misses"] > 0
    for want, have in zip(got["resident"][:2], got["offload"][:2]):
        torch.testing.assert_close(have, want, atol=0, rtol=0)


# ------------------------------------------------------------------ GPU


gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), needs_triton]


def _graphed(fn, *inputs):
    """Capture ``fn(*inputs)`` in one CUDA graph (after a warm-up on a side stream); (graph, outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*inputs)
    return graph, out


@pytest.mark.parametrize("fmt, inter", [("fp4", 2048), ("fp8", 1024), ("bf16", 1024)])
def test_gpu_slot_pool_at_v4_shapes_in_a_graph(fmt, inter):
    """D = 4096, 256 experts, a 64-slot pool; T = 1, 4, 16 (top-6, the union fits when T <= 10, else
    the pool is the union): pool == resident bank bitwise, replayed in a CUDA graph on new slots."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    bank = _bank(fmt, 256, 4096, inter, gen, (128, 128))
    block = (128, 128) if fmt == "fp8" else None
    for tokens in (1, 4, 16):
        ids, weights = random_routing(tokens, 6, 256, gen=gen)
        used = ids.unique()
        rest = torch.tensor([e for e in range(256) if e not in set(used.tolist())], device="cuda")
        perm = torch.cat([used.flip(0), rest])
        n = max(64, used.numel())
        pool = _pool(bank, perm, n)
        slot_of = torch.full((256,), -1, dtype=torch.int64, device="cuda")
        slot_of[perm[:n]] = torch.arange(n, device="cuda")
        x = torch.randn(tokens, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
        want = fused_bank(x, ids, weights, bank, V4, block)
        static = torch.zeros_like(ids)  # captured on slot 0 everywhere, replayed on the real slots
        graph, out = _graphed(lambda s: fused_bank(x, s, weights, pool, V4, block), static)
        static.copy_(slot_of[ids])
        graph.replay()
        assert torch.equal(out, want), (fmt, tokens)
        truth = fused_experts_reference(x.float(), ids, weights, **bank, limit=V4.limit, block=block)
        assert rel_error(out, truth) < 1e-2


for _mark in gpu:
    test_gpu_slot_pool_at_v4_shapes_in_a_graph = _mark(test_gpu_slot_pool_at_v4_shapes_in_a_graph)


def _decode_v4(path, offload, prompt: list[int]) -> tuple[list[torch.Tensor], list[int], dict | None]:
    """bf16 on CUDA, graphed: two 8-token prefills' logits, 8 greedy tokens, the offload counters."""
    from shardsmith.runtime.engine.engine import Engine, SamplingParams

    eng = Engine.load(path, rank=0, world_size=1, device="cuda", dtype=torch.bfloat16, max_seq_len=64,
                      offload=offload)
    logits = [eng.logits(prompt[:8]) for _ in range(2)]
    tokens = [s.token_id for s in eng.generate(prompt, SamplingParams(max_tokens=8))]
    stats = None
    if eng.offload:
        stats = dict(eng.offload.stats(), kernel=eng.offload.kernel)
        eng.offload.close()
    eng.shutdown()
    return logits, tokens, stats


@pytest.mark.parametrize("inplace", ["auto", "auto:read", "reference"])
def test_gpu_tiny_v4_offloaded_through_the_kernel_equals_resident(tiny_v4_packs, use_settings, inplace):
    """The tiny DeepSeek-V4 with the kernel on (the CUDA default), graphed: offloaded to a 12-slot
    cache (misses, then hits), its decode steps' experts run fused_experts over the pool, and give
    the resident kernel bank's logits bit for bit and its greedy tokens; ``auto``: misses decided on
    the device and copied from the pinned host banks by a kernel (``auto:read``: read in place by
    the expert kernel), each step one graph; ``reference``: the host table, copied after a sync."""
    from shardsmith.runtime.offload import OffloadConfig

    inplace, _, miss = inplace.partition(":")
    use_settings(fused_experts="auto")
    use_settings(offload_inplace=inplace)
    use_settings(offload_miss=miss or "copy")
    prompt = [3, 17, 42, 99, 5, 8, 61, 7, 200, 13]
    want, want_tokens, _ = _decode_v4(tiny_v4_packs[1], None, prompt)
    got, tokens, stats = _decode_v4(tiny_v4_packs[1], OffloadConfig(backend="gpu", cache_slots=12, probe=False,
                                                                   pin="require"), prompt)
    print(f"\ntiny V4 offloaded through the kernel: {stats}")
    assert stats["kernel"] and stats["misses"] > 0 and stats["hits"] > 0
    assert (stats.get("mode") == "inplace") is (inplace == "auto")
    assert stats.get("miss", "copy") == (miss or "copy")
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    assert tokens == want_tokens


for _mark in gpu:
    test_gpu_tiny_v4_offloaded_through_the_kernel_equals_resident = _mark(
        test_gpu_tiny_v4_offloaded_through_the_kernel_equals_resident)
