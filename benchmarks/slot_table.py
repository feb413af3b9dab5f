"""Host time per decode token spent in the expert slot table, at real model scale.

Every MoE layer of every decode step calls :meth:`SlotTable.admit` on the host, between the router
and the expert matmuls, so its cost adds to every token. This replays a Zipf routing trace (per
layer, ``top_k`` distinct experts per token, popularity ``1/rank^s``, permuted per layer) through
the table at DeepSeek-V4-Flash scale (43 layers x 256 experts, top-6) and SmolLM2-MoE scale
(30 x 8, top-2), for each policy and cache share, and reports milliseconds per token and hit rate.

Rows ``current`` use the table's default hot-set refresh (every 64 requests), as does the
alternative; ``current, refresh 4 steps`` is what :class:`~shardsmith.runtime.offload.expert_cache.ExpertCache`
configures (every ``4 x layers`` requests). ``--module FILE`` times another implementation of the same class (e.g. an older
``slots.py`` from git) side by side; its decisions are checked equal to the current one's.

Example::

    python benchmarks/slot_table.py
    git show 1b1db9d:shardsmith/runtime/offload/slots.py > /tmp/old_slots.py
    python benchmarks/slot_table.py --module /tmp/old_slots.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = {"deepseek-v4-flash": (43, 256, 6), "smollm2-moe": (30, 8, 2)}


def load_alternative(path: Path):
    """The ``SlotTable`` class of another ``slots.py`` (its package-relative import made absolute)."""
    src = path.read_text().replace("from ...errors import", "from shardsmith.errors import")
    spec = importlib.util.spec_from_loader("alt_slots", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["alt_slots"] = mod  # dataclasses look their module up there
    exec(compile(src, str(path), "exec"), mod.__dict__)  # noqa: S102 - a benchmark loading a given file
    return mod.SlotTable


def replay(cls, trace, n_slots: int, policy: str, repeat: int, refresh: int = 64) -> tuple[float, float, list]:
    """Best-of-``repeat`` seconds for the whole trace (a fresh table each time), hit rate, decisions."""
    best = float("inf")
    for _ in range(repeat):
        t = cls(n_slots, policy=policy, refresh=refresh)
        out = []
        t0 = time.perf_counter()
        for req in trace:
            for i in range(0, len(req), n_slots):
                out.append(t.admit(req[i: i + n_slots]))
        best = min(best, time.perf_counter() - t0)
    return best, t.stats()["hit_rate"], out


def main() -> None:
    from decode_offload import zipf_trace
    from rich.console import Console
    from rich.table import Table

    from shardsmith.runtime.offload.expert_cache import REFRESH_STEPS
    from shardsmith.runtime.offload.slots import SlotTable

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--zipf", type=float, default=0.8)
    p.add_argument("--repeat", type=int, default=3, help="best of this many replays")
    p.add_argument("--module", type=Path, help="another slots.py to time side by side")
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    impls = {"current": SlotTable}
    if a.module:
        impls[f"{a.module.name}"] = load_alternative(a.module)
    rows = []
    for model, (layers, experts, k) in MODELS.items():
        trace = zipf_trace(layers=layers, experts=experts, k=k, tokens=a.tokens, s=a.zipf, seed=0)
        for policy in ("lru", "hot"):
            for share in (0.25, 0.0625):
                n = max(k, int(share * layers * experts))
                ref = None
                for name, cls in impls.items():
                    seconds, hit, decisions = replay(cls, trace, n, policy, a.repeat)
                    same = None if ref is None else decisions == ref
                    ref = decisions if ref is None else ref
                    rows.append({"model": model, "layers": layers, "experts": experts, "top_k": k, "policy": policy,
                                 "cache_share": share, "slots": n, "implementation": name, "refresh_requests": 64,
                                 "ms_per_token": 1e3 * seconds / a.tokens, "hit_rate": hit,
                                 "same_decisions_as_current": same})
                if policy == "hot":
                    refresh = max(64, REFRESH_STEPS * layers)
                    seconds, hit, _ = replay(SlotTable, trace, n, policy, a.repeat, refresh)
                    rows.append({**rows[-1], "implementation": f"current, refresh {REFRESH_STEPS} steps",
                                 "refresh_requests": refresh, "ms_per_token": 1e3 * seconds / a.tokens,
                                 "hit_rate": hit, "same_decisions_as_current": None})
    t = Table(title=f"slot table host time per decode token (Zipf s={a.zipf}, {a.tokens} tokens)")
    for col in ("model", "policy", "cache share", "slots", "implementation", "ms/token", "hit rate", "vs current"):
        t.add_column(col, justify="right")
    cur = {(r["model"], r["policy"], r["cache_share"]): r["ms_per_token"] for r in rows if r["implementation"] == "current"}
    for r in rows:
        key = (r["model"], r["policy"], r["cache_share"])
        t.add_row(r["model"], r["policy"], f"{r['cache_share']:.4g}", str(r["slots"]), r["implementation"],
                  f"{r['ms_per_token']:.3f}", f"{r['hit_rate']:.3f}", f"{r['ms_per_token'] / cur[key]:.1f}x")
    Console(width=150).print(t)
    if any(r["same_decisions_as_current"] is False for r in rows):
        raise SystemExit("the alternative implementation made different decisions")
    if not a.no_save:
        from _results import save_results

        save_results("slot_table", rows, extra={"zipf_s": a.zipf, "tokens": a.tokens,
                                                "alternative": str(a.module) if a.module else None})


if __name__ == "__main__":
    main()
