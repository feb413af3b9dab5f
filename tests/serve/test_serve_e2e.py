"""End to end: ``shardsmith serve`` on the real SmolLM2 MoE pack at TP=2 on CPU (gloo), as a real
subprocess on 127.0.0.1, spoken to over HTTP.

One server serves the module's request tests; the last of them stops it with SIGTERM and checks a
clean exit. A second server has a rank killed and must go down, saying which rank, in bounded time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shardsmith.testing.server import Server, post, sse_events

httpx = pytest.importorskip("httpx")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "smollm2-tp2"




@pytest.fixture(scope="module")
def pack(smollm2_pack) -> Path:
    """The session's TP=2 pack of the SmolLM2 MoE (shared, read-only)."""
    return smollm2_pack(2)


HEADER_TIMEOUT_S = 3.0  # short, so the stalled-connection test below is quick


@pytest.fixture(scope="module")
def server(pack: Path, tmp_path_factory: pytest.TempPathFactory):
    with Server(pack, tmp_path_factory.mktemp("log") / "serve.log", "--header-timeout", str(HEADER_TIMEOUT_S),
                "--body-timeout", str(HEADER_TIMEOUT_S), model=MODEL) as srv:
        yield srv


def test_health_and_models(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ready"}
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert data[0]["id"] == MODEL and data[0]["max_model_len"] == 2048


def test_chat_answers_paris(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 24})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["prompt_tokens"] > 10 and 0 < u["completion_tokens"] <= 24
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_stream_completion_with_usage(server: Server) -> None:
    req = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8}
    whole = post(server, "/v1/completions", req).json()
    r = post(server, "/v1/completions", req | {"stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert all(c["usage"] is None for c in text_chunks)
    streamed, cached = dict(usage_chunk["usage"]), usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert usage_chunk["choices"] == [] and streamed.pop("prompt_tokens_details") and \
        streamed == {k: v for k, v in whole["usage"].items() if k != "prompt_tokens_details"}
    assert cached == whole["usage"]["prompt_tokens"] - 1  # the same prompt again: all but its last token reused
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]
    assert " Paris" in whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == whole["choices"][0]["finish_reason"]


def test_stream_chat_chunks(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "temperature": 0,
                                              "max_tokens": 24, "stream": True})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in c for c in chunks)
    assert "Paris" in "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def test_stop_string_and_logprobs(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 24,
                                              "stop": ["Paris"], "logprobs": True, "top_logprobs": 3}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and "Paris" not in choice["message"]["content"]
    content = choice["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 3 and c["logprob"] <= 0 for c in content)
    assert "".join(bytes(c["bytes"]).decode() for c in content).startswith(choice["message"]["content"])
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "temperature": 0,
                                         "max_tokens": 4, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert lp["tokens"][0] == " Paris" and lp["text_offset"][0] == 0 and all(len(t) <= 2 for t in lp["top_logprobs"])


def test_seeded_sampling_is_reproducible(server: Server) -> None:
    req = {"model": MODEL, "prompt": "Once upon a time", "temperature": 1.0, "top_p": 0.9, "top_k": 50,
           "max_tokens": 8, "seed": 1234}
    a, b = (post(server, "/v1/completions", req).json()["choices"][0]["text"] for _ in range(2))
    assert a == b


def test_bad_requests_get_4xx_while_good_one_succeeds(server: Server) -> None:
    import concurrent.futures as cf

    bad = [
        (b'{"model": "smollm2-tp2", "messages": [', 400),
        (json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": -5}).encode(), 400),
        (json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 10**6}).encode(), 400),
        (json.dumps({"model": MODEL, "messages": QUESTION, "bogus": 1}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x " * 3000}).encode(), 400),
        (json.dumps({"model": "other", "messages": QUESTION}).encode(), 404),
    ]
    with cf.ThreadPoolExecutor(4) as pool:
        good = pool.submit(post, server, "/v1/chat/completions",
                           {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 24})
        results = list(pool.map(lambda b: httpx.post(f"{server.url}/v1/chat/completions" if b[0].find(b'prompt') < 0
                                                     else f"{server.url}/v1/completions", content=b[0],
                                                     headers={"content-type": "application/json"}, timeout=60), bad))
    for (_, status), r in zip(bad, results):
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert results[2].json()["error"]["code"] == "context_length_exceeded"
    assert "Paris" in good.result().json()["choices"][0]["message"]["content"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_stalled_and_truncated_connections_are_closed(server: Server) -> None:
    """50 connections that send half a request and idle, and one that declares ``Content-Length: 100``,
    sends 46 bytes and half-closes: each is answered and closed within its limit, while a chat request
    meanwhile answers about as fast as alone."""
    import socket

    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 4}

    def timed() -> float:
        t0 = time.monotonic()
        assert post(server, "/v1/chat/completions", body).status_code == 200
        return time.monotonic() - t0

    alone = min(timed() for _ in range(2))
    addr = ("127.0.0.1", server.port)
    stalled = [socket.create_connection(addr) for _ in range(50)]
    try:
        for s in stalled:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: app")
        t0 = time.monotonic()
        with socket.create_connection(addr) as cut:
            cut.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"{" * 46)
            cut.shutdown(socket.SHUT_WR)
            cut.settimeout(10)
            answer = b""
            while chunk := cut.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400") and b"Content-Length declared" in answer, answer
        busy = timed()
        assert busy < 2 * alone + 0.5, (busy, alone)
        for s in stalled:
            s.settimeout(HEADER_TIMEOUT_S + 10)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 3
    finally:
        for s in stalled:
            s.close()
    help_text = subprocess.run([sys.executable, "-m", "shardsmith.cli", "serve", "--help"], capture_output=True,
                               text=True, env=os.environ | {"COLUMNS": "200"}).stdout
    for flag in ("--header-timeout", "--body-timeout", "--keep-alive-timeout", "--max-connections"):
        assert flag in help_text


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130}}}


