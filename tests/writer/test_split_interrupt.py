"""Interrupted splits are the tool's to finish or replace: a partial with only rank directories and
``journal.tmp``, ``--resume`` on a finished pack, and Ctrl-C (in-process and a real SIGINT)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardsmith.cli import app
from shardsmith.errors import UsageError, exit_code_for
from shardsmith.writer import split as split_mod
from shardsmith.writer.split import split_checkpoint
from shardsmith.writer.verify import verify_pack

runner = CliRunner()


def _killed_at_first_journal(out: Path, world_size: int = 2) -> Path:
    """OUT.partial as a split killed right after writing its journal's temporary file leaves it."""
    partial = out.with_name(out.name + ".partial")
    for r in range(world_size):
        (partial / f"rank-{r}-of-{world_size}").mkdir(parents=True)
    (partial / "journal.tmp").write_text('{"key": {"format_version": 1}}\n')
    return partial


@pytest.mark.parametrize("flags", [(), ("--resume",), ("--force",)])
def test_partial_with_only_rank_dirs_and_journal_tmp(tiny, tmp_path: Path, flags: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    partial = _killed_at_first_journal(out)
    rep = verify_pack(partial)
    assert not rep.ok and any("--resume to continue it" in p for p in rep.problems), rep.problems
    r = runner.invoke(app, ["split", str(tiny("mixtral")), str(out), "--tp", "2", *flags])
    assert r.exit_code == 0, r.output
    assert not partial.exists() and verify_pack(out, deep=True).ok


def test_resume_on_a_finished_pack_says_it_is_complete(tiny, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = split_checkpoint(tiny("mixtral"), out, world_size=2)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    r = runner.invoke(app, ["split", str(tiny("mixtral")), str(out), "--tp", "2", "--resume"])
    assert r.exit_code == 0, r.output
    assert "already complete" in r.output and first.pack_id in r.output
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes  # nothing rewritten
    res = split_checkpoint(tiny("mixtral"), out, world_size=2, resume=True)
    assert res.already_complete and res.files_written == 0 and res.pack_id == first.pack_id
    with pytest.raises(UsageError, match="finished pack of another split .another plan or world size.*--force"):
        split_checkpoint(tiny("mixtral"), out, world_size=3, resume=True)
    with pytest.raises(UsageError, match="finished pack of another split .ranks"):
        split_checkpoint(tiny("mixtral"), out, world_size=2, ranks=(1,), resume=True)


def test_ctrl_c_in_process_exits_130_saying_resume_continues(tiny, tmp_path: Path, monkeypatch) -> None:
    src, out = tiny("deepseek-v3"), tmp_path / "out"
    calls = []

    def interrupt_after_first(self, *a, **k):
        calls.append(a)
        if len(calls) == 2:
            deadline = time.monotonic() + 30  # the first shard's tensors may still be queued: let a file finish,
            while not self.files and time.monotonic() < deadline:  # so the resume below has work to reuse
                time.sleep(0.01)
            raise KeyboardInterrupt
        return original(self, *a, **k)

    original = split_mod.Journal.source_done
    monkeypatch.setattr(split_mod.Journal, "source_done", interrupt_after_first)
    r = runner.invoke(app, ["split", str(src), str(out), "--tp", "2", "--max-file-bytes", "200000"])
    assert r.exit_code == 130, r.output
    assert "interrupted" in r.output and "out.partial holds the work done so far" in r.output
    assert "--resume to continue it" in r.output and not r.output.startswith("\n")
    monkeypatch.undo()
    v = runner.invoke(app, ["verify", str(tmp_path / "out.partial")], standalone_mode=False)
    assert exit_code_for(v.exception) == 2 and "--resume to continue it" in str(v.exception), v.exception
    done = runner.invoke(app, ["split", str(src), str(out), "--tp", "2", "--max-file-bytes", "200000", "--resume",
                               "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["files_reused"] >= 1
    assert verify_pack(out, deep=True, against=src).ok


def test_sigint_to_a_real_split(tiny, tmp_path: Path) -> None:
    src, out = tiny("deepseek-v3"), tmp_path / "out"
    args = [sys.executable, str(Path(__file__).with_name("slow_split.py")), "0.5", "split", str(src), str(out), "--tp", "4",
            "--max-file-bytes", "200000"]
    # SIGINT back to its default in the child, so Python installs its Ctrl-C handler there even when this
    # test runs as a shell's background job (which starts with SIGINT ignored, inherited by children)
    child = subprocess.Popen(args, env=dict(os.environ), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    journal = tmp_path / "out.partial" / "journal.jsonl"
    deadline = time.monotonic() + 60
    while not (journal.exists() and '"file"' in journal.read_text()):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "split made no progress"
        time.sleep(0.02)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 130, stderr
    assert "--resume to continue it" in stderr and "Traceback" not in stderr, stderr
    assert not out.exists()
    verify = subprocess.run([sys.executable, "-m", "shardsmith.cli", "verify", str(tmp_path / "out.partial")],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 2 and "--resume to continue it" in verify.stderr, verify.stderr
    resumed = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert verify_pack(out, deep=True, against=src).ok


def test_a_second_split_into_the_same_out_is_refused_while_the_first_runs(tiny, tmp_path: Path) -> None:
    """Two splits into one OUT would delete each other's OUT.partial mid-write: the second is refused,
    naming the holder, and touches nothing; once the first ends, a split runs."""
    from shardsmith.writer.outdir import split_lock

    out = tmp_path / "out"
    with split_lock(out):  # what a running split holds
        (tmp_path / "out.partial").mkdir()
        (tmp_path / "out.partial" / "marker").write_text("first split's work")
        with pytest.raises(UsageError, match=f"another split is writing it \\(pid {os.getpid()}"):
            split_checkpoint(tiny("mixtral"), out, world_size=2)
        assert (tmp_path / "out.partial" / "marker").read_text() == "first split's work"
        result = runner.invoke(app, ["split", str(tiny("mixtral")), str(out), "--tp", "2"])  # the CLI maps it to exit 1
        assert isinstance(result.exception, UsageError) and exit_code_for(result.exception) == 1
        assert "another split is writing it" in str(result.exception)
    (tmp_path / "out.partial" / "marker").unlink()
    (tmp_path / "out.partial").rmdir()
    split_checkpoint(tiny("mixtral"), out, world_size=2)
    assert verify_pack(out).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock file, no partial left
