"""Time to ready from a pack vs ``--from-checkpoint`` vs a plain sequential read of the rank's bytes.

For each TP, three runs of fresh rank processes (the same spawn as ``decode.py``):

- ``pack``: ``Engine.load`` of the rank's pack (memory-mapped, zero-copy, every file hashed with
  XXH3-128 as it is first read: the default verified load), then the warm-up step;
- ``pack-no-verify``: the same with ``--no-verify`` (no hashing), to price the verification;
- ``checkpoint``: ``Engine.load(from_checkpoint=True)``: plan + slice the unsplit source at start-up;
- ``read-floor``: each rank reads its pack files sequentially (8 MiB reads), nothing else.

``seconds_to_ready`` is spawn to the last rank ready (for the floor: to the last rank done reading).
With ``--cold`` (when ``/proc/sys/vm/drop_caches`` is writable) the page cache is dropped before
every run; otherwise every run reads from the page cache (the ``cache`` field says which). A pack's
pages are faulted in lazily: ready means the warm-up touched what it used, not every expert.

Usage: ``python benchmarks/load.py [--tp 1 2] [--device cpu|cuda] [--checkpoint DIR] [--cold]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import default_checkpoint, ensure_pack, pack_bytes, spawn  # noqa: E402

DROP = Path("/proc/sys/vm/drop_caches")


def drop_caches(cold: bool) -> str:
    """Drop the page cache when asked and allowed; returns ``cold`` or ``warm``."""
    if cold and os.access(DROP, os.W_OK):
        subprocess.run(["sync"], check=False)
        DROP.write_text("3\n")
        return "cold"
    return "warm"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the SmolLM2 MoE demo (built if missing)")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--pack-root", type=Path, default=Path("/tmp/shardsmith-bench-decode"))
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every run (needs root)")
    a = ap.parse_args()
    from _results import save_results

    ckpt = a.checkpoint or default_checkpoint(a.fp8)
    root = a.pack_root / ckpt.name
    rows = []
    for tp in a.tp:
        pack = ensure_pack(ckpt, root, tp)
        files = [sorted((pack / f"rank-{r}-of-{tp}").glob("*.safetensors")) for r in range(tp)]
        jobs = {
            "read-floor": {"mode": "read-floor", "files": files},
            "pack": {"mode": "ready", "path": str(pack), "device": a.device},
            "pack-no-verify": {"mode": "ready", "path": str(pack), "device": a.device, "verify": False},
            "checkpoint": {"mode": "ready", "path": str(ckpt), "device": a.device, "from_checkpoint": True},
        }
        for source, job in jobs.items():
            cache = drop_caches(a.cold)
            rep = spawn(tp, job)
            row = {"tp": tp, "device": a.device, "source": source, "cache": cache, "checkpoint": ckpt.name,
                   "seconds_to_ready": round(rep["seconds_to_ready"], 3),
                   "load_seconds": round(rep["load_seconds_max"], 3), "bytes_per_rank": pack_bytes(pack, 0, tp)}
            print(row, flush=True)
            rows.append(row)
    save_results("load", rows, extra={"load_average": os.getloadavg()})


if __name__ == "__main__":
    main()
