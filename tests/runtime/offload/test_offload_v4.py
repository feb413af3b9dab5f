"""DeepSeek-V4 with offloaded FP4 experts on CPU: the ``gpu`` (slot cache on a CPU pool), ``cpu`` and
``hybrid`` backends give the resident model's logits bit for bit (they run the resident bank's own
per-expert and, for decode-sized steps on slots, per-pair kernels) and its greedy tokens at world
sizes 1, 2 and 4; the slots hold packed FP4 (half a byte per weight), and only the decoder layers'
banks are read (the MTP layer's are not)."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from shardsmith.runtime.offload import OffloadConfig, host_kernel
from shardsmith.testing.ranks import run_ranks

PROMPT = [3, 17, 42, 99, 5, 8, 61, 7, 200, 13]
BACKENDS = {
    "gpu-12slots": OffloadConfig(backend="gpu", cache_slots=12, probe=False),
    "cpu": OffloadConfig(backend="cpu", probe=False),
    "hybrid": OffloadConfig(backend="hybrid", cache_slots=2, hybrid_fraction=0.5, probe=False),
}


@pytest.fixture(scope="module")
def packs(tiny_v4_packs) -> dict[int, Path]:
    return tiny_v4_packs


def _run(rank: int, world_size: int, path: str) -> dict:
    """Rank 0's float32 logits ``[T, V]``, greedy tokens and offload stats per backend; others follow."""
    from shardsmith.runtime.engine.engine import Engine, SamplingParams

    out = {}
    for name in ("resident", *BACKENDS):
        eng = Engine.load(path, rank=rank, world_size=world_size, dtype=torch.float32, max_seq_len=64,
                          offload=BACKENDS.get(name))
        if rank == 0:
            logits = eng.logits(PROMPT).numpy()
            short = eng.logits(PROMPT[:8]).numpy()  # 8 tokens x top-2 = 16 pairs: the batched decode path
            tokens = [s.token_id for s in eng.generate(PROMPT, SamplingParams(max_tokens=6))]
            stats = eng.offload.stats() if eng.offload else None
            if eng.offload:
                layers = eng.offload.host.layers
                stats["layers"] = sorted(layers)
                stats["dtypes"] = {a: str(t.dtype) for a, t in next(iter(layers.values())).items()}
                stats["pool_dtype"] = str(eng.offload.cache.pool["gate_up"].dtype) if eng.offload.cache else None
            out[name] = (logits, tokens, stats, short)
            eng.shutdown()
        else:
            eng.follow()
        if eng.offload:
            eng.offload.close()
    return out


