"""Thinking output as ``reasoning_content``: for a model with a thinking mode (DeepSeek's V3.1 and V4
formats, Qwen3's and DeepSeek-R1's templates: they write their reasoning before ``</think>``), the
answer's text before ``</think>`` is returned as ``reasoning_content`` and only the rest as
``content``, as vLLM's and SGLang's reasoning parsers and DeepSeek's own API do; streamed, the
reasoning goes out in ``reasoning_content`` deltas and the answer in ``content`` deltas, and no part
of a ``<think>``/``</think>`` marker reaches either. History messages may carry
``reasoning_content`` back (accepted and passed to the template, which decides whether to show it).

Where the answer starts: inside the reasoning when the prompt ends in an open ``<think>`` (DeepSeek's
thinking mode writes it into the prompt), else outside unless the answer itself opens with
``<think>`` (Qwen3). An answer cut by ``max_tokens`` before ``</think>`` is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardsmith.runtime.serve.tools import partial_marker

__all__ = ["END", "START", "Reasoning", "ReasoningStream", "prompt_opens_thinking"]

START, END = "<think>", "</think>"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether ``prompt_text`` ends inside a thinking block (its last ``<think>`` is not closed)."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


@dataclass(frozen=True, slots=True)
class Reasoning:
    """The reasoning split of one request. Attributes: inside: the answer starts inside the reasoning."""

    inside: bool

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning_content or None, content)`` of a whole answer."""
        inside, body = self.inside, text
        if not inside and body.lstrip().startswith(START):
            inside, body = True, body.lstrip()[len(START):]
        if not inside:
            return None, text
        at = body.find(END)
        if at < 0:
            return body.strip() or None, ""
        return body[:at].strip() or None, body[at + len(END):].lstrip()

    def stream(self) -> "ReasoningStream":
        """A :class:`ReasoningStream` for one streamed choice of this request."""
        return ReasoningStream(self.inside)


class ReasoningStream:
    """:meth:`push` each text delta, get ``(reasoning, content)`` safe to send now; text that may
    begin a marker is held back until the next delta tells. :meth:`finish`: what is left."""

    def __init__(self, inside: bool) -> None:
        self.state = "reasoning" if inside else "start"  # start: not yet known whether it opens with <think>
        self.buf = ""

    def push(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        out_r, out_c = "", ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(START):
                    self.buf, self.state = head[len(START):], "reasoning"
                    continue
                if START.startswith(head):  # may still become <think>: wait (whitespace included)
                    return out_r, out_c
                self.state = "content"
                continue
            if self.state == "reasoning":
                at = self.buf.find(END)
                if at >= 0:
                    out_r += self.buf[:at]
                    self.buf, self.state = self.buf[at + len(END):].lstrip(), "content_start"
                    continue
                keep = partial_marker(self.buf, END)
                out_r += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return out_r, out_c
            if self.state == "content_start":  # the blank lines after </think> are not content
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out_r, out_c
                self.state = "content"
            out_c += self.buf
            self.buf = ""
            return out_r, out_c

    def finish(self) -> tuple[str, str]:
        """``(reasoning, content)`` still held at the end of the answer."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "reasoning" else ("", rest if self.state != "content_start" else "")

