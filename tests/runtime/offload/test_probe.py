"""The start-up probe's decision model and measurements (``offload/probe.py``) and the host round trip
it times (``CpuExperts.submit_from`` / ``collect``), on CPU: tiny FP4 banks, real threads."""

from __future__ import annotations

import pytest
import torch

from shardsmith.runtime.offload.cpu_backend import CpuExperts
from shardsmith.runtime.offload.host_bank import HostBanks
from shardsmith.runtime.offload.probe import (HYBRID_MIN_GAIN, decide, hybrid_split, measure_gpu_fused,
                                              measure_host_path, probe_experts)
from shardsmith.testing.quant import quantize_fp4_group

MS = 1e-3


@pytest.fixture()
def cpu() -> CpuExperts:
    """Two layers of 8 FP4 experts, D = 64, I_r = 32."""
    g = torch.Generator().manual_seed(0)
    layers = {}
    for name in ("layers.0", "layers.1"):
        gu, gus = zip(*(quantize_fp4_group(torch.randn(64, 64, generator=g)) for _ in range(8)))
        dn, dns = zip(*(quantize_fp4_group(torch.randn(64, 32, generator=g)) for _ in range(8)))
        layers[name] = {"gate_up": torch.stack(gu), "gate_up_scale": torch.stack(gus),
                        "down": torch.stack(dn), "down_scale": torch.stack(dns)}
    c = CpuExperts(HostBanks(layers), list(layers), None)
    yield c
    c.close()


def test_split_balances_host_and_link() -> None:
    # host 2x slower than the copy, nothing else: 2 of 6 on the host, max(4 x 0.25, 2 x 0.5) = 1.0 of 1.5 ms
    k, gain = hybrid_split(0.25 * MS, 0.5 * MS, misses=6)
    assert k == 2 and gain == pytest.approx(1 / 3)
    assert hybrid_split(0.25 * MS, 2 * MS, misses=6) == (0, 0.0)  # one host expert outlasts all six copies


def test_split_step_pays_where_the_host_keeps_up_with_the_link() -> None:
    """Issue 15 at the rates measured on the H200 host (RESULTS.md, h200x1b: 25 GB/s link, 0.534 ms
    per copy, host 0.630 ms/expert + 0.638 ms per layer): with the GPU's experts kept on the slot
    path and overlapped with the host's share, 2 of 6 misses on the host save a third of the layer
    time, so ``auto`` picks ``hybrid``; a host slower than the link (1.5 ms/expert) saves 16%, under
    the margin, so ``auto`` keeps ``gpu``."""
    t_copy, round_trip, fused = 0.534 * MS, 0.638 * MS, 0.05 * MS
    k, gain = hybrid_split(t_copy, 0.630 * MS, round_trip_s=round_trip, fused_s=fused)
    assert k == 2 and gain == pytest.approx(1 - (4 * 0.534 + 0.05) / (6 * 0.534 + 0.05))  # max(2.186, 1.898) ms
    slot = int(0.534e-3 * 25e9)  # the bytes one copy moves in 0.534 ms at 25 GB/s
    backend, f, reason = decide("auto", cuda=True, h2d_gb_per_s=25, slot_bytes=slot, cpu_s_per_expert=0.630 * MS,
                                round_trip_s=round_trip, fused_s=fused)
    assert (backend, f) == ("hybrid", pytest.approx(2 / 6)) and "2 of 6 misses" in reason
    # eager steps (--enforce-eager): a split step measured slower than gpu there, so auto keeps gpu
    backend, f, reason = decide("auto", cuda=True, h2d_gb_per_s=25, slot_bytes=slot, cpu_s_per_expert=0.630 * MS,
                                round_trip_s=round_trip, fused_s=fused, graphed=False)
    assert (backend, f) == ("gpu", 0.0) and "eagerly" in reason
    assert decide("hybrid", cuda=True, h2d_gb_per_s=25, slot_bytes=slot, cpu_s_per_expert=0.630 * MS,
                  round_trip_s=round_trip, fused_s=fused, graphed=False)[0] == "hybrid"  # asked for: given
    k, gain = hybrid_split(t_copy, 1.5 * MS, round_trip_s=round_trip, fused_s=fused)
    assert k == 1 and 0 < gain < HYBRID_MIN_GAIN
    assert decide("auto", cuda=True, h2d_gb_per_s=25, slot_bytes=slot, cpu_s_per_expert=1.5 * MS,
                  round_trip_s=round_trip, fused_s=fused)[:2] == ("gpu", 0.0)


def test_auto_picks_hybrid_only_with_margin() -> None:
    slot = 12 << 20  # 0.25 ms at 50 GB/s, 2.5 ms at 5 GB/s
    backend, f, reason = decide("auto", cuda=True, h2d_gb_per_s=5, slot_bytes=slot, cpu_s_per_expert=1 * MS,
                                round_trip_s=0.2 * MS, fused_s=0.1 * MS)
    assert backend == "hybrid" and f == pytest.approx(4 / 6) and "save" in reason  # max(2 x 2.52 + 0.1, 0.2 + 4) ms of 15.2
    # the same rates, but the host barely keeps up once its round trip counts: under the margin
    backend, f, reason = decide("auto", cuda=True, h2d_gb_per_s=50, slot_bytes=slot, cpu_s_per_expert=0.5 * MS,
                                round_trip_s=0.4 * MS)
    assert (backend, f) == ("gpu", 0.0) and "under 20%" in reason
    assert decide("hybrid", cuda=True, h2d_gb_per_s=50, slot_bytes=slot, cpu_s_per_expert=0.5 * MS,
                  hybrid_fraction=0.3)[:2] == ("hybrid", 0.3)


