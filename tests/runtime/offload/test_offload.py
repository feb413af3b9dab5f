"""Offloaded experts on CPU: host banks read from a pack match the pack's arrays bit for bit; the
``gpu`` (cache on a CPU pool), ``cpu`` and ``hybrid`` backends give the resident path's logits at
world sizes 1 and 2 (bf16 and FP8 tiny Mixtral); the FP4 expert maths; GPU-only paths behind ``gpu``."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from shardsmith.errors import RuntimeLoadError, UsageError
from shardsmith.runtime.offload import OffloadConfig, host_kernel
from shardsmith.runtime.offload.host_bank import load_host_banks
from shardsmith.testing.ranks import run_ranks

PROMPT = [3, 17, 42, 99, 5, 8, 61, 7]
BACKENDS = {
    "gpu-3slots": OffloadConfig(backend="gpu", cache_slots=3, probe=False),
    "gpu-1slot-lru": OffloadConfig(backend="gpu", cache_slots=1, policy="lru", probe=False),
    "cpu": OffloadConfig(backend="cpu", probe=False),
    "hybrid": OffloadConfig(backend="hybrid", cache_slots=2, hybrid_fraction=0.5),
}


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[tuple[str, int], Path]:
    from shardsmith.testing import tiny_mixtral
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("offload")
    out = {}
    for fmt in ("bf16", "fp8"):
        src = tiny_mixtral(root / f"src-{fmt}", fp8=fmt == "fp8", experts=8)
        out[(fmt, 0)] = src
        for ws in (1, 2):
            out[(fmt, ws)] = root / f"{fmt}-tp{ws}"
            split_checkpoint(src, out[(fmt, ws)], world_size=ws)
    return out


def _run_cases(rank: int, world_size: int, cases: list[tuple[str, str, str]],
               dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict:
    """Rank 0's ``[T, V]`` logits and greedy tokens per case, resident first; others follow."""
    from shardsmith.runtime.engine.engine import Engine, SamplingParams

    out = {}
    for key, path, backend in cases:
        for dtype in dtypes:
            cfg = None if backend == "resident" else BACKENDS[backend]
            eng = Engine.load(path, rank=rank, world_size=world_size, dtype=getattr(torch, dtype), max_seq_len=64,
                              offload=cfg)
            if rank == 0:
                logits = eng.logits(PROMPT)
                tokens = [s.token_id for s in eng.generate(PROMPT, SamplingParams(max_tokens=8))]
                out[(key, dtype)] = (logits, tokens, eng.offload.stats() if eng.offload else None)
                eng.shutdown()
            else:
                eng.follow()
    return out


def _cases(packs, ws: int) -> list[tuple[str, str, str]]:
    return [(f"{fmt}/{b}", str(packs[(fmt, ws)]), b) for fmt in ("bf16", "fp8") for b in ("resident", *BACKENDS)]


def _check(results: dict) -> None:
    for (key, dtype), (logits, tokens, stats) in results.items():
        fmt, backend = key.split("/")
        if backend == "resident":
            continue
        want, want_tokens, _ = results[(f"{fmt}/resident", dtype)]
        if backend in ("cpu", "hybrid") and host_kernel.available():
            # host experts by the stored-format kernel: float32 accumulation, another summation order
            tol = 1e-4 if dtype == "float32" else 3e-2
            torch.testing.assert_close(logits, want, atol=tol * want.abs().max().item(), rtol=tol, msg=f"{key} {dtype}")
            if dtype == "float32":
                assert tokens == want_tokens, (key, dtype)
        else:
            # same device, same kernels, contributions added in expert order: bitwise equal
            torch.testing.assert_close(logits, want, atol=0, rtol=0, msg=f"{key} {dtype}")
            assert tokens == want_tokens, (key, dtype)
        if backend.startswith("gpu"):
            assert stats["misses"] > 0 and stats["bytes_copied"] == stats["misses"] * stats["slot_bytes"]
        if backend == "gpu-3slots":
            assert stats["hits"] > 0
        if backend in ("cpu", "hybrid"):
            assert stats["host_experts"] > 0


def test_backends_match_resident_world_size_1(packs):
    _check(_run_cases(0, 1, _cases(packs, 1)))


