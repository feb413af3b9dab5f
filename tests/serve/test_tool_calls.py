"""Tool calls through the real server: ``shardsmith serve`` on the real SmolLM2 MoE pack (CPU, TP=1)
with ``--chat-template`` set to a Hermes-style ChatML template that lists tools
(``tests/fixtures/chat_templates/chatml_tools.jinja``). A named and a ``required`` ``tool_choice``
give ``tool_calls`` whose arguments follow the function's schema (streamed and not), the call and
its result go back in the history, and the final answer is content with no markup; ``auto``
answers never leak ``<tool_call>`` into content, streamed or not; bad tool requests are 400s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shardsmith.testing.server import Server, post, sse_events

jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2-tools"
TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "chatml_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a time zone.",
                                         "parameters": {"type": "object", "required": ["zone"], "additionalProperties": False,
                                                        "properties": {"zone": {"type": "string", "maxLength": 20}}}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(smollm2_pack, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("tools-log") / "serve.log"
    with Server(smollm2_pack(1), log, "--chat-template", str(TEMPLATE), model=MODEL) as srv:
        yield srv


def _chat(server: Server, **body) -> dict:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "temperature": 0, "max_tokens": 60} | body)
    assert r.status_code == 200, r.text
    return r.json()


def _check_call(call: dict, tool: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == tool["function"]["name"]
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_named_call_then_its_result_then_the_answer(server: Server) -> None:
    body = _chat(server, messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    _check_call(call, WEATHER)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21, "sky": "clear"}'}]
    final = _chat(server, messages=history, tools=[WEATHER, TIME], tool_choice="none")["choices"][0]
    assert final["message"]["content"] and "tool_calls" not in final["message"]
    assert "<tool_call>" not in final["message"]["content"] and "<tool_response>" not in final["message"]["content"]
    assert final["finish_reason"] in ("stop", "length")


def test_required_and_streamed_calls(server: Server) -> None:
    body = _chat(server, messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
    calls = body["choices"][0]["message"]["tool_calls"]
    assert calls and body["choices"][0]["finish_reason"] == "tool_calls"
    for call in calls:
        _check_call(call, WEATHER if call["function"]["name"] == "get_weather" else TIME)
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": NAMED,
                                              "temperature": 0, "max_tokens": 60, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)  # the arguments never stream as content
    (streamed,) = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert streamed["index"] == 0
    args = _check_call(streamed, WEATHER)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = _chat(server, messages=ASK, tools=[WEATHER], tool_choice=NAMED)["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(whole["function"]["arguments"]) == args  # greedy: the same call either way


def test_auto_answers_keep_markup_out_of_content(server: Server) -> None:
    whole = _chat(server, messages=ASK, tools=[WEATHER, TIME])["choices"][0]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME],
                                              "temperature": 0, "max_tokens": 60, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    streamed_calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", ())]
    assert "<tool_call>" not in content and "<tool_call>" not in (whole["message"]["content"] or "")
    assert content.strip() == (whole["message"]["content"] or "").strip()
    assert [c["function"]["name"] for c in streamed_calls] == \
        [c["function"]["name"] for c in whole["message"].get("tool_calls", [])]
    assert (whole["finish_reason"] == "tool_calls") == bool(whole["message"].get("tool_calls"))


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice",
     "not among 'tools'"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0] must be"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "give one"),
])
def test_bad_tool_requests_are_named(server: Server, body: dict, param: str, words: str) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK} | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_openai_client_calls_a_tool_and_answers(server: Server, stream: bool) -> None:
    """OpenAI's own Python client: a forced call to ``get_weather``, its result sent back as a
    ``tool`` message, then the final answer, whole and streamed."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=MODEL, temperature=0, max_tokens=60, tools=[WEATHER, TIME])
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(messages=ASK, tool_choice=NAMED, stream=True, **kw):
            choice = chunk.choices[0]
            assert not choice.delta.content  # the arguments never arrive as content
            for tc in choice.delta.tool_calls or ():
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
        assert finish == "tool_calls" and list(calls) == [0]
        call = {"id": calls[0]["id"], "type": "function",
                "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}
    else:
        reply = client.chat.completions.create(messages=ASK, tool_choice=NAMED, **kw)
        assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
        call = reply.choices[0].message.tool_calls[0].model_dump()
    _check_call(call, WEATHER)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21, "sky": "clear"}'}]
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(messages=history, tool_choice="none", stream=True, **kw))
    else:
        text = client.chat.completions.create(messages=history, tool_choice="none", **kw).choices[0].message.content
    assert text and "<tool_call>" not in text and "<tool_response>" not in text
