"""The device-side LRU slot table (``offload/device_slots.py``): the Triton kernel against its reference.

CPU: the kernel under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton loads) and the
Python reference, fed the same random sequence of 30 calls (3 layers of 16 experts, T in {1, 3, 16},
K = 6 or 2, int32 and int64 ids with duplicates, S = 1, 5, 37 slots, with and without staging rows):
the same ``src``, ``dst``, ``read`` and state (``slot_key``, ``slot_used``, ``tick``, ``counts``)
after every call. Hand-checked cases on both backends: LRU eviction order, a duplicate expert within
one call (read from host, not admitted twice), more distinct experts than slots (later misses not
admitted), staging rows for misses not admitted, a repeated call all hits, keys per layer, an empty
call, counts and stats, the state never reallocated. Bad inputs raise naming the problem. With CUDA
the same tests run on the GPU (the compiled kernel); ``-m gpu`` adds a captured
call replayed on new ids: the same results and state as the reference.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.errors import UsageError
from shardsmith.runtime.layers.kernels import KernelError, triton_available
from shardsmith.runtime.offload.device_slots import DeviceSlots

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter
E = 16  # experts per layer


def _state(slots: DeviceSlots) -> list[list[int]]:
    return [slots.slot_key.tolist(), slots.slot_used.tolist(), slots.tick.tolist(), slots.counts.tolist()]


def _calls(seed: int, n: int = 30) -> list[tuple[int, torch.Tensor]]:
    """``n`` calls ``(layer, ids [T, K])``: 3 layers, T in {1, 3, 16}, K = 6 or 2, ids drawn from a
    skewed distribution (repeats across calls: hits; within a call: duplicates), int32 or int64."""
    rng = random.Random(seed)
    calls = []
    for _ in range(n):
        T, K = rng.choice([1, 3, 16]), rng.choice([6, 2])
        hot = rng.sample(range(E), 5)
        ids = [[rng.choice(hot) if rng.random() < 0.6 else rng.randrange(E) for _ in range(K)] for _ in range(T)]
        calls.append((rng.randrange(3), torch.tensor(ids, dtype=rng.choice([torch.int32, torch.int64]))))
    return calls


def _check_read(slots: DeviceSlots, src: torch.Tensor, dst: torch.Tensor, read: torch.Tensor) -> None:
    """``read`` against ``src``/``dst`` (module docstring): a hit reads its slot; a copied pair reads
    its ``dst``; a row is copied once per call and every pair reading it has its expert; a pair left
    on the host reads the host copy and only when the staging rows ran out."""
    S, rows = slots.n_slots, {}
    for s, d, r in zip(src.tolist(), dst.tolist(), read.tolist()):
        if s >= 0:
            assert r == s and d == -1
        elif d >= 0:
            assert r == d and d not in rows
            rows[d] = s
        elif r < 0:
            assert r == s and sum(d >= S for d in dst.tolist()) == slots.n_stage
    for s, r in zip(src.tolist(), read.tolist()):
        if s < 0 and r >= 0:
            assert rows.get(r, s) == s  # a row filled in this call holds this pair's expert


@needs_triton
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize(("S", "n_stage"), [(1, 2), (5, 0), (5, 3), (37, 0)])
def test_kernel_matches_reference(S: int, policy: str, n_stage: int) -> None:
    """30 calls (``lfu``: counts halved every 7 calls, so the decay runs 4 times): the same src, dst,
    read and state after every call, with and without staging rows."""
    kw = {"policy": policy, "n_layers": 3, "decay": 7, "n_stage": n_stage}
    kern, ref = DeviceSlots(S, E, DEV, **kw), DeviceSlots(S, E, DEV, **kw)
    seen = {"hit": 0, "fill": 0, "host": 0}
    for i, (layer, ids) in enumerate(_calls(seed=S)):
        ids = ids.to(DEV)
        src_k, dst_k, read_k = kern.assign_rows(layer, ids, backend="triton")
        src_r, dst_r, read_r = ref.assign_rows(layer, ids, backend="reference")
        assert src_k.dtype == dst_k.dtype == read_k.dtype == torch.int64 and src_k.shape == (ids.numel(),), i
        assert src_k.tolist() == src_r.tolist(), f"call {i}: src"
        assert dst_k.tolist() == dst_r.tolist(), f"call {i}: dst"
        assert read_k.tolist() == read_r.tolist(), f"call {i}: read"
        _check_read(ref, src_r, dst_r, read_r)
        assert _state(kern) == _state(ref), f"call {i}: state"
        assert kern.freq.tolist() == ref.freq.tolist() and kern.slot_freq.tolist() == ref.slot_freq.tolist(), i
        seen["hit"] += int((src_r >= 0).sum())
        seen["fill"] += int((dst_r >= 0).sum())
        seen["host"] += int(((src_r < 0) & (dst_r < 0)).sum())  # not admitted, or a duplicate of a fill
    total = sum(ids.numel() for _, ids in _calls(seed=S))
    assert kern.stats()["hits"] + kern.stats()["misses"] == total
    assert kern.tick.item() == 30
    assert all(seen.values()) or (S == 1 and policy == "lfu" and seen["fill"] and seen["host"]), seen  # every branch ran


@pytest.mark.parametrize("backend", BACKENDS)
def test_staging_rows_copy_misses_not_admitted(backend: str) -> None:
    """``n_stage``: a miss that no slot takes is copied to a staging row after the slots (the first
    ``n_stage`` such experts of a call, a repeat reads the same row), the rest read the host; a pair of
    an expert filled earlier in the call reads that slot; staging is forgotten at the next call."""
    s = DeviceSlots(2, E, DEV, n_stage=2)
    src, dst, read = s.assign_rows(0, torch.tensor([[1, 2, 3], [1, 4, 3], [5, 3, 2]]).to(DEV), backend=backend)
    # 1 and 2 fill slots 0 and 1; 3 and 4 find every slot used: staged in rows 2 and 3; 5 is left on the host
    assert src.tolist() == [-2, -3, -4, -2, -5, -4, -6, -4, -3]
    assert dst.tolist() == [0, 1, 2, -1, 3, -1, -1, -1, -1]
    assert read.tolist() == [0, 1, 2, 0, 3, 2, -6, 2, 1]
    assert s.slot_key.tolist() == [1, 2] and s.counts.tolist() == [0, 9]
    src, dst, read = s.assign_rows(0, torch.tensor([[3, 1, 4]]).to(DEV), backend=backend)
    # next call: 3 evicts 1 (both slots last used at tick 1: the lower index), 1 evicts 2, 4 is staged again
    assert src.tolist() == [-4, -2, -5] and dst.tolist() == [0, 1, 2] and read.tolist() == [0, 1, 2]
    with pytest.raises(UsageError, match=r"n_stage=-1 must be an int >= 0"):
        DeviceSlots(2, E, DEV, n_stage=-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lru_eviction_order(backend: str) -> None:
    s = DeviceSlots(2, E, DEV)
    assert [t.tolist() for t in s.assign(0, torch.tensor([[3]]).to(DEV), backend=backend)] == [[-4], [0]]  # empty slot 0
    assert [t.tolist() for t in s.assign(0, torch.tensor([[5]]).to(DEV), backend=backend)] == [[-6], [1]]  # then slot 1
    assert [t.tolist() for t in s.assign(0, torch.tensor([[3]]).to(DEV), backend=backend)] == [[0], [-1]]  # hit: 3 newer than 5
    assert [t.tolist() for t in s.assign(0, torch.tensor([[7]]).to(DEV), backend=backend)] == [[-8], [1]]  # evicts 5 (LRU)
    assert [t.tolist() for t in s.assign(0, torch.tensor([[9]]).to(DEV), backend=backend)] == [[-10], [0]]  # evicts 3
    assert s.slot_key.tolist() == [9, 7] and s.slot_used.tolist() == [5, 4] and s.tick.tolist() == [5]
    assert s.counts.tolist() == [1, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_lfu_keeps_frequent_experts_from_one_off_misses(backend: str) -> None:
    """``lfu``: an expert is admitted over a slot only with a higher count than the slot's (or into an
    empty one), so a stream of one-off experts reads from the host and leaves the frequent ones cached,
    where LRU would evict them; an expert seen often enough displaces the least counted."""
    s = DeviceSlots(2, E, DEV, policy="lfu", n_layers=1)
    ask = lambda e: [t.tolist() for t in s.assign(0, torch.tensor([[e]]).to(DEV), backend=backend)]  # noqa: E731
    assert ask(3) == [[-4], [0]] and ask(5) == [[-6], [1]]  # empty slots: admitted
    assert ask(3) == [[0], [-1]] and ask(3) == [[0], [-1]]  # 3 counted 3 times, 5 once
    assert ask(7) == [[-8], [-1]]  # 7 (count 1) does not beat 5 (count 1): read from the host, not admitted
    assert ask(7) == [[-8], [1]]  # count 2 > 1: evicts 5 (the lower count), not 3
    assert ask(9) == [[-10], [-1]] and s.slot_key.tolist() == [3, 7]
    assert s.freq[[3, 5, 7, 9]].tolist() == [3, 1, 2, 1] and s.slot_freq.tolist() == [3, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_within_call_reads_host(backend: str) -> None:
    s = DeviceSlots(4, E, DEV)
    src, dst = s.assign(1, torch.tensor([[2, 4], [4, 2]], dtype=torch.int32).to(DEV), backend=backend)
    # pair 0 and 1 fill slots 0 and 1; pairs 2 and 3 find them filled in this call: host copy, no fill
    assert src.tolist() == [-3, -5, -5, -3] and dst.tolist() == [0, 1, -1, -1]
    assert s.slot_key.tolist() == [E + 2, E + 4, -1, -1] and s.counts.tolist() == [0, 4]
    src, dst = s.assign(1, torch.tensor([[4, 4]]).to(DEV), backend=backend)  # next call: the slot is written, both hit
    assert src.tolist() == [1, 1] and dst.tolist() == [-1, -1] and s.counts.tolist() == [2, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_experts_than_slots(backend: str) -> None:
    s = DeviceSlots(2, E, DEV)
    s.assign(0, torch.tensor([[0]]).to(DEV), backend=backend)  # slot 0 holds expert 0, used at tick 1
    src, dst = s.assign(0, torch.tensor([[1, 0, 2, 3]]).to(DEV), backend=backend)
    # 1 fills the empty slot 1; 0 hits slot 0; 2 and 3 find every slot used in this call: not admitted
    assert src.tolist() == [-2, 0, -3, -4] and dst.tolist() == [1, -1, -1, -1]
    assert s.slot_key.tolist() == [0, 1] and s.slot_used.tolist() == [2, 2] and s.counts.tolist() == [1, 4]
    one = DeviceSlots(1, E, DEV)
    src, dst = one.assign(0, torch.tensor([[5, 6], [6, 5]]).to(DEV), backend=backend)
    assert src.tolist() == [-6, -7, -7, -6] and dst.tolist() == [0, -1, -1, -1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeat_call_all_hits_and_stats(backend: str) -> None:
    s = DeviceSlots(8, E, DEV)
    assert s.stats() == {"hits": 0, "misses": 0, "hit_rate": 0.0}
    ids = torch.tensor([[1, 2], [3, 1], [2, 4]], device=DEV)
    src, dst = s.assign(2, ids, backend=backend)
    assert dst.tolist() == [0, 1, 2, -1, -1, 3]
    src, dst = s.assign(2, ids, backend=backend)
    assert src.tolist() == [0, 1, 2, 0, 1, 3] and dst.tolist() == [-1] * 6
    assert s.stats() == {"hits": 6, "misses": 6, "hit_rate": 0.5}
    src, dst = s.assign(0, ids[:1], backend=backend)  # another layer: other keys
    assert src.tolist() == [-2, -3] and dst.tolist() == [4, 5]
    s.reset_counts()
    assert s.stats() == {"hits": 0, "misses": 0, "hit_rate": 0.0} and s.tick.tolist() == [3]
    s.assign(2, ids[1:2], backend=backend)
    assert s.stats() == {"hits": 2, "misses": 0, "hit_rate": 1.0}


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_call_and_state_in_place(backend: str) -> None:
    s = DeviceSlots(3, E, DEV)
    ptrs = [t.data_ptr() for t in (s.slot_key, s.slot_used, s.tick, s.counts)]
    src, dst = s.assign(0, torch.empty(0, 6, dtype=torch.int64, device=DEV), backend=backend)
    assert src.shape == dst.shape == (0,) and s.tick.tolist() == [1] and s.counts.tolist() == [0, 0]
    s.assign(0, torch.tensor([[1, 2]]).to(DEV), backend=backend)
    assert [t.data_ptr() for t in (s.slot_key, s.slot_used, s.tick, s.counts)] == ptrs


def test_bad_input_raises() -> None:
    with pytest.raises(UsageError, match=r"n_slots=0 must be an int >= 1"):
        DeviceSlots(0, E, DEV)
    with pytest.raises(UsageError, match=r"n_experts=0 must be an int >= 1"):
        DeviceSlots(4, 0, DEV)
    s = DeviceSlots(4, E, DEV)
    with pytest.raises(KernelError, match=r"ids \(6,\) torch.int64: want \[T, K\] int32 or int64"):
        s.assign(0, torch.arange(6, device=DEV))
    with pytest.raises(KernelError, match=r"ids \(1, 2\) torch.float32: want \[T, K\] int32 or int64"):
        s.assign(0, torch.tensor([[1.0, 2.0]]).to(DEV))
    with pytest.raises(KernelError, match=rf"ids on meta, table on {DEV.type}(:0)?: one device"):
        s.assign(0, torch.zeros(1, 2, dtype=torch.int64, device="meta"))
    with pytest.raises(KernelError, match=r"layer=-1 must be an int >= 0"):
        s.assign(-1, torch.zeros(1, 2, dtype=torch.int64, device=DEV))
    with pytest.raises(KernelError, match=r"backend 'gpu'"):
        s.assign(0, torch.zeros(1, 2, dtype=torch.int64, device=DEV), backend="gpu")
    assert s.tick.tolist() == [0]  # nothing ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay() -> None:
    dev = torch.device("cuda")
    # capture one call of fixed (T, K), replay it on new ids copied into its input
    graphed, ref = DeviceSlots(5, E, dev), DeviceSlots(5, E, dev)
    ids = torch.zeros(3, 6, dtype=torch.int32, device=dev)
    graphed.assign(0, ids, backend="triton")  # compile outside the capture
    ref.assign(0, ids, backend="reference")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        src, dst = graphed.assign(1, ids, backend="triton")
    torch.cuda.synchronize()
    for i, (_, new) in enumerate(_calls(seed=11, n=10)):
        new = new[:3, :6] if new.shape[0] >= 3 and new.shape[1] == 6 else \
            torch.randint(0, E, (3, 6), generator=torch.Generator().manual_seed(i))
        ids.copy_(new)
        graph.replay()
        src_r, dst_r = ref.assign(1, ids, backend="reference")
        assert src.tolist() == src_r.tolist() and dst.tolist() == dst_r.tolist(), i
        assert _state(graphed) == _state(ref), i
