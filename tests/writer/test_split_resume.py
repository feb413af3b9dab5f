"""A real ``shardsmith split`` process killed with SIGKILL partway leaves no pack; ``--resume``
finishes it, reusing the files the journal lists, and the result verifies against the source.

Deterministic: the child (``slow_split.py``) sleeps before it journals each finished file, and
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


SLOW_SPLIT = Path(__file__).with_name("slow_split.py")


def _cli(*args: str, slow: float | None = None, **kw) -> subprocess.Popen:
    """``shardsmith ARGS`` in a child process; with ``slow``, one that waits that many seconds per finished file."""
    head = [sys.executable, str(SLOW_SPLIT), str(slow)] if slow else [sys.executable, "-m", "shardsmith.cli"]
    return subprocess.Popen([*head, *args], env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def _finished_files(journal: Path) -> int:
    try:
        return sum('"file"' in line for line in journal.read_text().splitlines())
    except FileNotFoundError:
        return 0


def test_kill_then_resume(tiny, tmp_path: Path) -> None:
    src, out = tiny("deepseek-v3"), tmp_path / "out"
    args = ("split", str(src), str(out), "--tp", "4", "--max-file-bytes", "200000")
    child = _cli(*args, slow=0.5)
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


def test_resume_rewrites_a_damaged_journaled_file(tiny, tmp_path: Path, monkeypatch) -> None:
    """A journaled file that no longer matches its hash is written again, the rest reused."""
    import pytest

    from shardsmith.writer import split as split_mod

    src, out = tiny("qwen3-moe"), tmp_path / "out"

    def crash(*a, **k):
        raise KeyboardInterrupt("stop before the manifests")

    with monkeypatch.context() as m:
        m.setattr(split_mod, "finalize_pack", crash)
        with pytest.raises(KeyboardInterrupt):
            split_mod.split_checkpoint(src, out, world_size=2)
    partial = tmp_path / "out.partial"
    assert not out.exists() and (partial / "journal.jsonl").is_file()
    victim = sorted((partial / "rank-1-of-2").glob("experts-*"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    res = split_mod.split_checkpoint(src, out, world_size=2, resume=True)
    assert res.files_written == 1 and res.files_reused >= 3
    assert any(victim.name in n and "differs from its journal entry" in n for n in res.notes)
    rep = verify_pack(out, deep=True, against=src)
    assert rep.ok, rep.problems
