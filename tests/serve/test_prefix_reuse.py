"""Prefix reuse through the real server: ``shardsmith serve`` on the real SmolLM2 MoE pack (CPU,
TP=1, float32), a three-turn chat whose system prompt is over one 512-token prefill chunk, each turn
resending the history as a chat client does. The second and third turns compute only what was added
(what that saves: ``benchmarks/prefix_reuse.py``); usage and ``/metrics`` count the reused tokens.
Then the same three prompts are asked again after unrelated prompts have taken every slot (so
nothing is reused: ``cached_tokens`` 0), and the answers are the same.

float32: a reused answer's keys and values come from its decode steps, a recomputed one's from a
prefill; in bf16 that rounding difference can flip a near-tie greedy choice a few turns later (seen
on the third answer), as batching and chunking do in any engine; in float32 it does not.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from shardsmith.testing.server import Server, post

from shardsmith.testing.conversation import QUESTIONS, chat_turns, long_history

httpx = pytest.importorskip("httpx")

MODEL = "smollm2"
PARAGRAPHS = 6  # ~560 prompt tokens with the chat template: two prefill chunks
SLOTS = 2


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^shardsmith_{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_a_long_conversation_reuses_its_history(smollm2_pack, tmp_path: Path) -> None:
    system = long_history(PARAGRAPHS)
    with Server(smollm2_pack(1), tmp_path / "serve.log", "--max-model-len", "2048", "--dtype", "float32",
                "--max-num-seqs", str(SLOTS), model=MODEL) as srv:
        on = chat_turns(srv.url, MODEL, system, QUESTIONS, max_tokens=12)
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        # the later turns again from scratch (the first one was): unrelated prompts first take (and
        # overwrite) every slot
        again = [on[0]]
        for turns in (2, 3):
            for word in ("Zebras", "Volcanoes")[:SLOTS]:  # no shared first token: each takes its own slot
                r = post(srv, "/v1/completions", {"model": MODEL, "prompt": f"{word} are", "max_tokens": 2,
                                                  "temperature": 0})
                assert r.status_code == 200, r.text
            again.append(chat_turns(srv.url, MODEL, system, QUESTIONS[:turns], max_tokens=12,
                                    answers=[t.text for t in on[:turns - 1]])[-1])
    print("\n".join(f"turn {i + 1}: ttft {a.ttft_s:.3f} s (from scratch {b.ttft_s:.3f} s), prompt {a.prompt_tokens}, "
                    f"cached {a.cached_tokens}: {a.text!r}" for i, (a, b) in enumerate(zip(on, again))))
    assert [t.text for t in on] == [t.text for t in again], "prefix reuse changed the greedy answers"
    assert all(t.text for t in on) and all(t.cached_tokens == 0 for t in again)  # on[0] too: nothing to reuse
    assert [t.prompt_tokens for t in on] == [t.prompt_tokens for t in again]
    assert on[0].prompt_tokens > 512 and on[0].cached_tokens == 0
    for prev, turn in zip(on, on[1:]):
        # everything the previous turn's slot was fed, bar where the resent answer's tokens differ from the generated ones
        assert turn.cached_tokens >= prev.prompt_tokens, (prev, turn)  # what it saves: benchmarks/prefix_reuse.py
    assert _metric(metrics, "prefix_cache_hits_total") == 2
    assert _metric(metrics, "prefix_cache_hit_tokens_total") == on[1].cached_tokens + on[2].cached_tokens
    assert _metric(metrics, "prefix_cache_tokens") >= on[2].prompt_tokens  # the last turn's slot, kept
    assert _metric(metrics, "prefix_cache_bytes") > 0
