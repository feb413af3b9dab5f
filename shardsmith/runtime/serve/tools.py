"""Tool calls: ``tools`` and ``tool_choice`` in, OpenAI ``tool_calls`` out.

How a request's tools reach the model and how its calls come back:

- **Rendering.** ``tools`` go to the chat template as its ``tools`` variable (Qwen's, Hermes',
  DeepSeek's templates list them in the system turn), and assistant ``tool_calls`` and ``tool``
  messages of the history go through as the template expects them (``function.arguments`` as an
  object). A template that never mentions ``tools`` gets them as a system message instead
  (:func:`tools_system_text`), as llama.cpp's generic tool format does.
- **``auto``.** The model writes calls in its own markup (:class:`ToolFormat`: Hermes/Qwen
  ``<tool_call>{...}</tool_call>``, DeepSeek's ``<｜tool▁calls▁begin｜>...``), recognised from the
  template; the answer is split into ``content`` before the markup and the parsed calls
  (:meth:`ToolFormat.parse`). Streaming holds back any text that may begin the markup
  (:class:`ToolStream`), so no markup reaches ``content``; the calls go out as ``tool_calls``
  deltas once complete.
- **``required`` and a named function.** The answer is constrained by a JSON schema
  (:func:`call_schema`), as vLLM does: a named function's ``arguments`` object, or a non-empty array
  of ``{"name", "arguments"}`` for ``required``; it becomes ``tool_calls`` whatever the model's markup.

``finish_reason`` is ``tool_calls`` when the answer made calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["DEEPSEEK", "GENERIC", "HERMES", "ToolCall", "ToolFormat", "ToolPlan", "ToolStream", "call_schema", "calls_from_constrained",
           "detect_format", "history_for_template", "parse_calls", "partial_marker", "tools_system_text"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call. Attributes: name; arguments: the arguments as a JSON text (OpenAI's form)."""

    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (with ``index`` for a streamed delta)."""
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index} | out


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A model family's tool-call markup. Attributes: name; start: the text that opens the calls
    (everything from it on is calls); pattern: one call's regex, with either a group ``body`` (a
    ``{"name", "arguments"}`` object) or groups ``name`` and ``args`` (``name2``/``args2`` for a
    second spelling); whole: the call is the whole answer, a bare object (no markup)."""

    name: str
    start: str
    pattern: re.Pattern
    whole: bool = False

    def parse(self, text: str, names: frozenset[str] = frozenset()) -> tuple[str, list[ToolCall]] | None:
        """``(content, calls)`` of a whole answer: the text before :attr:`start` (stripped) and
        every call after it; ``(text, [])`` when there is no :attr:`start`; None when the markup
        is there but a call does not parse, or (``whole``) names a function not in ``names`` (the
        caller returns the raw text as content).
        """
        at = (0 if text.lstrip().startswith(self.start) else -1) if self.whole else text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for m in self.pattern.finditer(text, at):
            g = m.groupdict()
            try:
                if g.get("body") is not None:
                    body = json.loads(g["body"])
                    name, args = body["name"], body.get("arguments", body.get("parameters", {}))
                else:
                    name, args = (g.get("name") or g.get("name2")).strip(), json.loads(g.get("args") or g.get("args2"))
            except (ValueError, KeyError, TypeError, AttributeError):
                return None
            if not isinstance(name, str) or not isinstance(args, dict) or (self.whole and name not in names):
                return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return (text[:at].strip(), calls) if calls else None


HERMES = ToolFormat("hermes", "<tool_call>", re.compile(r"<tool_call>\s*(?P<body>\{.*?\})\s*</tool_call>", re.S))
# DeepSeek-V3 (``function<｜tool▁sep｜>name\n```json\n{...}\n```) and V3.1+ (``name<｜tool▁sep｜>{...}``)
DEEPSEEK = ToolFormat("deepseek", "<｜tool▁calls▁begin｜>", re.compile(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>(?P<name>[^\n]+)\n```json\n(?P<args>.*?)\n```"
    r"|(?P<name2>[^<]+?)<｜tool▁sep｜>(?P<args2>.*?))<｜tool▁call▁end｜>", re.S))
# a template with no tool markup: the system message asks for a bare {"name", "arguments"} object
GENERIC = ToolFormat("generic", "{", re.compile(r"\A\s*(?P<body>\{.*\})\s*\Z", re.S), whole=True)


def parse_calls(fmt: ToolFormat, text: str, names: frozenset[str] = frozenset()) -> tuple[str, list[ToolCall]] | None:
    """``fmt.parse(text, names)`` (:meth:`ToolFormat.parse`); ``names``: the request's functions."""
    return fmt.parse(text, names)


