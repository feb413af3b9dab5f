"""The README's walk-through waits for the server before asking it, and a passing test run leaves
nothing in the system temp directory (the suite writes ~7 GB there)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_walk_through_waits_on_health_before_curl() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Walk-through", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = block.strip().splitlines()
    serve = next(i for i, line in enumerate(lines) if line.startswith("shardsmith serve"))
    ask = next(i for i, line in enumerate(lines) if line.startswith("curl") and "/v1/" in line)
    waits = [i for i, line in enumerate(lines) if re.search(r"until curl -sf \S+/health", line)]
    assert waits and serve < waits[0] < ask, block


def test_a_passing_run_removes_its_temp_files(tmp_path: Path) -> None:
    """Runs pytest with this project's configuration on a test that writes into tmp_path."""
    where = tmp_path / "where.txt"
    test = tmp_path / "test_writes.py"
    test.write_text(
        "def test_writes(tmp_path, tmp_path_factory):\n"
        f"    open({str(where)!r}, 'w').write(str(tmp_path_factory.getbasetemp()))\n"
        "    (tmp_path / 'big.bin').write_bytes(bytes(1 << 20))\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "no:cacheprovider", str(test)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    basetemp = Path(where.read_text())
    assert basetemp.name.startswith("pytest-") and not basetemp.exists()
