"""Concurrent streams through the HTTP server: aggregate and per-stream tokens/s, time to first token.

Starts ``shardsmith serve PACK`` (a real subprocess: one process per rank, continuous batching with
``--max-num-seqs``), waits for ``/health``, then for each concurrency C in ``--concurrency`` (default
1, 2, 4, 8) fires C streaming ``/v1/completions`` requests at once (greedy, ``--tokens`` each,
different prompts), ``--repeat`` times. Client: the ``openai`` package when installed, else
``urllib`` (standard library) reading the SSE stream. Rows per concurrency:

- ``aggregate_tokens_per_s``: tokens of all streams / (last stream's end - first request sent);
- ``per_stream_tokens_per_s``: mean over streams of (tokens - 1) / (end - first token);
- ``ttft_s``: mean time from sending a request to its first token (each stream's client is made
  before the clock starts); ``ttft_max_s``: the worst; ``server_ttft_s``: the server's own view
  (request arrival to first token, from ``/metrics``);
- ``aggregate_vs_1`` / ``per_stream_vs_1``: ratios to the C = 1 row (issue 14's target on the GPU:
  8 streams >= 4x the single-stream aggregate, per-stream >= 0.5x);
- where the time went, from the server's ``/metrics`` before and after each run: ``engine_step_ms``
  (mean engine step: prefill chunks, batched decode, token choice), ``step_output_ms`` (mean text
  side per step: detokenise, stop strings), ``mean_decode_rows`` and ``engine_busy_share``
  (engine step seconds over the run's wall seconds, first request sent to last stream's end; the
  rest is the server and the clients);
- with ``--step-trace FILE`` (the server's ``SHARDSMITH_STEP_TRACE``), the engine steps by kind: count
  and mean ms of steps that prefilled a prompt eagerly (``prefill_*``), fed prompt tokens through
  decode rows (``feeding_*``) or only decoded (``decode_*``), and the mean ms per step between steps
  (``gap_ms_per_step``), on the text side and handing events to the event loop.

Medians over ``--repeat``. Writes ``benchmarks/results/serve_concurrency-<YYYYMMDD>-<host>.json``
(``SHARDSMITH_HOST`` labels the host), or ``--out FILE``.

Usage::

    python benchmarks/serve_concurrency.py PACK [--device cpu|cuda] [--tokens 32] [--dtype float32]
        [--concurrency 1 2 4 8] [--label resident] [-- extra serve options, e.g. --moe-backend gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from shardsmith.runtime.serve.launch import free_ports

sys.path.insert(0, str(Path(__file__).resolve().parent))
PROMPTS = ["Once upon a time", "The history of the Roman empire", "def quicksort(items):", "My favourite recipe is",
           "In the beginning", "The weather today", "Dear friend, I am writing", "The capital of France is"]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server started by :func:`start_server` (its clean shutdown), then kill it after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_server(pack: Path, *, device: str, dtype: str, max_num_seqs: int, extra: list[str], log: Path,
                 trace: Path | None = None, cwd: Path | None = None):
    port, dist_port = free_ports(2)
    env = os.environ | {"PYTHONUNBUFFERED": "1"} | ({"SHARDSMITH_STEP_TRACE": str(trace)} if trace else {})
    cmd = [sys.executable, "-m", "shardsmith.cli", "serve", str(pack), "--port", str(port), "--dist-port",
           str(dist_port), "--device", device, "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
           "--served-model-name", "bench", *extra]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server not ready within 30 minutes")


def stream_urllib(url: str, body: dict, client: None, on_first=None) -> tuple[float, float, int]:
    """(first token time, end time, tokens) of one streaming completion read with urllib (no client
    object: ``client`` is None); ``on_first()``, when given, is called as the first token arrives."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    first, n = None, 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and first is None:
                first = time.perf_counter()
                if on_first is not None:
                    on_first()
    return first or time.perf_counter(), time.perf_counter(), n


