"""Connection limits on a real uvicorn server over real sockets (a small ASGI app that echoes the body).

Stalled headers and bodies get a 408 and are closed within their timeout, a body cut short by a
half-close gets a 400 the client can still read, a connection past ``max_connections`` a 503, and a
normal request keeps answering meanwhile. The same limits on ``shardsmith serve`` itself:
``tests/serve/test_serve_e2e.py``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

uvicorn = pytest.importorskip("uvicorn")
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from shardsmith.runtime.serve.http_limits import HTTPLimits, limited_protocol  # noqa: E402

LIMITS = HTTPLimits(header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_s=1.0, max_connections=60)


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"bytes": len(body)})


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                            http=limited_protocol(LIMITS), timeout_keep_alive=LIMITS.keep_alive_s)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started
    yield "127.0.0.1", port
    srv.should_exit = True
    thread.join(10)


def request(body: bytes = b'{"a": 1}', *, length: int | None = None) -> bytes:
    return (f"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body) if length is None else length}\r\n\r\n").encode() + body


def read_all(s: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Every byte until the server closes; and the seconds that took."""
    s.settimeout(timeout)
    t0, out = time.monotonic(), b""
    while chunk := s.recv(65536):
        out += chunk
    return out, time.monotonic() - t0


def status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def timed_request(addr: tuple[str, int]) -> tuple[int, float]:
    with socket.create_connection(addr) as s:
        t0 = time.monotonic()
        s.sendall(request())
        s.shutdown(socket.SHUT_WR)
        raw, _ = read_all(s, 5)
        return status_and_body(raw)[0], time.monotonic() - t0


def test_a_whole_request_is_answered(server) -> None:
    status, seconds = timed_request(server)
    assert status == 200 and seconds < 1.0


def test_stalled_connections_are_closed_and_others_still_served(server) -> None:
    """50 connections with half their headers, and one silent one: each gets its 408 within the header
    timeout (plus scheduling slack), while a normal request answers as fast as alone."""
    alone = min(timed_request(server)[1] for _ in range(3))
    stalled = [socket.create_connection(server) for _ in range(50)]
    try:
        for s in stalled[:-1]:
            s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\n")
        t0 = time.monotonic()
        busy = min(timed_request(server)[1] for _ in range(3))
        assert busy < max(10 * alone, 0.2), (busy, alone)
        for s in stalled:
            raw, _ = read_all(s, LIMITS.header_timeout_s + 5)
            status, body = status_and_body(raw)
            assert status == 408 and "--header-timeout" in body["error"]["message"], raw
        assert time.monotonic() - t0 < LIMITS.header_timeout_s + 2
    finally:
        for s in stalled:
            s.close()


def test_a_stalled_body_gets_408(server) -> None:
    with socket.create_connection(server) as s:
        s.sendall(request(b'{"a": ', length=100))
        raw, waited = read_all(s, LIMITS.body_timeout_s + 5)
    status, body = status_and_body(raw)
    assert status == 408 and "--body-timeout" in body["error"]["message"]
    assert LIMITS.body_timeout_s - 0.2 < waited < LIMITS.body_timeout_s + 2


def test_a_body_cut_short_by_a_half_close_gets_400(server) -> None:
    """``Content-Length: 100``, 46 bytes sent, then the client shuts its sending side."""
    with socket.create_connection(server) as s:
        s.sendall(request(b"x" * 46, length=100))
        s.shutdown(socket.SHUT_WR)
        raw, waited = read_all(s, 5)
    status, body = status_and_body(raw)
    assert status == 400 and "Content-Length declared" in body["error"]["message"] and "100" in body["error"]["message"]
    assert waited < 1.0


def test_headers_cut_short_by_a_half_close_get_400(server) -> None:
    with socket.create_connection(server) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\n")
        s.shutdown(socket.SHUT_WR)
        raw, _ = read_all(s, 5)
    assert status_and_body(raw)[0] == 400


def test_connections_past_the_limit_get_503(server) -> None:
    held = [socket.create_connection(server) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.2)  # every one accepted
        with socket.create_connection(server) as extra:
            raw, _ = read_all(extra, 5)
        status, body = status_and_body(raw)
        assert status == 503 and "--max-connections" in body["error"]["message"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert timed_request(server)[0] == 200  # the slots come back


def test_keep_alive_serves_a_second_request_then_closes_when_idle(server) -> None:
    with socket.create_connection(server) as s:
        s.settimeout(5)
        for _ in range(2):
            s.sendall(request())
            raw = b""
            while not raw.endswith(b'{"bytes":8}'):
                raw += s.recv(65536)
            assert raw.startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert s.recv(65536) == b""  # closed by the keep-alive timeout, no 408
        assert time.monotonic() - t0 < LIMITS.keep_alive_s + 2


def test_limits_name_their_flags() -> None:
    bad = HTTPLimits(header_timeout_s=0, body_timeout_s=-1, keep_alive_s=1, max_connections=0).problems()
    assert bad == ["--header-timeout must be more than 0 seconds, got 0",
                   "--body-timeout must be more than 0 seconds, got -1",
                   "--max-connections must be at least 1, got 0"]
