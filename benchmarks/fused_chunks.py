"""A prefill chunk's row-wise maths compiled against the same functions as PyTorch ops, function by function,
side by side in one run (``runtime/layers/fused.py``).

Each fused function (DeepSeek-V4's mixer scores, collapse, collapse with the block's norm, query heads'
norm and RoPE, the KV rows' norm and RoPE, the index queries' RoPE, the output's inverse RoPE, the grouped
experts' SwiGLU and per-token combine) at V4-Flash's shapes (``shardsmith.testing.fused_cases.V4_FLASH``:
4 streams of 4096, 64 heads of 512, 64 index heads of 128, 6 experts of 2048 per token) on ``--tokens`` rows: milliseconds per call eager and compiled (median of
``--repeat`` after warm calls; the compile is not timed), their ratio, and the compiled output's error
relative to eager. On a GPU each call is synchronised. Rows go to
``benchmarks/results/fused_chunks-<YYYYMMDD>-<host>.json``.

    python benchmarks/fused_chunks.py --device cuda --tokens 2048 8192
    python benchmarks/fused_chunks.py --device cpu --dtype bfloat16 --tokens 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardsmith.runtime.layers import fused  # noqa: E402
from shardsmith.runtime.layers.kernels.testing import rel_error  # noqa: E402
from shardsmith.testing.fused_cases import V4_FLASH, fused_chunk_cases  # noqa: E402


def ms_per_call(fn, args, repeat: int, sync) -> float:
    """Median milliseconds of ``fn(*args)`` over ``repeat`` calls, after two untimed ones."""
    for _ in range(2):
        fn(*args)
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    from _results import save_results

    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    gen = torch.Generator(device=a.device).manual_seed(0)
    fused.ENABLED = True
    rows = []
    for T in a.tokens:
        for fn, args in fused_chunk_cases(T, **V4_FLASH, dtype=getattr(torch, a.dtype), device=a.device, gen=gen):
            eager = ms_per_call(fn.reference, args, a.repeat, sync)
            compiled = ms_per_call(fn, args, a.repeat, sync)
            rows.append({"function": fn.__name__, "tokens": T, "device": device_name, "dtype": a.dtype,
                         "eager_ms": round(eager, 3), "fused_ms": round(compiled, 3),
                         "speedup": round(eager / compiled, 2),
                         "rel_error": rel_error(fn(*args).float(), fn.reference(*args).float())})
            r = rows[-1]
            print(f"{r['function']:<15} T={T:<6} eager {eager:9.3f} ms  fused {compiled:9.3f} ms  {r['speedup']:5.2f}x"
                  f"  rel err {r['rel_error']:.1e}", flush=True)
    for T in a.tokens:
        eager = sum(r["eager_ms"] for r in rows if r["tokens"] == T)
        compiled = sum(r["fused_ms"] for r in rows if r["tokens"] == T)
        print(f"all {len(rows) // len(a.tokens)} at T={T}: eager {eager:.2f} ms, fused {compiled:.2f} ms ({eager / compiled:.2f}x)")
    if not a.no_save:
        save_results("fused_chunks", rows)


if __name__ == "__main__":
    main()
