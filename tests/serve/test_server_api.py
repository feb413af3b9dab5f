"""HTTP API without an engine: request validation, OpenAI error bodies, health while loading,
metrics text, SSE framing. The app is the real one with its engine thread not started (the state
the server is in while the ranks load), so every check below runs before any engine work.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from shardsmith.runtime.serve.metrics import Histogram, Metrics  # noqa: E402
from shardsmith.runtime.serve.protocol import SSE_DONE, sse  # noqa: E402
from shardsmith.runtime.serve.server import create_app  # noqa: E402
from shardsmith.runtime.serve.worker import EngineWorker  # noqa: E402

MODEL = "smollm2-moe-tp2"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}


@pytest.fixture()
def loading_client():
    metrics = Metrics()
    worker = EngineWorker(lambda: None, metrics=metrics, on_fatal=lambda msg: None)  # never started: loading
    with TestClient(create_app(worker, model_name=MODEL, metrics=metrics)) as client:
        yield client


def _error(resp, status: int, *, param=None, code=None, match: str = "") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert re.search(match, err["message"]), err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def test_malformed_json(loading_client) -> None:
    r = loading_client.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    _error(r, 400, code="invalid_json", match="not valid JSON")


@pytest.mark.parametrize("path,body,param,match", [
    ("/v1/chat/completions", CHAT | {"max_token": 5}, "max_token", "unknown field 'max_token'"),
    ("/v1/chat/completions", CHAT | {"max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", COMPLETION | {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("/v1/chat/completions", {"model": MODEL}, "messages", "missing required field 'messages'"),
    ("/v1/chat/completions", CHAT | {"messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "role"),
    ("/v1/chat/completions", CHAT | {"temperature": 3}, "temperature", "less than or equal to 2"),
    ("/v1/completions", COMPLETION | {"logprobs": 50}, "logprobs", "less than or equal to 20"),
    ("/v1/completions", COMPLETION | {"n": 0}, "n", "greater than or equal to 1"),
    ("/v1/chat/completions", CHAT | {"n": 129}, "n", "less than or equal to 128"),
    ("/v1/chat/completions", CHAT | {"stream_options": {"include_usage": True}}, "stream_options", "only allowed when 'stream'"),
    ("/v1/chat/completions", CHAT | {"stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x", "unknown field"),
    ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, "top_logprobs", "requires 'logprobs'"),
    ("/v1/chat/completions", CHAT | {"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ("/v1/chat/completions", CHAT | {"min_p": -0.1}, "min_p", "greater than or equal to 0"),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function"}]}, "tools", "tools\\[0\\] must be"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "yaml"}}, "response_format", "is not one of"),
    ("/v1/completions", COMPLETION | {"prompt": ["a", "b"]}, "prompt", "only one prompt"),
    ("/v1/completions", COMPLETION | {"prompt": ""}, "prompt", "must not be empty"),
    ("/v1/completions", COMPLETION | {"echo": True}, "echo", "not supported"),
    ("/v1/completions", COMPLETION | {"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
])
def test_bad_requests_get_400_with_openai_body(loading_client, path, body, param, match) -> None:
    err = _error(loading_client.post(path, json=body), 400, match=match)
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


def test_unknown_model_is_404(loading_client) -> None:
    _error(loading_client.post("/v1/chat/completions", json=CHAT | {"model": "gpt-4"}), 404,
           param="model", code="model_not_found", match=f"serves '{MODEL}'")


def test_valid_request_while_loading_is_503_and_server_keeps_serving(loading_client) -> None:
    for _ in range(2):
        _error(loading_client.post("/v1/completions", json=COMPLETION), 503, code="model_not_ready", match="loading")
    r = loading_client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "loading"}
    models = loading_client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    _error(loading_client.get("/v1/nothing"), 404)


def test_metrics_count_rejected_requests(loading_client) -> None:
    loading_client.post("/v1/completions", json=COMPLETION | {"best_of": 3})
    loading_client.post("/v1/completions", json=COMPLETION)
    text = loading_client.get("/metrics").text
    assert 'shardsmith_requests_total{endpoint="/v1/completions",status="400"} 1' in text
    assert 'shardsmith_requests_total{endpoint="/v1/completions",status="503"} 1' in text
    assert "shardsmith_ready 0" in text
    assert "# TYPE shardsmith_time_to_first_token_seconds histogram" in text


def test_histogram_is_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 5.0):
        h.observe(v)
    assert h.lines("x") == ['x_bucket{le="0.1"} 1', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 4',
                            "x_sum 6.05", "x_count 4"]


def test_sse_framing() -> None:
    event = sse({"text": "é 🙂", "n": 1})
    assert event == 'data: {"text":"é 🙂","n":1}\n\n'
    assert json.loads(event.removeprefix("data: ")) == {"text": "é 🙂", "n": 1}
    assert SSE_DONE == "data: [DONE]\n\n"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"model": "%s", "prompt": "\\ud800"}' % MODEL.encode(), "prompt"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udfffb"}]}' % MODEL.encode(),
     "messages.0.content"),
    ("/v1/chat/completions", b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", '
                             b'"text": "\\ud83d"}]}]}' % MODEL.encode(), "messages.0.content.0.text"),
    ("/v1/completions", b'{"model": "%s", "prompt": "x", "\\ud800": 1}' % MODEL.encode(), "\\ud800"),
])
def test_lone_surrogate_is_a_400_with_openai_body(loading_client, path, body, param) -> None:
    """JSON's \\ud800 escape decodes to a lone surrogate: refused by name, never a plain-text 500."""
    r = loading_client.post(path, content=body, headers={"content-type": "application/json"})
    err = _error(r, 400, param=param, code="invalid_unicode", match="not valid Unicode")
    assert "surrogate" in err["message"]
    r.content.decode("ascii")  # the body itself is plain ASCII JSON


