"""``shardsmith generate`` (spawned ranks and under ``torchrun``) and ``shardsmith demo`` on the real
SmolLM2 MoE at TP=2 on CPU, as subprocesses; the answers come from the real model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from shardsmith.runtime.serve.launch import free_port as _free_port

PARIS = "The capital of France is Paris."




@pytest.fixture(scope="module")
def pack(smollm2_pack) -> Path:
    """The session's TP=2 pack of the SmolLM2 MoE (shared, read-only)."""
    return smollm2_pack(2)


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ | env)


def test_generate_spawns_ranks(pack: Path) -> None:
    out = _run([sys.executable, "-m", "shardsmith.cli", "generate", str(pack), "--chat", "--max-tokens", "16",
                "--prompt", "What is the capital of France?", "--prompt", "What is the capital of France?",
                "--dist-port", str(_free_port())])
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{PARIS}\n{PARIS}\n"  # nothing but the answers on stdout
    assert "[rank 1]" not in out.stderr  # only rank 0 logs
    if len(os.sched_getaffinity(0)) >= 2:  # each rank pinned to its own half of the CPUs (dist.pin_cores)
        assert "rank 0 of 2 on this host: pinned to CPUs" in out.stderr, out.stderr[-2000:]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_generate_under_torchrun(pack: Path) -> None:
    out = _run(["torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                "-m", "shardsmith.cli", "generate", str(pack), "--chat", "--max-tokens", "16",
                "--prompt", "What is the capital of France?"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(PARIS)


def test_demo(smollm2_bf16: Path, tmp_path: Path) -> None:
    cache = smollm2_bf16.parent.parent  # demo_cache: the demo reuses the checkpoint built for the tests
    out = _run([sys.executable, "-m", "shardsmith.cli", "demo", "--out", str(tmp_path / "pack"), "--max-tokens", "12"],
               SHARDSMITH_CACHE=str(cache))
    assert out.returncode == 0, out.stderr
    assert f"Q: What is the capital of France?\nA: {PARIS}" in out.stdout
    assert (tmp_path / "pack" / "pack.yaml").is_file() and "verify" in out.stderr
