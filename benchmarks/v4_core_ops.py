"""Host cost of DeepSeek-V4's eager decode work: torch ops dispatched per layer per decode step (issue 12).

In a graphed decode step (``engine.cuda_graphs.DecodeGraphs``) only the row-wise pieces are captured;
``decode_step`` (the step's context), each layer's ``attn_in_args`` and its attention core
(``attn_core``: window, compressors, indexer, softmax) run eagerly, so every torch op there costs
host time (~5-20 us each on the GPU host). This counts them on CPU on the tiny DeepSeek-V4
(``shardsmith.testing.tiny_v4``: layers sliding, CSA, HCA, CSA; window 16, CSA ratio 4, HCA 128), in
bf16 like the GPU runs, for batches of ``B`` rows (slots 0..B-1, prefilled to 40, 53, 66, ...
tokens so the rows pass the window and complete CSA windows on different steps), over ``--steps``
consecutive steps.

Per layer kind and B, per layer per step (mean over the steps and the layers of the kind):

* ``aten_ops``: ATen ops dispatched (a ``TorchDispatchMode`` counter: what reaches the kernels,
  views included; einsum counts its permutes/reshapes/bmm);
* ``torch_calls``: torch-level calls (a ``TorchFunctionMode`` counter: functions, methods,
  indexing: the Python calls that each cost interpreter and dispatcher time);
* ``us``: CPU wall time of the layer's eager work (a sanity check, 2 shared cores: noisy).

The ``step`` row is ``decode_step`` alone (once per step, shared by every layer). Rows go to
``benchmarks/results/v4_core_ops-<YYYYMMDD>-<host>.json``. ``--compare REF`` also runs this script
on ``git archive REF``'s ``shardsmith/`` (the same measurement of the code before a change) and
prints both side by side; the other run's rows are kept under ``"compare"``.

Example::

    SHARDSMITH_HOST=cpu2 python benchmarks/v4_core_ops.py --compare int
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

PREFILL = [40 + 13 * b for b in range(8)]  # slot b's prompt length (tokens)


class Count(TorchDispatchMode):
    """Counts ATen ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class Calls(TorchFunctionMode):
    """Counts torch-level calls (functions, Tensor methods, indexing) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def counted(fn, *args):
    """``fn(*args)`` under both counters: ``(result, (aten ops, torch calls))``."""
    aten, calls = Count(), Calls()
    with calls, aten:
        out = fn(*args)
    return out, (aten.n, calls.n)


def measure(pack: Path, batches: list[int], steps: int, timed: bool) -> list[dict]:
    """Rows per (B, kind): mean ops per layer per step; a ``step`` kind for ``decode_step``."""
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4

    weights = load_rank_weights(pack, rank=0, world_size=1)
    rows = []
    for B in batches:
        model = DeepseekV4.from_weights(weights, dtype=torch.bfloat16, max_seq_len=256, max_num_seqs=max(batches))
        gen = torch.Generator().manual_seed(B)
        pos = []
        with torch.inference_mode():
            for b in range(B):
                model(torch.randint(2, 500, (PREFILL[b],), generator=gen), 0, slot=b)
                pos.append(PREFILL[b])
        kinds = [layer.attn.kind for layer in model.decode_layers]
        acc: dict[str, list] = defaultdict(lambda: [0, 0, 0])  # kind -> aten ops, torch calls, samples
        ids = torch.randint(2, 500, (B,), generator=gen)
        with torch.inference_mode():
            for _ in range(steps):
                step, c = counted(model.decode_step, ids, list(pos), list(range(B)), B)
                _add(acc["step"], c)
                (h,) = model.embed_ids(ids)
                for kind, layer in zip(kinds, model.decode_layers):
                    args, c1 = counted(layer.attn_in_args, step)
                    a = layer.attn_in(h, *args)
                    mid, c2 = counted(layer.attn_core, a, step)
                    _add(acc[kind], tuple(x + y for x, y in zip(c1, c2)))
                    (h,) = layer.ffn_block(h, *mid)
                pos = [p + 1 for p in pos]
            wall = None
            if timed:  # uncounted steps: CPU wall time of the eager parts alone
                t_eager = 0.0
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step = model.decode_step(ids, list(pos), list(range(B)), B)
                    t_eager += time.perf_counter() - t0
                    (h,) = model.embed_ids(ids)
                    for layer in model.decode_layers:
                        t0 = time.perf_counter()
                        args = layer.attn_in_args(step)
                        t_eager += time.perf_counter() - t0
                        a = layer.attn_in(h, *args)
                        t0 = time.perf_counter()
                        mid = layer.attn_core(a, step)
                        t_eager += time.perf_counter() - t0
                        (h,) = layer.ffn_block(h, *mid)
                    pos = [p + 1 for p in pos]
                wall = t_eager / steps
        for kind in ["step", *dict.fromkeys(kinds)]:
            aten, calls, n = acc[kind]
            rows.append({"B": B, "kind": kind, "layers": 1 if kind == "step" else kinds.count(kind),
                         "aten_ops": round(aten / n, 2), "torch_calls": round(calls / n, 2)})
        rows.append({"B": B, "kind": "token", "layers": len(kinds),
                     "aten_ops": round(sum(acc[k][0] for k in acc) / steps, 2),
                     "torch_calls": round(sum(acc[k][1] for k in acc) / steps, 2),
                     "eager_us_per_step": None if wall is None else round(wall * 1e6, 1)})
    return rows


def _add(acc: list, c: tuple) -> None:
    acc[0] += c[0]
    acc[1] += c[1]
    acc[2] += 1


def build_pack(work: Path) -> Path:
    """The tiny DeepSeek-V4 checkpoint split at TP=1 under ``work`` (reused when present)."""
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4
    from shardsmith.writer.split import split_checkpoint

    pack = work / "tp1"
    if not (pack / "manifest.json").exists() and not pack.exists():
        split_checkpoint(tiny_deepseek_v4(work / "src"), pack, world_size=1)
    return pack


def compare_run(ref: str, argv: list[str]) -> list[dict]:
    """This script's rows for ``shardsmith/`` as of git ``ref`` (extracted with ``git archive``)."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", ref, "shardsmith"], cwd=root, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "PYTHONPATH": tmp}
        subprocess.run([sys.executable, __file__, *argv, "--rows-out", str(out)], env=env, check=True)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "v4-core-ops")
    p.add_argument("--batches", default="1,4,8", help="rows per step, comma-separated")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--no-time", action="store_true", help="skip the uncounted timing steps")
    p.add_argument("--compare", metavar="REF", help="also measure shardsmith/ at this git ref")
    p.add_argument("--rows-out", type=Path, help=argparse.SUPPRESS)  # the --compare child's output
    a = p.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in a.batches.split(",")]
    rows = measure(build_pack(a.work), batches, a.steps, not a.no_time)
    if a.rows_out:
        a.rows_out.write_text(json.dumps(rows))
        return
    argv = ["--work", str(a.work), "--batches", a.batches, "--steps", str(a.steps)] + (["--no-time"] if a.no_time else [])
    before = compare_run(a.compare, argv) if a.compare else None
    old = {(r["B"], r["kind"]): r for r in before or []}
    print(f"{'B':>2} {'kind':<8} {'layers':>6} {'aten ops':>18} {'torch calls':>18} {'eager us/step':>20}")
    for r in rows:
        o = old.get((r["B"], r["kind"]), {})

        def pair(key: str) -> str:
            now = r.get(key)
            if now is None:
                return "-"
            return f"{o[key]:>8} -> {now:<8}" if o.get(key) is not None else f"{now}"
        print(f"{r['B']:>2} {r['kind']:<8} {r['layers']:>6} {pair('aten_ops'):>18} {pair('torch_calls'):>18} "
              f"{pair('eager_us_per_step'):>20}")
    from _results import save_results

    extra = {"note": "per layer per step (token row: the whole step's eager work, all layers); tiny V4, bf16, "
                     "CPU, 1 thread", "steps": a.steps, "torch": torch.__version__}
    if before is not None:
        extra["compare"] = {"ref": a.compare, "rows": before}
    save_results("v4_core_ops", rows, extra=extra)


if __name__ == "__main__":
    main()
