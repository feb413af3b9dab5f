"""A multi-turn chat against a running ``shardsmith serve``, as a chat client sends it: every turn
resends the whole history (system prompt, earlier questions and the answers it got back) plus a new
question, streamed, and its time to first token is measured. Used by the prefix-reuse tests and
``benchmarks/conversation.py``; needs ``httpx`` (the ``serve`` extra).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

__all__ = ["QUESTIONS", "Turn", "chat_turns", "long_history"]

_TOPICS = ("the river delta", "the old lighthouse", "the mountain railway", "the harbour market", "the glass works",
           "the winter festival", "the salt marshes", "the observatory", "the paper mill", "the stone bridge",
           "the orchard terraces", "the ferry crossing", "the clock tower", "the wool exchange", "the copper mine")
_FACTS = ("was founded {n} years before the town charter", "employs {n} people in the busy season",
          "is {n} metres from the main square", "was rebuilt {n} times after storms",
          "welcomes about {n} visitors each spring", "keeps records going back {n} generations")

QUESTIONS = ("Which place in the notes was rebuilt the most times? Answer in one sentence.",
             "Now name the place with the most visitors each spring.",
             "Thank you. Summarise the notes in two sentences.")


def long_history(paragraphs: int) -> str:
    """A system prompt of town notes, ``paragraphs`` paragraphs of varied facts (about 90 SmolLM2
    tokens each), deterministic."""
    out = []
    for i in range(paragraphs):
        topic = _TOPICS[i % len(_TOPICS)]
        facts = [f.format(n=(i * 7 + j * 13) % 97 + 3) for j, f in enumerate(_FACTS)]
        out.append(f"Note {i + 1}. In the town, {topic} " + ", ".join(facts[:3]) + ". It also " + ", and ".join(facts[3:])
                   + f". Visitors say {topic} is best seen in the {('morning', 'evening', 'afternoon')[i % 3]}.")
    return "You answer questions about these town notes.\n\n" + "\n".join(out)


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn's answer. Attributes: text; ttft_s: request sent to first content chunk (seconds);
    total_s: to the last chunk; prompt_tokens, cached_tokens, completion_tokens: the usage the
    server reported (cached: taken from an earlier request's state)."""

    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def chat_turns(url: str, model: str, system: str, questions: tuple[str, ...], *, max_tokens: int = 24,
               timeout: float = 600.0, answers: list[str] | None = None) -> list[Turn]:
    """Ask ``questions`` in one conversation (greedy, streamed with usage), each turn resending the
    history with the previous answers; one :class:`Turn` per question. ``answers``: the assistant
    turns to send instead of the ones received (the first ``len(answers)`` questions are not asked:
    their turns are taken as given), to ask a later turn alone.

    Raises:
        RuntimeError: a non-200 answer (its body in the message).
    """
    import httpx

    messages, turns = [{"role": "system", "content": system}], []
    for q, a in zip(questions, answers or ()):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    with httpx.Client(timeout=timeout) as client:
        for q in questions[len(answers or ()):]:
            messages.append({"role": "user", "content": q})
            body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0, first, text, usage = time.perf_counter(), None, [], None
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for c in chunk.get("choices", ()):
                        piece = c.get("delta", {}).get("content")
                        if piece:
                            first = first if first is not None else time.perf_counter()
                            text.append(piece)
            end = time.perf_counter()
            answer = "".join(text)
            turns.append(Turn(answer, (first or end) - t0, end - t0, usage["prompt_tokens"],
                              usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]))
            messages.append({"role": "assistant", "content": answer})
    return turns
