"""The shipped DeepSeek-V4-Flash header sample (tests/fixtures/deepseek-v4-flash-sample/: the release's
config and 3 of its 48 raw headers) opens, inspects and plans with real names, dtypes and shapes in
any checkout, with or without ../shared beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardsmith.checkpoint import open_checkpoint
from shardsmith.cli import app
from shardsmith.plans import Layout, plan_checkpoint

SAMPLE = Path(__file__).parents[1] / "fixtures" / "deepseek-v4-flash-sample"
runner = CliRunner()


@pytest.fixture(scope="module")
def sample() -> Path:
    return SAMPLE


def test_sample_is_small_and_real() -> None:
    assert sum(p.stat().st_size for p in SAMPLE.iterdir()) < 220_000
    ckpt = open_checkpoint(SAMPLE)
    assert ckpt.header_only and len(ckpt.files) == 3 and len(ckpt.tensors) == 999
    release = json.loads((SAMPLE / "release-config.json").read_text())
    assert {**release, "num_hidden_layers": 1} == ckpt.config  # the one edit the fixture README names
    assert release["num_hidden_layers"] == 43 and release["n_routed_experts"] == 160
    (shard,) = [f for f in ckpt.files.values() if f.name == "model-00005-of-00048.safetensors"]
    real = Path(__file__).resolve().parents[2].parent / "shared/real-inventories/deepseek-v4-flash-0731-reap160"
    if (real / (shard.name + ".json")).is_file():  # byte for byte the release's header
        assert shard.path.read_bytes() == (real / (shard.name + ".json")).read_bytes()


def test_sample_plans_like_the_release(sample: Path) -> None:
    ckpt = open_checkpoint(sample)
    plans = {w: plan_checkpoint(ckpt, w) for w in (1, 2, 4, 8)}
    for plan in plans.values():
        assert plan.experts == {"layers.3": 160}
    p4 = plans[4].tensors
    assert p4["layers.3.attn.wq_b.weight"].local_shape(1) == (8192, 1024)
    assert p4["layers.3.attn.wq_b.scale"].local_shape(1) == (64, 8)
    assert p4["layers.3.attn.wo_a.weight"].local_shape(2) == (2048, 4096)
    assert p4["layers.3.attn.wo_b.weight"].local_shape(3) == (4096, 2048)
    assert p4["layers.3.attn.attn_sink"].ranges[3] == ((48, 16),)
    assert p4["layers.3.ffn.experts.7.w2.weight"].local_shape(0) == (4096, 256)  # 512 FP4 values
    assert p4["layers.3.ffn.experts.7.w1.weight"].local_shape(0) == (512, 2048)
    assert p4["embed.weight"].layout is Layout.VOCAB
    aligned = plan_checkpoint(ckpt, 4, align=128)
    assert [n for (_, n), in aligned.tensors["embed.weight"].ranges] == [32384, 32384, 32256, 32256]
    b1, b2 = plans[1].rank_bytes(0)["expert_banks"], plans[2].rank_bytes(1)["expert_banks"]
    assert b1 == 2 * b2  # TP-within-expert halves each rank's expert bytes


def test_sample_refuses_tp16_naming_the_valid_sizes(sample: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "shardsmith.cli", "plan", str(sample), "--tp", "16"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "world_size=16 does not divide o_groups=8" in proc.stderr and "valid world sizes: 1, 2, 4, 8" in proc.stderr


def test_sample_inspect_and_plan_json(sample: Path) -> None:
    r = runner.invoke(app, ["inspect", str(sample), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["family"] == "deepseek-v4" and info["header_only"] and info["experts_per_layer"] == [160]
    r = runner.invoke(app, ["plan", str(sample), "--tp", "8", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["moe_layers"] == 1
    assert all(row["host_bytes"] == summary["ranks"][0]["host_bytes"] > 0 for row in summary["ranks"])
