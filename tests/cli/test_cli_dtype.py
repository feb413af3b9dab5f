"""`--dtype` on generate: the compute dtype reaches every rank; a bad value is a usage error."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardsmith.cli", *args], capture_output=True, text=True, timeout=600)


def test_generate_float32_at_tp2(smollm2_pack) -> None:
    proc = _run("generate", str(smollm2_pack(2)), "--chat", "--prompt", "What is the capital of France?",
                "--max-tokens", "12", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout and "torch.float32" in proc.stderr


def test_bad_dtype_is_a_usage_error(smollm2_pack) -> None:
    proc = _run("generate", str(smollm2_pack(2)), "--prompt", "x", "--dtype", "int8")
    assert proc.returncode == 1 and "--dtype must be auto, bfloat16, float16 or float32, got 'int8'" in proc.stderr
