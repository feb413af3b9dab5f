"""`shardsmith inspect` and `shardsmith plan` through the real CLI: output, JSON and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from shardsmith.cli import app

runner = CliRunner()


def test_inspect_json_categories(tiny) -> None:
    result = runner.invoke(app, ["inspect", str(tiny("deepseek-v4")), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["family"] == "deepseek-v4" and info["moe_layers"] == 5  # 4 layers + 1 MTP layer
    assert info["quantization"]["fp4-group"] == 5 * 8 * 3 and info["quantization"]["fp8-block"] > 0
    assert set(info["categories"]) == {"dense", "embeddings", "routed_experts"}
    assert info["problems"] == []


def test_plan_table_and_json(tiny) -> None:
    ckpt = str(tiny("mixtral-fp8"))
    result = runner.invoke(app, ["plan", ckpt, "--tp", "3"])
    assert result.exit_code == 0, result.output
    assert "attention replicated" in result.output and "tp-within-expert" in result.output
    result = runner.invoke(app, ["plan", ckpt, "--tp", "2", "--json", "--tensors"])
    summary = json.loads(result.stdout)
    assert summary["world_size"] == 2 and len(summary["ranks"]) == 2
    w1 = summary["tensors"]["model.layers.0.block_sparse_moe.experts.0.w1.weight"]
    assert w1["ranges"] == [[[0, 256]], [[256, 256]]]
    ranks = summary["ranks"]
    assert ranks[0]["expert_bank_bytes"] == ranks[1]["expert_bank_bytes"] > 0


def test_plan_refuses_bad_world_size_with_exit_1(real_v4) -> None:
    proc = subprocess.run([sys.executable, "-m", "shardsmith.cli", "plan", str(real_v4.root), "--tp", "16"],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "world_size=16 does not divide o_groups=8" in proc.stderr and "valid world sizes: 1, 2, 4, 8" in proc.stderr


def test_plan_on_real_inventory_json(real_v4) -> None:
    result = runner.invoke(app, ["plan", str(real_v4.root), "--tp", "8", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["moe_layers"] == 46
    assert all(r["host_bytes"] == summary["ranks"][0]["host_bytes"] for r in summary["ranks"])


def test_unknown_architecture_exit_1(tmp_path, tiny) -> None:
    import shutil

    ckpt = tmp_path / "c"
    shutil.copytree(tiny("mixtral"), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "shardsmith.cli", "plan", str(ckpt), "--tp", "2"], capture_output=True, text=True)
    assert proc.returncode == 1 and "unknown architecture 'FalconForCausalLM'; known:" in proc.stderr


def test_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for cmd in ("inspect", "plan"):
        assert cmd in result.output