def openai_client(url: str):
    """One stream's ``openai`` client, made before the clock starts (tens of ms each, serialised by the
    benchmark's GIL: inside the timing it added ~0.25 s to the 8-stream time to first token)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=3600)


def stream_openai(url: str, body: dict, client) -> tuple[float, float, int]:
    """The same with the ``openai`` client (``client``: :func:`openai_client`'s)."""
    first, n = None, 0
    for chunk in client.completions.create(stream=True, **body):
        if chunk.usage:
            n = chunk.usage.completion_tokens
        elif chunk.choices and first is None:
            first = time.perf_counter()
    return first or time.perf_counter(), time.perf_counter(), n


def run_concurrency(url: str, c: int, tokens: int, stream) -> dict:
    """C streams at once: their timings, and the row's numbers."""
    results: list = [None] * c
    go = threading.Barrier(c + 1)

    def one(i: int) -> None:
        # logprobs 0: a chunk per token even when its text is empty (random weights, a partial character)
        body = {"model": "bench", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0,
                "logprobs": 0, "stream_options": {"include_usage": True}}
        client = openai_client(url) if stream is stream_openai else None
        go.wait()
        t0 = time.perf_counter()
        try:
            results[i] = (t0, *stream(url, body if stream is stream_openai else body | {"stream": True}, client))
        except Exception as e:  # noqa: BLE001 - counted as an error in the row
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    go.wait()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, Exception)]
    ok = [r for r in results if not isinstance(r, Exception)]
    if not ok:
        raise SystemExit(f"every request failed at concurrency {c}: {errors[0]}")
    start, end = min(r[0] for r in ok), max(r[2] for r in ok)
    total = sum(r[3] for r in ok)
    per = [(r[3] - 1) / (r[2] - r[1]) for r in ok if r[3] > 1 and r[2] > r[1]]
    return {"wall_s": end - start, "aggregate_tokens_per_s": total / (end - start), "per_stream_tokens_per_s": statistics.mean(per) if per else 0.0,
            "ttft_s": statistics.mean(r[1] - r[0] for r in ok), "ttft_max_s": max(r[1] - r[0] for r in ok),
            "tokens": total, "errors": len(errors)}


STEP_SERIES = ("shardsmith_engine_step_seconds", "shardsmith_step_output_seconds", "shardsmith_decode_batch_size",
               "shardsmith_time_to_first_token_seconds")


def scrape(url: str) -> dict[str, float]:
    """The ``_sum`` and ``_count`` of the step histograms in the server's ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.removesuffix("_sum").removesuffix("_count") in STEP_SERIES and name.endswith(("_sum", "_count")):
            out[name] = float(value)
    return out


def step_split(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """Where a run's steps went: mean engine step and text side per step (ms), mean decode rows,
    and the share of the wall time the engine thread spent in steps."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("shardsmith_engine_step_seconds_count", 0.0)
    if not steps:
        return {}
    rows = d.get("shardsmith_decode_batch_size_count", 0.0)
    return {"steps": int(steps),
            "engine_step_ms": 1e3 * d["shardsmith_engine_step_seconds_sum"] / steps,
            "step_output_ms": 1e3 * d["shardsmith_step_output_seconds_sum"] / steps,
            "mean_decode_rows": d["shardsmith_decode_batch_size_sum"] / rows if rows else 0.0,
            "server_ttft_s": (d["shardsmith_time_to_first_token_seconds_sum"]
                              / max(1.0, d["shardsmith_time_to_first_token_seconds_count"])),
            "engine_busy_share": d["shardsmith_engine_step_seconds_sum"] / wall_s}


