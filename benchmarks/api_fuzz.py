"""Fuzz the HTTP API against its published schema: schemathesis, no 5xx allowed.

Builds a tiny Mixtral checkpoint with the tiny DeepSeek tokenizer and chat template
(:mod:`shardsmith.testing`), splits it at TP=2, starts ``shardsmith serve`` on it (gloo, 2 ranks,
``--max-seq-len 64`` so that no generated request runs long), waits for ``/health``, then runs
``schemathesis run <url>/openapi.json --checks not_a_server_error`` (schemathesis generates requests
from the schema, valid and invalid, and fails an operation on any 5xx). Hand-made requests the
schema cannot produce follow (lone surrogates, a 405, ``models.retrieve``), each checked for its
status and OpenAI's error body. Every operation's and hand-made request's outcome is one row of
``benchmarks/results/api_fuzz-<YYYYMMDD>-<host>.json``; the server's own request counters by
status (``/metrics``) go in as well.

schemathesis is not a test dependency: ``pip install schemathesis`` (run here with 4.32).

Usage: ``python benchmarks/api_fuzz.py [--max-examples 200] [--seed 17] [--dir /tmp/shardsmith-api-fuzz]``
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import save_results  # noqa: E402

MODEL = "tiny"
HAND_MADE = [  # (what, method, path, raw JSON body or None, expected status, expected error param)
    ("lone surrogate as prompt", "POST", "/v1/completions",
     '{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', 400, "prompt"),
    ("lone surrogate in chat content", "POST", "/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfff"}], "max_tokens": 2}', 400,
     "messages.0.content"),
    ("lone surrogate as model", "POST", "/v1/chat/completions",
     '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
    ("405 on a POST route", "GET", "/v1/completions", None, 405, None),
    ("models.retrieve, served model", "GET", "/v1/models/tiny", None, 200, None),
    ("models.retrieve, another model", "GET", "/v1/models/gpt-4", None, 404, "model"),
]


def build_pack(root: Path) -> Path:
    from shardsmith.testing import tiny_mixtral
    from shardsmith.testing.tokenizer import deepseek_tokenizer
    from shardsmith.writer.split import split_checkpoint

    ckpt = deepseek_tokenizer(tiny_mixtral(root / "ckpt"), vocab_size=320, chat="template")
    split_checkpoint(ckpt, root / "pack", world_size=2)
    return root / "pack"


def start_server(pack: Path, port: int, log: Path) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "shardsmith.cli", "serve", str(pack), "--port", str(port),
                             "--served-model-name", MODEL, "--max-seq-len", "64"],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not ready after 300 s:\n{log.read_text(errors='replace')}")


def hand_made(url: str) -> list[dict]:
    import httpx

    rows = []
    for what, method, path, body, status, param in HAND_MADE:
        r = httpx.request(method, f"{url}{path}", content=body, timeout=60,
                          headers={"content-type": "application/json"} if body else None)
        ok = r.status_code == status
        if status >= 400:
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            ok = ok and set(err) == {"message", "type", "param", "code"} and (param is None or err["param"] == param)
            ok = ok and (status != 405 or bool(r.headers.get("allow")))
        rows.append({"kind": "hand-made", "case": what, "method": method, "path": path, "status": r.status_code,
                     "expected_status": status, "ok": ok})
    return rows


def schemathesis_rows(url: str, out: Path, *, max_examples: int, seed: int) -> tuple[list[dict], int, float]:
    report = out / "schemathesis.json"
    exe = shutil.which("schemathesis") or shutil.which("st")
    if exe is None:
        raise SystemExit("schemathesis is not installed: pip install schemathesis")
    t0 = time.perf_counter()
    run = subprocess.run([exe, "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
                          "--max-examples", str(max_examples), "--seed", str(seed), "--request-timeout", "120",
                          "--report", "json", "--report-json-path", str(report), "--no-color"],
                         capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    (out / "schemathesis.log").write_text(run.stdout + run.stderr)
    rows = []
    doc = json.loads(report.read_text()) if report.is_file() else {}
    for op in _operations(doc):
        rows.append({"kind": "schemathesis", **op})
    if not rows:  # no report to read: keep the summary line so the result says what happened
        summary = [l for l in run.stdout.splitlines() if re.search(r"\d+ (passed|failed)", l)]
        rows.append({"kind": "schemathesis", "summary": summary[-1:] or run.stdout[-500:], "exit_code": run.returncode})
    return rows, run.returncode, seconds


def _operations(doc: dict) -> list[dict]:
    """From schemathesis' JSON run report: per operation and phase, how many generated requests the
    server accepted (2xx), rejected (4xx) or could not reach (404 on ``model``); then one totals row."""
    rows = [{"operation": op, "phase": phase, **{k: v for k, v in counts.items() if isinstance(v, int)}}
            for op, phases in (doc.get("valid_rates") or {}).items() for phase, counts in phases.items()]
    cases = doc.get("test_cases") or {}
    rows.append({"operation": "all", "phase": "all", "generated": cases.get("generated"),
                 "with_failures": cases.get("with_failures"), "failures": len(doc.get("failures") or []),
                 "errors": len(doc.get("errors") or []), "schemathesis_version": doc.get("schemathesis_version")})
    return rows


def server_counts(url: str) -> dict[str, float]:
    import httpx

    counts = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("shardsmith_requests_total{"):
            name, value = line.rsplit(" ", 1)
            counts[name.removeprefix("shardsmith_requests_total")] = float(value)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-examples", type=int, default=200, help="schemathesis examples per operation")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardsmith-api-fuzz"))
    args = ap.parse_args()
    from shardsmith.runtime.serve.launch import free_port

    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    pack = build_pack(args.dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(pack, port, args.dir / "serve.log")
    try:
        rows, code, seconds = schemathesis_rows(url, args.dir, max_examples=args.max_examples, seed=args.seed)
        rows += hand_made(url)
        counts = server_counts(url)
    finally:
        proc.send_signal(signal.SIGTERM)  # the launcher stops the ranks
        proc.wait(60)
    server_5xx = sum(v for k, v in counts.items() if re.search(r'status="5\d\d"', k) and 'status="503"' not in k)
    extra = {"schemathesis_exit_code": code, "schemathesis_seconds": round(seconds, 1),
             "max_examples": args.max_examples, "seed": args.seed, "server_requests_by_status": counts,
             "server_5xx_other_than_503": server_5xx,
             "hand_made_ok": all(r["ok"] for r in rows if r["kind"] == "hand-made")}
    save_results("api_fuzz", rows, extra=extra)
    print(json.dumps(extra, indent=2))
    if code != 0 or not extra["hand_made_ok"] or server_5xx:
        raise SystemExit(f"failures: see {args.dir}/schemathesis.log")


if __name__ == "__main__":
    main()
