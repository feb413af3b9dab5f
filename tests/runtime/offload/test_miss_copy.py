"""The device copy of missed experts (``offload/miss_copy.py``): the Triton kernel against its reference.

CPU: the kernel under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton loads) and the
PyTorch reference copy the same pairs into equal pools, for an FP4 bank (uint8 weights and UE8M0
scales, rows longer than one 16 KiB program), gpt-oss's MXFP4 bank (the same and a bf16 gate/up bias: five
arrays), an FP8 bank (float8 weights, float32 scales) and a bf16 bank (no scales): rows named by ``dst`` hold the host expert ``-1 - src``, every other row is untouched.
With CUDA: the host bank page-locked, the call captured in a CUDA graph and replayed on new pairs.
Bad inputs raise naming the array and the rule.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.kernels import KernelError, triton_available
from shardsmith.runtime.offload.miss_copy import copy_misses

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E_HOST, S = 7, 5


def _bank(fmt: str, rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A bank of ``rows`` experts (CPU, random bytes) in ``fmt``: fp4 rows of 17 KiB (two programs)."""
    def raw(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if fmt in ("fp4", "gpt-oss"):
        bank = {"gate_up": raw(rows, 34, 512), "gate_up_scale": raw(rows, 34, 32), "down": raw(rows, 16, 544),
                "down_scale": raw(rows, 16, 34)}
        return bank if fmt == "fp4" else {**bank, "gate_up_bias": torch.randn(rows, 34, generator=gen).bfloat16()}
    if fmt == "fp8":
        return {"gate_up": raw(rows, 64, 96).view(torch.float8_e4m3fn), "gate_up_scale": torch.rand(rows, 1, 1, generator=gen),
                "down": raw(rows, 48, 32).view(torch.float8_e4m3fn), "down_scale": torch.rand(rows, 1, 1, generator=gen)}
    return {"gate_up": torch.randn(rows, 24, 40, generator=gen).bfloat16(),
            "down": torch.randn(rows, 40, 12, generator=gen).bfloat16()}


def _pairs(src: list[int], dst: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(src, dtype=torch.int64, device=DEV), torch.tensor(dst, dtype=torch.int64, device=DEV)


def _expected(pool: dict, host: dict, src: list[int], dst: list[int]) -> dict[str, torch.Tensor]:
    out = {name: rows.clone() for name, rows in pool.items()}
    for s, d in zip(src, dst):
        if d >= 0:
            for name in out:
                out[name][d] = host[name][-1 - s].to(DEV)
    return out


@pytest.mark.parametrize("fmt", ["fp4", "gpt-oss", "fp8", "bf16"])
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_copies_named_rows_only(fmt: str, backend: str) -> None:
    gen = torch.Generator().manual_seed(3)
    host = _bank(fmt, E_HOST, gen)
    if DEV.type == "cuda":
        host = {name: a.pin_memory() for name, a in host.items()}
    pool = {name: a.to(DEV) for name, a in _bank(fmt, S, gen).items()}
    src, dst = [-4, 2, -7, -1, -2, 0], [3, -1, 0, -1, 4, -1]  # a hit (2), a miss left on the host (-1, -1)
    want = _expected(pool, host, src, dst)
    copy_misses(pool, host, *_pairs(src, dst), backend=backend)
    for name in pool:
        assert torch.equal(pool[name].view(torch.uint8), want[name].view(torch.uint8)), name
    copy_misses(pool, host, *_pairs([], []), backend=backend)  # no pairs: nothing to do


def test_bad_input_raises() -> None:
    gen = torch.Generator().manual_seed(0)
    host, pool = _bank("fp4", E_HOST, gen), {n: a.to(DEV) for n, a in _bank("fp4", S, gen).items()}
    src, dst = _pairs([-1], [0])
    with pytest.raises(KernelError, match=r"host bank has no down_scale"):
        copy_misses(pool, {n: a for n, a in host.items() if n != "down_scale"}, src, dst)
    bad = dict(host, down=host["down"][:, :, :10])
    with pytest.raises(KernelError, match=r"down: host \(7, 16, 10\) torch.uint8 against pool \(5, 16, 544\)"):
        copy_misses(pool, bad, src, dst)
    with pytest.raises(KernelError, match=r"pool arrays \['bias', .*want 1-5 of gate_up"):
        copy_misses(dict(pool, bias=pool["down"]), host, src, dst)
    with pytest.raises(KernelError, match=r"dst \(1,\) torch.int32 on .*: want \[P\] int64"):
        copy_misses(pool, host, src, dst.int())
    before = {n: a.clone() for n, a in pool.items()}
    with pytest.raises(KernelError, match=r"backend 'gpu'"):
        copy_misses(pool, host, src, dst, backend="gpu")
    assert all(torch.equal(before[n], pool[n]) for n in pool)  # nothing ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_from_pinned_memory() -> None:
    gen = torch.Generator().manual_seed(5)
    host = {name: a.pin_memory() for name, a in _bank("fp4", E_HOST, gen).items()}
    pool = {name: a.cuda() for name, a in _bank("fp4", S, gen).items()}
    src, dst = _pairs([-1, -2], [0, 1])
    copy_misses(pool, host, src, dst, backend="triton")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_misses(pool, host, src, dst, backend="triton")
    for new_src, new_dst in (([-7, -3], [4, 2]), ([-5, 1], [0, -1])):
        want = _expected(pool, host, new_src, new_dst)
        s2, d2 = _pairs(new_src, new_dst)
        src.copy_(s2), dst.copy_(d2)
        graph.replay()
        torch.cuda.synchronize()
        for name in pool:
            assert torch.equal(pool[name], want[name]), name