def _rank_main(rank: int, world_size: int, port: int, cases, queue) -> None:
    try:
        from shardsmith.runtime.engine.dist import init_distributed

        init_distributed(rank, world_size, master_port=port)
        out = _run_cases(rank, world_size, cases, ("float32",))
        if rank == 0:  # numpy pickles by value (a tensor would be shared through this process's fds)
            queue.put(("ok", {k: (v[0].numpy(), *v[1:]) for k, v in out.items()}))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def test_backends_match_resident_world_size_2(packs):
    payload = run_ranks(_rank_main, 2, _cases(packs, 2), timeout=200)
    _check({k: (torch.from_numpy(v[0]), *v[1:]) for k, v in payload.items()})


def test_host_backends_match_resident_world_size_4(tmp_path):
    """The host kernel's experts (``cpu``, ``hybrid``) at world size 4 (gloo, four ranks): a tiny
    Mixtral with four KV heads (the fixture's three do not split four ways), bf16 and FP8 experts,
    float32, against the resident model split the same way."""
    from shardsmith.testing import tiny_mixtral
    from shardsmith.writer.split import split_checkpoint

    cases = []
    for fmt in ("bf16", "fp8"):
        src = tiny_mixtral(tmp_path / f"src-{fmt}", fp8=fmt == "fp8", experts=8, heads=8, kv_heads=4)
        split_checkpoint(src, tmp_path / f"{fmt}-tp4", world_size=4)
        cases += [(f"{fmt}/{b}", str(tmp_path / f"{fmt}-tp4"), b) for b in ("resident", "cpu", "hybrid")]
    payload = run_ranks(_rank_main, 4, cases, timeout=300)
    assert {k for k, _ in payload} == {c[0] for c in cases}
    _check({k: (torch.from_numpy(v[0]), *v[1:]) for k, v in payload.items()})


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_host_banks_match_the_pack_bit_for_bit(packs, fmt):
    from shardsmith.pack.reader import open_rank

    for rank in (0, 1):
        rp = open_rank(packs[(fmt, 2)], rank, 2)
        hb = load_host_banks(rp, pin="off")
        mapped = rp.banks()
        assert hb.layers.keys() == mapped.keys()
        for layer, arrays in mapped.items():
            for name, a in arrays.items():
                got = hb.layers[layer][name]
                assert got.dtype == a.dtype and got.shape == a.shape
                assert torch.equal(got.view(torch.uint8), a.view(torch.uint8)), (layer, name)
        assert hb.array_bytes == sum(a.numel() * a.element_size() for arr in mapped.values() for a in arr.values())
        assert hb.array_bytes <= hb.nbytes < hb.array_bytes + 4096 * 4 * len(mapped)
        assert not hb.pinned


def test_host_banks_are_one_world_size_th_of_the_experts(packs):
    from shardsmith.pack.reader import open_rank

    one = load_host_banks(open_rank(packs[("bf16", 1)], 0, 1), pin="off").array_bytes
    two = [load_host_banks(open_rank(packs[("bf16", 2)], r, 2), pin="off").array_bytes for r in (0, 1)]
    assert sum(two) == one and two[0] == two[1]