def detect_format(template_source: str) -> ToolFormat | None:
    """The markup a chat template's model writes calls in, from the template text (None: the
    template has no tool-call markup)."""
    if "tool▁calls▁begin" in template_source:
        return DEEPSEEK
    if "<tool_call>" in template_source:
        return HERMES
    return None


def history_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each assistant ``tool_calls`` entry's ``function.arguments`` as an object
    (templates write it with ``tojson``; OpenAI sends a JSON text); text that is not a JSON object
    is left as it is."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"])
                        if isinstance(args, dict):
                            fn["arguments"] = args
                    except ValueError:
                        pass
                fixed.append(dict(c) | {"function": fn} | ({"name": fn.get("name"), "arguments": fn.get("arguments")}))
            m = dict(m) | {"tool_calls": fixed}
        out.append(m)
    return out


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """A system message that lists ``tools`` for a template with no place for them."""
    specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return ("You can call these functions. To call one, answer with only a JSON object "
            '{"name": <function name>, "arguments": <its arguments>}.\n' + specs)


def _function(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for t in tools:
        fn = t.get("function") or {}
        if fn.get("name") == name:
            return fn
    raise KeyError(name)


def call_schema(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> dict[str, Any]:
    """The JSON schema a ``required`` or named ``tool_choice`` answer must follow: a named
    function's ``parameters`` (any object when it has none), or for ``required`` an array of one or
    more ``{"name": one of the functions, "arguments": its parameters}``.

    Raises:
        KeyError: a named function that is not among ``tools``.
    """
    if isinstance(choice, dict):
        return _function(tools, choice["function"]["name"]).get("parameters") or {"type": "object"}
    variants = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": fn["name"]}, "arguments": fn.get("parameters") or {"type": "object"}}}
                for fn in (t.get("function") or {} for t in tools)]
    return {"type": "array", "minItems": 1, "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}


def calls_from_constrained(text: str, choice: str | dict[str, Any]) -> list[ToolCall] | None:
    """The calls of an answer written under :func:`call_schema` (None: not a whole document, e.g.
    cut by ``max_tokens``)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if isinstance(choice, dict):
        return [ToolCall(choice["function"]["name"], json.dumps(doc, ensure_ascii=False))]
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in doc]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a request's answers become ``tool_calls``. Attributes: mode: ``auto`` (the model's own
    markup, :attr:`fmt`) or ``forced`` (a ``required`` or named ``tool_choice``, the answer written
    under :func:`call_schema`); names: the request's functions; choice: its ``tool_choice``."""

    mode: str
    fmt: ToolFormat | None
    names: frozenset[str]
    choice: Any

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole answer (content None when the answer is only calls)."""
        if self.mode == "forced":
            calls = calls_from_constrained(text, self.choice)
            return (text, []) if calls is None else (None, calls)
        parsed = parse_calls(self.fmt, text, self.names)
        if parsed is None or not parsed[1]:
            return text, []
        return parsed[0] or None, parsed[1]

    def stream(self) -> "ToolStream":
        """A :class:`ToolStream` for one streamed choice."""
        return ToolStream(self.fmt if self.mode == "auto" else None, self.names, self.choice)


class ToolStream:
    """Streamed ``auto`` answers: :meth:`push` each text delta and get the content safe to send now
    (never any part of the markup: text that may begin :attr:`ToolFormat.start` is held back until
    the next delta tells); :meth:`finish` returns the held text's content and the calls."""

    def __init__(self, fmt: ToolFormat | None, names: frozenset[str] = frozenset(), choice: Any = None) -> None:
        # fmt None: a forced answer (all of it is the calls' JSON: nothing is sent as content)
        self.fmt, self.names, self.choice = fmt, names, choice
        self.text, self.sent, self.in_calls = "", 0, fmt is None

    def push(self, delta: str) -> str:
        self.text += delta
        if self.in_calls:
            return ""
        if self.fmt.whole:  # a call is the whole answer: hold it all once it opens with "{"
            head = self.text.lstrip()
            if not head or head.startswith("{"):
                self.in_calls = bool(head)
                return ""
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        at = self.text.find(self.fmt.start, self.sent)
        if at >= 0:
            self.in_calls = True
            out, self.sent = self.text[self.sent:at], at
            return out.rstrip()
        keep = partial_marker(self.text, self.fmt.start)
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """``(content not sent yet, calls)`` at the end of the answer; malformed markup comes back
        as content."""
        if self.fmt is None:
            calls = calls_from_constrained(self.text, self.choice)
            if calls is None:
                self.sent = len(self.text)
                return self.text, []
            return "", calls
        parsed = parse_calls(self.fmt, self.text, self.names)
        if parsed is None or not parsed[1]:
            rest = self.text[self.sent:]
            self.sent = len(self.text)
            return rest, []
        return "", parsed[1]


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (characters a
    streamed answer holds back until the next delta says whether the marker follows)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
