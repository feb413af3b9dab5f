"""Offloaded experts read in place, decided on the device (issue 12): no host sync in a decode step.

CPU: the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton
loads); the "device" is the CPU, so the host bank is read through the same pointer arithmetic as
mapped pinned memory on a GPU. Checked: the offload runtime in the in-place mode
(``SHARDSMITH_KERNELS=offload_inplace=kernel``) gives the resident kernel bank's bits for every call of a
sequence of decode batches over two layers (misses read from the host bank, hits from slots, LRU
evictions, a 20-token batch run in chunks), the slots it filled hold exactly the host experts its
device table says they hold, and the device counters add up (pairs, bytes over the link), both for
misses copied into pool rows first (``SHARDSMITH_TUNING=offload_miss=copy``, the default) and read in place
by the expert kernel (``read``); the switches and the modes they refuse. GPU checks: ``test_fused_slots.py -m gpu`` (the tiny DeepSeek-V4 offloaded
and graphed, in place and copied, against the resident bank).
"""

from __future__ import annotations

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.experts import ExpertMath, fused_bank
from shardsmith.runtime.layers.kernels import triton_available
from shardsmith.runtime.layers.kernels.testing import random_bank, random_routing

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install "
                                  "'shardsmith[kernels]')")
V4 = ExpertMath(limit=3.0, accumulate_f32=True, batched_pairs=16)
GPT_OSS = ExpertMath(limit=2.0, alpha=1.702, interleaved=True)  # gpt-oss's GLU (a tighter clamp, so it bites)


def _runtime(fmt: str, use_settings, *, slots: int, inplace: str = "kernel", backend: str = "gpu", experts: int = 12,
             miss: str = "copy", top_k: int | None = None):
    """An offload runtime over two layers of random host banks (D 64, I_r 32), and those banks."""
    from shardsmith.runtime.offload import OffloadConfig, OffloadRuntime
    from shardsmith.runtime.offload.host_bank import HostBanks

    use_settings(fused_experts="kernel")
    use_settings(offload_inplace=inplace)
    use_settings(offload_miss=miss)
    gen = torch.Generator(device=DEV).manual_seed(11)
    banks = {f"layers.{i}": random_bank(experts, 64, 32, fp4=fmt != "bf16", gen=gen) for i in range(2)}
    if fmt == "gpt-oss":  # MXFP4 with the gate/up bias: five arrays a slot
        for b in banks.values():
            b["gate_up_bias"] = torch.randn(experts, 64, generator=gen, device=DEV).bfloat16()
    host = HostBanks({k: {n: t.cpu() for n, t in b.items()} for k, b in banks.items()})
    rt = OffloadRuntime(OffloadConfig(backend=backend, cache_slots=slots, probe=False, pin="off"), host, list(banks),
                        device=torch.device(DEV), dtype=torch.bfloat16, dim=64, block=None, math=_math(fmt),
                        top_k=top_k)
    rt.use_kernel_(torch.device(DEV))
    rt.start()
    return rt, banks


def _math(fmt: str) -> ExpertMath:
    return GPT_OSS if fmt == "gpt-oss" else V4


@needs_triton
@pytest.mark.parametrize(("fmt", "miss"), [("fp4", "copy"), ("fp4", "read"), ("bf16", "copy"), ("gpt-oss", "copy"),
                                           ("gpt-oss", "read")])  # bf16 read: kernel-only
def test_inplace_steps_equal_resident_kernel_and_fill_the_slots(fmt, miss, monkeypatch, use_settings):
    """Six calls (1, 1, 1, 3, 20, 1 tokens; bf16 and gpt-oss's bank with its bias and GLU: fewer; K = 4 of 12
    experts; 7 slots for 24 keys, so they evict):
    each the resident kernel's bits on the pair path (the in-place mode's; bf16 past 4 tokens would
    take the grouped path resident), each filled slot the host expert its device key names. ``copy``:
    8 pool rows, 4 of them staging (top-k 4): a one-token call reads every pair from the pool, larger
    ones read the misses past the staging rows from the host."""
    from shardsmith.runtime.layers.kernels import fused_moe

    monkeypatch.setattr(fused_moe, "pick_path", lambda fmt, tokens: "pairs")  # resident calls too
    rt, banks = _runtime(fmt, use_settings, slots=7 if miss == "read" else 8, miss=miss, top_k=4)
    assert rt.slots is not None and rt.decode_sync_free()
    assert (rt.slots.n_slots, rt.slots.n_stage) == ((7, 0) if miss == "read" else (4, 4))
    gen = torch.Generator(device=DEV).manual_seed(3)
    pairs = 0
    calls = {"fp4": ((0, 1), (1, 1), (0, 1), (0, 3), (1, 20), (1, 1)), "bf16": ((0, 1), (1, 3), (1, 17), (0, 1)),
             "gpt-oss": ((0, 1), (1, 3), (0, 2), (1, 1))}[fmt]
    for layer, tokens in calls:
        ids, weights = random_routing(tokens, 4, 12, gen=gen)
        x = torch.randn(tokens, 64, generator=gen, device=DEV).bfloat16()
        want = fused_bank(x, ids, weights, banks[f"layers.{layer}"], _math(fmt), None)
        assert torch.equal(rt.run_layer(layer, x, ids, weights), want), (fmt, layer, tokens)
        pairs += ids.numel()
        for s, key in enumerate(rt.slots.slot_key.tolist()):  # what the device table says each slot holds
            if key >= 0:
                held = banks[f"layers.{key // 12}"]
                for name, pool in rt.cache.pool.items():
                    assert torch.equal(pool[s], held[name][key % 12]), (s, key, name)
    st = rt.stats()
    assert st["mode"] == "inplace" and st["miss"] == miss and st["hits"] + st["misses"] == pairs and st["hits"] > 0 and st["misses"] > 0
    assert st["bytes_copied"] == st["misses"] * st["slot_bytes"] and st["tokens"] == sum(t for layer, t in calls if layer == 0)
    rt.reset_stats()
    assert rt.stats()["hits"] == rt.stats()["misses"] == rt.stats()["tokens"] == 0