def _rank_main(rank: int, world_size: int, port: int, path: str, queue) -> None:
    try:
        from shardsmith.runtime.engine.dist import init_distributed

        init_distributed(rank, world_size, master_port=port)
        out = _run(rank, world_size, path)
        if rank == 0:
            queue.put(("ok", out))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def _check(results: dict, world_size: int) -> None:
    want, want_tokens, _, want_short = results["resident"]
    for name in BACKENDS:
        logits, tokens, stats, short = results[name]
        if name in ("cpu", "hybrid") and host_kernel.available():
            # host experts by the stored-format kernel (float32 accumulation): float32 rounding apart
            torch.testing.assert_close(torch.from_numpy(logits), torch.from_numpy(want), msg=name,
                                       atol=1e-4 * float(abs(want).max()), rtol=1e-4)
        else:
            # the resident bank's own per-expert and per-pair kernels, on the same CPU: the same bits
            torch.testing.assert_close(torch.from_numpy(logits), torch.from_numpy(want), atol=0, rtol=0, msg=name)
        assert tokens == want_tokens, name
        assert stats["layers"] == [f"layers.{i}" for i in range(4)]  # no mtp.* banks read
        assert stats["dtypes"]["gate_up"] == "torch.int8" and stats["dtypes"]["gate_up_scale"] == "torch.float8_e8m0fnu"
        if name.startswith("gpu"):  # decode-sized steps: the batched per-pair maths on gathered slots
            torch.testing.assert_close(torch.from_numpy(short), torch.from_numpy(want_short), atol=0, rtol=0)
            assert stats["pool_dtype"] == "torch.int8"  # slots hold packed FP4
            assert stats["hits"] > 0 and stats["misses"] > 0
            assert stats["bytes_copied"] == stats["misses"] * stats["slot_bytes"]
            # one expert's rank shard, packed: I_r = 512 / world_size rows of w1 and w3 [I_r, 256/2] I8
            # + [I_r, 256/32] UE8M0, w2 [256, I_r/2] + [256, I_r/32]
            i_r = 512 // world_size
            assert stats["slot_bytes"] == 2 * i_r * (128 + 8) + 256 * (i_r // 2 + i_r // 32)
            assert stats["host_bytes"] >= 4 * 8 * stats["slot_bytes"]  # 4 layers x 8 experts (+ file alignment)
        else:
            assert stats["host_experts"] > 0


def test_v4_offload_matches_resident_world_size_1(packs):
    _check(_run(0, 1, str(packs[1])), 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_v4_offload_matches_resident_across_ranks(packs, world_size):
    _check(run_ranks(_rank_main, world_size, str(packs[world_size]), timeout=300), world_size)


def _slots_vs_resident_bf16(path: Path, device: str) -> None:
    """bf16 on ``device``: 8-token steps (16 pairs: the batched path) bit for bit, greedy decode steps alike.

    The cache (12 slots of 32 experts) misses on the first pass and hits during greedy decode, where
    the same experts recur step after step (repeated 8-token passes touch ~25 experts in one layer
    order, which LRU alone never hits).
    """
    from shardsmith.runtime.engine.engine import Engine, SamplingParams

    got = {}
    for name, cfg in (("resident", None), ("gpu", OffloadConfig(backend="gpu", cache_slots=12, probe=False,
                                                                pin="require" if device == "cuda" else "auto"))):
        eng = Engine.load(path, rank=0, world_size=1, device=device, dtype=torch.bfloat16, max_seq_len=64,
                          offload=cfg)
        logits = [eng.logits(PROMPT[:8]) for _ in range(2)]
        tokens = [s.token_id for s in eng.generate(PROMPT, SamplingParams(max_tokens=8))]
        got[name] = (logits, tokens)
        if eng.offload:
            stats = eng.offload.stats()
            assert stats["misses"] > 0 and stats["hits"] > 0, stats
            eng.offload.close()
        eng.shutdown()
    for want, have in zip(got["resident"][0], got["gpu"][0]):
        torch.testing.assert_close(have, want, atol=0, rtol=0)
    assert got["gpu"][1] == got["resident"][1]


def test_v4_offloaded_steps_are_the_resident_bits_in_bf16(packs):
    """The CPU twin of the CUDA check below: bf16 rounding, not float32, as on a GPU."""
    _slots_vs_resident_bf16(packs[1], "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v4_offloaded_decode_step_is_the_resident_bits_on_cuda(packs, use_settings):
    """On the GPU: slots gathered by pair, one [P] expansion and one bmm pair, as the resident bank
    on its PyTorch path (the fused kernel resident banks take on CUDA: test_kernels_wired.py)."""
    use_settings(fused_experts="reference")
    _slots_vs_resident_bf16(packs[1], "cuda")


LONG_PROMPT = [(7 * i + 3) % 500 + 2 for i in range(48)]  # 48 tokens: a prefill chunk past the decode-sized steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_v4_prefill_chunk_streams_each_missing_expert_once(packs, device):
    """A 48-token prompt on a 4-slot cache: each layer's chunk reads the experts the cache holds from
    their slots and copies every other present expert once, a group at a time (the next group's
    copies start before this group computes), leaves the cache's contents and counters as they were,
    and gives the resident model's logits bit for bit (the same grouped matmuls over the same bytes),
    then the same greedy tokens."""
    from shardsmith.runtime.engine.engine import Engine, SamplingParams
    from shardsmith.runtime.offload import runtime as offload_runtime

    resident = Engine.load(packs[1], rank=0, world_size=1, device=device, dtype=torch.float32, max_seq_len=96)
    want = resident.logits(LONG_PROMPT)
    want_tokens = [s.token_id for s in resident.generate(LONG_PROMPT, SamplingParams(max_tokens=4))]
    eng = Engine.load(packs[1], rank=0, world_size=1, device=device, dtype=torch.float32, max_seq_len=96,
                      offload=OffloadConfig(backend="gpu", cache_slots=4, probe=False))
    rt = eng.offload
    eng.logits(PROMPT)  # a short prompt first: the cache holds some experts (decode-sized steps admit them)
    rt.reset_stats()
    held_before = sorted(rt.cache.table.items())
    staged, routed = [], []
    real_stage, real_chunk = rt._stage, rt.run_chunk

    def stage(host, held, experts):
        staged.append((id(host), [e for e in experts if e not in held], [e for e in experts if e in held]))
        return real_stage(host, held, experts)

    def chunk(layer, x, index, weight):
        routed.append((layer, sorted(set(index.flatten().tolist()))))
        return real_chunk(layer, x, index, weight)

    rt._stage, rt.run_chunk = stage, chunk
    got = eng.logits(LONG_PROMPT)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    layers = [layer for layer, _ in routed]
    assert layers == list(range(len(rt.layers))) and all(len(e) > 1 for _, e in routed)
    # per layer: the groups cover the routed experts once, each missing one copied once
    by_host = {}
    for host, missed, held in staged:
        by_host.setdefault(host, []).append((missed, held))
    copied = 0
    for (layer, experts), groups in zip(routed, by_host.values()):
        missed = [e for m, _ in groups for e in m]
        held = [e for _, h in groups for e in h]
        assert sorted(missed + held) == experts and len(set(missed)) == len(missed)
        assert set(held) == {e for (lay, e), _ in held_before if lay == layer} & set(experts)
        copied += len(missed)
    st = rt.stats()
    assert copied > 0 and st["prefill_link_bytes"] == copied * rt.cache.slot_bytes
    assert st["prefill_tokens"] == len(LONG_PROMPT) and st["misses"] == st["hits"] == 0
    assert sorted(rt.cache.table.items()) == held_before  # nothing admitted, nothing evicted
    assert st["prefill_link_bytes_per_token"] == copied * rt.cache.slot_bytes / len(LONG_PROMPT)
    rt._stage, rt.run_chunk = real_stage, real_chunk
    assert [s.token_id for s in eng.generate(LONG_PROMPT, SamplingParams(max_tokens=4))] == want_tokens
    rt.close()
