"""Bounded load test: 8 concurrent clients against ``shardsmith serve`` (SmolLM2 MoE, TP=2, CPU/gloo).

Duration: ``$SHARDSMITH_LOAD_SECONDS`` (default 15). Every request is greedy with a short
``max_tokens``, so each answer must equal the one a single client got before the load; no request
may fail; ``/health`` must stay fast (the event loop never waits on the engine) and ready after.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from shardsmith.testing.server import Server

MODEL = "smollm2-tp2"

CLIENTS = 8
DURATION_S = float(os.environ.get("SHARDSMITH_LOAD_SECONDS", "15"))
REQUESTS = [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                              "temperature": 0, "max_tokens": 8}),
    ("/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6,
                         "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": MODEL, "prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 6, "stop": [" 7"]}),
]


@pytest.fixture(scope="module")
def pack(smollm2_pack) -> Path:
    """The session's TP=2 pack of the SmolLM2 MoE (shared, read-only)."""
    return smollm2_pack(2)


async def answer(client: httpx.AsyncClient, path: str, body: dict) -> tuple[str, int]:
    """(text, completion_tokens) of one request; raises on any HTTP or protocol error."""
    r = await client.post(path, json=body)
    r.raise_for_status()
    if not body.get("stream"):
        data = r.json()
        choice = data["choices"][0]
        return choice.get("text", choice.get("message", {}).get("content")), data["usage"]["completion_tokens"]
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks[:-1]), chunks[-1]["usage"]["completion_tokens"]


async def run_load(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        expected = [await answer(client, p, b) for p, b in REQUESTS]
        assert "Paris" in expected[0][0]
        deadline = time.monotonic() + DURATION_S
        done, errors, in_flight, peak, health_lat = [0] * CLIENTS, [], [0], [0], []

        async def user(i: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                k = (i + n) % len(REQUESTS)
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
                try:
                    got = await answer(client, *REQUESTS[k])
                    if got != expected[k]:
                        errors.append(f"client {i} request {n} ({REQUESTS[k][0]}): {got!r} != {expected[k]!r}")
                except Exception as e:  # noqa: BLE001 - every failure is recorded and fails the test
                    errors.append(f"client {i} request {n}: {type(e).__name__}: {e}")
                finally:
                    in_flight[0] -= 1
                n += 1
                done[i] = n

        async def probe() -> None:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                r = await client.get("/health")
                health_lat.append((time.perf_counter() - t0, r.status_code))
                await asyncio.sleep(0.5)

        before = (await client.get("/metrics")).text
        await asyncio.gather(probe(), *(user(i) for i in range(CLIENTS)))
        health = await client.get("/health")
        after = (await client.get("/metrics")).text
    return {"done": done, "errors": errors, "peak": peak[0], "health": health.status_code,
            "health_lat": health_lat, "before": before, "after": after}


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_eight_clients_under_load(pack: Path, tmp_path: Path) -> None:
    srv = Server(pack, tmp_path / "serve.log", model=MODEL)
    try:
        srv.wait_ready()
        res = asyncio.run(run_load(srv.url))
        assert srv.proc.poll() is None, srv.log()
    finally:
        code = srv.stop()
    assert res["errors"] == [], res["errors"][:10]
    total = sum(res["done"])
    assert all(n >= 1 for n in res["done"]) and total >= CLIENTS, res["done"]
    assert res["peak"] == CLIENTS  # the clients really were concurrent (queued on the engine)
    assert res["health"] == 200
    assert all(status == 200 for _, status in res["health_lat"])
    assert max(lat for lat, _ in res["health_lat"]) < 2.0, "the event loop was blocked"
    served = _counter(res["after"], "shardsmith_requests_total") - _counter(res["before"], "shardsmith_requests_total")
    assert served == total
    assert "shardsmith_requests_running 0" in res["after"] and "shardsmith_requests_waiting 0" in res["after"]
    assert code == 0, srv.log()
