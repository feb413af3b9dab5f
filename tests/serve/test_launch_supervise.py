"""The launcher's supervisor names the rank that caused a failure, whatever order the exits are seen in."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket

import pytest

from shardsmith.runtime.serve.launch import _supervise, free_port, free_ports


def _exit(code: int) -> None:
    if code < 0:
        os.kill(os.getpid(), -code)
    os._exit(code)


def _dead_ranks(codes: list[int]) -> list:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_exit, args=(c,)) for c in codes]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return procs


def test_signal_killed_rank_is_named_first_when_both_exits_land_in_one_poll(caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 SIGKILLed, rank 0 exited 1 after losing it; both are down before the supervisor looks."""
    procs = _dead_ranks([1, -signal.SIGKILL])
    with caplog.at_level(logging.ERROR, logger="shardsmith.runtime.serve.launch"):
        code = _supervise(procs)
    lines = [r.getMessage() for r in caplog.records]
    assert code == 1
    assert lines[0] == f"rank 1 (pid {procs[1].pid}) was killed by signal SIGKILL"
    assert lines[1] == f"rank 0 (pid {procs[0].pid}) exited with code 1"


def test_clean_exit_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    procs = _dead_ranks([0, 0])
    with caplog.at_level(logging.ERROR, logger="shardsmith.runtime.serve.launch"):
        assert _supervise(procs) == 0
    assert caplog.records == []


def test_free_ports_are_distinct_bindable_and_avoid_what_is_named() -> None:
    """An HTTP server and its rendezvous need different ports: ``free_ports`` holds each until all are chosen."""
    for _ in range(50):
        ports = free_ports(4)
        assert len(set(ports)) == 4
    avoid = set(free_ports(3))
    for _ in range(50):
        assert free_port(avoid=avoid) not in avoid
    socks = []
    try:
        for p in free_ports(3):  # each one is free: it binds
            socks.append(s := socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", p))
    finally:
        for s in socks:
            s.close()


def test_free_ports_lie_outside_the_ephemeral_range_where_a_rank_s_connections_could_take_them(
        tmp_path, monkeypatch) -> None:
    """While rank 0 loads, gloo's connections take ephemeral ports; a server port chosen among them
    can be taken before uvicorn binds it ("address already in use"). Where the range leaves no room
    outside it, the kernel picks."""
    import shardsmith.runtime.serve.launch as launch

    lo, hi = launch._ephemeral_range()
    ports = [p for _ in range(50) for p in free_ports(2)]
    assert all(not lo <= p <= hi and 10000 <= p <= 65535 for p in ports), (lo, hi, ports)
    fake = tmp_path / "range"
    fake.write_text("11000 65535\n")  # pool 10000..10999, below a range that reaches the top
    monkeypatch.setattr(launch, "EPHEMERAL_RANGE_FILE", fake)
    assert launch._ephemeral_range() == (11000, 65535)
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:  # a port of the pool in use is drawn again, never handed out
        busy = next(p for p in range(10000, 11000) if _binds(held, p))
        held.listen()
        drawn = [p for _ in range(200) for p in free_ports(5)]
        assert busy not in drawn and all(10000 <= p < 11000 for p in drawn)
    finally:
        held.close()
    fake.write_text("1024 65535\n")  # no room outside: the kernel's choice
    assert all(1024 <= p <= 65535 for p in free_ports(5))
    fake.write_text("not numbers\n")
    assert launch._ephemeral_range() == (49152, 65535)
    assert all(10000 <= p < 49152 for p in free_ports(5))


def _binds(s: socket.socket, port: int) -> bool:
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
