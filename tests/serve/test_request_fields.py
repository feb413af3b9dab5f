"""The request fields load tools and local-model clients send, against a real ``shardsmith serve``
(the real SmolLM2 MoE pack, TP=1, float32, on CPU): guidellm's and aiperf's fixed-length recipes,
the penalties and biases, stop tokens, chat template options, ``HEAD``, and 400s naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardsmith.testing.server import Server

httpx = pytest.importorskip("httpx")
MODEL = "smol"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_pack, tmp_path_factory: pytest.TempPathFactory):
    with Server(smollm2_pack(1), tmp_path_factory.mktemp("log") / "serve.log", "--dtype", "float32",
                model=MODEL) as srv:
        yield srv


def post(server: Server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120, **kw)


def sse_objects(resp: httpx.Response) -> list[dict]:
    data = [line.removeprefix("data: ") for line in resp.text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def greedy_ids(server: Server, prompt: str, n: int, **extra) -> list[str]:
    """The tokens (as strings) of a greedy completion, from its logprobs."""
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_guidellm_stream_with_continuous_usage_and_ignore_eos(server: Server) -> None:
    """guidellm's default request: streaming, ``continuous_usage_stats``, ``ignore_eos`` with a fixed
    ``max_tokens``: exactly that many tokens, every chunk's usage counting them."""
    body = {"messages": QUESTION, "max_tokens": 40, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    objs = sse_objects(post(server, "/v1/chat/completions", body))
    counts = [o["usage"]["completion_tokens"] for o in objs]
    assert counts == sorted(counts) and counts[-1] == 40 and objs[-1]["choices"] == []
    assert all(o["usage"]["total_tokens"] == o["usage"]["prompt_tokens"] + o["usage"]["completion_tokens"] for o in objs)
    finish = [c["finish_reason"] for o in objs for c in o["choices"] if c["finish_reason"]]
    assert finish == ["length"]


def test_aiperf_fixed_length_completion(server: Server) -> None:
    """aiperf's recipe: ``ignore_eos`` and ``min_tokens`` equal to ``max_tokens`` on completions."""
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 33, "min_tokens": 33, "ignore_eos": True,
                                         "temperature": 0.8, "seed": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 33 and r.json()["choices"][0]["finish_reason"] == "length"


def server_pack(server: Server) -> Path:
    return Path(server.proc.args[4])  # [python, -m, shardsmith.cli, serve, PACK, ...]


def token_id(server: Server, text: str) -> int:
    """The id of the one token that decodes to ``text`` (a ``logprobs`` token string)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(server_pack(server) / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_logit_bias_and_penalties_change_the_choice(server: Server) -> None:
    prompt = "The capital of France is"
    plain = greedy_ids(server, prompt, 6)
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5})
    runner_up = list(r.json()["choices"][0]["logprobs"]["top_logprobs"][0])[1]
    biased = greedy_ids(server, prompt, 6, logit_bias={str(token_id(server, runner_up)): 100})
    assert biased[0] == runner_up and biased != plain
    penalised = greedy_ids(server, prompt, 6, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=1.5)
    assert len(penalised) == 6 and len(set(penalised)) >= len(set(plain))  # penalties never make it repeat more


def test_stop_token_ids_and_include_stop_str(server: Server) -> None:
    prompt = "The capital of France is"
    plain = greedy_ids(server, prompt, 8)
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                         "stop_token_ids": [token_id(server, plain[2])]})
    assert r.json()["choices"][0]["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 3
    text = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
    stop = text.strip().split()[1]
    cut = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                           "stop": [stop]}).json()["choices"][0]["text"]
    kept = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": [stop],
                                            "include_stop_str_in_output": True}).json()["choices"][0]["text"]
    assert kept == cut + stop and stop not in cut


def test_continue_final_message_and_generation_prompt(server: Server) -> None:
    """``continue_final_message``: the prompt ends inside the assistant's partial answer, so the
    model continues it; the plain chat prompt is longer by the template's end of turn and new turn."""
    partial = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    r = post(server, "/v1/chat/completions", {"messages": partial, "max_tokens": 4, "temperature": 0,
                                              "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    closed = post(server, "/v1/chat/completions", {"messages": partial, "max_tokens": 4, "temperature": 0})
    assert closed.json()["usage"]["prompt_tokens"] > r.json()["usage"]["prompt_tokens"]
    both = post(server, "/v1/chat/completions", {"messages": partial, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    kw = post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2,
                                               "chat_template_kwargs": {"enable_thinking": False}})
    assert kw.status_code == 200, kw.text


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("min_p", 1.5),
    ("min_tokens", -1), ("top_k", -2), ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {"99999999": 1}), ("stop_token_ids", [99999999])])
def test_out_of_range_values_are_400s_naming_the_field(server: Server, field: str, value) -> None:
    r = post(server, "/v1/chat/completions", {"messages": QUESTION, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["param"].startswith(field), err


def test_min_tokens_above_max_tokens_and_unknown_fields(server: Server) -> None:
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "min_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokns": 3})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "unknown field 'max_tokns'" in msg and "openapi.json" in msg


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", f"/v1/models/{MODEL}", "/openapi.json"])
def test_head_works_wherever_get_does(server: Server, path: str) -> None:
    get = httpx.get(f"{server.url}{path}")
    head = httpx.head(f"{server.url}{path}")
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert httpx.head(f"{server.url}/v1/completions").status_code == 405
