"""guidellm and aiperf, unchanged, against ``shardsmith serve``: their fixed-output-length recipes
must run with no error and every request exactly the asked length.

Each tool lives in its own virtualenv (``pip install guidellm==0.8.1`` / ``aiperf==0.13.0``); give
their executables (default: found on ``PATH``; a tool not found is skipped and said so). The server
is started on ``PACK`` (TP from ``pack.yaml``); both tools tokenize with the pack's own tokenizer.
Rows: ``tool``, ``requests``, ``errored``, ``output_tokens_min``, ``output_tokens_max`` (per request,
as the tool counted them), ``output_tokens_per_s`` (the tool's figure). Exit 1 when a tool reports
an error or a request of another length. Saved as ``results/load_tools-<date>-<host>.json``.

Usage::

    python benchmarks/load_tools.py PACK [--guidellm BIN] [--aiperf BIN] [--requests 8] [--output-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from shardsmith.runtime.serve.launch import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))


def start_server(pack: Path, port: int, model: str, log: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "shardsmith.cli", "serve", str(pack), "--port", str(port),
           "--served-model-name", model, *extra]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"server not ready after 300 s:\n{log.read_text()[-3000:]}")


def run_guidellm(bin_: str, url: str, pack: Path, a, work: Path) -> dict:
    out = work / "guidellm.json"
    cmd = [bin_, "run", "--backend", f"kind=openai_http,target={url}", "--profile", "kind=synchronous",
           "--data", f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},output_tokens={a.output_tokens}",
           "--tokenizer", f"kind=hf_auto,model={pack}", "--constraint", f"kind=max_requests,count={a.requests}",
           "--output", f"kind=json,path={out}", "--disable-progress"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=a.timeout)
    bench = json.loads(out.read_text())["benchmarks"][0]
    req = bench["requests"]
    lengths = [r["output_tokens"] for r in req["successful"]]
    rate = bench["metrics"]["output_tokens_per_second"]["successful"]["mean"]
    return {"requests": len(lengths), "errored": len(req["errored"]) + len(req["incomplete"]),
            "output_tokens_min": min(lengths), "output_tokens_max": max(lengths), "output_tokens_per_s": rate}


def run_aiperf(bin_: str, url: str, pack: Path, a, work: Path, model: str) -> dict:
    art = work / "aiperf"
    cmd = [bin_, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(pack), "--synthetic-input-tokens-mean", str(a.prompt_tokens),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(a.output_tokens),
           "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--extra-inputs",
           f"min_tokens:{a.output_tokens}", "--per-chunk-usage", "--use-server-token-count",
           "--request-count", str(a.requests), "--concurrency", "1", "--artifact-dir", str(art), "--ui", "none"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=a.timeout)
    records = [json.loads(line) for line in (art / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    ok = [r for r in records if "error" not in r or not r["error"]]
    lengths = [r["metrics"]["output_sequence_length"]["value"] for r in ok]
    summary = json.loads((art / "profile_export_aiperf.json").read_text())
    rate = summary.get("output_token_throughput", {}).get("avg")
    return {"requests": len(lengths), "errored": len(records) - len(ok), "output_tokens_min": min(lengths),
            "output_tokens_max": max(lengths), "output_tokens_per_s": rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pack", type=Path)
    ap.add_argument("--guidellm", default=shutil.which("guidellm"))
    ap.add_argument("--aiperf", default=shutil.which("aiperf"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=1200.0, help="Seconds per tool run.")
    ap.add_argument("--serve-args", default="--dtype float32", help="More `shardsmith serve` options.")
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    model, port = a.pack.name, free_port()
    url = f"http://127.0.0.1:{port}"
    rows, bad = [], []
    with tempfile.TemporaryDirectory(prefix="shardsmith-load-tools-") as tmp:
        work = Path(tmp)
        server = start_server(a.pack, port, model, work / "serve.log", a.serve_args.split())
        try:
            for tool, bin_ in (("guidellm", a.guidellm), ("aiperf", a.aiperf)):
                if not bin_:
                    print(f"{tool}: not found (pass --{tool} BIN); skipped")
                    continue
                got = run_guidellm(bin_, url, a.pack, a, work) if tool == "guidellm" else \
                    run_aiperf(bin_, url, a.pack, a, work, model)
                version = subprocess.run([bin_, "--version"], capture_output=True, text=True).stdout.strip().split()[-1:]
                rows.append({"tool": tool, "version": version[0] if version else None, **got,
                             "output_tokens_asked": a.output_tokens})
                if got["errored"] or got["requests"] != a.requests or \
                        not got["output_tokens_min"] == got["output_tokens_max"] == a.output_tokens:
                    bad.append(tool)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    print(f"{'tool':>9} {'requests':>8} {'errored':>7} {'out_min':>7} {'out_max':>7} {'out_tok/s':>9}")
    for r in rows:
        print(f"{r['tool']:>9} {r['requests']:>8} {r['errored']:>7} {r['output_tokens_min']:>7} "
              f"{r['output_tokens_max']:>7} {r['output_tokens_per_s'] or float('nan'):>9.2f}")
    if rows and not a.no_save:
        from _results import save_results

        save_results("load_tools", rows, extra={"pack": str(a.pack), "serve_args": a.serve_args,
                                                "prompt_tokens": a.prompt_tokens, "cores": os.cpu_count()})
    if bad:
        raise SystemExit(f"{', '.join(bad)}: errors or requests of another length than {a.output_tokens}")


if __name__ == "__main__":
    main()
