"""One settings module: every ``SHARDSMITH_*`` variable is parsed, typed and checked in
:mod:`shardsmith.settings`, no other module reads one, there are at most eight, and README's table
lists each."""

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
    "shardsmith/testing/server.py": "the serve subprocess's environment (PYTHONUNBUFFERED)",
    "shardsmith/testing/ranks.py": "the caller's environment, carried into test ranks forked from the fork server",
    "shardsmith/runtime/engine/compile_cache.py": "points TorchInductor and Triton at a rank's compile cache folder",
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


def test_at_most_eight_variables() -> None:
    names = [v.name for v in settings.VARIABLES]
    assert len(names) <= 8 and len(set(names)) == len(names), names
    assert {i.variable for i in settings.ITEMS} == {"SHARDSMITH_KERNELS", "SHARDSMITH_TUNING"}
    assert len({(i.variable, i.key) for i in settings.ITEMS}) == len(settings.ITEMS)


def test_defaults_and_typed_values() -> None:
    s = Settings.from_env({})
    assert s == Settings() and s.fp8_dense is Kernel.AUTO and s.offload_miss is OffloadMiss.COPY and not s.spawned
    s = Settings.from_env({"SHARDSMITH_KERNELS": " fp8_dense=reference , hc_pre=kernel,host_experts=reference",
                           "SHARDSMITH_TUNING": "inplace_blocks=4x64,emulate_h2d_gbps= 25 ,offload_miss=read",
                           "SHARDSMITH_PIN_CORES": "0", "SHARDSMITH_SPAWNED_BY": "4242"})
    assert (s.fp8_dense, s.hc_pre, s.host_kernel, s.inplace_blocks, s.pin_cores, s.emulate_h2d_gbps, s.overlap_steps,
            s.offload_miss, s.spawned, s.spawned_by) == \
        (Kernel.OFF, Kernel.KERNEL, False, (4, 64), False, 25.0, None, OffloadMiss.READ, True, 4242)


def test_all_sets_every_kernel_and_later_items_win() -> None:
    s = Settings.from_env({"SHARDSMITH_KERNELS": "all=reference,fused_experts=kernel"})
    kernels = {i.field: getattr(s, i.field) for i in settings.ITEMS if i.variable == "SHARDSMITH_KERNELS"}
    assert kernels.pop("fused_experts") is Kernel.KERNEL
    assert set(kernels.values()) <= {Kernel.OFF, False}, kernels
    s = Settings.from_env({"SHARDSMITH_KERNELS": "hc_post=reference,all=auto"})
    assert s.hc_post is Kernel.AUTO and s.compile_pieces is Kernel.AUTO


def test_every_bad_entry_is_named_at_once() -> None:
    env = {"SHARDSMITH_KERNELS": "fused_experts=sometimes,warp_drive=on,hc_post", "SHARDSMITH_PIN_CORES": "yes",
           "SHARDSMITH_TUNING": "host_prefetch=-1,offload_miss=dma,emulate_h2d_gbps=inf",
           "SHARDSMITH_FUSED_EXPERTS": "off"}
    with pytest.raises(UsageError) as e:
        Settings.from_env(env)
    assert str(e.value) == (
        "SHARDSMITH_PIN_CORES='yes': expected 0 or 1; "
        "SHARDSMITH_KERNELS: fused_experts='sometimes': expected auto, kernel or reference; "
        "SHARDSMITH_KERNELS: unknown key 'warp_drive' (known: compile_pieces, compressor_step, decode_attention, "
        "fp8_dense, fused_experts, hc_post, hc_pre, host_experts, indexer_scores, merge_projections, offload_inplace, "
        "prefill_attention, router, all); "
        "SHARDSMITH_KERNELS: 'hc_post' is not key=word; "
        "SHARDSMITH_TUNING: host_prefetch='-1': expected a whole number in 0 .. 1048576; "
        "SHARDSMITH_TUNING: offload_miss='dma': expected one of copy, read; "
        "SHARDSMITH_TUNING: emulate_h2d_gbps='inf': expected a positive number; "
        "SHARDSMITH_FUSED_EXPERTS was removed: write SHARDSMITH_KERNELS=fused_experts=<auto|kernel|reference>")