def test_json_schema_answers_validate(server: Server) -> None:
    """12 sampled answers (3 requests of n=4) under ``response_format`` ``json_schema``: each parses,
    validates and ends on its own; a streamed one's deltas join to a valid document; json_object
    gives an object; a schema llguidance cannot enforce is a 400 naming ``response_format``."""
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = [{"role": "user", "content": "Invent a person and give their name and age."}]
    answers = []
    for seed in range(3):
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ask, "response_format": fmt, "n": 4,
                                                  "temperature": 1.0, "seed": seed, "max_tokens": 60})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(doc := json.loads(choice["message"]["content"]), PERSON)
            answers.append(doc)
    assert len(answers) == 12 and len({json.dumps(a) for a in answers}) > 1
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ask, "response_format": fmt, "stream": True,
                                              "temperature": 0, "max_tokens": 60})
    deltas = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in sse_events(r)[:-1]]
    jsonschema.validate(json.loads("".join(deltas)), PERSON)
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ask, "temperature": 0, "max_tokens": 60,
                                              "response_format": {"type": "json_object"}})
    choice = r.json()["choices"][0]
    content = choice["message"]["content"]  # a greedy object may go on to max_tokens: then it is cut, still an object
    assert isinstance(json.loads(content), dict) if choice["finish_reason"] == "stop" else content.startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ask, "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "cannot be enforced" in r.json()["error"]["message"]


