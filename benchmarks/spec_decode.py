"""Speculative decoding with n-gram drafts against plain decoding, side by side, on one pack.

One greedy sequence through the real :class:`~shardsmith.runtime.engine.scheduler.Scheduler` (rank
0, world size 1) on a text-editing prompt (rewrite a given paragraph: the answer repeats its input,
where prompt lookup pays), ``--tokens`` generated, timed from the first token to the last, for
each ``--k`` and without speculation; the same tokens either way are checked. ``verify_step_ms``:
a verify chunk of ``k + 1`` tokens; ``decode_step_ms``: a one-token step (both medians).

Rows: ``family``, ``layers``, ``speculative``, ``num_speculative_tokens``, ``acceptance_rate``,
``tokens_per_step``, ``tokens_per_s``, ``tokens_per_s_without``, ``speedup``, ``verify_step_ms``,
``decode_step_ms``, ``same_tokens``, ``moe_backend``; saved as
``benchmarks/results/spec_decode-<date>-<host>.json``.

    python benchmarks/spec_decode.py PACK --dtype float32 --k 2 4 6
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
from shardsmith.runtime.engine.speculative import SpeculativeConfig  # noqa: E402
from shardsmith.runtime.serve.tokenizer import Codec  # noqa: E402

PARAGRAPH = ("The harbour market opens at dawn. Fishermen bring their catch to the stone quay, and traders from "
             "the valley arrive with cheese, wool and apples. By noon the stalls are empty and the gulls take what "
             "is left. In winter the market moves under the arches of the old customs house, where the wind cannot "
             "reach the baskets, and the bell of the clock tower marks the hours of trade.")


def run(engine: Engine, prompt: list[int], tokens: int, cfg: SpeculativeConfig | None, sync) -> dict:
    """Tokens, seconds from the first token to the last, step times by kind, and the draft counters."""
    sched = Scheduler(engine, prefill_chunk=4096, decode_prompt_tokens=0, overlap=False, prefix_caching=False,
                      speculative=cfg)
    seq = Sequence(prompt, SamplingParams(max_tokens=tokens, stop_token_ids=()))
    sched.admit(seq)
    out, steps, first = [], {"verify": [], "decode": []}, None
    while sched.running:
        sync()
        t0 = time.perf_counter()
        before = sched.spec.steps
        got = sched.step()
        sync()
        dt = time.perf_counter() - t0
        if first is None and got:
            first = time.perf_counter()
        elif got:
            steps["verify" if sched.spec.steps > before else "decode"].append(dt * 1e3)
        out += [o.token_id for _, o in got]
    end = time.perf_counter()
    return {"tokens": out, "seconds": end - first, "steps": steps, "spec": sched.spec}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from _results import save_results

    codec = Codec(a.pack)
    prompt = codec.encode(f"Rewrite this paragraph, word for word:\n\n{PARAGRAPH}\n\nRewritten:\n")
    engine = Engine.load(a.pack, rank=0, world_size=1, device=a.device, dtype=getattr(torch, a.dtype),
                         max_seq_len=len(prompt) + a.tokens + 32, max_num_seqs=1)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    run(engine, prompt, 8, None, sync)  # warm
    base = [run(engine, prompt, a.tokens, None, sync) for _ in range(a.repeat)]
    plain_s = statistics.median(b["seconds"] for b in base)
    decode_ms = statistics.median(t for b in base for t in b["steps"]["decode"])
    rows = []
    for k in a.k:
        runs = [run(engine, prompt, a.tokens, SpeculativeConfig(k=k), sync) for _ in range(a.repeat)]
        s, st = statistics.median(r["seconds"] for r in runs), runs[-1]["spec"]
        verify = [t for r in runs for t in r["steps"]["verify"]]
        rows.append({"family": engine.family.name, "layers": int(engine.config.get("num_hidden_layers", 0)),
                     "speculative": "ngram", "num_speculative_tokens": k,
                     "acceptance_rate": round(st.acceptance_rate, 4),
                     "tokens_per_step": round(st.emitted / st.steps, 3) if st.steps else 0.0,
                     "tokens_per_s": round((a.tokens - 1) / s, 2), "tokens_per_s_without": round((a.tokens - 1) / plain_s, 2),
                     "speedup": round(plain_s / s, 3), "verify_step_ms": round(statistics.median(verify), 3) if verify else None,
                     "decode_step_ms": round(decode_ms, 3), "same_tokens": runs[0]["tokens"] == base[0]["tokens"],
                     "moe_backend": "resident"})
    print(f"{'k':>3} {'accept':>7} {'tok/step':>9} {'tok/s':>8} {'without':>8} {'speedup':>8} {'verify ms':>10} "
          f"{'decode ms':>10} {'same':>5}")
    for r in rows:
        print(f"{r['num_speculative_tokens']:>3} {r['acceptance_rate']:>7.3f} {r['tokens_per_step']:>9.2f} "
              f"{r['tokens_per_s']:>8.1f} {r['tokens_per_s_without']:>8.1f} {r['speedup']:>8.2f} "
              f"{r['verify_step_ms'] or 0:>10.2f} {r['decode_step_ms']:>10.2f} {str(r['same_tokens']):>5}")
    name = engine.device.type if engine.device.type != "cuda" else torch.cuda.get_device_name()
    save_results("spec_decode", rows, extra={"pack": a.pack.name, "device": name, "dtype": a.dtype,
                                              "prompt_tokens": len(prompt), "tokens": a.tokens}, path=a.out)


if __name__ == "__main__":
    main()