def test_405_names_the_allowed_methods(loading_client) -> None:
    r = loading_client.get("/v1/chat/completions")
    _error(r, 405)
    assert r.headers["allow"] == "POST"
    r = loading_client.delete("/v1/models")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_openapi_schema_is_published(loading_client) -> None:
    schema = loading_client.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}"} <= set(schema["paths"])
    assert "post" in schema["paths"]["/v1/chat/completions"]
    assert "ChatCompletionRequest" in schema["components"]["schemas"]


def test_models_show_the_configured_context_while_loading() -> None:
    metrics = Metrics()
    worker = EngineWorker(lambda: None, metrics=metrics, on_fatal=lambda msg: None)  # never started: loading
    with TestClient(create_app(worker, model_name=MODEL, metrics=metrics, max_model_len=4096)) as client:
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 4096
        assert client.get(f"/v1/models/{MODEL}").json()["max_model_len"] == 4096


def test_models_retrieve(loading_client) -> None:
    r = loading_client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200
    card = r.json()
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "shardsmith"
    _error(loading_client.get("/v1/models/gpt-4"), 404, param="model", code="model_not_found",
           match=f"'gpt-4' does not exist; this server serves '{MODEL}'")
    assert loading_client.get("/v1/models/org/gpt-4").status_code == 404


def test_openapi_schema_names_the_served_model(loading_client) -> None:
    schema = loading_client.get("/openapi.json").json()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert schema["components"]["schemas"][name]["properties"]["model"]["enum"] == [MODEL]
    (param,) = schema["paths"]["/v1/models/{model}"]["get"]["parameters"]
    assert param["schema"]["enum"] == [MODEL]


def test_openapi_schema_says_which_values_are_served(loading_client) -> None:
    """Fields accepted only at their neutral value say so in the schema, and that value passes
    validation (a 503 while loading, not a 400); another one is refused as the schema says."""
    props = loading_client.get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["n"]["anyOf"][0]["maximum"] == 128
    assert props["response_format"]["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    ok = CHAT | {"n": 1, "tools": [], "tool_choice": "auto", "presence_penalty": 0}
    _error(loading_client.post("/v1/chat/completions", json=ok), 503, code="model_not_ready")
    _error(loading_client.post("/v1/chat/completions", json=CHAT | {"tool_choice": "required"}), 400, param="tool_choice")