def test_env_round_trip() -> None:
    s = Settings.from_env({"SHARDSMITH_KERNELS": "fp8_dense=reference,compile_pieces=reference",
                           "SHARDSMITH_DEBUG": "1", "SHARDSMITH_TUNING": "inplace_blocks=2x3,overlap_steps=0",
                           "SHARDSMITH_STEP_TRACE": "/tmp/t.jsonl"})
    for one in (s, Settings()):
        assert Settings.from_env(settings.env(one)) == one
    assert settings.items(s, "SHARDSMITH_KERNELS")["fp8_dense"] == "reference"
    assert settings.items(s, "SHARDSMITH_KERNELS")["compile_pieces"] == "reference"
    assert settings.items(Settings(), "SHARDSMITH_TUNING") == {"offload_miss": "copy", "inplace_blocks": "16x8",
                                                               "gloo_gather_max": "65536", "compile_rows": "static"}


def test_overrides_keep_the_other_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSMITH_KERNELS", "hc_pre=reference")
    monkeypatch.setenv("SHARDSMITH_PIN_CORES", "0")
    got = settings.overrides(fused_experts="kernel", offload_miss="read")
    assert set(got) == {"SHARDSMITH_KERNELS", "SHARDSMITH_TUNING"}
    s = Settings.from_env({**got, "SHARDSMITH_PIN_CORES": "0"})
    assert (s.hc_pre, s.fused_experts, s.offload_miss, s.pin_cores) == (Kernel.OFF, Kernel.KERNEL, OffloadMiss.READ, False)
    assert settings.spelling("router_kernel", "auto") == "SHARDSMITH_KERNELS=router=auto"
    assert settings.spelling("pin_cores") == "SHARDSMITH_PIN_CORES"
    with pytest.raises(UsageError, match="SHARDSMITH_TUNING=inplace_blocks='4,64': expected two positive ints"):
        settings.with_words(inplace_blocks="4,64")


def test_current_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSMITH_KERNELS", "hc_pre=reference")
    assert settings.current().hc_pre is Kernel.OFF
    monkeypatch.setenv("SHARDSMITH_KERNELS", "hc_pre=junk")
    with pytest.raises(UsageError, match="SHARDSMITH_KERNELS: hc_pre='junk'"):
        settings.check()
    assert settings.debug() is False  # asked by error handlers even then
    monkeypatch.setenv("SHARDSMITH_DEBUG", "1")
    assert settings.debug() is True


def test_readme_table_lists_every_variable_and_item() -> None:
    text = README.read_text()
    rows = dict(re.findall(r"^\| `(SHARDSMITH_[A-Z0-9_]+)` \| ([^|]+) \|", text, re.M))
    want = {v.name: v.kind for v in settings.VARIABLES if v.kind != "internal"}
    assert {k: v.strip() for k, v in rows.items()} == want
    docs = (PACKAGE.parent / "docs" / "settings.md").read_text()
    listed = set(re.findall(r"^\| `(SHARDSMITH_[A-Z]+)` \| `([a-z0-9_]+)` \|", docs, re.M))
    assert listed == {(i.variable, i.key) for i in settings.ITEMS}


def test_removed_switches_are_refused_with_what_became_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSMITH_FP8_GEMV", "off")
    with pytest.raises(UsageError, match="SHARDSMITH_FP8_GEMV was removed: one-token FP8 linears always take the GEMV"):
        settings.check()
    monkeypatch.setenv("SHARDSMITH_FP8_GEMV", "")
    assert settings.check().fp8_dense is Kernel.AUTO  # empty: unset
    monkeypatch.setenv("SHARDSMITH_OVERLAP_STEPS", "1")
    with pytest.raises(UsageError, match=r"SHARDSMITH_OVERLAP_STEPS was removed: write SHARDSMITH_TUNING=overlap_steps=<0 or 1>"):
        settings.check()
