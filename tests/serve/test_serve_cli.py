"""CLI checks of ``serve`` / ``generate`` that fail before any rank starts, and the launcher's pieces."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardsmith.cli import app
from shardsmith.errors import UsageError
from shardsmith.runtime.serve.launch import RankFilter
from shardsmith.runtime.serve.placement import pack_world_size

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args), standalone_mode=False, catch_exceptions=True)


def test_help_is_fast_and_lists_commands() -> None:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "shardsmith.cli", "--help"], capture_output=True, text=True, check=True)
    assert time.perf_counter() - t0 < 5.0  # a fresh interpreter; the import itself is ~0.3 s
    for cmd in ("serve", "generate", "demo"):
        assert cmd in out.stdout
    from shardsmith import __version__

    version = subprocess.run([sys.executable, "-m", "shardsmith.cli", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout == f"shardsmith {__version__}\n"
    code = "import sys, shardsmith.cli; print('torch' in sys.modules, 'fastapi' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False False"


def test_not_a_pack(tmp_path: Path) -> None:
    r = _run("serve", str(tmp_path))
    assert "no pack.yaml" in str(r.exception)


@pytest.mark.parametrize("command", [("serve",), ("generate", "--prompt", "hi")])
def test_rank_directory_is_named_as_a_rank_of_the_pack(tmp_path: Path, command) -> None:
    pack = tmp_path / "out"
    (pack / "rank-1-of-2").mkdir(parents=True)
    (pack / "pack.yaml").write_text("format: shardsmith-pack\nworld_size: 2\n")
    (pack / "rank-1-of-2" / "manifest.yaml").write_text("rank: 1\n")
    r = _run(command[0], str(pack / "rank-1-of-2"), *command[1:])
    assert isinstance(r.exception, UsageError)
    assert f"is rank 1 of 2 of the pack at {pack}, not a pack: give the pack directory ({pack};" in str(r.exception)


def test_from_checkpoint_needs_tp(tmp_path: Path) -> None:
    r = _run("generate", str(tmp_path), "--prompt", "hi", "--from-checkpoint")
    assert "needs --tp" in str(r.exception)


def test_tp_must_match_pack(tmp_path: Path) -> None:
    (tmp_path / "pack.yaml").write_text("format: shardsmith-pack\nworld_size: 2\n")
    assert pack_world_size(tmp_path, tp=None, from_checkpoint=False) == 2
    r = _run("serve", str(tmp_path), "--tp", "4")
    assert "does not match the pack's world_size=2" in str(r.exception)


@pytest.mark.parametrize("args,match", [
    (("--device", "tpu"), "--device must be cpu or cuda"),
    (("--max-seq-len", "1"), "--max-model-len (--max-seq-len) must be at least 2"),
    (("--max-model-len", "0"), "--max-model-len (--max-seq-len) must be at least 2, got 0"),
    (("--dist-port", "70000"), "--dist-port must be in 1..65535"),
    (("--dist-port", "8000"), "--dist-port 8000 is also --port: the ranks' rendezvous and the HTTP server need a port each"),
    (("--decode-prompt-tokens", "-1"), "--decode-prompt-tokens must be between 0 and --max-model-len (2048), got -1"),
    (("--decode-prompt-tokens", "99999999999"), "--decode-prompt-tokens must be between 0 and --max-model-len (2048)"),
    (("--kv-cache-tokens", "1000"), "--kv-cache-tokens 1000 is less than one --max-model-len 2048 sequence; at least 2048"),
])
def test_bad_options(tmp_path: Path, args, match: str) -> None:
    (tmp_path / "pack.yaml").write_text("world_size: 2\n")
    assert match in str(_run("serve", str(tmp_path), *args).exception)


def test_kv_cache_tokens_for_a_family_whose_state_is_per_slot(tmp_path: Path) -> None:
    (tmp_path / "pack.yaml").write_text("world_size: 2\n")
    (tmp_path / "config.json").write_text('{"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}')
    message = str(_run("serve", str(tmp_path), "--kv-cache-tokens", "4096").exception)
    assert message == ("--kv-cache-tokens: DeepSeek-V4 keeps each slot's state for --max-model-len positions (the "
                       "KV caches of the Mixtral family, DeepSeek-V3 and gpt-oss are in blocks); leave it out")


def test_exit_code_through_main(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "shardsmith.cli", "serve", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1 and "no pack.yaml" in out.stderr


def test_rank_filter_passes_rank0_and_errors_only() -> None:
    rec = lambda level: logging.LogRecord("shardsmith", level, __file__, 1, "m", None, None)  # noqa: E731
    assert RankFilter(0).filter(rec(logging.INFO)) and RankFilter(None).filter(rec(logging.INFO))
    assert not RankFilter(1).filter(rec(logging.INFO))
    r = rec(logging.ERROR)
    assert RankFilter(1).filter(r) and r.rank == "rank 1"