def test_inplace_switch_and_the_modes_it_leaves_alone(use_settings):
    """``reference`` keeps the copying cache, and so does ``auto`` (the default) on a CPU device; ``cpu``
    (host compute) has no cache to fill."""
    rt, _ = _runtime("fp4", use_settings, slots=7, inplace="reference")
    assert rt.slots is None and not rt.decode_sync_free()
    rt, _ = _runtime("fp4", use_settings, slots=7, inplace="auto")  # on CUDA only
    assert rt.slots is None
    rt, _ = _runtime("fp4", use_settings, slots=7, backend="cpu")  # host compute: no cache, nothing in place
    assert rt.slots is None and rt.cache is None


def test_inplace_blocks_knob(monkeypatch, use_settings):
    """``SHARDSMITH_TUNING=inplace_blocks=RxG`` (benchmarks): two positive ints, else a UsageError naming it."""
    from shardsmith.errors import UsageError
    from shardsmith.runtime.offload.runtime import inplace_blocks

    monkeypatch.delenv("SHARDSMITH_TUNING", raising=False)
    assert inplace_blocks() == (16, 8)
    use_settings(inplace_blocks="4x64")
    assert inplace_blocks() == (4, 64)
    for bad in ("4", "4x0", "axb"):
        monkeypatch.setenv("SHARDSMITH_TUNING", f"inplace_blocks={bad}")
        with pytest.raises(UsageError, match=f"SHARDSMITH_TUNING: inplace_blocks='{bad}': expected two positive ints"):
            inplace_blocks()


def test_miss_mode_knob(monkeypatch, use_settings):
    """``SHARDSMITH_TUNING=offload_miss``: ``copy`` (unset) or ``read``, else a UsageError naming it and the choices."""
    from shardsmith.errors import UsageError
    from shardsmith.runtime.offload.runtime import miss_mode

    monkeypatch.delenv("SHARDSMITH_TUNING", raising=False)
    assert miss_mode() == "copy"
    use_settings(offload_miss="read")
    assert miss_mode() == "read"
    monkeypatch.setenv("SHARDSMITH_TUNING", "offload_miss=dma")
    with pytest.raises(UsageError, match=r"SHARDSMITH_TUNING: offload_miss='dma': expected one of copy, read"):
        miss_mode()


@needs_triton
def test_a_prefill_chunk_streams_its_experts_in_the_inplace_mode(use_settings):
    """Inside ``prefill()`` a 20-token call is a prefill chunk (``run_chunk``): the resident grouped path's
    bits, the experts the device table holds read from their slots and the rest copied once, the table
    and its counters untouched; the same call outside it (a decode step of 20 rows) keeps the in-place path."""
    from shardsmith.runtime.layers.experts import grouped_experts

    rt, banks = _runtime("fp4", use_settings, slots=8, top_k=4)
    gen = torch.Generator(device=DEV).manual_seed(5)
    ids, weights = random_routing(1, 4, 12, gen=gen)
    x1 = torch.randn(1, 64, generator=gen, device=DEV).bfloat16()
    rt.run_layer(0, x1, ids, weights)  # one token: four experts of layer 0 in slots
    keys, counts = rt.slots.slot_key.clone(), rt.slots.counts.clone()
    ids, weights = random_routing(20, 4, 12, gen=gen)
    x = torch.randn(20, 64, generator=gen, device=DEV).bfloat16()
    assert not rt.streams_chunk(x)
    with rt.prefill():
        assert rt.streams_chunk(x)
        got = rt.run_layer(0, x, ids, weights)
    assert torch.equal(got, grouped_experts(x, ids, weights, banks["layers.0"], V4))
    assert torch.equal(rt.slots.slot_key, keys) and torch.equal(rt.slots.counts, counts)
    held = {k % 12 for k in keys.tolist() if k >= 0 and k // 12 == 0}
    present = set(ids.flatten().tolist())
    assert rt.stats()["prefill_link_bytes"] == len(present - held) * rt.cache.slot_bytes > 0
