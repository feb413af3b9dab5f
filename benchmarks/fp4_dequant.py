"""FP4 (e2m1 + 1x32 UE8M0) expansion of one DeepSeek-V4-Flash expert: table lookups side by side.

The ``cpu`` and ``hybrid`` expert backends expand every FP4 expert they compute, and the GPU paths
expand every expert they apply, so the lookup's cost is paid per expert per token. Rows, for the
expert's ``gate_up [2*I/tp, D/2]`` and ``down [D, I/(2*tp)]`` (D = 4096, I = 2048) at TP 1 and 2:

- ``byte_index``: ``lut256[bytes]`` by advanced indexing (the runtime until this benchmark);
- ``byte_embedding``: the same table through ``F.embedding``;
- ``word_embedding``: a 65536-entry table of four values per 16-bit word through ``F.embedding``
  (:func:`shardsmith.runtime.layers.quant.dequantize_fp4` now);

each followed by the scale multiply, checked bit-identical to the first, and the bf16 matvec of the
expanded matrix for scale. Example: ``python benchmarks/fp4_dequant.py [--threads 2] [--device cpu]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    from shardsmith.runtime.layers.quant import FP4_GROUP, _byte_lut, dequantize_fp4, ue8m0_to_float

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dev, dt = torch.device(a.device), torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def scaled(vals, scale, lead):
        return (vals.view(*lead, -1, FP4_GROUP) * ue8m0_to_float(scale).to(dt)[..., None]).view(*lead, -1)

    methods = {
        "byte_index": lambda q, s: scaled(_byte_lut(dev, dt)[q.view(torch.uint8).int()], s, q.shape[:-1]),
        "byte_embedding": lambda q, s: scaled(F.embedding(q.view(torch.uint8).int(), _byte_lut(dev, dt)), s, q.shape[:-1]),
        "word_embedding": lambda q, s: dequantize_fp4(q, s, dt),
    }

    def best(f) -> float:
        f()
        sync()
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            f()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    g = torch.Generator().manual_seed(0)
    rows = []
    for tp in (1, 2):
        for array, (r, c) in (("gate_up", (2 * 2048 // tp, 4096)), ("down", (4096, 2048 // tp))):
            q = torch.randint(-128, 128, (r, c // 2), dtype=torch.int8, generator=g).to(dev)
            s = torch.randint(118, 128, (r, c // FP4_GROUP), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu).to(dev)
            ref = methods["byte_index"](q, s)
            x = torch.randn(1, c, dtype=dt, device=dev)
            matvec = best(lambda: F.linear(x, ref))
            for name, f in methods.items():
                rows.append({"tp": tp, "array": array, "rows": r, "cols": c, "method": name, "device": a.device,
                             "threads": a.threads, "ms": 1e3 * best(lambda: f(q, s)), "matvec_ms": 1e3 * matvec,
                             "bit_identical": bool(torch.equal(f(q, s), ref))})
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"FP4 expansion of one V4-Flash expert array ({a.device}, {a.threads} threads, bf16)")
    for col in ("tp", "array", "shape", "method", "ms", "vs byte_index", "bf16 matvec ms", "same bits"):
        t.add_column(col, justify="right")
    base = {(r["tp"], r["array"]): r["ms"] for r in rows if r["method"] == "byte_index"}
    for r in rows:
        t.add_row(str(r["tp"]), r["array"], f"{r['rows']}x{r['cols']}", r["method"], f"{r['ms']:.2f}",
                  f"{base[(r['tp'], r['array'])] / r['ms']:.2f}x", f"{r['matvec_ms']:.2f}", str(r["bit_identical"]))
    Console(width=140).print(t)
    if not all(r["bit_identical"] for r in rows):
        raise SystemExit("a lookup gave different bits")
    if not a.no_save:
        from _results import save_results

        save_results("fp4_dequant", rows)


if __name__ == "__main__":
    main()
