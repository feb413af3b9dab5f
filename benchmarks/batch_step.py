"""One batched engine step at 1, 2, 4 and 8 rows, without the server: where a batch's time goes.

Loads a pack as ``shardsmith serve`` does (one rank, ``--max-num-seqs`` slots, the start-up
warm-up: captured decode buckets on CUDA), prefills ``--prompt`` random tokens into every slot, then
times ``--steps`` batched decode steps per row count B, each step as the serving loop runs it
(:meth:`Engine.decode` with the logits left on the device, then
:func:`~shardsmith.runtime.engine.sampling.choose_rows`, greedy, which brings one small tensor to
the host). On CUDA one more set of steps per B runs under ``torch.profiler`` and the device time
is split by kernel: the routed-expert kernels (``fused_experts``' gate_up, down and combine), the
FP8 linear, and everything else. Routing follows the weights (random weights: near-uniform), so B
rows touch up to B x top-k experts per layer.

Rows: ``batch_rows``, ``ms_per_step`` (median), ``tokens_per_s`` (B / step), ``tokens_per_s_vs_1``
(issue 14's target through the server: 8 streams >= 4x one), and with the profile
``gpu_ms_per_step``, ``expert_kernel_ms_per_step``, ``fp8_linear_ms_per_step``,
``other_gpu_ms_per_step``, ``gpu_ops_per_step``; the top kernels per B go to ``--profile DIR``.

Usage::

    python benchmarks/batch_step.py PACK [--device cuda] [--dtype bfloat16] [--rows 1 2 4 8]
        [--cache-gb G (offloaded experts, --moe-backend gpu)] [--profile DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardsmith.runtime.engine.engine import Engine  # noqa: E402
from shardsmith.runtime.engine.sampling import SamplingParams, choose_rows  # noqa: E402

EXPERT_KERNELS = ("_gate_up_kernel", "_down_kernel", "_combine_kernel")


def kernel_kind(name: str) -> str:
    """The kind a device kernel's time counts under: ``expert_kernel``, ``fp8_linear`` or ``other_gpu``."""
    if any(k in name for k in EXPERT_KERNELS):
        return "expert_kernel"
    if "fp8" in name.lower():
        return "fp8_linear"
    return "other_gpu"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pack", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens prefilled into each slot")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per row count")
    ap.add_argument("--cache-gb", type=float, default=None, help="offload the experts with this GPU cache (GiB)")
    ap.add_argument("--label", default="resident")
    ap.add_argument("--profile", type=Path, default=None, help="write each B's top kernels here (CUDA)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default benchmarks/results/)")
    ap.add_argument("--append", action="store_true", help="add the rows to --out's existing rows")
    a = ap.parse_args()
    offload = None
    if a.cache_gb is not None:
        from shardsmith.runtime.offload import OffloadConfig

        offload = OffloadConfig(backend="gpu", cache_bytes=int(a.cache_gb * 2**30))
    slots = max(a.rows)
    engine = Engine.load(a.pack, rank=0, world_size=1, device=a.device, dtype=a.dtype, max_num_seqs=slots,
                         offload=offload)
    engine.warmup()
    cuda = engine.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    gen = torch.Generator().manual_seed(0)
    vocab = int(engine.config.get("vocab_size", 512))
    pos = []
    for s in range(slots):
        ids = torch.randint(0, vocab, (a.prompt,), generator=gen).tolist()
        engine.prefill(s, ids, 0, on_device=True)
        pos.append(a.prompt)
    params = [SamplingParams(max_tokens=1 << 30)] * slots
    last = [0] * slots

    def step(B: int) -> None:
        logits = engine.decode(last[:B], pos[:B], list(range(B)), on_device=True)
        for b, c in enumerate(choose_rows(logits, params[:B], [None] * B)):
            last[b], pos[b] = c.token_id, pos[b] + 1

    rows = []
    for B in a.rows:
        for _ in range(3):
            step(B)
        times = []
        for _ in range(a.steps):
            sync()
            t0 = time.perf_counter()
            step(B)
            times.append(time.perf_counter() - t0)
        row = {"label": a.label, "pack": a.pack.name, "device": str(engine.device), "dtype": a.dtype,
               "batch_rows": B, "ms_per_step": 1e3 * statistics.median(times)}
        row["tokens_per_s"] = B / (row["ms_per_step"] / 1e3)
        if cuda:
            row |= profile_rows(step, B, a.steps, sync, a.profile, a.label)
        rows.append(row)
        print(f"B={B}: {row['ms_per_step']:.3f} ms/step, {row['tokens_per_s']:.0f} tok/s", flush=True)
    base = next((r for r in rows if r["batch_rows"] == 1), None)
    cols = ("gpu_ms_per_step", "expert_kernel_ms_per_step", "fp8_linear_ms_per_step", "other_gpu_ms_per_step",
            "gpu_ops_per_step")
    print(f"{'rows':>4} {'ms/step':>8} {'tok/s':>8} {'vs 1':>6} " + " ".join(f"{c.removesuffix('_per_step'):>15}" for c in cols))
    for r in rows:
        if base:
            r["tokens_per_s_vs_1"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['batch_rows']:>4} {r['ms_per_step']:>8.3f} {r['tokens_per_s']:>8.0f} {r.get('tokens_per_s_vs_1', 0):>6.2f} "
              + " ".join(f"{r.get(c, 0):>15.3f}" for c in cols))
    from _results import save_results

    save_results("batch_step", rows, path=a.out, append=a.append)


def profile_rows(step, B: int, steps: int, sync, out: Path | None, label: str) -> dict:
    """Device time per step by kernel kind over ``steps`` steps of ``B`` rows (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    sync()
    prof.start()
    for _ in range(steps):
        step(B)
    sync()
    prof.stop()
    device = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    kinds = {"expert_kernel": 0.0, "fp8_linear": 0.0, "other_gpu": 0.0}
    by: dict[str, list[float]] = {}
    for e in device:
        kinds[kernel_kind(e.name)] += e.device_time_total
        by.setdefault(e.name[:90], []).append(e.device_time_total)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:25]
        (out / f"batch_step-{label.replace(' ', '_')}-B{B}.txt").write_text("\n".join(
            f"{sum(v) / 1e3 / steps:9.3f} ms/step {len(v) / steps:7.1f} calls/step  {k}" for k, v in top) + "\n")
    res = {f"{k}_ms_per_step": v / 1e3 / steps for k, v in kinds.items()}
    return res | {"gpu_ms_per_step": sum(kinds.values()) / 1e3 / steps, "gpu_ops_per_step": len(device) / steps}


if __name__ == "__main__":
    main()
