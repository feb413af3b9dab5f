"""A prefill chunk's routed experts through one FP4 bank: the tile kernel (the FP4 decoded in registers) against
the same grouped matmuls with each group of experts expanded to bf16 first, side by side in one run.

A random FP4 bank at V4-Flash's expert shapes (``--experts`` of ``D = 4096``, ``I_r = 2048 / --tp``, 1x32
UE8M0 scales) and a chunk of ``--tokens`` random tokens routed to ``--top-k`` distinct experts each:
:func:`~shardsmith.runtime.layers.experts.grouped_experts` whole (sort, both matmuls, SwiGLU, combine) with
``TILE_KERNEL`` on and off, milliseconds per call (median of ``--repeat`` after two warm calls, synchronised)
and tokens per second; then :func:`~shardsmith.runtime.layers.kernels.fused_moe.grouped_gemm` alone on the
gate/up matrix over the ``--blocks`` given (``M,N,K,warps,stages``, with and without ``tl.dot_scaled``), its
TFLOP/s and the HBM bytes it must read (the selected experts' FP4 bytes and scales, the rows once). The
error column is each output's relative error to the expanded path's (``grouped_experts``) or to
:func:`~shardsmith.runtime.layers.kernels.fused_moe.grouped_gemm_reference` (the kernel alone).

``--other-banks`` then times the banks other families prefill with, each expert by expert (the path before
grouped experts) against its grouped path, same tokens: an FP8 bank at DeepSeek-V3's shapes (256 experts,
``D = 7168``, ``I_r = 2048 / --tp``, 128x128 float32 block scales, top-8) through the tile kernel, and a bf16
bank at Qwen3-30B-A3B's (128 experts, ``D = 2048``, ``I_r = 768 / --tp``, top-8) through ``torch._grouped_mm``
(CUDA's default for dense banks) and through the tile kernel. Rows go to
``benchmarks/results/grouped_experts-<YYYYMMDD>-<host>.json``.

    python benchmarks/grouped_experts.py --tokens 2048 8192
    python benchmarks/grouped_experts.py --tokens 2048 8192 --blocks --other-banks
    python benchmarks/grouped_experts.py --tokens 8192 --blocks 64,128,128,4,3 128,128,64,8,3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardsmith.runtime.layers import experts  # noqa: E402
from shardsmith.runtime.layers.experts import ExpertMath, grouped_experts  # noqa: E402
from shardsmith.runtime.layers.experts import grouped_experts_reference as loop  # noqa: E402
from shardsmith.runtime.layers.kernels.fused_moe import grouped_gemm, grouped_gemm_reference  # noqa: E402
from shardsmith.runtime.layers.kernels.testing import random_bank, random_routing, rel_error  # noqa: E402

V4_MATH = ExpertMath(limit=10.0, accumulate_f32=True, batched_pairs=16)


def ms_per_call(fn, repeat: int) -> tuple[float, torch.Tensor]:
    """Median milliseconds of ``fn()`` over ``repeat`` synchronised calls after two untimed ones, and its result."""
    for _ in range(2):
        out = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), out


def other_banks(a: argparse.Namespace, device_name: str, gen: torch.Generator) -> list[dict]:
    """The FP8 and bf16 banks of ``--other-banks``: loop against each grouped path, rows as ``main``'s."""
    rows = []
    math = ExpertMath(limit=0.0)
    for fmt, E, D, I, K, paths in (("fp8", 256, 7168, 2048 // a.tp, 8, (("tile kernel", None),)),
                                   ("bf16", 128, 2048, 768 // a.tp, 8, (("torch._grouped_mm", None),
                                                                         ("tile kernel", True)))):
        block = (128, 128) if fmt == "fp8" else None
        bank = random_bank(E, D, I, fp4=False, gen=gen, fp8_block=block, dtype=torch.bfloat16)
        for T in a.tokens:
            index, weight = random_routing(T, K, E, gen=gen)
            x = torch.randn(T, D, generator=gen, device="cuda").bfloat16()
            base = {"device": device_name, "bank": fmt, "experts": E, "top_k": K, "hidden": D,
                    "intermediate_per_rank": I, "tokens": T}
            ms0, want = ms_per_call(lambda: loop(x, index, weight, bank, math, block), a.repeat)
            rows.append(base | {"what": "grouped_experts", "path": "expert by expert", "ms": round(ms0, 3),
                                "tokens_per_s": round(T / ms0 * 1e3), "ratio_to_loop": 1.0, "rel_error": 0.0})
            print(f"{fmt:<5} T={T:<6} {'expert by expert':<18} {ms0:9.3f} ms  {T / ms0 * 1e3:10.0f} tokens/s  1.00x",
                  flush=True)
            for path, tiles in paths:
                experts.TILE_KERNEL = tiles
                ms, out = ms_per_call(lambda: grouped_experts(x, index, weight, bank, math, block=block), a.repeat)
                experts.TILE_KERNEL = None
                rows.append(base | {"what": "grouped_experts", "path": path, "ms": round(ms, 3),
                                    "tokens_per_s": round(T / ms * 1e3), "ratio_to_loop": round(ms0 / ms, 2),
                                    "rel_error": rel_error(out.float(), want.float())})
                print(f"{fmt:<5} T={T:<6} {path:<18} {ms:9.3f} ms  {T / ms * 1e3:10.0f} tokens/s  "
                      f"{ms0 / ms:5.2f}x  rel err {rows[-1]['rel_error']:.1e}", flush=True)
        bank.clear()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--tp", type=int, default=1, help="I_r = 2048 / tp (TP-within-expert)")
    ap.add_argument("--blocks", nargs="*", default=["64,128,128,4,3", "128,128,64,8,3", "64,64,128,4,4",
                                                     "128,256,64,8,3"],
                    help="grouped_gemm launches to time alone: BLOCK_M,BLOCK_N,BLOCK_K,warps,stages")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--other-banks", action="store_true",
                    help="also FP8 (DeepSeek-V3 shapes) and bf16 (Qwen3-30B-A3B shapes) banks, loop against grouped")
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    from _results import save_results

    if not torch.cuda.is_available():
        raise SystemExit("grouped_experts.py measures the GPU kernels: no CUDA device here")
    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    gen = torch.Generator(device=device).manual_seed(0)
    D, I = 4096, 2048 // a.tp
    bank = random_bank(a.experts, D, I, fp4=True, gen=gen)
    rows = []
    for T in a.tokens:
        index, weight = random_routing(T, a.top_k, a.experts, gen=gen)
        x = torch.randn(T, D, generator=gen, device=device).bfloat16()
        base = {"device": name, "experts": a.experts, "top_k": a.top_k, "hidden": D, "intermediate_per_rank": I,
                "tokens": T}
        timed = {}
        for path, tiles in (("expanded", False), ("tile kernel", True)):
            experts.TILE_KERNEL = tiles
            ms, out = ms_per_call(lambda: grouped_experts(x, index, weight, bank, V4_MATH), a.repeat)
            timed[path] = (ms, out)
            rows.append(base | {"what": "grouped_experts", "path": path, "ms": round(ms, 3),
                                "tokens_per_s": round(T / ms * 1e3),
                                "ratio_to_expanded": round(timed["expanded"][0] / ms, 2),
                                "rel_error": rel_error(out.float(), timed["expanded"][1].float())})
            print(f"grouped_experts T={T:<6} {path:<12} {ms:9.3f} ms  {T / ms * 1e3:10.0f} tokens/s  "
                  f"{rows[-1]['ratio_to_expanded']:5.2f}x  rel err {rows[-1]['rel_error']:.1e}", flush=True)
        experts.TILE_KERNEL = None
        counts = torch.bincount(index.flatten(), minlength=a.experts).tolist()
        order = index.flatten().argsort(stable=True)
        xs = x[order // a.top_k].contiguous()
        w, s = bank["gate_up"], bank["gate_up_scale"]
        flop = 2 * xs.shape[0] * w.shape[1] * D
        present = sum(1 for c in counts if c)
        read = present * (w[0].numel() + s[0].numel()) + xs.numel() * 2
        ref = grouped_gemm_reference(xs, w, s, counts)
        for spec in a.blocks:
            bm, bn, bk, warps, stages = (int(v) for v in spec.split(","))
            for scaled in (False, True):
                try:
                    ms, out = ms_per_call(lambda: grouped_gemm(xs, w, s, counts, block_m=bm, block_n=bn, block_k=bk,
                                                                 num_warps=warps, num_stages=stages,
                                                                 scaled_dot=scaled), a.repeat)
                except Exception as e:  # a block shape Triton cannot compile here: say so, go on
                    print(f"grouped_gemm {spec} scaled_dot={scaled}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                rows.append(base | {"what": "grouped_gemm gate_up", "blocks": spec, "scaled_dot": scaled,
                                    "ms": round(ms, 3), "tflop_per_s": round(flop / ms / 1e9, 1),
                                    "read_gb_per_s": round(read / ms / 1e6, 1),
                                    "rel_error": rel_error(out.float(), ref.float())})
                print(f"grouped_gemm T={T:<6} {spec:<16} scaled_dot={scaled!s:<5} {ms:8.3f} ms  "
                      f"{flop / ms / 1e9:7.1f} TFLOP/s  rel err {rows[-1]['rel_error']:.1e}", flush=True)
        del ref
        if not a.no_save:  # the rows so far on disk: a step cut off by its limit keeps them
            save_results("grouped_experts", rows)
    bank.clear()  # the FP4 bank's memory back before the other banks
    if a.other_banks:
        rows += other_banks(a, name, gen)
        if not a.no_save:
            save_results("grouped_experts", rows)


if __name__ == "__main__":
    main()
