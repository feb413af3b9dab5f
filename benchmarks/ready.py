"""Time to ready through the real ``serve`` path: a first start on empty compile caches, then starts
that find them filled, beside the load floor (the pack's bytes at the measured disk rate); with every
batch bucket built before ready (``--no-defer-buckets``) and with the larger ones built while idle
(``--defer-buckets``), side by side (``all_buckets_s``: from the command until none is pending).

Each start runs ``shardsmith serve PACK`` as a subprocess (``serve_concurrency.start_server``) with
``SHARDSMITH_CACHE=--cache`` (emptied before the first start only; serve keeps each rank's compile
caches there, ``$SHARDSMITH_CACHE/compile``), waits for ``/health``, then reads:

- ``ready_s``: wall seconds from the command to ``/health`` answering 200;
- ``load_s``: the engine's load on rank 0 (``/metrics`` ``load_seconds``: map the pack, build the
  model); ``warmup_s`` and its phases (the ``warm-up phases`` log line: Triton kernel variants,
  first prefill and step, each batch bucket, the prompt probe);
- ``process_start_s``: the rest (interpreter and imports, the launcher, rank start-up):
  ``ready_s - load_s - warmup_s``; ``start_phases_s``: its parts as rank 0 timed them (``/metrics``
  ``start_seconds``: the launcher, the rank's own start, its process group, the engine's import);
- ``compile_cache_files`` (files under ``--cache`` at ready) and ``new_cache_files`` (added by this
  start; a start on filled caches should add none);
- ``engine_step_ms``: the mean engine step of one greedy streaming request after ready (``--tokens``
  tokens; ``/metrics`` ``engine_step_seconds`` sum over count, before and after it), so a start that
  skipped its compiles is seen to step as fast; ``request_tokens_per_s``: its tokens over its wall
  time (a stream's chunks may come together: text held back until it decodes as UTF-8);
  ``engine_step_ms_streams``: the mean step while ``--streams`` such requests run together (the larger
  buckets' pieces);
- ``compile_rows``: ``SHARDSMITH_TUNING=compile_rows`` of the start (``--compile-rows``: each mode's
  starts in turn, the first on empty caches);
- ``page_cache``: ``dropped`` (``--cold-page-cache``: the pack's files dropped from the page cache
  before every start) or ``as left``;
- ``checkout``, ``commit``: whose code served (``--checkout LABEL=DIR``, repeatable: a base commit's
  worktree beside this one, side by side in one run).

The load floor: the pack's files are dropped from the page cache (``posix_fadvise`` DONTNEED) and
read back (``--floor-gb`` of them at most), giving ``disk_gb_per_s``; ``load_floor_s`` is the
pack's bytes at that rate. Rows go to ``benchmarks/results/ready-<YYYYMMDD>-<host>.json``
(``SHARDSMITH_HOST`` labels the host) or ``--out``.

Usage::

    python benchmarks/ready.py PACK [--device cuda] [--dtype bfloat16] [--starts 2] [--buckets all deferred]
        [--compile-rows static dynamic] [--cache DIR] [--tokens 64] [--streams 4] [--out FILE]
        [--checkout base=/tmp/base --checkout new=.]
        [-- extra serve options, e.g. --moe-backend gpu]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import save_results  # noqa: E402
from serve_concurrency import start_server, stop_server, stream_urllib  # noqa: E402
from ttft import cache_files  # noqa: E402


def pack_files(pack: Path) -> list[Path]:
    return sorted(p for p in pack.rglob("*") if p.is_file())


def disk_rate(files: list[Path], limit_bytes: int) -> tuple[float, int]:
    """(bytes per second, bytes read) reading ``files`` (up to ``limit_bytes``) after dropping them
    from the page cache; the rate is an upper bound where the kernel keeps some pages anyway."""
    chunk, done, t = 16 << 20, 0, 0.0
    for path in files:
        if done >= limit_bytes:
            break
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while done < limit_bytes:
                got = os.read(fd, chunk)
                if not got:
                    break
                done += len(got)
            t += time.perf_counter() - t0
        finally:
            os.close(fd)
    return (done / t if t > 0 else float("inf")), done


def drop_page_cache(files: list[Path]) -> None:
    """Drop ``files`` from the page cache (``posix_fadvise`` DONTNEED: clean pages no process maps)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def metric(url: str, name: str) -> float | None:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^(?:shardsmith_)?{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def start_phases(url: str) -> dict[str, float]:
    """``/metrics`` ``start_seconds{phase=...}``: rank 0's seconds before the load, by phase (empty from
    a checkout that does not export them)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in re.findall(r'^shardsmith_start_seconds\{phase="(\w+)"\} ([0-9.eE+-]+)$', text, re.M)}


def step_ms(url: str) -> tuple[float, float]:
    """``/metrics`` ``engine_step_seconds`` (sum, count)."""
    return metric(url, "engine_step_seconds_sum") or 0.0, metric(url, "engine_step_seconds_count") or 0.0


def mean_step_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    return round(1e3 * (after[0] - before[0]) / (after[1] - before[1]), 3) if after[1] > before[1] else None


def one_start(a: argparse.Namespace, extra: list[str], label: str, buckets: str, log: Path) -> dict:
    before = cache_files(a.cache)
    if a.cold_page_cache:
        drop_page_cache(a.files)
    t0 = time.perf_counter()
    flag = "--defer-buckets" if buckets == "deferred" else "--no-defer-buckets"
    proc, url = start_server(a.pack, device=a.device, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
                             extra=[flag, *extra], log=log, cwd=a.checkout_dir)
    ready_s = time.perf_counter() - t0
    try:
        at_ready = cache_files(a.cache)
        load_s = metric(url, "load_seconds")
        before_load = start_phases(url)
        pending = metric(url, "decode_buckets_pending")
        while pending:  # deferred: the idle server builds the rest now
            time.sleep(0.2)
            pending = metric(url, "decode_buckets_pending")
        all_buckets_s = time.perf_counter() - t0
        deadline = time.monotonic() + 10
        phases: dict[str, float] = {}
        compiling: dict[str, float] = {}
        warm = None
        while time.monotonic() < deadline and warm is None:  # rank 0's lines reach the log as it flushes
            text = log.read_text()
            warm = re.search(r"ready: every rank .*?\(warm-up ([\d.]+) s: (\d+) kernel launches", text)
            ph = re.search(r"warm-up phases \(s\): (.*)$", text, re.M)
            if ph:
                phases = {k: float(v) for k, v in (kv.split("=") for kv in ph.group(1).split())}
            co = re.search(r"warm-up compiling \(s\): (.*)$", text, re.M)
            if co:
                compiling = {k: float(v) for k, v in (kv.split("=") for kv in co.group(1).split())}
            time.sleep(0.2)
        warmup_s = float(warm.group(1)) if warm else None
        body = {"model": "bench", "prompt": list(range(1, 17)), "max_tokens": a.tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        steps0 = step_ms(url)
        sent = time.perf_counter()
        first, end, got = stream_urllib(url, body, None)
        steps1 = step_ms(url)
        with ThreadPoolExecutor(a.streams) as pool:  # the larger buckets' step, the same tokens from each stream
            list(pool.map(lambda i: stream_urllib(url, body | {"prompt": list(range(1 + i, 17 + i))}, None),
                          range(a.streams)))
        steps_n = step_ms(url)
        after = cache_files(a.cache)
    finally:
        stop_server(proc)
    row = {"checkout": a.checkout, "commit": a.checkout_commit, "page_cache": "dropped" if a.cold_page_cache else "as left",
           "start": label, "buckets": buckets, "device": a.device_name, "pack_bytes": a.pack_bytes,
           "ready_s": round(ready_s, 2), "all_buckets_s": round(all_buckets_s, 2),
           "load_s": None if load_s is None else round(load_s, 2), "warmup_s": warmup_s,
           "process_start_s": None if load_s is None or warmup_s is None else round(ready_s - load_s - warmup_s, 2),
           "start_phases_s": before_load, "warmup_phases_s": phases, "warmup_compile_s": compiling, "warmup_kernel_launches": int(warm.group(2)) if warm else None,
           "compile_cache_files": at_ready, "new_cache_files": at_ready - before,
           "compiled_after_ready_files": after - at_ready, "ttft_s": round(first - sent, 4),
           "request_s": round(end - sent, 4), "request_tokens_per_s": round(got / (end - sent), 2) if got else None,
           "engine_step_ms": mean_step_ms(steps0, steps1), "streams": a.streams,
           "engine_step_ms_streams": mean_step_ms(steps1, steps_n), "compile_rows": a.compile_rows}
    print(f"{a.checkout:>8} {label:>7} {buckets:>8}: ready {ready_s:7.2f} s (every bucket {all_buckets_s:.2f} s) = process start {row['process_start_s']} s + load {row['load_s']} s + "
          f"warm-up {warmup_s} s; compile-cache files {at_ready} ({at_ready - before:+d}); "
          f"decode: engine step {row['engine_step_ms']} ms ({row['engine_step_ms_streams']} ms with {a.streams} streams), "
          f"{row['request_tokens_per_s']} tokens/s over the request", flush=True)
    if before_load:
        print("         before the load (s): " + ", ".join(f"{k} {v:.2f}" for k, v in before_load.items()), flush=True)
    if phases:
        print("         warm-up phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack", type=Path)
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--starts", type=int, default=2, help="starts per bucket mode: the first on empty caches, then cached")
    ap.add_argument("--buckets", nargs="+", default=["all", "deferred"], choices=("all", "deferred"),
                    help="all: every batch bucket before ready (--no-defer-buckets); deferred: built while idle")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the decode check after each start")
    ap.add_argument("--streams", type=int, default=4, help="concurrent requests of the larger buckets' step check")
    ap.add_argument("--compile-rows", nargs="+", default=["static"], choices=("static", "dynamic"),
                    help="the compiled pieces per batch bucket, or one for every bucket past one row "
                         "(SHARDSMITH_TUNING=compile_rows=...), each with its own starts")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/ready-cache"), help="compile caches (emptied first)")
    ap.add_argument("--floor-gb", type=float, default=4.0, help="read at most this much of the pack for the disk rate")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cold-page-cache", action="store_true",
                    help="drop the pack's files from the page cache before every start (a start after a reboot "
                         "or on a new pack reads the disk)")
    ap.add_argument("--checkout", action="append", default=None, metavar="LABEL=DIR",
                    help="a checkout whose shardsmith serves (its DIR first on PYTHONPATH), repeatable, each "
                         "through every mode in turn (e.g. base=/tmp/base new=.); default: this one")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.pack, a.cache = a.pack.resolve(), a.cache.resolve()
    extra = argv[cut + 1:]
    files = a.files = pack_files(a.pack)
    a.pack_bytes = sum(p.stat().st_size for p in files)
    if a.device == "cuda":
        import torch

        a.device_name = torch.cuda.get_device_name(0)
    else:
        a.device_name = "cpu"
    rate, sampled = disk_rate(files, int(a.floor_gb * 1e9))
    floor_s = a.pack_bytes / rate
    print(f"pack {a.pack}: {a.pack_bytes / 2**30:.2f} GiB; disk read {rate / 1e9:.2f} GB/s over {sampled / 2**30:.2f} GiB "
          f"(page cache dropped): load floor {floor_s:.2f} s", flush=True)
    for v in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):  # set, serve would use them as set
        os.environ.pop(v, None)
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    rows = []
    tuning = os.environ.get("SHARDSMITH_TUNING", "")
    here = Path(__file__).resolve().parent.parent
    checkouts = [c.split("=", 1) for c in a.checkout or [f"this={here}"]]
    if bad := [c for c in checkouts if len(c) != 2 or not (Path(c[1]) / "shardsmith").is_dir()]:
        raise SystemExit(f"--checkout takes LABEL=DIR, DIR holding the shardsmith package: {bad}")
    path0 = os.environ.get("PYTHONPATH", "")
    for (label, where), compile_rows, buckets in [(k, c, b) for k in checkouts for c in a.compile_rows for b in a.buckets]:
        a.checkout, a.checkout_dir = label, Path(where).resolve()  # the command runs there: python -m puts it first
        a.checkout_commit = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or None
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(where).resolve()), path0]))
        shutil.rmtree(a.cache, ignore_errors=True)  # each mode's first start on empty caches
        a.cache.mkdir(parents=True)
        os.environ["SHARDSMITH_CACHE"] = str(a.cache)  # serve keeps its compile caches under it, per pack and rank
        os.environ["SHARDSMITH_TUNING"] = ",".join(filter(None, [tuning, f"compile_rows={compile_rows}"]))
        a.compile_rows = compile_rows
        for i in range(a.starts):
            r = one_start(a, extra, "cold" if i == 0 else "cached", buckets,
                          out_dir / f"ready-serve-{label}-{compile_rows}-{buckets}-{i}.log")
            rows.append(r | {"load_floor_s": round(floor_s, 2), "disk_gb_per_s": round(rate / 1e9, 3),
                             "ready_over_floor_s": round(r["ready_s"] - floor_s, 2),
                             "ready_vs_cold_all": round(r["ready_s"] / (rows or [r])[0]["ready_s"], 3)})
            # after every start: a run stopped by its time limit keeps the starts it made
            save_results("ready", rows, extra={"pack": a.pack.name, "serve_args": " ".join(extra)}, path=a.out)
    print(f"{'checkout':>8} {'compile':>8} {'start':>7} {'buckets':>8} {'ready s':>8} {'all s':>7} {'process s':>9} "
          f"{'load s':>7} {'warm-up s':>9} {'floor s':>8} {'vs cold':>8} {'step ms':>8} {'x' + str(a.streams) + ' ms':>8}  "
          "before the load: launcher / rank start / imports / group s")
    for r in rows:
        before = " / ".join(f"{r['start_phases_s'][k]:.2f}" for k in ("launcher", "rank_start", "imports", "group")
                            if k in r["start_phases_s"]) or "-"
        print(f"{r['checkout']:>8} {r['compile_rows']:>8} {r['start']:>7} {r['buckets']:>8} {r['ready_s']:>8} {r['all_buckets_s']:>7} "
              f"{r['process_start_s']!s:>9} {r['load_s']!s:>7} {r['warmup_s']!s:>9} {r['load_floor_s']:>8} "
              f"{r['ready_vs_cold_all']:>8} {r['engine_step_ms']!s:>8} {r['engine_step_ms_streams']!s:>8}  {before}")


if __name__ == "__main__":
    main()