def test_host_banks_from_checkpoint_weights(packs):
    from shardsmith.pack.reader import open_rank
    from shardsmith.runtime.engine.loader import load_rank_weights

    ck = load_host_banks(load_rank_weights(packs[("fp8", 0)], rank=1, world_size=2, from_checkpoint=True), pin="off")
    pk = load_host_banks(open_rank(packs[("fp8", 2)], 1, 2), pin="off")
    for layer, arrays in pk.layers.items():
        for name, a in arrays.items():
            assert torch.equal(ck.layers[layer][name].view(torch.uint8), a.view(torch.uint8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_pinning_required_without_cuda_is_a_clear_error(packs):
    from shardsmith.pack.reader import open_rank

    with pytest.raises(RuntimeLoadError, match="cannot page-lock.*no CUDA device.*pageable"):
        load_host_banks(open_rank(packs[("bf16", 1)], 0, 1), pin="require")
    with pytest.raises(UsageError, match="pin must be"):
        load_host_banks(open_rank(packs[("bf16", 1)], 0, 1), pin="yes")


def test_options_from_cli():
    assert OffloadConfig.from_cli(moe_backend="hybrid", expert_cache_gb=1.5).cache_bytes == 3 << 29
    with pytest.raises(UsageError, match="--moe-backend must be one of auto, gpu, cpu, hybrid"):
        OffloadConfig.from_cli(moe_backend="npu")


def test_probe_never_picks_a_slower_backend():
    from shardsmith.runtime.offload.probe import decide

    slot = 12 << 20  # 12 MiB: 0.25 ms at 50 GB/s
    assert decide("auto", cuda=True, h2d_gb_per_s=50, slot_bytes=slot, cpu_s_per_expert=2e-3)[:2] == ("gpu", 0.0)
    backend, f, _ = decide("auto", cuda=True, h2d_gb_per_s=5, slot_bytes=slot, cpu_s_per_expert=1e-3)
    assert backend == "hybrid" and 0.5 < f < 1  # host faster than a 2.5 ms copy: it takes the larger share
    backend, f, _ = decide("auto", cuda=True, h2d_gb_per_s=50, slot_bytes=slot, cpu_s_per_expert=0.5e-3)
    assert backend == "hybrid" and 0.3 < f < 0.4  # host 2x slower than the copy: still a third of the misses
    assert decide("auto", cuda=False, h2d_gb_per_s=0, slot_bytes=slot, cpu_s_per_expert=1e-3)[0] == "cpu"
    assert decide("gpu", cuda=True, h2d_gb_per_s=5, slot_bytes=slot, cpu_s_per_expert=1e-6)[0] == "gpu"


def test_fp4_expert_maths_matches_the_reference_quantizer():
    from shardsmith.runtime.layers.quant import expert_weights
    from shardsmith.testing.quant import dequantize_fp4_group, quantize_fp4_group

    g = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(64, 96, generator=g), torch.randn(64, 96, generator=g), torch.randn(96, 64, generator=g)
    (qg, sg), (qu, su), (qd, sd) = quantize_fp4_group(gate), quantize_fp4_group(up), quantize_fp4_group(down)
    arrays = {"gate_up": torch.cat([qg, qu]), "gate_up_scale": torch.cat([sg, su]), "down": qd, "down_scale": sd}
    got = expert_weights(arrays, torch.float32, None)
    for w, (q, s) in zip(got, ((qg, sg), (qu, su), (qd, sd))):
        torch.testing.assert_close(w, dequantize_fp4_group(q, s), atol=0, rtol=0)


# ------------------------------------------------------------------ GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cache_with_copy_stream_matches_resident(packs, use_settings):
    from shardsmith.runtime.engine.engine import Engine

    # offloaded slots run the PyTorch pair path: compare with the resident bank on that path (the fused
    # kernel that resident banks take on CUDA is checked against it in test_kernels_wired.py)
    use_settings(fused_experts="reference")

    for fmt in ("bf16", "fp8"):
        ref = Engine.load(packs[(fmt, 1)], rank=0, world_size=1, device="cuda", dtype=torch.bfloat16, max_seq_len=64)
        want = ref.logits(PROMPT)
        for cfg in (OffloadConfig(backend="gpu", cache_slots=3, pin="require"),
                    OffloadConfig(backend="hybrid", cache_slots=2, hybrid_fraction=0.5, pin="require")):
            eng = Engine.load(packs[(fmt, 1)], rank=0, world_size=1, device="cuda", dtype=torch.bfloat16,
                              max_seq_len=64, offload=cfg)
            assert eng.offload.host.pinned
            got = eng.logits(PROMPT)
            if cfg.backend == "gpu":  # same kernels on the same device: bitwise
                torch.testing.assert_close(got, want, atol=0, rtol=0)
            else:  # host-computed experts use CPU kernels
                torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
            s = eng.offload.stats()
            assert s["misses"] > 0 and s["h2d_gb_per_s"] > 0 and s["probe_h2d_gb_per_s"] > 0
            eng.offload.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_chunks_never_split_an_expert(packs):
    from shardsmith.pack.reader import open_rank

    hb = load_host_banks(open_rank(packs[("bf16", 1)], 0, 1), pin="require", chunk_bytes=1 << 20)
    assert hb.pinned and len(hb._registered) > len(hb.layers) * 2
    for arrays in hb.layers.values():
        for a in arrays.values():
            assert a[0].is_pinned() and a[-1].is_pinned()
    hb.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_index_staging_is_one_async_copy_with_the_right_values():
    """:func:`to_device` returns the parts' values, and the host does not wait for queued kernels."""
    from shardsmith.runtime.layers.staging import to_device

    parts = [torch.tensor([3, 1, 4]), torch.tensor([], dtype=torch.int64), torch.tensor([1, 5, 9, 2, 6])]
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(), torch.cuda.Event()
    start.record()
    for _ in range(20):  # ~tens of ms queued on the stream
        a = a @ a / 64
    got = to_device(parts, torch.device("cuda"))
    end.record()
    assert not end.query()  # had to_device synchronised the stream, the matmuls would be done
    assert [g.tolist() for g in got] == [p.tolist() for p in parts] and all(g.is_cuda for g in got)
