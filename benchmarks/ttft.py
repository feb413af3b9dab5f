"""Time to first token over new prompt lengths, and whether serving compiled anything (issue 14).

Starts ``shardsmith serve PACK`` (``serve_concurrency.start_server``) with empty Triton and
TorchInductor caches of its own (``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR`` under
``--cache``), waits for ready (the engine's warm-up included), counts the cache's files, then
sends one streaming ``/v1/completions`` request per prompt length in ``--lengths`` (token-id
prompts, so the lengths are exact; one at a time, greedy, ``--tokens`` each) and counts again.
A compile during serving writes new files: ``compiled_while_serving`` should be 0 and every
length's TTFT should be a step's time, not seconds. The ready line's warm-up seconds are
reported too.

Usage::

    python benchmarks/ttft.py PACK [--device cuda] [--dtype bfloat16] [--lengths 3 17 29 ...]
        [--out FILE] [-- extra serve options, e.g. --moe-backend gpu --expert-cache-gb 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_concurrency import start_server, stop_server, stream_urllib  # noqa: E402

LENGTHS = (3, 17, 29, 61, 100, 257, 400, 700)  # 700 > the 512-token prefill chunk: two chunks


def cache_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack", type=Path)
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--tokens", type=int, default=4, help="tokens generated per request")
    ap.add_argument("--vocab", type=int, default=500, help="prompt token ids are drawn below this")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/ttft-cache"), help="fresh compile caches here")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    extra = argv[cut + 1:]
    shutil.rmtree(a.cache, ignore_errors=True)
    os.environ["TRITON_CACHE_DIR"] = str(a.cache / "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(a.cache / "inductor")
    log = Path(os.environ.get("OUT", "/tmp")) / "ttft-serve.log"
    t0 = time.perf_counter()
    # every bucket before ready: a bucket built while idle would count as a compile while serving
    proc, url = start_server(a.pack, device=a.device, dtype=a.dtype, max_num_seqs=8, extra=["--no-defer-buckets", *extra],
                             log=log)
    ready_s = time.perf_counter() - t0
    rows = []
    try:
        time.sleep(1.0)  # let rank 0's ready line reach the log
        ready_line = next((ln for ln in log.read_text().splitlines() if "ready: every rank" in ln), "")
        warm = re.search(r"warm-up ([\d.]+) s: (\d+) kernel launches", ready_line)
        before = cache_files(a.cache)
        for i, n in enumerate(a.lengths):
            prompt = [(7919 * (i + 1) * (j + 3)) % (a.vocab - 2) + 1 for j in range(n)]
            body = {"model": "bench", "prompt": prompt, "max_tokens": a.tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            files0 = cache_files(a.cache)
            sent = time.perf_counter()
            first, end, got = stream_urllib(url, body)
            rows.append({"prompt_tokens": n, "ttft_s": round(first - sent, 4), "total_s": round(end - sent, 4),
                         "completion_tokens": got, "new_cache_files": cache_files(a.cache) - files0})
            print(f"prompt {n:>5} tokens: TTFT {first - sent:7.3f} s, {got} tokens in {end - sent:.3f} s, "
                  f"new compile-cache files {rows[-1]['new_cache_files']}", flush=True)
        after = cache_files(a.cache)
    finally:
        stop_server(proc)
    result = {"benchmark": "ttft", "date": time.strftime("%Y-%m-%d"), "host": os.environ.get("SHARDSMITH_HOST"),
              "commit": os.environ.get("SHARDSMITH_COMMIT"), "pack": a.pack.name, "device": a.device,
              "dtype": a.dtype, "serve_args": " ".join(extra), "seconds_to_ready": round(ready_s, 2),
              "warmup_s": float(warm.group(1)) if warm else None,
              "warmup_kernel_launches": int(warm.group(2)) if warm else None,
              "cache_files_at_ready": before, "compiled_while_serving": after - before, "rows": rows}
    print(f"ready in {ready_s:.1f} s (warm-up {result['warmup_s']} s, {result['warmup_kernel_launches']} kernel "
          f"launches; {before} compile-cache files); compile-cache files added while serving: {after - before} "
          f"({'NO compile while serving' if after == before else 'COMPILED WHILE SERVING'}); "
          f"max TTFT {max(r['ttft_s'] for r in rows):.3f} s")
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