def test_metrics_reflect_requests(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["shardsmith_ready"] == 1 and values["shardsmith_load_seconds"] > 0
    # the start before the load, by phase (each rank's own clock), adds up with the job's part to the
    # command's whole: the launcher's start to ready
    phases = {k: values[f'shardsmith_start_seconds{{phase="{k}"}}'] for k in ("launcher", "rank_start", "imports", "group")}
    assert all(v >= 0 for v in phases.values()) and phases["launcher"] > 0 and phases["imports"] > 0, phases
    whole, parts = values["shardsmith_command_to_ready_seconds"], sum(phases.values()) + values["shardsmith_ready_seconds"]
    assert parts - 0.05 <= whole <= parts + 1.0, (whole, parts, phases)
    assert values['shardsmith_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 4
    assert values['shardsmith_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 4
    assert values['shardsmith_requests_total{endpoint="/v1/completions",status="200"}'] >= 5
    assert values["shardsmith_generation_tokens_total"] >= 50 and values["shardsmith_prompt_tokens_total"] > 50
    assert values["shardsmith_time_to_first_token_seconds_count"] >= 9
    assert values["shardsmith_inter_token_latency_seconds_count"] > 0


def test_client_disconnect_stops_generation(server: Server) -> None:
    def tokens() -> float:
        line = next(l for l in httpx.get(f"{server.url}/metrics").text.splitlines()
                    if l.startswith("shardsmith_generation_tokens_total "))
        return float(line.split()[1])

    before = tokens()
    req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=req, timeout=60) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i == 4:
                break
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "temperature": 0,
                                         "max_tokens": 2})
    assert r.json()["choices"][0]["text"].startswith(" Paris")
    assert tokens() - before < 60  # the abandoned request stopped early instead of running 400 tokens
    assert '{endpoint="/v1/completions",status="499"} 1' in httpx.get(f"{server.url}/metrics").text


def test_non_streaming_client_timeout_cancels_generation(server: Server) -> None:
    """A JSON (non-streaming) request whose client gives up stops generating at once; the next
    request runs right away instead of queuing behind ~1500 abandoned tokens."""
    def metric(prefix: str) -> float:
        return sum(float(l.rsplit(" ", 1)[1]) for l in httpx.get(f"{server.url}/metrics").text.splitlines()
                   if l.startswith(prefix))

    tokens, gone = "shardsmith_generation_tokens_total ", 'shardsmith_requests_total{endpoint="/v1/chat/completions",status="499"}'
    before, gone_before = metric(tokens), metric(gone)
    story = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
             "temperature": 0, "max_tokens": 1500}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=story, timeout=3)
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "temperature": 0,
                                         "max_tokens": 2})
    waited = time.monotonic() - t0
    assert r.json()["choices"][0]["text"].startswith(" Paris")
    assert waited < 15, waited  # not queued behind the abandoned request
    assert metric(tokens) - before < 120  # it stopped instead of running 1500 tokens
    assert metric(gone) == gone_before + 1


def test_zz_sigterm_stops_cleanly(server: Server) -> None:
    pids = server.rank_pids()
    assert sorted(pids) == [0, 1]
    t0 = time.monotonic()
    assert server.stop() == 0, server.log()
    assert time.monotonic() - t0 < 30
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert "server stopped" in server.log()


def test_killed_rank_takes_the_server_down(pack: Path, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed mid-stream: the client's stream ends, the server exits non-zero, saying why."""
    srv = Server(pack, tmp_path / "serve.log", model=MODEL)
    try:
        srv.wait_ready()
        pids = srv.rank_pids()
        req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "stream": True}
        received = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=req, timeout=60) as resp:
            try:
                for line in resp.iter_lines():
                    received.append(line)
                    if len(received) == 3:
                        os.kill(pids[1], signal.SIGKILL)
                        t0 = time.monotonic()
            except httpx.TransportError:
                pass
        code = srv.proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        srv.stop()
    log = srv.log()
    assert code != 0 and elapsed < 30, log
    assert f"rank 1 (pid {pids[1]}) was killed by signal SIGKILL" in log
    assert sum(line.startswith("data: {") for line in received) < 100  # the stream ended early
    assert not Path(f"/proc/{pids[0]}").exists() or "zombie" in Path(f"/proc/{pids[0]}/status").read_text().lower()
