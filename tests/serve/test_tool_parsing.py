"""Tool-call markup to OpenAI ``tool_calls`` (:mod:`shardsmith.runtime.serve.tools`), without a model:
Hermes/Qwen and DeepSeek (V3's and V3.1's) markup, the generic bare-object form, forced answers,
streamed answers cut at every point (no markup ever sent as content), history for templates."""

from __future__ import annotations

import json

import pytest

from shardsmith.runtime.serve.tools import (DEEPSEEK, GENERIC, HERMES, ToolPlan, call_schema, calls_from_constrained,
                                            detect_format, history_for_template, parse_calls)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

ANSWERS = {
    "hermes": (HERMES, 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                       '"opts": {"unit": "C"}}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}'
                       '</tool_call>'),
    "deepseek-v3": (DEEPSEEK, "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                              '```json\n{"city": "Paris", "opts": {"unit": "C"}}\n```<｜tool▁call▁end｜>\n'
                              "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
                              "<｜tool▁calls▁end｜>"),
    "deepseek-v3.1": (DEEPSEEK, "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                                '{"city": "Paris", "opts": {"unit": "C"}}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time'
                                "<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_markup_becomes_calls(name: str) -> None:
    fmt, text = ANSWERS[name]
    content, calls = parse_calls(fmt, text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "opts": {"unit": "C"}}), ("get_time", {})]
    assert parse_calls(fmt, "No calls here.") == ("No calls here.", [])
    broken = text.replace('"city": "Paris"', '"city": Paris')
    assert parse_calls(fmt, broken) is None  # malformed: the caller keeps the raw text
    plan = ToolPlan("auto", fmt, frozenset({"get_weather", "get_time"}), "auto")
    assert plan.split(broken) == (broken, [])


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_streamed_markup_never_reaches_content(name: str) -> None:
    """Every way of cutting the answer into two deltas, and one character at a time: the content
    sent is the text before the markup, and the calls come out at the end."""
    fmt, text = ANSWERS[name]
    plan = ToolPlan("auto", fmt, frozenset({"get_weather", "get_time"}), "auto")
    cuts = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for deltas in cuts:
        s = plan.stream()
        sent = "".join(s.push(d) for d in deltas)
        rest, calls = s.finish()
        assert (sent + rest).strip() == "Let me look." and fmt.start not in sent + rest
        assert [c.name for c in calls] == ["get_weather", "get_time"]
    s = plan.stream()  # text that looks like the start of the markup and is not
    sent = "".join(s.push(d) for d in ["a ", fmt.start[:3], "x b"])
    rest, calls = s.finish()
    assert sent + rest == "a " + fmt.start[:3] + "x b" and calls == []


def test_generic_bare_object_and_forced_answers() -> None:
    names = frozenset({"get_weather"})
    assert parse_calls(GENERIC, ' {"name": "get_weather", "arguments": {"city": "Oslo"}}', names)[1][0].name == \
        "get_weather"
    assert parse_calls(GENERIC, '{"name": "rm_rf", "arguments": {}}', names) is None  # not one of the tools
    assert parse_calls(GENERIC, "Oslo is cold.", names) == ("Oslo is cold.", [])
    s = ToolPlan("auto", GENERIC, names, "auto").stream()
    assert [s.push(d) for d in ['{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}']] == ["", ""]
    assert s.finish()[1][0].arguments == '{"city": "Oslo"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert call_schema([WEATHER, TIME], named) == WEATHER["function"]["parameters"]
    both = call_schema([WEATHER, TIME], "required")
    assert both["type"] == "array" and len(both["items"]["anyOf"]) == 2
    assert calls_from_constrained('{"city": "Oslo"}', named)[0].name == "get_weather"
    assert [c.name for c in calls_from_constrained('[{"name": "get_time", "arguments": {}}]', "required")] == ["get_time"]
    assert calls_from_constrained('[{"name": "get_ti', "required") is None  # cut by max_tokens
    forced = ToolPlan("forced", None, names, named).stream()
    assert forced.push('{"city": ') == "" and forced.push('"Oslo"}') == ""
    assert forced.finish()[1][0].arguments == '{"city": "Oslo"}'


def test_detect_format_and_history() -> None:
    assert detect_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert detect_format("<｜tool▁calls▁begin｜>") is DEEPSEEK
    assert detect_format("{{ messages }}") is None
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    out = history_for_template(history)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert history[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # the request is untouched
    assert out[1] == history[1]


REASONING = [(True, "Let me think. 2+2=4.</think>\n\nThe answer is 4.", ("Let me think. 2+2=4.", "The answer is 4.")),
             (False, "<think>\nhmm, <b>\n</think>\n\nFour.", ("hmm, <b>", "Four.")),
             (False, "Just four, <thinking> aside.", (None, "Just four, <thinking> aside.")),
             (True, "cut off while reasoning </thi", ("cut off while reasoning </thi", ""))]


@pytest.mark.parametrize("inside, text, want", REASONING)
def test_thinking_splits_from_the_answer_at_every_cut(inside: bool, text: str, want: tuple) -> None:
    from shardsmith.runtime.serve.reasoning import END, START, Reasoning, prompt_opens_thinking

    r = Reasoning(inside)
    assert r.split(text) == want
    for deltas in [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]:
        s = r.stream()
        parts = [s.push(d) for d in deltas] + [s.finish()]
        reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        assert (reasoning.strip() or None, content) == want, deltas
        assert END not in reasoning + content and (START not in reasoning + content or "<thinking>" in text)
    assert prompt_opens_thinking("<｜Assistant｜><think>") and not prompt_opens_thinking("<think>x</think>")
