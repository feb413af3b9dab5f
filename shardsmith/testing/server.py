"""A real ``shardsmith serve`` subprocess on 127.0.0.1, for tests and benchmarks: started with free
ports, waited on until ``/health`` answers, stopped with SIGTERM (killed after a timeout), its log
kept in a file. Needs ``httpx`` (the ``serve`` extra).

Example::

    with Server(pack, tmp / "serve.log", "--max-num-seqs", "4", model="m") as srv:
        r = post(srv, "/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 4})
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shardsmith.runtime.serve.launch import free_ports

__all__ = ["READY_TIMEOUT_S", "Server", "ServerFailed", "post", "sse_events"]

READY_TIMEOUT_S = 180.0


class ServerFailed(RuntimeError):
    """The server exited before it was ready, or was not ready in time (the message holds its log)."""


class Server:
    """A ``shardsmith serve PACK`` subprocess and its log.

    Args:
        pack: what ``serve`` takes (a pack, or a checkpoint with ``--from-checkpoint`` in ``extra``).
        log: file that receives the server's stdout and stderr.
        extra: more ``serve`` arguments. model: ``--served-model-name``.
        ready_timeout: seconds :meth:`wait_ready` waits by default (a GPU's first warm-up takes minutes).
    """

    def __init__(self, pack: Path, log: Path, *extra: str, model: str = "model",
                 ready_timeout: float = READY_TIMEOUT_S) -> None:
        (self.port, dist_port), self.log_path, self.ready_timeout = free_ports(2), log, ready_timeout
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "shardsmith.cli", "serve", str(pack), "--port", str(self.port),
               "--dist-port", str(dist_port), "--served-model-name", model, *extra]
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=os.environ | {"PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float | None = None) -> None:
        """Return once ``/health`` answers 200 (``timeout``: seconds, default ``ready_timeout``).

        Raises:
            ServerFailed: the process exited first, or ``timeout`` seconds passed (with the log).
        """
        import httpx

        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"server exited with {self.proc.returncode} before ready:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise ServerFailed(f"server not ready after {timeout} s:\n{self.log()}")

    def rank_pids(self) -> dict[int, int]:
        """``{rank: pid}`` as the launcher logged them (empty before it did)."""
        m = re.search(r"rank pids: (.*)", self.log())
        return {int(r): int(p) for r, p in re.findall(r"rank (\d+)=(\d+)", m.group(1))} if m else {}

    def __enter__(self) -> "Server":
        """Ready to serve (``with Server(...) as srv``); stopped on the way out, whatever happened."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def post(server: Server, path: str, body: dict, **kw: Any):
    """``httpx.post`` of JSON ``body`` to ``path`` on ``server`` (120 s timeout); the response."""
    import httpx

    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kw)


def sse_events(resp) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing (one line, blank line after).

    Raises:
        AssertionError: the body is not framed that way.
    """
    text = resp.text
    assert text.endswith("\n\n"), text[-200:]
    blocks = text.split("\n\n")[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    return [b.removeprefix("data: ") for b in blocks]
