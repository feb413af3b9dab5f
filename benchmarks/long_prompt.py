"""Long prompts through the real ``serve`` path: time to first token and decode speed at the context,
for several ``serve`` configurations side by side (by default the prefill chunk's default against
``--prefill-chunk 2048``).

Each configuration starts ``shardsmith serve PACK`` (``serve_concurrency.start_server``), then for
every ``--prompt`` length sends one streaming ``/v1/completions`` request whose prompt is that many
random token ids (a first token of its own each time, so no prompt reuses another's slot) with
``--decode-tokens`` tokens to generate (``ignore_eos``), alone on the server, then the same request
again, and reads the server's ``/metrics`` histograms before and after each (the server's clock):

- ``ttft_s``: the first request's arrival to its first token (the prompt's prefill and one token);
  ``prefill_tokens_per_s``: ``prompt_tokens / ttft_s``;
- ``decode_step_ms``: the second request's mean gap between tokens (its prompt resumed from the kept
  prefix; the decode pieces of the context's length bucket built), ``decode_tokens_per_s_at_context``
  its inverse; ``decode_step_ms_first_request``: the first request's, which includes building the
  decode pieces of a length bucket the server had not run yet;
- ``ratio_to_first``: the first configuration's ``ttft_s`` over this row's (> 1: faster).

Rows go to ``benchmarks/results/long_prompt-<YYYYMMDD>-<host>.json`` (``SHARDSMITH_HOST``) or ``--out``,
with the fields of the long-prompt issue's table (``device``, ``tp``, ``layers``,
``experts_per_layer``, ``prompt_tokens``, ``ttft_s``, ``prefill_tokens_per_s``,
``decode_tokens_per_s_at_context``, ``moe_backend``) and ``config``, ``serve_args``.

Usage::

    python benchmarks/long_prompt.py PACK [--device cuda] [--dtype bfloat16] [--prompt 1024 8192 32768]
        [--decode-tokens 64] [--config default=] [--config chunk2k=--prefill-chunk 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import save_results  # noqa: E402
from serve_concurrency import start_server, stop_server, stream_urllib  # noqa: E402


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return r.read().decode()


def gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^shardsmith_{name} ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def histograms(url: str) -> dict[str, float]:
    """``/metrics``' time-to-first-token and inter-token-latency histograms' sums and counts."""
    text = metrics(url)
    return {f"{h}_{part}": gauge(text, f"{h}_seconds_{part}") or 0.0
            for h in ("time_to_first_token", "inter_token_latency") for part in ("sum", "count")}


def _timed(url: str, body: dict) -> tuple[dict[str, float], int]:
    """One streaming request; the change in :func:`histograms` over it, and its completion tokens."""
    before = histograms(url)
    _, _, completion = stream_urllib(url, body, None)
    after = histograms(url)
    return {k: after[k] - before[k] for k in after}, completion


def _step_ms(d: dict[str, float]) -> float | None:
    n = d["inter_token_latency_count"]
    return 1e3 * d["inter_token_latency_sum"] / n if n else None


def one_prompt(url: str, length: int, vocab: int, decode: int, seed: int) -> dict:
    """One streaming request of ``length`` random token ids (its time to first token, and its mean
    decode step, which includes building the decode pieces of a length bucket the server had not run
    yet), then the same request again: its prompt resumed from the kept prefix, its mean decode step at
    the context with the pieces built. Times come from the server's own histograms (the server's clock: a
    stream of random ids holds back text that is not whole UTF-8 yet, so the client's first chunk can come
    after many tokens)."""
    rng = random.Random(seed)
    prompt = [3 + (seed % (vocab - 3))] + [rng.randrange(3, vocab) for _ in range(length - 1)]
    body = {"model": "bench", "prompt": prompt, "max_tokens": decode, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    first, completion = _timed(url, body)
    again, _ = _timed(url, body)
    ttft = first["time_to_first_token_sum"] / max(1.0, first["time_to_first_token_count"])
    step_ms, first_ms = _step_ms(again), _step_ms(first)
    return {"prompt_tokens": length, "completion_tokens": completion,
            "ttft_s": round(ttft, 4), "prefill_tokens_per_s": round(length / ttft, 1),
            "decode_step_ms": None if step_ms is None else round(step_ms, 3),
            "decode_step_ms_first_request": None if first_ms is None else round(first_ms, 3),
            "decode_tokens_per_s_at_context": None if not step_ms else round(1e3 / step_ms, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack", type=Path)
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=1)
    ap.add_argument("--config", action="append", default=None, metavar="NAME=SERVE ARGS",
                    help="a serve configuration (repeatable), side by side in this order; default: "
                         "'default=' and 'chunk2k=--prefill-chunk 2048'")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    configs = [c.split("=", 1) for c in a.config or ["default=", "chunk2k=--prefill-chunk 2048"]]
    if bad := [c for c in configs if len(c) != 2]:
        raise SystemExit(f"--config takes NAME=SERVE ARGS: {bad}")
    cfg = json.loads((a.pack / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    if (a.pack / "tokenizer.json").is_file():  # the server takes ids its tokenizer knows: a test pack's is smaller
        from tokenizers import Tokenizer

        vocab = min(vocab, Tokenizer.from_file(str(a.pack / "tokenizer.json")).get_vocab_size(with_added_tokens=True))
    layers = int(cfg.get("num_hidden_layers") or 0)
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    context = max(a.prompt) + a.decode_tokens + 16
    device_name = "cpu"
    if a.device == "cuda":
        import torch

        device_name = torch.cuda.get_device_name(0)
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    rows: list[dict] = []
    seed = 0
    for name, args in configs:
        extra = ["--max-model-len", str(context), *args.split()]
        proc, url = start_server(a.pack, device=a.device, dtype=a.dtype, max_num_seqs=a.max_num_seqs, extra=extra,
                                 log=out_dir / f"long-prompt-serve-{name}.log")
        try:
            for length in a.prompt:
                seed += 1
                row = one_prompt(url, length, vocab, a.decode_tokens, seed)
                first = next((r for r in rows if r["prompt_tokens"] == row["prompt_tokens"]), None)
                offloaded = "shardsmith_expert_host_bytes" in metrics(url)  # only an offloading engine has it
                row = {"config": name, "serve_args": " ".join(extra), "device": device_name, "tp": 1,
                       "layers": layers, "experts_per_layer": experts,
                       "moe_backend": "offloaded" if offloaded else "resident", **row,
                       "ratio_to_first": round(first["ttft_s"] / row["ttft_s"], 3) if first else 1.0}
                rows.append(row)
                print(f"{name:>10} prompt {row['prompt_tokens']:>6}: ttft {row['ttft_s']:8.3f} s "
                      f"({row['prefill_tokens_per_s']:9.1f} tokens/s, x{row['ratio_to_first']}), decode step "
                      f"{row['decode_step_ms']} ms at the context", flush=True)
                save_results("long_prompt", rows, extra={"pack": a.pack.name}, path=a.out)
        finally:
            stop_server(proc)
    print(f"{'config':>10} {'prompt':>7} {'ttft s':>8} {'prefill tok/s':>14} {'vs first':>9} {'decode ms':>10} {'decode tok/s':>13}")
    for r in rows:
        print(f"{r['config']:>10} {r['prompt_tokens']:>7} {r['ttft_s']:>8} {r['prefill_tokens_per_s']:>14} "
              f"{r['ratio_to_first']:>9} {r['decode_step_ms']!s:>10} {r['decode_tokens_per_s_at_context']!s:>13}")


if __name__ == "__main__":
    main()
