"""``serve --speculative ngram`` on the real SmolLM2 MoE pack (CPU, TP=1, float32): a request that
copies a paragraph gets the answer a server without speculation gives, streamed and not, and
``/metrics`` counts the drafts (most accepted); ``serve --speculative mtp`` on a tiny DeepSeek-V3 pack
at TP=2 (its MTP layer on both ranks) answers as without it."""

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
            if mode:  # streamed with drafts too: the same text (streaming alone is the e2e tests')
                chunks = [json.loads(e) for e in sse_events(post(srv, "/v1/chat/completions", ASK | {"stream": True}))[:-1]]
                assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole
            answers[bool(mode)] = whole
            metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert answers[True] == answers[False] and answers[True]
    assert _metric(metrics, "spec_decode_steps_total") > 0
    assert _metric(metrics, "spec_decode_acceptance_rate") > 0.5
    assert _metric(metrics, "spec_decode_emitted_tokens_total") > _metric(metrics, "spec_decode_steps_total")


def _with_and_without(make, tmp_path: Path, world_size: int, prompt: list[int], max_tokens: int,
                      speculative: tuple[str, ...]) -> None:
    """A pack of the tiny checkpoint ``make`` writes, split at ``world_size``: the greedy completion of
    ``prompt`` from a server with ``speculative`` options equals one without, and drafts were checked."""
    from shardsmith.testing.tokenizer import deepseek_tokenizer
    from shardsmith.writer.split import split_checkpoint

    src = make(tmp_path / "src")
    deepseek_tokenizer(src, vocab_size=512, chat="template")
    split_checkpoint(src, tmp_path / "pack", world_size=world_size)
    ask = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    answers = {}
    for mode in ((), speculative):
        with Server(tmp_path / "pack", tmp_path / f"serve{len(mode)}.log", "--dtype", "float32", *mode,
                    model=MODEL) as srv:
            answers[bool(mode)] = post(srv, "/v1/completions", ask).json()["choices"][0]["text"]
            metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert answers[True] == answers[False] and answers[True]
    assert _metric(metrics, "spec_decode_steps_total") > 0
    assert _metric(metrics, "spec_decode_draft_tokens_total") >= _metric(metrics, "spec_decode_steps_total")


def test_mtp_speculation_through_serve_at_tp2(tmp_path: Path) -> None:
    """``serve --speculative mtp`` on a tiny DeepSeek-V3 pack at TP=2: the MTP layer loads on every rank,
    drafts are checked, and the greedy answer is the one a server without speculation gives."""
    from shardsmith.testing import tiny_deepseek_v3

    _with_and_without(tiny_deepseek_v3, tmp_path, 2, [3, 17, 42, 99, 5, 8, 61, 7, 3, 17, 42], 16,
                      ("--speculative", "mtp", "--num-speculative-tokens", "3"))


def test_deepseek_v4_ngram_speculation_through_serve(tmp_path: Path) -> None:
    """``serve --speculative ngram`` on a tiny DeepSeek-V4 pack: the server reserves the draft's rows
    before its warm-up (V4's window rings grown, its state allocated anew), drafts ride in the batched
    step as verify runs, and the greedy answer is the one a server without speculation gives."""
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4

    _with_and_without(tiny_deepseek_v4, tmp_path, 1, [3, 17, 42, 99, 5, 8, 61, 7] * 4, 24,
                      ("--speculative", "ngram", "--num-speculative-tokens", "3"))
