"""Continuous batching through the HTTP server (issue 14): ``shardsmith serve`` on the real SmolLM2
MoE at world sizes 1 and 2 (CPU, gloo, float32), 4 sequence slots, 2 waiting places, prefill
chunks of 8 tokens.

Concurrent greedy requests with different prompts and lengths get exactly the tokens each gets
alone, and really ran as one batch (``/metrics``); a request joins while another streams and
finishes first; a seeded sampled request draws the same tokens in a batch as alone; past 4 running
and 2 waiting requests a new one gets a 429 with OpenAI's error body and ``Retry-After``; a client
that goes away frees its slot and the next waiting request is admitted.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from shardsmith.testing.server import Server

MODEL = "smol"
SLOTS, QUEUE = 4, 2
FLAGS = ("--dtype", "float32", "--max-num-seqs", str(SLOTS), "--max-queue", str(QUEUE), "--prefill-chunk", "8",
         "--max-model-len", "256", "--kv-cache-tokens", "896")
# different prompt lengths (the chat one is ~30 tokens: 4 prefill chunks) and completion lengths
REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 14}),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6}),
    ("/v1/completions", {"prompt": "def fibonacci(n):\n    ", "max_tokens": 16}),
    ("/v1/completions", {"prompt": "Water boils at", "max_tokens": 10}),
]


@pytest.fixture(scope="module")
def server(smollm2_pack, tmp_path_factory):
    """A TP=1 server; the TP=2 one runs in its own test (load is the slow part on this CPU)."""
    logs = tmp_path_factory.mktemp("log")
    os.environ["SHARDSMITH_STEP_TRACE"] = str(logs / "steps.jsonl")  # read by test_step_trace_accounts_for_every_token
    try:
        srv = Server(smollm2_pack(1), logs / "serve.log", *FLAGS, model=MODEL)
    finally:
        del os.environ["SHARDSMITH_STEP_TRACE"]
    srv.trace = logs / "steps.jsonl"
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def ask(srv: Server, path: str, body: dict, **extra) -> tuple[str, int]:
    """(text, completion tokens) of a non-streaming greedy request."""
    r = httpx.post(f"{srv.url}{path}", json={"model": MODEL, "temperature": 0} | body | extra, timeout=900)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice.get("text", (choice.get("message") or {}).get("content")), r.json()["usage"]["completion_tokens"]


def metrics(srv: Server) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{srv.url}/metrics", timeout=120).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def open_stream(client: httpx.Client, body: dict) -> httpx.Response:
    """A streaming completion whose headers arrived (the job is queued or running); read it later."""
    req = client.build_request("POST", "/v1/completions", json={"model": MODEL, "stream": True} | body)
    return client.send(req, stream=True)


def _invariance(server: Server) -> None:
    alone = [ask(server, path, body) for path, body in REQUESTS]
    before = metrics(server)
    with cf.ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = list(pool.map(lambda r: ask(server, *r), REQUESTS))
    after = metrics(server)
    assert together == alone
    assert "Paris" in alone[0][0] and all(n > 0 for _, n in alone)
    batched = (after["shardsmith_decode_batch_size_count"] - before["shardsmith_decode_batch_size_count"]) - (
        after['shardsmith_decode_batch_size_bucket{le="1.0"}'] - before['shardsmith_decode_batch_size_bucket{le="1.0"}'])
    assert batched > 0, "no decode step ran more than one sequence"
    steps = after["shardsmith_engine_step_seconds_count"] - before["shardsmith_engine_step_seconds_count"]
    assert steps >= after["shardsmith_decode_batch_size_count"] - before["shardsmith_decode_batch_size_count"] > 0
    assert after["shardsmith_engine_step_seconds_sum"] > before["shardsmith_engine_step_seconds_sum"]
    assert after["shardsmith_step_output_seconds_count"] - before["shardsmith_step_output_seconds_count"] == steps
    assert after["shardsmith_max_num_seqs"] == SLOTS and after["shardsmith_sequence_state_bytes"] > 0
    assert after["shardsmith_queue_time_seconds_count"] >= 2 * len(REQUESTS)
    assert f"{SLOTS} sequence slot(s) of 256 tokens" in server.log()
    assert "a KV pool of 896 positions in blocks of 16" in server.log()
    assert after["shardsmith_kv_cache_blocks"] == 56 and 0 < after["shardsmith_kv_cache_blocks_used"] <= 56


def test_concurrent_greedy_requests_get_the_tokens_each_gets_alone(server: Server) -> None:
    _invariance(server)


def test_concurrent_greedy_requests_get_the_tokens_each_gets_alone_at_tp2(smollm2_pack, tmp_path: Path) -> None:
    """At TP=2, with the two shortest completion prompts fed through decode rows (``--decode-prompt-tokens``)."""
    srv = Server(smollm2_pack(2), tmp_path / "serve.log", *FLAGS, "--decode-prompt-tokens", "6", model=MODEL)
    try:
        srv.wait_ready()
        assert "prompts of <= 6 tokens fed through decode steps" in srv.log()
        _invariance(srv)
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_request_joins_while_another_streams(server: Server) -> None:
    short = REQUESTS[1]
    want = ask(server, *short)
    with httpx.Client(base_url=server.url, timeout=900) as client:
        long = open_stream(client, {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0})
        lines = long.iter_lines()
        got = [line for line, _ in zip(lines, range(6))]  # a few tokens: it is streaming
        assert all(line.startswith("data: {") or not line for line in got)
        assert ask(server, *short) == want  # joined the running batch and finished
        rest = list(lines)
        long.close()
    texts = [json.loads(x.removeprefix("data: ")) for x in got + rest if x.startswith("data: {")]
    assert len([t for t in texts if t["choices"][0]["text"]]) > 10  # the long one kept going after
    assert texts[-1]["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_is_the_same_in_a_batch(server: Server) -> None:
    seeded = ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "top_p": 0.95,
                                  "seed": 1234})
    alone = ask(server, seeded[0], seeded[1] | {"temperature": 1.0})
    with cf.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(ask, server, *r) for r in REQUESTS[1:]]
        batched = ask(server, seeded[0], seeded[1] | {"temperature": 1.0})
        [f.result() for f in others]
    assert batched == alone


def test_queue_limit_429_and_a_disconnect_frees_its_slot(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=900) as client:
        streams = [open_stream(client, {"prompt": f"Story number {i}:", "max_tokens": 200}) for i in range(SLOTS + QUEUE)]
        deadline = time.monotonic() + 600  # engine steps take seconds each on a loaded 2-core machine
        while metrics(server)["shardsmith_requests_running"] < SLOTS and time.monotonic() < deadline:
            time.sleep(0.2)
        m = metrics(server)
        assert m["shardsmith_requests_running"] == SLOTS and m["shardsmith_requests_waiting"] == QUEUE, m
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=120)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "rate_limit_exceeded"
        assert f"--max-queue {QUEUE}" in err["message"] and int(r.headers["Retry-After"]) >= 1
        streams[0].close()  # the client goes away: its slot is freed, the first waiting request runs
        while metrics(server)["shardsmith_requests_waiting"] > QUEUE - 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        m = metrics(server)
        assert m["shardsmith_requests_waiting"] == QUEUE - 1 and m["shardsmith_requests_running"] == SLOTS, m
        for s in streams[1:]:
            s.close()
    while metrics(server)["shardsmith_requests_running"] > 0 and time.monotonic() < deadline + 300:
        time.sleep(0.2)
    m = metrics(server)
    assert m["shardsmith_requests_running"] == 0 and m["shardsmith_requests_waiting"] == 0, m
    assert ask(server, *REQUESTS[1])[1] > 0  # still serving


def test_requests_without_max_tokens_share_the_pool_and_a_preempted_one_keeps_its_answer(smollm2_pack,
                                                                                         tmp_path: Path) -> None:
    """Three slots of 64 positions over a pool of 176 (11 blocks of 16): three chat requests that leave
    ``max_tokens`` out (each runs to the context's end, ``ignore_eos``: 4 blocks, 12 together) are admitted
    on their prompts' blocks; as they grow the one that arrived last is preempted and resumes when another
    ends, its tokens computed again. Each ends with ``length`` at the context's end, and the last one's
    answer is the one it gets alone."""
    srv = Server(smollm2_pack(1), tmp_path / "serve.log", "--dtype", "float32", "--max-num-seqs", "3",
                 "--max-model-len", "64", "--kv-cache-tokens", "176", "--prefill-chunk", "16", model=MODEL)
    try:
        srv.wait_ready()
        bodies = [{"messages": [{"role": "user", "content": f"Tell story number {i}."}], "ignore_eos": True}
                  for i in range(3)]
        with cf.ThreadPoolExecutor(3) as pool:
            futures = []
            for body in bodies:  # one after the other: the arrival order is the order sent
                futures.append(pool.submit(httpx.post, f"{srv.url}/v1/chat/completions", timeout=900,
                                           json={"model": MODEL, "temperature": 0} | body))
                time.sleep(0.2)
            answers = [f.result().json() for f in futures]
        assert metrics(srv)["shardsmith_num_preemptions_total"] >= 1
        assert "preempted a sequence" in srv.log() and "raise --kv-cache-tokens" in srv.log()  # said once
        for a in answers:
            assert a["choices"][0]["finish_reason"] == "length"
            assert a["usage"]["prompt_tokens"] + a["usage"]["completion_tokens"] == 64
        assert ask(srv, "/v1/chat/completions", bodies[-1])[0] == answers[-1]["choices"][0]["message"]["content"]
    finally:
        assert srv.stop() == 0, srv.log()


def test_n_choices_are_seeded_sequences_each_reproducible_alone(server: Server) -> None:
    """``n=3``: three choices, ``index`` 0..2, choice i equal to the request alone with ``seed + i``;
    ``usage`` counts every choice's tokens; more choices than the server holds at once is a 400."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 41}
    r = httpx.post(f"{server.url}/v1/completions", json=body | {"n": 3}, timeout=900)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    alone = [ask(server, "/v1/completions", body | {"seed": 41 + i}) for i in range(3)]
    assert [(c["text"], c["finish_reason"]) for c in choices] == [(t, "length") for t, _ in alone]
    assert len({t for t, _ in alone}) > 1, "the choices' seeds differ, so should their texts"
    assert r.json()["usage"]["completion_tokens"] == sum(n for _, n in alone) == 24
    too_many = httpx.post(f"{server.url}/v1/completions", json=body | {"n": SLOTS + QUEUE + 1}, timeout=120)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n", too_many.text
    assert f"holds {SLOTS + QUEUE} sequences" in too_many.json()["error"]["message"]


def test_n_streamed_chat_choices_interleave_and_each_ends(server: Server) -> None:
    """A streamed chat request with ``n=2``: each choice opens with its role, ends with one finish
    chunk, and its content equals the same request's non-streamed choice."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
            "temperature": 1.0, "seed": 5, "n": 2}
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=900).json()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=900,
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [e["choices"][0] for e in events if e["choices"]]
    for i in range(2):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["finish_reason"] for c in mine[1:-1]] == [None] * (len(mine) - 2) and mine[-1]["finish_reason"]
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == whole["choices"][i]["message"]["content"]
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] > 0


def test_step_trace_accounts_for_every_token(server: Server) -> None:
    """``SHARDSMITH_STEP_TRACE``: one line per engine step, written when the batch goes idle; over two
    concurrent requests the lines count every prompt token (prefilled in chunks of 8 on a CPU, where
    no prompt is fed through decode rows) and every generated one (a decode row, or the token sampled
    from a prompt's last chunk)."""
    def lines() -> list[dict]:
        return [json.loads(x) for x in server.trace.read_text().splitlines()] if server.trace.exists() else []

    time.sleep(0.5)  # the batch is idle between tests: what earlier tests ran is written
    before = len(lines())
    bodies = [{"prompt": "The capital of France is", "max_tokens": 7},
              {"prompt": "def fibonacci(n):\n    return", "max_tokens": 5}]
    with cf.ThreadPoolExecutor(2) as pool:
        usage = list(pool.map(lambda b: httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "temperature": 0} | b,
                                                   timeout=900).json()["usage"], bodies))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (new := lines()[before:]):
        time.sleep(0.2)
    assert new, "no step lines were written after the requests"
    assert sum(x["prefill_tokens"] for x in new) == sum(u["prompt_tokens"] for u in usage)
    assert sum(x["feeding_rows"] for x in new) == 0
    first_tokens = 2  # each request's first token comes from its last prefill chunk, not a decode row
    assert sum(x["rows"] for x in new) + first_tokens == sum(u["completion_tokens"] for u in usage)
    assert max(x["rows"] for x in new) == 2 and all(x["engine_s"] > 0 and x["gap_s"] >= 0 for x in new)
    assert [x["t_s"] for x in new] == sorted(x["t_s"] for x in new)


def test_switch_interval_from_the_environment(monkeypatch, use_settings):
    """``SHARDSMITH_TUNING=switch_interval_ms=MS`` sets the interpreter's switch interval; junk is refused by name."""
    import sys

    from shardsmith.errors import UsageError
    from shardsmith.runtime.serve.worker import set_switch_interval

    before = sys.getswitchinterval()
    try:
        use_settings(switch_interval_ms="0.25")
        assert set_switch_interval() == pytest.approx(0.00025)
        for bad in ("0", "-1", "fast"):
            monkeypatch.setenv("SHARDSMITH_TUNING", f"switch_interval_ms={bad}")
            with pytest.raises(UsageError, match=f"SHARDSMITH_TUNING: switch_interval_ms={bad!r}"):
                set_switch_interval()
        monkeypatch.delenv("SHARDSMITH_TUNING")
        assert set_switch_interval() == pytest.approx(0.00025)  # unset: what is in force stays
    finally:
        sys.setswitchinterval(before)
