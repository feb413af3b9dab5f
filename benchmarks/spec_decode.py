"""Speculative decoding against plain decoding, side by side, on one pack; and what a verify step costs.

One greedy sequence through the real :class:`~shardsmith.runtime.engine.scheduler.Scheduler` (rank
0, world size 1) on a text-editing prompt (rewrite a given paragraph: the answer repeats its input,
where prompt lookup pays), ``--tokens`` generated, timed from the first token to the last, for
each ``--k`` and without speculation; the same tokens either way are checked. ``verify_step_ms``:
a step that verified a draft (``verify``: a decode step with the ``k + 1`` rows of the sequence's
verify run where the model takes them, else a chunk of ``k + 1`` tokens); ``decode_step_ms``: a
one-token step (both medians).

Rows: ``family``, ``layers``, ``speculative``, ``num_speculative_tokens``, ``acceptance_rate``,
``tokens_per_step``, ``tokens_per_s``, ``tokens_per_s_without``, ``speedup``, ``verify_step_ms``,
``decode_step_ms``, ``same_tokens``, ``moe_backend``; saved as
``benchmarks/results/spec_decode-<date>-<host>.json``.

``--cost`` (any family, no tokenizer needed: a random prompt of ``--prompt-tokens``): what one
step costs by kind, medians over ``--repeat`` x 8 steps after the prompt: ``decode_step_ms`` (the
engine's batched one-token step: graphed on CUDA), ``verify_step_ms`` at each ``k`` (a decode step of
the ``k + 1`` rows of a verify run where the model takes them, and a ``k + 1``-token speculative
chunk, side by side (``--verify``), then the state put back to its first token: the whole rollback a
rejected draft costs on DeepSeek-V4), ``draft_ms`` (``--speculative mtp``: the MTP layer's ``k`` chained drafts), and
the single-stream tokens/s those costs give at 80% and 90% per-token acceptance: a step emits
``(1 - a^(k+1)) / (1 - a)`` tokens on average (random weights accept nothing, so the speed-up is
modelled from the measured step). Rows add ``modeled_tokens_per_s_at_80``, ``..._at_90`` and
``modeled_speedup_at_80``.

    python benchmarks/spec_decode.py PACK --dtype float32 --k 2 4 6
    python benchmarks/spec_decode.py PACK --cost --k 1 2 3 --speculative mtp --device cuda
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


def run(engine: Engine, prompt: list[int], tokens: int, cfg: SpeculativeConfig | None, sync,
        verify_runs: bool = True) -> dict:
    """Tokens, seconds from the first token to the last, step times by kind, and the draft counters."""
    sched = Scheduler(engine, prefill_chunk=4096, decode_prompt_tokens=0, overlap=False, prefix_caching=False,
                      speculative=cfg, verify_runs=verify_runs)
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


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify step emits on average when each draft token is accepted with probability ``a``
    (independently, up to the first rejection), plus the verify's own choice."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def cost_rows(engine: Engine, a: argparse.Namespace, sync) -> list[dict]:
    """``--cost``: step costs by kind and the modelled single-stream speed (module docstring)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.vocab_size, (a.prompt_tokens,), generator=g).tolist()
    mtp = a.speculative == "mtp"

    def median_ms(fn, n: int = 8) -> float:
        times = []
        for _ in range(a.repeat):
            engine.release(0)
            engine.prefill(0, prompt, 0)
            pos = len(prompt)
            for _ in range(n):
                sync()
                t0 = time.perf_counter()
                pos = fn(pos)
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def decode(pos: int) -> int:
        engine.decode([7], [pos], [0], on_device=True)
        return pos + 1

    hows = [how for how in a.verify if how == "chunk" or engine.verify_runs]
    if "run" in hows:  # the verify rides in the decode step as k + 1 rows of the slot
        engine.reserve_rows(1 + max(a.k))
    for _ in range(2):  # warm: compiles, captures
        median_ms(decode, 2)
    decode_ms = median_ms(decode)
    rows = []
    for k, how in [(k, how) for k in a.k for how in hows]:
        runs = how == "run"

        def verify(pos: int, k=k, runs=runs) -> int:
            if runs:
                engine.decode([7] * (k + 1), list(range(pos, pos + k + 1)), [0] * (k + 1), on_device=True)
            else:
                engine.prefill(0, [7] * (k + 1), pos, last_only=False, on_device=True, speculative=True)
            engine.restore(0, pos + 1)  # everything but the pending token rejected: the rollback is whole
            return pos + 1

        def draft(pos: int, k=k) -> int:
            engine.draft(0, 7, pos, k)
            engine.decode([7], [pos], [0], on_device=True)  # moves on, so every draft starts at a new position
            return pos + 1

        median_ms(verify, 2)
        verify_ms = median_ms(verify)
        draft_ms = max(0.0, median_ms(draft) - decode_ms) if mtp else 0.0
        step = verify_ms + draft_ms
        at = {p: expected_tokens(p / 100, k) / step * 1e3 for p in (80, 90)}
        rows.append({"family": engine.family.name, "layers": int(engine.config.get("num_hidden_layers", 0)),
                     "speculative": a.speculative, "num_speculative_tokens": k, "prompt_tokens": len(prompt),
                     "verify": "run in the decode step" if runs else "chunk",
                     "decode_step_ms": round(decode_ms, 3), "verify_step_ms": round(verify_ms, 3),
                     "draft_ms": round(draft_ms, 3), "verify_over_decode": round(verify_ms / decode_ms, 3),
                     "tokens_per_s_without": round(1e3 / decode_ms, 2),
                     "modeled_tokens_per_s_at_80": round(at[80], 2), "modeled_tokens_per_s_at_90": round(at[90], 2),
                     "modeled_speedup_at_80": round(at[80] * decode_ms / 1e3, 3), "moe_backend": "resident"})
    print(f"{'k':>3} {'verify':>6} {'decode ms':>10} {'verify ms':>10} {'draft ms':>9} {'verify/decode':>14} "
          f"{'tok/s':>8} {'@80%':>8} {'@90%':>8} {'x@80%':>6}")
    for r in rows:
        print(f"{r['num_speculative_tokens']:>3} {r['verify'].split()[0]:>6} {r['decode_step_ms']:>10.2f} "
              f"{r['verify_step_ms']:>10.2f} "
              f"{r['draft_ms']:>9.2f} {r['verify_over_decode']:>14.2f} {r['tokens_per_s_without']:>8.1f} "
              f"{r['modeled_tokens_per_s_at_80']:>8.1f} {r['modeled_tokens_per_s_at_90']:>8.1f} "
              f"{r['modeled_speedup_at_80']:>6.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--from-checkpoint", action="store_true", help="PACK is a checkpoint (split in memory)")
    ap.add_argument("--cost", action="store_true", help="step costs and the modelled speed (module docstring)")
    ap.add_argument("--speculative", choices=("ngram", "mtp"), default="ngram",
                    help="--cost: the draft source (mtp loads the MTP layer and times its drafts)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="--cost: random prompt length")
    ap.add_argument("--verify", nargs="+", choices=("run", "chunk"), default=["run", "chunk"],
                    help="how drafts are checked, side by side: rows of the batched step (where the model takes "
                         "verify runs) or a chunk per sequence")
    a = ap.parse_args()
    from _results import save_results

    mtp = int(a.cost and a.speculative == "mtp")
    if a.cost:
        engine = Engine.load(a.pack, rank=0, world_size=1, device=a.device, dtype=getattr(torch, a.dtype),
                             from_checkpoint=a.from_checkpoint, max_seq_len=a.prompt_tokens + 64 * max(a.k) + 64,
                             max_num_seqs=1, mtp_layers=mtp)
        sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
        rows = cost_rows(engine, a, sync)
        name = engine.device.type if engine.device.type != "cuda" else torch.cuda.get_device_name()
        save_results("spec_decode", rows, extra={"pack": a.pack.name, "device": name, "dtype": a.dtype,
                                                  "mode": "cost"}, path=a.out, append=a.out is not None)
        return
    codec = Codec(a.pack)
    prompt = codec.encode(f"Rewrite this paragraph, word for word:\n\n{PARAGRAPH}\n\nRewritten:\n")
    engine = Engine.load(a.pack, rank=0, world_size=1, device=a.device, dtype=getattr(torch, a.dtype),
                         from_checkpoint=a.from_checkpoint, max_seq_len=len(prompt) + a.tokens + 32, max_num_seqs=1)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    run(engine, prompt, 8, None, sync)  # warm
    base = [run(engine, prompt, a.tokens, None, sync) for _ in range(a.repeat)]
    plain_s = statistics.median(b["seconds"] for b in base)
    decode_ms = statistics.median(t for b in base for t in b["steps"]["decode"])
    rows = []
    for k, how in [(k, how) for k in a.k for how in a.verify if how == "chunk" or engine.verify_runs]:
        runs = [run(engine, prompt, a.tokens, SpeculativeConfig(k=k), sync, verify_runs=how == "run")
                for _ in range(a.repeat)]
        s, st = statistics.median(r["seconds"] for r in runs), runs[-1]["spec"]
        verify = [t for r in runs for t in r["steps"]["verify"]]
        rows.append({"family": engine.family.name, "layers": int(engine.config.get("num_hidden_layers", 0)),
                     "speculative": "ngram", "num_speculative_tokens": k,
                     "verify": "run in the decode step" if how == "run" else "chunk",
                     "acceptance_rate": round(st.acceptance_rate, 4),
                     "tokens_per_step": round(st.emitted / st.steps, 3) if st.steps else 0.0,
                     "tokens_per_s": round((a.tokens - 1) / s, 2), "tokens_per_s_without": round((a.tokens - 1) / plain_s, 2),
                     "speedup": round(plain_s / s, 3), "verify_step_ms": round(statistics.median(verify), 3) if verify else None,
                     "decode_step_ms": round(decode_ms, 3), "same_tokens": runs[0]["tokens"] == base[0]["tokens"],
                     "moe_backend": "resident"})
    print(f"{'k':>3} {'verify':>6} {'accept':>7} {'tok/step':>9} {'tok/s':>8} {'without':>8} {'speedup':>8} "
          f"{'verify ms':>10} {'decode ms':>10} {'same':>5}")
    for r in rows:
        print(f"{r['num_speculative_tokens']:>3} {r['verify'].split()[0]:>6} {r['acceptance_rate']:>7.3f} "
              f"{r['tokens_per_step']:>9.2f} "
              f"{r['tokens_per_s']:>8.1f} {r['tokens_per_s_without']:>8.1f} {r['speedup']:>8.2f} "
              f"{r['verify_step_ms'] or 0:>10.2f} {r['decode_step_ms']:>10.2f} {str(r['same_tokens']):>5}")
    name = engine.device.type if engine.device.type != "cuda" else torch.cuda.get_device_name()
    save_results("spec_decode", rows, extra={"pack": a.pack.name, "device": name, "dtype": a.dtype,
                                              "prompt_tokens": len(prompt), "tokens": a.tokens}, path=a.out)


if __name__ == "__main__":
    main()
