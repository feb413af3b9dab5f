"""A MoE layer's router for a decode step on one GPU: ``route_topk`` (one launch) against the PyTorch path it
replaced (``route_topk_reference``: cuBLAS GEMV, scores, top-k or table gather, gather, normalise), eagerly
and under ``torch.compile`` (as the decode pieces run it), side by side.

Shapes: V4-Flash's router (D = 4096, float32 gate ``[256, 4096]`` = 4 MiB, K = 6, sqrt-softplus, bias),
bf16 x, T = 1, 4 and 16 tokens; ``--experts 24`` for our test packs' gates, ``--hashed`` for the hash-routed
first layers (``tid2eid[ids]``, no top-k). Each configuration is timed as CUDA-graph replays of ``--calls``
router calls over distinct gates; ``--sets`` such graphs (other gates) replay in turn, so a gate comes from
HBM and not from the L2 (``--sets 1``: L2-warm). Rows give microseconds per call, the ratio to the eager
PyTorch path, device ops per call (kernels, memsets and copies of one call after warm-up, torch.profiler),
the gate's read bandwidth and the error against the reference (experts compared as sets; weights of the
kernel's experts). Rows go to ``benchmarks/results/router-<YYYYMMDD>-<host>.json``.

Example::

    python benchmarks/router.py --splits 0,8,32 --block-e 8,16,32 --block-k 128,256 --warps 2,4,8
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_kernels import try_seconds  # noqa: E402  (graphs of distinct gates replayed in turn)
from shardsmith.runtime.layers.kernels import triton_available  # noqa: E402
from shardsmith.runtime.layers.kernels.router import route_topk, route_topk_reference  # noqa: E402

D, TOP_K, SCALE, VOCAB = 4096, 6, 1.5, 4096
SCORE = "sqrtsoftplus"


def device_ops(call: Callable) -> int:
    """Device operations (kernels, memsets, copies) of one call after a warm-up call (torch.profiler)."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def errors(got: tuple[torch.Tensor, torch.Tensor], x, gate, table: dict) -> tuple[float, float]:
    """``(fraction of tokens whose experts equal the reference's as sets, max |weight - reference's|
    for the kernel's experts)``."""
    index, weight = got
    want_index, _ = route_topk_reference(x, *gate, TOP_K, SCORE, SCALE, **table)
    same = (index.sort(1).values == want_index.sort(1).values).all(1).float().mean().item()
    _, want = route_topk_reference(x, gate[0], gate[1], TOP_K, SCORE, SCALE, index=index)
    return same, (weight - want).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--experts", type=int, default=256, help="E (V4-Flash: 256; our test packs: 24)")
    ap.add_argument("--hashed", action="store_true", help="the hash-routed layers' path (tid2eid[ids], no top-k)")
    ap.add_argument("--splits", default="0", help="split_k values; 0: the default (about two waves)")
    ap.add_argument("--block-e", default="8,16,32", help="gate rows per program")
    ap.add_argument("--block-k", default="128,256", help="D elements per step of a program")
    ap.add_argument("--warps", default="2,4")
    ap.add_argument("--calls", type=int, default=8, help="router calls (distinct gates) per captured graph")
    ap.add_argument("--sets", type=int, default=4, help="graphs of other gates replayed in turn (1: L2-warm)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/router.py times CUDA-graph replays on a GPU, and torch.cuda.is_available() is "
                         "False here (on CPU, tests/runtime/kernels/test_router_kernel.py checks the kernel under "
                         "TRITON_INTERPRET=1)")
    if not triton_available():
        raise SystemExit("benchmarks/router.py needs triton (pip install 'shardsmith[kernels]')")
    E = a.experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    gates = [[(torch.randn(E, D, generator=gen, device="cuda") * D ** -0.5,
               None if a.hashed else torch.randn(E, generator=gen, device="cuda") * 0.1) for _ in range(a.calls)]
             for _ in range(a.sets)]
    tid2eid = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:TOP_K] for _ in range(VOCAB)])
    compiled_ref = torch.compile(route_topk_reference, dynamic=False)
    compiled_kernel = torch.compile(route_topk, dynamic=False)
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16)
        table = {"tid2eid": tid2eid, "ids": torch.randint(0, VOCAB, (T,), device="cuda", generator=gen)} \
            if a.hashed else {}

        def calls(fn, **kw) -> list[list[Callable]]:
            return [[lambda g=g: fn(x, *g, TOP_K, SCORE, SCALE, **table, **kw) for g in s] for s in gates]

        gate = gates[0][0]

        def one(fn, **kw) -> Callable:
            return lambda: fn(x, *gate, TOP_K, SCORE, SCALE, **table, **kw)

        one(route_topk)()  # the split-K counters exist before any trace or capture (as the engine's warm-up)
        base = None
        for name, fn in (("PyTorch (route_topk_reference)", route_topk_reference),
                         ("PyTorch, torch.compile", compiled_ref), ("route_topk, torch.compile", compiled_kernel)):
            sec = try_seconds(calls(fn), a.replays, f"{name} T={T}")
            if sec is not None:
                base = base or sec
                rows.append({"path": name, "tokens": T, "config": "default", "us_per_call": sec * 1e6,
                             "vs_pytorch_eager": base / sec, "device_ops_per_call": device_ops(one(fn)),
                             "gate_GBps": E * D * 4 / sec / 1e9})
        for split in (int(s) for s in a.splits.split(",")):
            for block_e, block_k, warps in itertools.product(*((int(v) for v in arg.split(","))
                                                                 for arg in (a.block_e, a.block_k, a.warps))):
                kw = {"split_k": split or None, "block_e": block_e, "block_k": block_k, "num_warps": warps}
                sec = try_seconds(calls(route_topk, **kw), a.replays, f"route_topk T={T} {kw}")
                if sec is None:
                    continue
                same, err = errors(one(route_topk, **kw)(), x, gate, table)
                rows.append({"path": "route_topk", "tokens": T,
                             "config": f"split_k={split or 'auto'} block_e={block_e} block_k={block_k} warps={warps}",
                             "us_per_call": sec * 1e6, "vs_pytorch_eager": (base or sec) / sec,
                             "device_ops_per_call": device_ops(one(route_topk, **kw)),
                             "gate_GBps": E * D * 4 / sec / 1e9, "same_experts": same, "max_abs_weight_error": err})
    print(f"{'path':<32} {'T':>3} {'config':<46} {'us/call':>8} {'eager/this':>10} {'ops':>4} {'GB/s':>7} "
          f"{'same':>5} {'w err':>9}")
    for r in rows:
        print(f"{r['path']:<32} {r['tokens']:>3} {r['config']:<46} {r['us_per_call']:>8.2f} "
              f"{r['vs_pytorch_eager']:>10.2f} {r['device_ops_per_call']:>4} {r['gate_GBps']:>7.0f} "
              f"{r.get('same_experts', float('nan')):>5.2f} {r.get('max_abs_weight_error', float('nan')):>9.2e}")
    if not a.no_save:
        from _results import save_results

        save_results("router", rows, extra={"shape": f"E={E} D={D} K={TOP_K} {SCORE} bf16 x",
                                            "hashed": a.hashed, "calls_per_graph": a.calls, "graph_sets": a.sets})


if __name__ == "__main__":
    main()
