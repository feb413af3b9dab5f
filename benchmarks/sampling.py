"""What honouring the sampling fields costs per decode step, side by side with greedy, on one pack.

B sequences run in one :class:`~shardsmith.runtime.engine.scheduler.Scheduler` (rank 0, world size
1) and the steady-state decode step is timed (model step, then each row's choice), in one run per
configuration:

- ``greedy``: temperature 0, nothing else (the serving benchmarks' case);
- ``sampled``: temperature 0.8, ``top_k`` 50, ``min_p`` 0.05, a seed per sequence;
- ``all``: ``sampled`` plus presence 0.5, frequency 0.5 and repetition 1.1 penalties and a
  64-entry ``logit_bias`` (the per-slot token counts on the device, updated every step).

Rows: ``batch``, ``params``, ``step_ms`` (median over ``--steps`` steps of the median of
``--repeat`` runs), ``ratio_to_greedy``. Saved as ``results/sampling-<date>-<host>.json``.

Usage::

    python benchmarks/sampling.py PACK [--device cpu|cuda] [--dtype bfloat16] [--batch 1 8] [--steps 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardsmith.runtime.engine.engine import Engine, SamplingParams  # noqa: E402
from shardsmith.runtime.engine.scheduler import Scheduler, Sequence  # noqa: E402

PROMPT_TOKENS = 32


def configs(vocab: int, max_tokens: int, seed: int) -> dict[str, SamplingParams]:
    bias = tuple((t, 5.0 if t % 2 else -5.0) for t in range(7, vocab, max(1, vocab // 64)))[:64]
    sampled = dict(max_tokens=max_tokens, temperature=0.8, top_k=50, min_p=0.05, seed=seed)
    return {"greedy": SamplingParams(max_tokens=max_tokens),
            "sampled": SamplingParams(**sampled),
            "all": SamplingParams(**sampled, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                                  logit_bias=bias)}


def step_ms(engine: Engine, params: list[SamplingParams], steps: int) -> float:
    """Median milliseconds of ``steps`` steady-state steps with one sequence per ``params`` entry."""
    sched = Scheduler(engine, prefill_chunk=4096, decode_prompt_tokens=0, overlap=False)
    gen = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(0, engine.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist(), p) for p in params]
    for s in seqs:
        sched.admit(s)
    while any(s.prefilled < len(s.prompt_ids) for s in seqs) or sched.last_batch < len(seqs):
        sched.step()
    times = []
    for _ in range(steps):
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sched.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    for s in list(sched.running):
        sched.abort(s)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pack", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    max_tokens = 2 * (a.steps + 8)
    engine = Engine.load(a.pack, rank=0, world_size=1, device=a.device, dtype=dtype,
                         max_seq_len=PROMPT_TOKENS + max_tokens + 8, max_num_seqs=max(a.batch))
    rows = []
    print(f"{'batch':>5} {'params':>8} {'step_ms':>9} {'ratio_to_greedy':>16}")
    for b in a.batch:
        base = None
        for name in ("greedy", "sampled", "all"):
            runs = [step_ms(engine, [configs(engine.vocab_size, max_tokens, seed)[name] for seed in range(b)], a.steps)
                    for _ in range(a.repeat)]
            ms = statistics.median(runs)
            base = base if base is not None else ms
            rows.append({"batch": b, "params": name, "step_ms": round(ms, 4), "ratio_to_greedy": round(ms / base, 4)})
            print(f"{b:>5} {name:>8} {ms:>9.3f} {ms / base:>16.3f}")
    if not a.no_save:
        from _results import save_results

        save_results("sampling", rows, extra={"pack": str(a.pack), "device": a.device, "dtype": a.dtype,
                                              "vocab": engine.vocab_size, "torch": torch.__version__,
                                              "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None})
    engine.shutdown()


if __name__ == "__main__":
    main()
