"""Time ``split`` and ``verify`` on a generated multi-GB DeepSeek-V4-shaped checkpoint beside the
disk's floors for the same bytes.

The checkpoint has the real per-tensor names, dtypes and shapes of the DeepSeek-V4-Flash release
inventory (``/work/shared/real-inventories/deepseek-v4-flash-0731-reap160``), with fewer layers and
experts: embed and head (1.06 GB each, BF16), ``--layers`` backbone layers with all their dense
tensors (FP8 with E8M0 128x128 scales) and the first ``--experts`` routed experts (FP4 packed in I8
with 1x32 E8M0 scales). Weight bytes are random; scales are sane E8M0 exponents (2^-3..2^3); F32
mixers are small normals. Written with the shared :func:`shardsmith.testing.write_checkpoint`.

Each step is a fresh process timed on the wall clock, its peak RSS from ``/usr/bin/time -v``:

- ``read floor``: ``cat`` of every source shard to /dev/null;
- ``copy floor``: ``dd bs=8M conv=fsync`` of every shard into a new directory (read + write + flush);
- ``split --tp 2`` and ``--tp 4`` (fsync included), ``verify`` and ``verify --deep`` of the TP=4
  pack, ``verify --against`` (reads pack and source).

With ``--cold`` (default when ``/proc/sys/vm/drop_caches`` is writable) the page cache is dropped
before every step, so every step reads from disk; otherwise every step after the first warm read
reads from the page cache and the read floor is a memory-bandwidth number. Ratios are throughput
ratios against the floor (``floor GB/s / step GB/s``, bytes of the step's own input).

Usage: ``python benchmarks/split.py [--layers 2] [--experts 48] [--dir /tmp/shardsmith-bench]``
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import save_results  # noqa: E402

INVENTORY = Path("/work/shared/real-inventories/deepseek-v4-flash-0731-reap160")


def build_checkpoint(root: Path, *, layers: int, experts: int, seed: int = 0) -> Path:
    """Write the scaled-down V4 checkpoint to ``root`` (skipped when ``root/.built`` says the same)."""
    import numpy as np
    import torch

    from shardsmith.dtypes import DTYPES
    from shardsmith.testing import write_checkpoint

    stamp = {"layers": layers, "experts": experts, "seed": seed}
    if (root / ".built").is_file() and json.loads((root / ".built").read_text()) == stamp:
        return root
    shutil.rmtree(root, ignore_errors=True)
    header: dict = {}
    for f in sorted(INVENTORY.glob("model-*.safetensors.json")):
        header.update({k: v for k, v in json.loads(f.read_text()).items() if k != "__metadata__"})
    keep = re.compile(rf"(embed|head|norm|hc_head_\w+)(\.weight)?|layers\.([0-9]+)\..+")
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, e in header.items():
        m = keep.fullmatch(name)
        if not m or (m.group(3) is not None and int(m.group(3)) >= layers):
            continue
        em = re.search(r"\.experts\.(\d+)\.", name)
        if em and int(em.group(1)) >= experts:
            continue
        d = DTYPES[e["dtype"]]
        n = d.nbytes(e["shape"])
        if e["dtype"] == "F8_E8M0":
            raw = rng.integers(124, 131, n, dtype=np.uint8).tobytes()
        elif e["dtype"] in ("F32",):
            raw = (rng.standard_normal(n // 4, dtype=np.float32) * 0.02).tobytes()
        elif e["dtype"] == "I64":
            raw = rng.integers(0, experts, n // 8, dtype=np.int64).tobytes()
        else:
            raw = rng.bytes(n)
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        tensors[name] = t.view(d.torch_dtype).reshape(e["shape"]) if d.torch_dtype is not None else t
    config = json.loads((INVENTORY / "config.json").read_text())
    config.update(num_hidden_layers=layers, n_routed_experts=experts, num_nextn_predict_layers=0)
    config.pop("reap_pruning", None)
    write_checkpoint(root, tensors, config, max_shard_bytes=1 << 30)
    (root / ".built").write_text(json.dumps(stamp))
    return root


def drop_caches(enabled: bool) -> None:
    if enabled:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed(cmd: str, *, cold: bool) -> tuple[float, int]:
    """Run ``cmd`` in a shell under /usr/bin/time -v: (wall seconds, peak RSS bytes of the command)."""
    drop_caches(cold)
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v", "bash", "-c", cmd], capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{cmd} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
    return dt, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardsmith-bench"))
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache between steps")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint and packs")
    args = ap.parse_args()
    cold = not args.warm
    if cold:
        try:
            drop_caches(True)
        except OSError:
            print("cannot drop the page cache: measuring warm", file=sys.stderr)
            cold = False
    t0 = time.perf_counter()
    src = build_checkpoint(args.dir / "src", layers=args.layers, experts=args.experts)
    print(f"checkpoint {src} built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    shards = sorted(src.glob("*.safetensors"))
    src_bytes = sum(f.stat().st_size for f in shards)
    copy_dir, tp2, tp4 = args.dir / "copy", args.dir / "tp2", args.dir / "tp4"
    for d in (copy_dir, tp2, tp4):
        shutil.rmtree(d, ignore_errors=True)
    copy_dir.mkdir(parents=True)
    files = " ".join(str(f) for f in shards)
    steps = [
        ("read floor (cat)", f"cat {files} > /dev/null", src_bytes, None),
        ("copy floor (dd conv=fsync)", f"for f in {files}; do dd if=$f of={copy_dir}/$(basename $f) bs=8M conv=fsync status=none; done",
         src_bytes, None),
        ("split --tp 2", f"shardsmith split {src} {tp2} --tp 2 --json > /dev/null", src_bytes, 2),
        ("split --tp 4", f"shardsmith split {src} {tp4} --tp 4 --json > /dev/null", src_bytes, 4),
        ("verify (tp 4)", f"shardsmith verify {tp4}", None, 4),
        ("verify --deep (tp 4)", f"shardsmith verify {tp4} --deep", None, 4),
        ("verify --against (tp 4)", f"shardsmith verify {tp4} --against {src}", None, 4),
    ]
    rows = []
    for label, cmd, nbytes, tp in steps:
        seconds, rss = timed(cmd, cold=cold)
        if label.startswith("copy"):
            shutil.rmtree(copy_dir)
        if nbytes is None:
            nbytes = sum(f.stat().st_size for f in tp4.rglob("*") if f.is_file())
            if "against" in label:
                nbytes += src_bytes
        rows.append({"step": label, "tp": tp, "seconds": round(seconds, 3), "bytes": nbytes,
                     "gb_per_s": round(nbytes / seconds / 1e9, 3), "peak_rss_bytes": rss})
        print(f"{label:28s} {seconds:7.2f} s  {nbytes / 1e9:6.2f} GB  {nbytes / seconds / 1e9:6.2f} GB/s  "
              f"peak RSS {rss / 2**20:7.0f} MiB", file=sys.stderr)
    read, copy = rows[0], rows[1]
    for row in rows[2:]:
        if row["step"].startswith("split"):  # against the larger (slower) of the two floors, same bytes
            row["floor"] = "copy" if copy["seconds"] >= read["seconds"] else "read"
            row["ratio_to_floor"] = round(row["seconds"] / max(read["seconds"], copy["seconds"]), 3)
        else:  # against the read floor's throughput, for the bytes this step reads
            row["floor"] = "read"
            row["ratio_to_floor"] = round(read["gb_per_s"] / row["gb_per_s"], 3)
    print("\n| step | seconds | GB | GB/s | peak RSS MiB | ratio to floor |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['step']} | {row['seconds']:.2f} | {row['bytes'] / 1e9:.2f} | {row['gb_per_s']:.2f} | "
              f"{row['peak_rss_bytes'] / 2**20:.0f} | {row.get('ratio_to_floor', '-')} |")
    save_results("split", rows, extra={"config": {"layers": args.layers, "experts": args.experts, "cold_cache": cold,
                                                  "source_bytes": src_bytes, "source_files": len(shards)}})
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
