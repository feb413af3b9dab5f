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
