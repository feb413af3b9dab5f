"""One settings module: every ``SHARDSMITH_*`` variable is parsed, typed and checked in
:mod:`shardsmith.settings`, no other module reads one, and README's table lists each."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import shardsmith
from shardsmith import settings
from shardsmith.errors import UsageError
from shardsmith.settings import Kernel, OffloadMiss, Settings

PACKAGE = Path(shardsmith.__file__).parent
README = PACKAGE.parent / "README.md"

# modules that may touch os.environ at all, and for what: never a SHARDSMITH_* name
ENVIRON_USERS = {
    "shardsmith/settings.py": "the settings themselves",
    "shardsmith/runtime/serve/launch.py": "torchrun's variables; a rank's environment (RANK, threads, gloo)",
    "shardsmith/runtime/engine/dist.py": "torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE; the thread counts it sets",
    "shardsmith/parity/ranks.py": "a parity rank's RANK, thread counts and the reference paths it sets",
    "shardsmith/cli_serve.py": "torchrun's RANK and LOCAL_WORLD_SIZE in the pre-flight checks",
    "shardsmith/runtime/layers/kernels/_common.py": "Triton's own TRITON_INTERPRET",
    "shardsmith/ui.py": "the terminal's COLUMNS",
}


def environ_reads(source: str, where: str) -> list[str]:
    """Lines of ``source`` that use ``os.environ`` / ``os.getenv`` (``where: line: text``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        text = ast.unparse(node) if isinstance(node, ast.Attribute) else ""
        if text in ("os.environ", "os.getenv"):
            out.append(f"{where}:{node.lineno}: {text}")
    return sorted(set(out))


def shardsmith_names(source: str) -> list[str]:
    """``SHARDSMITH_*`` string constants in ``source`` (where a variable could be read by name)."""
    return sorted({n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str) and re.fullmatch(r"SHARDSMITH_[A-Z0-9_]+", n.value)})


def test_only_the_settings_module_reads_the_environment() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        src = path.read_text()
        reads = environ_reads(src, rel)
        if reads and rel not in ENVIRON_USERS:
            bad += reads
        if reads and rel != "shardsmith/settings.py" and (names := shardsmith_names(src)):
            bad.append(f"{rel}: touches os.environ and names {names}: go through shardsmith.settings")
    assert not bad, "\n".join(bad)


def test_the_scan_catches_a_planted_read() -> None:
    planted = 'import os\nMODE = os.environ.get("SHARDSMITH_NEW_SWITCH", "auto")\n'
    assert environ_reads(planted, "x.py") == ["x.py:2: os.environ"]
    assert shardsmith_names(planted) == ["SHARDSMITH_NEW_SWITCH"]
    assert environ_reads("import os\nos.getenv('X')\n", "y.py") == ["y.py:2: os.getenv"]


def test_defaults_and_typed_values() -> None:
    s = Settings.from_env({})
    assert s == Settings() and s.fp8_dense is Kernel.AUTO and s.offload_miss is OffloadMiss.COPY
    s = Settings.from_env({"SHARDSMITH_FP8_DENSE": "dequantize", "SHARDSMITH_HC_PRE": "kernel",
                           "SHARDSMITH_INPLACE_BLOCKS": "4,64", "SHARDSMITH_PIN_CORES": "0",
                           "SHARDSMITH_EMULATE_H2D_GBPS": " 25 ", "SHARDSMITH_OVERLAP_STEPS": ""})
    assert (s.fp8_dense, s.hc_pre, s.inplace_blocks, s.pin_cores, s.emulate_h2d_gbps, s.overlap_steps) == \
        (Kernel.OFF, Kernel.KERNEL, (4, 64), False, 25.0, None)


def test_every_bad_variable_is_named_at_once() -> None:
    env = {"SHARDSMITH_FUSED_EXPERTS": "sometimes", "SHARDSMITH_PIN_CORES": "yes", "SHARDSMITH_HOST_PREFETCH": "-1",
           "SHARDSMITH_OFFLOAD_MISS": "dma", "SHARDSMITH_EMULATE_H2D_GBPS": "inf", "SHARDSMITH_HC_POST": "auto"}
    with pytest.raises(UsageError) as e:
        Settings.from_env(env)
    assert str(e.value) == ("SHARDSMITH_PIN_CORES='yes': expected 0 or 1; "
                            "SHARDSMITH_FUSED_EXPERTS='sometimes': expected auto, kernel or off; "
                            "SHARDSMITH_OFFLOAD_MISS='dma': expected one of copy, read; "
                            "SHARDSMITH_HOST_PREFETCH='-1': expected a whole number in 0 .. 1048576; "
                            "SHARDSMITH_EMULATE_H2D_GBPS='inf': expected a positive number")


def test_words_round_trip() -> None:
    s = Settings.from_env({"SHARDSMITH_FP8_DENSE": "off", "SHARDSMITH_DEBUG": "1", "SHARDSMITH_INPLACE_BLOCKS": "2,3",
                           "SHARDSMITH_STEP_TRACE": "/tmp/t.jsonl", "SHARDSMITH_OVERLAP_STEPS": "0"})
    for one in (s, Settings()):
        assert Settings.from_env(settings.words(one)) == one
    assert settings.words(s, kind="kernel")["SHARDSMITH_FP8_DENSE"] == "off"


def test_current_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSMITH_HC_PRE", "off")
    assert settings.current().hc_pre is Kernel.OFF
    monkeypatch.setenv("SHARDSMITH_HC_PRE", "junk")
    with pytest.raises(UsageError, match="SHARDSMITH_HC_PRE='junk'"):
        settings.check()
    assert settings.debug() is False  # asked by error handlers even then
    monkeypatch.setenv("SHARDSMITH_DEBUG", "1")
    assert settings.debug() is True


def test_readme_table_lists_every_variable() -> None:
    text = README.read_text()
    rows = dict(re.findall(r"^\| `(SHARDSMITH_[A-Z0-9_]+)` \| ([^|]+) \|", text, re.M))
    want = {v.name: v.kind for v in settings.VARIABLES if v.kind != "internal"}
    assert {k: v.strip() for k, v in rows.items()} == want


def test_removed_switches_are_refused_with_what_became_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSMITH_FP8_GEMV", "off")
    with pytest.raises(UsageError, match="SHARDSMITH_FP8_GEMV was removed: one-token FP8 linears always take the GEMV"):
        settings.check()
    monkeypatch.setenv("SHARDSMITH_FP8_GEMV", "")
    assert settings.check().fp8_dense is Kernel.AUTO  # empty: unset
