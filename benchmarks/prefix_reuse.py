"""Time to first token of a conversation's next turn when its history is reused, side by side with
computing it again, at the engine level (token ids, so any pack works: random weights too).

One :class:`~shardsmith.runtime.engine.scheduler.Scheduler` per mode on one engine (rank 0, world
size 1): turn 1 is a ``--history``-token prompt answered with ``--answer`` greedy tokens; turn 2 is
that prompt, the answer and ``--added`` new tokens. With reuse the second turn resumes the first
turn's slot (its whole history: DeepSeek-V4 resumes only that); without, it computes every token.
TTFT: admission to the first token on the host, prefill chunks of ``--chunk`` tokens.

Rows: ``history_tokens``, ``added_tokens``, ``mode`` (``reuse`` / ``recompute``), ``reused_tokens``,
``ttft_s`` (median of ``--repeat``: the first run also compiles), ``ratio_to_recompute``, ``same_first_token``; saved as
``benchmarks/results/prefix_reuse-<date>-<host>.json``.

    python benchmarks/prefix_reuse.py PACK --device cuda --history 8192 --added 64
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


def run_turn(sched: Scheduler, prompt: list[int], max_tokens: int, sync) -> tuple[float, list[int], int]:
    """``(seconds to the first token, tokens, reused prompt tokens)`` of one greedy turn."""
    seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=()))
    sync()
    t0, first, tokens = time.perf_counter(), None, []
    sched.admit(seq)
    while sched.running:
        for _, out in sched.step():
            first = first if first is not None else time.perf_counter() - t0
            tokens.append(out.token_id)
    return first, tokens, seq.reused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--history", type=int, nargs="+", default=[1024])
    ap.add_argument("--added", type=int, default=64)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--from-checkpoint", action="store_true", help="PACK is a checkpoint (loaded as TP=1)")
    ap.add_argument("--warmup", action="store_true", help="the engine's warm-up first (else the repeats absorb compiles)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from _results import save_results

    longest = max(a.history) + a.answer + a.added + a.answer + 8
    engine = Engine.load(a.pack, rank=0, world_size=1, device=a.device, dtype=getattr(torch, a.dtype),
                         max_seq_len=longest, max_num_seqs=2, from_checkpoint=a.from_checkpoint)
    if a.warmup:
        engine.warmup()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for history in a.history:
        first = torch.randint(3, engine.vocab_size, (history,), generator=gen).tolist()
        added = torch.randint(3, engine.vocab_size, (a.added,), generator=gen).tolist()
        got = {}
        for mode in ("reuse", "recompute"):
            times, firsts, reused = [], [], 0
            for _ in range(a.repeat):
                sched = Scheduler(engine, prefill_chunk=a.chunk, decode_prompt_tokens=0, overlap=False,
                                  prefix_caching=mode == "reuse")
                _, answer, _ = run_turn(sched, first, a.answer, sync)
                # the history as a client resends it: the prompt, the answer, the new message
                ttft, tokens, reused = run_turn(sched, first + answer + added, a.answer, sync)
                times.append(ttft)
                firsts.append(tokens[0])
            got[mode] = (statistics.median(times), reused, firsts[0])
        for mode, (ttft, reused, tok) in got.items():
            rows.append({"history_tokens": history, "added_tokens": a.added, "mode": mode, "reused_tokens": reused,
                         "ttft_s": round(ttft, 5), "ratio_to_recompute": round(ttft / got["recompute"][0], 4),
                         "same_first_token": tok == got["recompute"][2]})
    print(f"{'history':>8} {'added':>6} {'mode':<10} {'reused':>7} {'ttft s':>9} {'ratio':>7} {'same':>5}")
    for r in rows:
        print(f"{r['history_tokens']:>8} {r['added_tokens']:>6} {r['mode']:<10} {r['reused_tokens']:>7} "
              f"{r['ttft_s']:>9.4f} {r['ratio_to_recompute']:>7.3f} {str(r['same_first_token']):>5}")
    name = engine.device.type if engine.device.type != "cuda" else torch.cuda.get_device_name()
    save_results("prefix_reuse", rows, extra={"pack": a.pack.name, "device": name, "dtype": a.dtype,
                                               "prefill_chunk_tokens": a.chunk, "answer_tokens": a.answer}, path=a.out)


if __name__ == "__main__":
    main()