def test_split_refuses_bad_inputs() -> None:
    with pytest.raises(ValueError, match="misses >= 1"):
        hybrid_split(1.0, 1.0, misses=0)
    with pytest.raises(ValueError, match="round_trip_s=-1"):
        hybrid_split(1.0, 1.0, round_trip_s=-1)
    with pytest.raises(ValueError, match="0 experts"):
        probe_experts(0, 3)


def test_probe_experts_are_distinct_and_far_from_the_link_probe() -> None:
    assert probe_experts(160, 4) == [159, 158, 157, 156]
    assert probe_experts(3, 5) == [2, 1, 0, 2, 1]


def test_round_trip_equals_compute(cpu: CpuExperts) -> None:
    """``submit_from`` + ``collect`` give what ``compute`` gives for the same inputs, and count calls."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g).bfloat16()
    index = torch.tensor([[1, 5], [5, 2], [7, 1]])
    weight = torch.rand(3, 2, generator=g)
    want = cpu.compute(1, x, index, weight, [1, 5, 7])
    got = cpu.collect(cpu.submit_from(1, x, index, weight, [1, 5, 7]), torch.device("cpu"))
    assert sorted(got) == [1, 5, 7]
    for e in want:
        assert torch.equal(got[e][0], want[e][0]) and torch.equal(got[e][1], want[e][1])
    t = cpu.timings()
    assert t["host_calls"] == 2 and t["host_compute_s"] > 0 and t["host_wait_s"] >= 0
    cpu.reset_timings()
    assert cpu.timings()["host_calls"] == 0 and cpu.experts_computed == 0


def test_host_path_measured_warm_and_leaves_counters(cpu: CpuExperts) -> None:
    round_trip, per = measure_host_path(cpu, torch.device("cpu"), 64, torch.float32, repeats=3, batch=3)
    assert round_trip >= 0 and per > 0
    assert cpu.experts_computed == 0 and cpu.timings()["host_calls"] == 0 and cpu.timings()["host_wait_s"] == 0
    with pytest.raises(ValueError, match="batch >= 2"):
        measure_host_path(cpu, torch.device("cpu"), 64, torch.float32, batch=1)
    assert measure_gpu_fused(cpu, torch.device("cpu"), 64, torch.float32, None, kernel=False) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_round_trip_from_the_device(cpu: CpuExperts) -> None:
    """From CUDA tensors: one D2H in, results on the device, equal to the host computation; the
    probe's timings of that path are positive and leave the counters as they were."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 64, generator=g).bfloat16()
    index = torch.tensor([[3, 6], [6, 0]])
    weight = torch.rand(2, 2, generator=g)
    want = cpu.compute(0, x, index, weight, [0, 3, 6])
    got = cpu.collect(cpu.submit_from(0, x.to(dev), index, weight.to(dev), [0, 3, 6]), dev)
    for e in want:
        assert got[e][1].device.type == "cuda"
        assert torch.equal(got[e][0].cpu(), want[e][0]) and torch.equal(got[e][1].cpu(), want[e][1])
    cpu.reset_timings()
    round_trip, per = measure_host_path(cpu, dev, 64, torch.bfloat16, repeats=3)
    assert round_trip >= 0 and per > 0 and cpu.timings()["host_calls"] == 0
    assert measure_gpu_fused(cpu, dev, 64, torch.bfloat16, None, kernel=True) > 0


def _rank_decides(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    from shardsmith.runtime.offload.probe import _slowest

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # rank 0's link is slower (5 GB/s), rank 1's host: both ranks must decide on the slowest of each
        bw, round_trip, per, gpu_s = [(-5.0, 0.1e-3, 0.6e-3, 0.05e-3), (-8.0, 0.3e-3, 1.5e-3, 0.05e-3)][rank]
        neg_bw, round_trip, per, gpu_s = _slowest([bw, round_trip, per, gpu_s], torch.device("cpu"))
        queue.put((rank, (neg_bw, round_trip, per), decide("auto", cuda=True, h2d_gb_per_s=-neg_bw, slot_bytes=12 << 20,
                                                          cpu_s_per_expert=per, round_trip_s=round_trip,
                                                          fused_s=gpu_s)))
    finally:
        dist.destroy_process_group()


def test_ranks_decide_alike_on_the_slowest_measurements() -> None:
    import socket

    from shardsmith.testing.ranks import rank_context, rank_process

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_context()
    queue = ctx.Queue()
    procs = [rank_process(ctx, _rank_decides, r, port, queue) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (m, d)) for r, m, d in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got[0] == got[1]
    (neg_bw, round_trip, per), decision = got[0]
    assert (neg_bw, round_trip, per) == (-5.0, 0.3e-3, 1.5e-3)  # the max of -bandwidth is the slower link
    assert decision == decide("auto", cuda=True, h2d_gb_per_s=5.0, slot_bytes=12 << 20, cpu_s_per_expert=1.5e-3,
                              round_trip_s=0.3e-3, fused_s=0.05e-3)
