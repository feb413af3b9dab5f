"""``serve --speculative ngram`` on the real SmolLM2 MoE pack (CPU, TP=1, float32): a request that
copies a paragraph gets the answer a server without speculation gives, streamed and not, and
``/metrics`` counts the drafts (most accepted)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardsmith.testing.server import Server, post, sse_events

httpx = pytest.importorskip("httpx")

MODEL = "smollm2-spec"
TEXT = ("The harbour market opens at dawn. Fishermen bring their catch to the stone quay, and traders from the "
        "valley arrive with cheese, wool and apples. By noon the stalls are empty.")
ASK = {"model": MODEL, "temperature": 0, "max_tokens": 40,
       "messages": [{"role": "user", "content": f"Repeat this paragraph word for word:\n\n{TEXT}"}]}


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^shardsmith_{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_ngram_speculation_keeps_the_answer(smollm2_pack, tmp_path: Path) -> None:
    answers = {}
    for mode in ((), ("--speculative", "ngram", "--num-speculative-tokens", "4")):
        with Server(smollm2_pack(1), tmp_path / f"serve{len(mode)}.log", "--dtype", "float32", *mode,
                    model=MODEL) as srv:
            whole = post(srv, "/v1/chat/completions", ASK).json()["choices"][0]["message"]["content"]
            chunks = [json.loads(e) for e in sse_events(post(srv, "/v1/chat/completions", ASK | {"stream": True}))[:-1]]
            streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert streamed == whole
            answers[bool(mode)] = whole
            metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert answers[True] == answers[False] and answers[True]
    assert _metric(metrics, "spec_decode_steps_total") > 0
    assert _metric(metrics, "spec_decode_acceptance_rate") > 0.5
    assert _metric(metrics, "spec_decode_emitted_tokens_total") > _metric(metrics, "spec_decode_steps_total")
