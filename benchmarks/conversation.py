"""Time to first token of each turn of a long chat, with prefix reuse and without, side by side.

Starts ``shardsmith serve`` on a pack twice (``--prefix-caching``, then ``--no-prefix-caching``) and
holds one conversation against each (:func:`shardsmith.testing.conversation.chat_turns`): a system
prompt of ``--paragraphs`` paragraphs of notes (17: about 1,500 SmolLM2 tokens), then three questions,
each turn resending the history with the answers, greedy, streamed. Default pack: the real SmolLM2
MoE demo checkpoint split at TP=1 (built under ``$SHARDSMITH_CACHE`` by ``shardsmith demo``).

Rows (one per mode and turn): ``mode``, ``turn``, ``prompt_tokens``, ``cached_tokens``, ``ttft_s``,
``ttft_ratio_to_turn1`` (this turn's TTFT over the same mode's first turn's), ``ttft_ratio_to_off``
(over the same turn without reuse), ``total_s``, ``answers_match_off``; saved as
``benchmarks/results/conversation-<date>-<host>.json``.

    python benchmarks/conversation.py --dtype float32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardsmith.testing.conversation import QUESTIONS, chat_turns, long_history  # noqa: E402
from shardsmith.testing.server import Server  # noqa: E402


def default_pack() -> Path:
    """The SmolLM2 MoE demo checkpoint split at TP=1 under the cache (made once)."""
    from shardsmith import settings
    from shardsmith.demo import build_demo_checkpoint
    from shardsmith.writer.split import split_checkpoint

    cache = settings.current().cache_dir
    pack = cache / "bench" / "smollm2-moe-bf16-tp1"
    if not (pack / "pack.yaml").exists():
        ckpt = build_demo_checkpoint(cache / "demo" / "smollm2-moe-bf16", cache_dir=cache)
        split_checkpoint(ckpt, pack, world_size=1)
    return pack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack", type=Path, nargs="?", default=None, help="a pack (default: the SmolLM2 MoE at TP=1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--paragraphs", type=int, default=17)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from _results import save_results

    pack = a.pack or default_pack()
    system, turns = long_history(a.paragraphs), {}
    for mode in ("--prefix-caching", "--no-prefix-caching"):
        log = Path(f"/tmp/shardsmith-bench-conversation{mode.replace('--', '-')}.log")
        with Server(pack, log, mode, "--device", a.device, "--dtype", a.dtype, "--max-num-seqs", "4",
                    "--max-model-len", str(a.max_model_len), model="bench", ready_timeout=1800) as srv:
            turns[mode] = chat_turns(srv.url, "bench", system, QUESTIONS, max_tokens=a.max_tokens)
    on, off = turns["--prefix-caching"], turns["--no-prefix-caching"]
    rows = []
    for mode, run in (("reuse", on), ("no reuse", off)):
        for i, t in enumerate(run):
            rows.append({"mode": mode, "turn": i + 1, "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                         "ttft_s": round(t.ttft_s, 4), "ttft_ratio_to_turn1": round(t.ttft_s / run[0].ttft_s, 4),
                         "ttft_ratio_to_off": round(t.ttft_s / off[i].ttft_s, 4), "total_s": round(t.total_s, 4),
                         "answers_match_off": t.text == off[i].text})
    print(f"{'mode':<9} {'turn':>4} {'prompt':>7} {'cached':>7} {'ttft s':>8} {'/turn1':>7} {'/off':>6} {'same':>5}")
    for r in rows:
        print(f"{r['mode']:<9} {r['turn']:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {r['ttft_s']:>8.3f} "
              f"{r['ttft_ratio_to_turn1']:>7.3f} {r['ttft_ratio_to_off']:>6.3f} {str(r['answers_match_off']):>5}")
    save_results("conversation", rows, extra={"pack": pack.name, "device": a.device, "dtype": a.dtype,
                                               "paragraphs": a.paragraphs, "max_tokens": a.max_tokens}, path=a.out)


if __name__ == "__main__":
    main()