def trace_lines(path: Path, start: int, timeout: float = 10.0) -> list[dict]:
    """The server's step-trace lines from line ``start`` on, once the run's last step (nothing running
    or waiting) is written: the server writes its buffered lines when the batch goes idle."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(x) for x in path.read_text().splitlines()[start:]] if path.exists() else []
        if lines and lines[-1]["running"] == 0 and lines[-1]["waiting"] == 0 or time.monotonic() > deadline:
            return lines


def trace_split(lines: list[dict]) -> dict:
    """Where a run's engine steps went, by kind, from its step-trace lines (``SHARDSMITH_STEP_TRACE``):
    steps that prefilled a prompt eagerly, steps that fed prompt tokens through decode rows, and the
    rest (decode only); mean engine ms of each kind, their counts, and the mean ms per step between
    steps (``gap``), on the text side and handing events to the event loop (``emit``)."""
    if not lines:
        return {}
    kinds = {"prefill": [x for x in lines if x["prefill_tokens"]],
             "feeding": [x for x in lines if x["feeding_rows"] and not x["prefill_tokens"]],
             "decode": [x for x in lines if not x["feeding_rows"] and not x["prefill_tokens"]]}
    out = {}
    for kind, xs in kinds.items():
        out[f"{kind}_steps"] = len(xs)
        out[f"{kind}_step_ms"] = 1e3 * statistics.mean(x["engine_s"] for x in xs) if xs else 0.0
    for part in ("gap", "output", "emit"):
        out[f"{part}_ms_per_step"] = 1e3 * statistics.mean(x[f"{part}_s"] for x in lines[1:] or lines)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pack", type=Path)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per request")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--label", default="", help="a name for this configuration in the rows (resident, offload-25%%)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here instead of benchmarks/results/")
    ap.add_argument("--append", action="store_true", help="add the rows to --out's existing rows")
    ap.add_argument("--step-trace", type=Path, default=None,
                    help="have the server write a line per engine step here (SHARDSMITH_STEP_TRACE); rows then say "
                         "how long prefill, prompt-feeding and decode-only steps took")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    extra = argv[cut + 1:]  # after --: extra `shardsmith serve` options
    try:
        import openai  # noqa: F401

        stream, client = stream_openai, "openai"
    except ImportError:
        stream, client = stream_urllib, "urllib"
    tag = re.sub(r"[^A-Za-z0-9]+", "-", a.label).strip("-")
    log = Path(os.environ.get("OUT", "/tmp")) / f"serve_concurrency{'-' + tag if tag else ''}.log"
    load_before = os.getloadavg()
    if a.step_trace is not None and a.step_trace.exists():
        a.step_trace.unlink()  # a previous run's lines (before the server opens the file)
    proc, url = start_server(a.pack, device=a.device, dtype=a.dtype, max_num_seqs=a.max_num_seqs, extra=extra, log=log,
                              trace=a.step_trace)
    rows = []
    try:
        run_concurrency(url, 1, 4, stream)  # warm: the first request's one-time costs
        for c in a.concurrency:
            runs = []
            for _ in range(a.repeat):
                before = scrape(url)
                mark = len(a.step_trace.read_text().splitlines()) if a.step_trace and a.step_trace.exists() else 0
                run = run_concurrency(url, c, a.tokens, stream)
                runs.append(run | step_split(before, scrape(url), run["wall_s"])
                            | (trace_split(trace_lines(a.step_trace, mark)) if a.step_trace else {}))
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0] if all(k in r for r in runs)}
            rows.append({"label": a.label, "pack": a.pack.name, "device": a.device, "dtype": a.dtype,
                         "max_num_seqs": a.max_num_seqs, "concurrency": c, "tokens_per_request": a.tokens,
                         "client": client, "serve_args": " ".join(extra), **row})
    finally:
        stop_server(proc)
    base = next((r for r in rows if r["concurrency"] == 1), None)
    print(f"{'streams':>7} {'aggregate tok/s':>16} {'per-stream tok/s':>17} {'TTFT s':>8} {'agg vs 1':>9} {'per vs 1':>9} "
          f"{'errors':>6} {'srv TTFT':>8} {'step ms':>8} {'text ms':>8} {'rows':>5} {'busy':>5}")
    for r in rows:
        if base:
            r["aggregate_vs_1"] = r["aggregate_tokens_per_s"] / base["aggregate_tokens_per_s"]
            r["per_stream_vs_1"] = r["per_stream_tokens_per_s"] / base["per_stream_tokens_per_s"]
        print(f"{r['concurrency']:>7} {r['aggregate_tokens_per_s']:>16.1f} {r['per_stream_tokens_per_s']:>17.1f} "
              f"{r['ttft_s']:>8.3f} {r.get('aggregate_vs_1', 0):>9.2f} {r.get('per_stream_vs_1', 0):>9.2f} {r['errors']:>6} "
              f"{r.get('server_ttft_s', 0):>8.3f} {r.get('engine_step_ms', 0):>8.2f} {r.get('step_output_ms', 0):>8.2f} {r.get('mean_decode_rows', 0):>5.1f} "
              f"{r.get('engine_busy_share', 0):>5.2f}")
    if a.step_trace:
        print(f"{'streams':>7} {'prefill steps (ms)':>19} {'feeding steps (ms)':>19} {'decode steps (ms)':>18} "
              f"{'gap ms':>7} {'text ms':>7} {'emit ms':>7}")
        for r in rows:
            print(f"{r['concurrency']:>7} " + " ".join(
                f"{r.get(k + '_steps', 0):>9.0f} ({r.get(k + '_step_ms', 0):6.2f})" for k in ("prefill", "feeding")) +
                f" {r.get('decode_steps', 0):>8.0f} ({r.get('decode_step_ms', 0):6.2f}) {r.get('gap_ms_per_step', 0):>7.3f} "
                f"{r.get('output_ms_per_step', 0):>7.3f} {r.get('emit_ms_per_step', 0):>7.3f}")
    from _results import save_results

    # the 1-minute load average before and after: on a shared machine other work skews every number
    save_results("serve_concurrency", rows, path=a.out, append=a.append,
                 extra={"load_average_1m": [load_before[0], os.getloadavg()[0]], "cores": os.cpu_count()})


if __name__ == "__main__":
    main()
