"""Ctrl-C and SIGKILL during ``shardsmith serve`` (issue 17, #10): real subprocesses, the SmolLM2 MoE
pack at TP=2, gloo on CPU.

Ctrl-C is sent as a terminal sends it: SIGINT to the launcher's whole process group. Every case
checks that no process of ours is left: the ranks and ``multiprocessing``'s resource tracker, all
children of the launcher, collected while it runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shardsmith.runtime.serve.launch import free_ports

httpx = pytest.importorskip("httpx")

START_TIMEOUT_S = 240.0
MODEL = "smol"


@pytest.fixture(scope="module")
def pack(smollm2_pack) -> Path:
    return smollm2_pack(2)


class Serve:
    """``shardsmith serve`` in its own session (process group), as a terminal would start it."""

    def __init__(self, pack: Path, log: Path) -> None:
        (self.port, dist_port), self.log_path = free_ports(2), log
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardsmith.cli", "serve", str(pack), "--port", str(self.port),
             "--dist-port", str(dist_port), "--served-model-name", MODEL],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"})
        self.children: set[int] = set()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while text not in self.log():
            self.note_children()
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no {text!r} in the log (exit {self.proc.poll()}):\n{self.log()}")
            time.sleep(0.1)
        self.note_children()

    def note_children(self) -> None:
        """Remember the launcher's children (ranks and resource tracker) while it runs."""
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            try:
                self.children.update(int(p) for p in task.read_text().split())
            except OSError:
                pass

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self.note_children()
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        pytest.fail(f"not ready after {START_TIMEOUT_S} s:\n{self.log()}")

    def ctrl_c(self) -> float:
        self.note_children()
        os.killpg(self.proc.pid, signal.SIGINT)
        return time.monotonic()

    def finish(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within {timeout:.0f} s; its process group:\n"
                        f"{self.snapshot()}\nlog:\n{self.log()}")
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self._log.close()

    def snapshot(self) -> str:
        """Each process of the group: state, kernel wait channel, command; and its Python stacks
        when ``py-spy`` is installed (what a hang needs to be understood)."""
        ps = subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:30,etime,args", "-g", str(self.proc.pid)],
                            capture_output=True, text=True).stdout
        pids = [int(line.split()[0]) for line in ps.splitlines()[1:] if line.split()]
        stacks = []
        if shutil.which("py-spy"):
            for pid in pids:
                r = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
                stacks.append(r.stdout + r.stderr)
        return ps + "\n".join(stacks)

    def left_behind(self, within_s: float = 3.0) -> list[int]:
        deadline = time.monotonic() + within_s
        while (alive := [p for p in self.children if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "zombie" not in status.lower()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def test_ctrl_c_while_loading_stops_the_load(pack: Path, tmp_path: Path) -> None:
    srv = Serve(pack, tmp_path / "serve.log")
    srv.wait_for("ready once every rank has loaded")  # rank 0's HTTP server is up; the engine is loading
    want, deadline = {f"shardsmith: rank {r} of 2 {pack}" for r in (0, 1)}, time.monotonic() + 30
    while not want <= (names := {_cmdline(p) for p in srv.children}) and time.monotonic() < deadline:
        time.sleep(0.1)  # rank 1 may still be importing
        srv.note_children()
    assert want <= names, names  # what `ps -ef` shows for the ranks
    t0 = srv.ctrl_c()
    code = srv.finish()
    elapsed, log = time.monotonic() - t0, srv.log()
    assert code == 130, log
    assert elapsed < 15, log
    assert "ready:" not in log and "stopped while loading" in log, log
    assert "Traceback" not in log and "ERROR" not in log, log
    assert len(srv.children) >= 2 and srv.left_behind() == [], (srv.children, log)


def test_ctrl_c_with_a_stream_in_flight_ends_it_with_an_error_event(pack: Path, tmp_path: Path) -> None:
    srv = Serve(pack, tmp_path / "serve.log")
    try:
        srv.wait_ready()
        req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "stream": True}
        events, t0 = [], None
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=req, timeout=60) as resp:
            for line in resp.iter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                if len(events) == 5 and t0 is None:
                    t0 = srv.ctrl_c()
        stream_s = time.monotonic() - t0
    finally:
        code = srv.finish()
    elapsed, log = time.monotonic() - t0, srv.log()
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert last["error"]["code"] == "server_shutting_down" and "SIG" in last["error"]["message"], last
    assert len(events) < 400  # the stream was cut by the stop, not finished
    assert stream_s < 3, log  # no graceful-shutdown stall
    assert code == 130 and elapsed < 15, log
    assert "Traceback" not in log and "CancelledError" not in log and "ERROR" not in log, log
    assert srv.left_behind() == [], (srv.children, log)


def test_sigkill_of_the_launcher_leaves_nothing(pack: Path, tmp_path: Path) -> None:
    """The ranks notice the launcher is gone and stop; the resource tracker goes with the launcher
    at once and has no semaphore to warn about."""
    srv = Serve(pack, tmp_path / "serve.log")
    srv.wait_for("rank pids:")
    time.sleep(1.0)
    srv.note_children()
    srv.proc.send_signal(signal.SIGKILL)
    srv.finish()
    assert len(srv.children) >= 2
    assert srv.left_behind(within_s=10.0) == [], (srv.children, srv.log())
    time.sleep(0.5)  # anything the tracker writes as it exits reaches the log
    assert "leaked semaphore" not in srv.log() and "resource_tracker" not in srv.log(), srv.log()


def test_sigterm_to_the_whole_group_mid_stream_is_a_clean_stop(pack: Path, tmp_path: Path) -> None:
    """As a service manager stops a unit: SIGTERM to every process at once. The other ranks die
    under rank 0's step; that is the stop, not a failure: exit 0, the stream ends with the stop event."""
    srv = Serve(pack, tmp_path / "serve.log")
    try:
        srv.wait_ready()
        req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=req, timeout=60) as resp:
            for line in resp.iter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                if len(events) == 5:
                    srv.note_children()
                    os.killpg(srv.proc.pid, signal.SIGTERM)
    finally:
        code = srv.finish()
    log = srv.log()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down", events[-3:]
    assert code == 0, log
    assert "ERROR" not in log and "Traceback" not in log, log
    assert srv.left_behind() == [], (srv.children, log)
