"""DeepSeek-V4's compressor decode step (``compressor_step``) against its PyTorch reference.

CPU: under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton loads), small shapes, a run of
decode steps long enough for every row to complete windows several times: HCA-like (no overlap, a
ratio past one row chunk) and CSA-like (overlap: the carry of the last window's Ca half, starting from
``-inf`` gates), a head dim that is not a power of two, rows of distinct slots and padding rows that
share the scratch slot, float32 and bf16. The window buffer and the CSA carry are copies (equal bit for
bit); the entries land within float32 summation order of the reference's (float16 too; bf16, which the
interpreter casts by truncation: no further from the
float32 reference's entries than 3x the bf16 reference's own distance). The new rows come as a strided
slice, as the attention's merged projection hands them (``test_kernels_wired.py`` runs the tiny model's
decode through the kernel).
GPU (``-m gpu``): V4-Flash's shapes (d 512 with r 4 and 128, the indexer's 128 with r 4, rope 64) in
bf16, the same checks, and the same bits under CUDA-graph capture and replay.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.kernels import KernelError, triton_available
from shardsmith.runtime.layers.kernels.deepseek_v4.compressor_step import (
    compressor_step,
    compressor_step_reference,
)
from shardsmith.runtime.models.deepseek_v4.ops import inv_freq
from shardsmith.runtime.models.deepseek_v4.rows import DecodeRows, RowsSpec

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


class _State:
    """A compressor's per-slot state (``Compressor.allocate``'s layout), random but finite, the carry's
    gates ``-inf`` (reset) in some slots."""

    def __init__(self, slots: int, r: int, d: int, overlap: bool, E: int, dtype: torch.dtype, device: str,
                 g: torch.Generator) -> None:
        width = (2 if overlap else 1) * d
        rand = lambda *s: torch.randn(*s, generator=g, device=device)
        self.buf = rand(slots, r, 2, width).to(dtype)
        self.ape = rand(r, width)
        self.weight = 1 + 0.1 * rand(d)
        self.keys = rand(slots, 3 + E, d).to(dtype)  # entries live in a strided view, as in the key buffer
        self.entries = self.keys[:, 3:]
        self.prev_kv = self.prev_gate = None
        if overlap:
            self.prev_kv = rand(slots, r, d).to(dtype)
            self.prev_gate = rand(slots, r, d)
            self.prev_gate[::2] = float("-inf")

    def clone(self) -> _State:
        other = object.__new__(_State)
        other.__dict__ = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        other.entries = other.keys[:, 3:]
        return other

    def step(self, kv_gate: torch.Tensor, rows: DecodeRows, r: int, backend: str) -> None:
        done, entry, cs, sn = rows.completion(r)
        fn = compressor_step if backend != "reference" else compressor_step_reference
        kwargs = {"backend": backend} if backend != "reference" else {}
        fn(kv_gate, self.buf, self.ape, self.weight, self.entries, rows.index, rows.column(r), done, entry, cs, sn,
           self.prev_kv, self.prev_gate, eps=1e-6, **kwargs)


def _run(r: int, d: int, overlap: bool, B: int, padding: int, steps: int, dtype: torch.dtype, *, device: str = "cpu",
         rope: int = 8, slots: int = 6, seed: int = 0) -> None:
    g = torch.Generator(device=device).manual_seed(seed)
    L = r * (steps // r + 3)
    spec = RowsSpec(window=8, ratios=(r,), max_seq_len=L, freqs={"main": inv_freq(rope, 1e4).to(device),
                                                                   "compress": inv_freq(rope, 1.6e5).to(device)})
    ref = _State(slots, r, d, overlap, L // r, dtype, device, g)
    ker, exact = ref.clone(), ref.clone()  # exact: the reference in float32 on the same inputs (bf16's yardstick)
    for name in ("buf", "keys", "prev_kv"):
        if getattr(exact, name) is not None:
            setattr(exact, name, getattr(exact, name).float())
    exact.entries = exact.keys[:, 3:]
    scratch = slots - 1
    start = torch.randint(0, 3 * r, (B,), generator=g, device=device)
    index = torch.cat((torch.randperm(slots - 1, generator=g, device=device)[:B],
                       torch.full((padding,), scratch, device=device)))
    width = (2 if overlap else 1) * d
    completed = 0
    for t in range(steps):
        positions = torch.cat((start + t, (start[:1] + t).expand(padding)))
        rows = DecodeRows(positions, index, L, scratch, spec)
        wide = torch.randn(B + padding, 2 * width + 5, generator=g, device=device).to(dtype)
        kv_gate = wide[:, 3:3 + 2 * width].view(-1, 2, width)  # strided rows, as a merged projection's slice
        ref.step(kv_gate, rows, r, "reference")
        ker.step(kv_gate, rows, r, "triton")
        exact.step(kv_gate.float(), rows, r, "reference")
        completed += int(rows.completion(r)[0].sum())
        real = index[:B]
        assert torch.equal(ker.buf[real], ref.buf[real]), f"step {t}: the window rows differ"
        if overlap:
            assert torch.equal(ker.prev_kv[real], ref.prev_kv[real]) and torch.equal(ker.prev_gate[real],
                                                                                      ref.prev_gate[real])
        got, want = ker.entries[real].double(), ref.entries[real].double()
        if dtype != torch.bfloat16:  # float32 summation order apart (float16: one rounding of it)
            err = ((got - want).abs() / want.abs().clamp(min=1.0)).max().item()
            tol = 2e-5 if dtype == torch.float32 else 2 ** -10
            assert err <= tol, f"step {t}: entries differ by {err:.3g} (tolerance {tol:.3g})"
        else:  # no further from float32's entries than 3x the reference's own bf16 distance (one ulp at least)
            truth = exact.entries[real].double()
            own = max((want - truth).abs().max().item(), 2 ** -8 * truth.abs().max().item())
            err = (got - truth).abs().max().item()
            assert err <= 3 * own, f"step {t}: entries {err:.3g} from float32's, the reference {own:.3g}"
        assert torch.equal(ker.keys[:, :3], ref.keys[:, :3]), "rows outside the entries view were written"
        assert torch.isfinite(ker.entries[scratch].float()).all() and torch.isfinite(ker.buf[scratch].float()).all()
    assert completed >= B * (steps // r), "the run completed too few windows to test the pooling"


@needs_triton
@pytest.mark.parametrize(("r", "d", "overlap", "B", "padding", "steps", "dtype"), [
    (4, 16, True, 3, 2, 13, torch.float32),      # CSA: the carry, -inf gates at first, padding rows
    (8, 24, False, 2, 1, 18, torch.float32),     # HCA: d not a power of two
    (32, 16, False, 1, 0, 40, torch.float32),    # a window past one row chunk (the three passes loop)
    (4, 32, True, 2, 1, 9, torch.bfloat16),      # bf16: weights and products rounded as the reference's
    (3, 17, True, 2, 1, 8, torch.float16),       # odd d (the rope pairs start at an odd channel), ratio 3
    (1, 9, False, 2, 0, 3, torch.float32),       # ratio 1: every step completes a window
])
def test_compressor_step_matches_reference(r, d, overlap, B, padding, steps, dtype):
    _run(r, d, overlap, B, padding, steps, dtype)


def _one_row(rows: DecodeRows, b: int, spec: RowsSpec) -> DecodeRows:
    return DecodeRows(rows.positions[b:b + 1], rows.index[b:b + 1], rows.key, rows.scratch, spec)


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@needs_triton
@pytest.mark.parametrize(("r", "d", "overlap", "device"), [
    (4, 16, True, "cpu"), (3, 8, False, "cpu"),
    pytest.param(4, 512, True, "cuda", marks=_CUDA), pytest.param(128, 512, False, "cuda", marks=_CUDA),
])
def test_runs_in_one_launch_equal_their_rows_one_by_one(r, d, overlap, device):
    """``run``: a slot's consecutive rows (a verify run) in one launch, the run's first row's program
    taking them in order, leave the state of one-row steps in row order (the reference): runs of 3 and
    2 rows that complete windows inside them, a slot's only row and padding rows, over 7 steps (on
    CUDA at V4-Flash's shapes, where the barrier between a run's rows matters)."""
    g = torch.Generator(device=device).manual_seed(3)
    L, slots, K = 4 * r + 32, 6, 3
    spec = RowsSpec(window=8, ratios=(r,), max_seq_len=L, runs=K,
                    freqs={"main": inv_freq(8, 1e4).to(device), "compress": inv_freq(8, 1.6e5).to(device)})
    ref = _State(slots, r, d, overlap, L // r, torch.float32, device, g)
    ker = ref.clone()
    scratch, width = slots - 1, (2 if overlap else 1) * d
    pos = {0: r - 2, 1: 2 * r - 2, 2: r - 1}  # slot -> its next position; runs of 3, 2 and 1 rows
    completed = 0
    for t in range(7):
        lengths = {0: 3, 1: 2, 2: 1} if t % 2 == 0 else {0: 1, 1: 3, 2: 2}
        positions = [pos[s] + j for s, n in lengths.items() for j in range(n)]
        index = [s for s, n in lengths.items() for _ in range(n)]
        positions += [positions[0]] * 2  # padding rows: row 0's position in the scratch slot
        index += [scratch] * 2
        rows = DecodeRows(torch.tensor(positions, device=device), torch.tensor(index, device=device), L, scratch, spec)
        kv_gate = torch.randn(len(positions), 2, width, generator=g, device=device)
        for b in range(len(positions) - 2):  # the reference: each real row alone, in row order
            ref.step(kv_gate[b:b + 1], _one_row(rows, b, spec), r, "reference")
        done, entry, cs, sn = rows.completion(r)
        assert rows.run_lengths().tolist() == [n if j == 0 else 0 for n in lengths.values() for j in range(n)] + [1, 1]
        compressor_step(kv_gate, ker.buf, ker.ape, ker.weight, ker.entries, rows.index, rows.column(r), done, entry,
                        cs, sn, ker.prev_kv, ker.prev_gate, eps=1e-6, backend="triton", run=rows.run_lengths())
        completed += int(done[:-2].sum())
        real = torch.tensor(sorted(lengths), device=device)
        assert torch.equal(ker.buf[real], ref.buf[real]), f"step {t}: the window rows differ"
        if overlap:
            assert torch.equal(ker.prev_kv[real], ref.prev_kv[real]) and torch.equal(ker.prev_gate[real],
                                                                                      ref.prev_gate[real])
        torch.testing.assert_close(ker.entries[real], ref.entries[real], atol=2e-5, rtol=2e-5)
        for s, n in lengths.items():
            pos[s] += n
    assert completed >= 3, "the runs completed too few windows to test the pooling inside a run"


@needs_triton
def test_compressor_step_refuses_bad_input():
    s = _State(3, 4, 16, True, 4, torch.float32, "cpu", torch.Generator().manual_seed(0))
    spec = RowsSpec(8, (4,), 16, {"main": inv_freq(8, 1e4), "compress": inv_freq(8, 1e4)})
    rows = DecodeRows(torch.tensor([3]), torch.tensor([0]), 16, 2, spec)
    done, entry, cs, sn = rows.completion(4)
    args = [torch.zeros(1, 2, 32), s.buf, s.ape, s.weight, s.entries, rows.index, rows.column(4), done, entry, cs, sn]
    with pytest.raises(KernelError, match="prev_kv and prev_gate"):
        compressor_step(*args, s.prev_kv, None, eps=1e-6, backend="triton")
    with pytest.raises(KernelError, match=r"kv_gate \(1, 2, 16\)"):
        compressor_step(torch.zeros(1, 2, 16), *args[1:], s.prev_kv, s.prev_gate, eps=1e-6, backend="triton")
    with pytest.raises(KernelError, match="done"):
        compressor_step(*args[:7], done.long(), *args[8:], s.prev_kv, s.prev_gate, eps=1e-6, backend="triton")
    with pytest.raises(KernelError, match="contiguous"):
        compressor_step(*args[:1], s.buf.transpose(0, 1).contiguous().transpose(0, 1), *args[2:], s.prev_kv,
                        s.prev_gate, eps=1e-6, backend="triton")
    before = s.buf.clone()
    compressor_step(torch.zeros(0, 2, 32), *args[1:5], *(t[:0] for t in args[5:]), s.prev_kv, s.prev_gate,
                    eps=1e-6, backend="triton")  # no rows: nothing written
    assert torch.equal(s.buf, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("r", "d", "overlap"), [(4, 512, True), (128, 512, False), (4, 128, True)])
def test_compressor_step_v4_shapes_cuda(r, d, overlap):
    _run(r, d, overlap, 4, 4, 2 * r + 3, torch.bfloat16, device="cuda", rope=64, slots=10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compressor_step_graph_replay_cuda():
    """Captured once, replayed over a run of steps: the same bits as the eager kernel."""
    r, d, B = 4, 512, 4
    g = torch.Generator(device="cuda").manual_seed(1)
    L = 64
    spec = RowsSpec(8, (r,), L, {"main": inv_freq(64, 1e4).cuda(), "compress": inv_freq(64, 1.6e5).cuda()})
    eager = _State(6, r, d, True, L // r, torch.bfloat16, "cuda", g)
    graphed = eager.clone()
    positions = torch.zeros(B, dtype=torch.int64, device="cuda")
    index = torch.tensor([0, 1, 2, 5], device="cuda")
    kv_gate = torch.zeros(B, 2, 2 * d, dtype=torch.bfloat16, device="cuda")
    rows = DecodeRows(positions, index, L, 5, spec)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm (compile) outside the capture, on a scratch copy
        eager.clone().step(kv_gate, rows, r, "triton")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step(kv_gate, DecodeRows(positions, index, L, 5, spec), r, "triton")
    for t in range(2 * r + 1):
        positions.copy_(torch.tensor([t, t + 1, t + 3, t], device="cuda"))
        kv_gate.copy_(torch.randn(B, 2, 2 * d, generator=g, device="cuda").to(torch.bfloat16))
        graph.replay()
        eager.step(kv_gate, DecodeRows(positions.clone(), index, L, 5, spec), r, "triton")
        for a, b in ((graphed.buf, eager.buf), (graphed.entries, eager.entries), (graphed.prev_kv, eager.prev_kv),
                     (graphed.prev_gate, eager.prev_gate)):
            assert torch.equal(a[:3], b[:3]), f"step {t}"
