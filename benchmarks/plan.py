"""Time `shardsmith --help`, `inspect` and `plan --tp N` on the real DeepSeek-V4-Flash inventory.

Each command runs as a fresh process (what a user waits for), repeated; the table shows the
median wall time in seconds and its ratio to the target (--help 0.5 s, plan 2 s).

Usage: python benchmarks/plan.py [--inventory DIR] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import save_results  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "real-inventories" / "deepseek-v4-flash-0731-reap160"


def timed(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inventory", type=Path, default=DEFAULT)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    exe = [sys.executable, "-m", "shardsmith.cli"]
    cases = [("--help", exe + ["--help"], 0.5, None), ("inspect", exe + ["inspect", str(args.inventory)], None, None)]
    cases += [(f"plan --tp {tp}", exe + ["plan", str(args.inventory), "--tp", str(tp)], 2.0, tp) for tp in (1, 2, 4, 8)]
    rows = []
    print(f"{'command':<16} {'seconds':>8} {'target_s':>9} {'ratio':>6}")
    for name, cmd, target, tp in cases:
        s = timed(cmd, args.repeat)
        ratio = s / target if target else None
        rows.append({"command": name, "tp": tp, "seconds": round(s, 3), "target_seconds": target,
                     "ratio_to_target": round(ratio, 3) if ratio else None, "tensors": 45821})
        print(f"{name:<16} {s:8.3f} {target or '-':>9} {ratio and f'{ratio:.2f}' or '-':>6}")
    save_results("plan", rows)


if __name__ == "__main__":
    main()
