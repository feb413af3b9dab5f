"""A config.json that contradicts the tensors, or experts that cannot stack into one bank, fail at
`plan` (exit 1, every mismatch named) instead of producing a pack that cuts heads in half."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardsmith.checkpoint import open_checkpoint
from shardsmith.cli import app
from shardsmith.errors import PlanError, exit_code_for
from shardsmith.plans import plan_checkpoint

runner = CliRunner()


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("change,fragment", [
    ({"num_attention_heads": 12}, "model.layers.0.self_attn.q_proj.weight': shape [384, 192] (BF16), but config.json implies [768, 192]"),
    ({"num_key_value_heads": 1}, "k_proj.weight': shape [192, 192]"),
    ({"hidden_size": 256}, "model.embed_tokens.weight': shape [320, 192]"),
    ({"num_local_experts": 8}, "hold 4 routed experts (e.g. model.layers.0); config.json says 8"),
    ({"intermediate_size": 1024}, "experts.0.w1.weight': shape [512, 192]"),
    ({"num_hidden_layers": 3}, "config.json's num_hidden_layers says 3"),
])
def test_mixtral_config_contradicting_tensors(tiny, tmp_path: Path, change: dict, fragment: str) -> None:
    ckpt = _edit_config(tiny("mixtral"), tmp_path / "c", **change)
    with pytest.raises(PlanError) as exc:
        plan_checkpoint(open_checkpoint(ckpt), 2)
    assert "config.json disagrees with the checkpoint's tensors" in str(exc.value) and fragment in str(exc.value)
    result = runner.invoke(app, ["plan", str(ckpt), "--tp", "2"])
    assert exit_code_for(result.exception) == 1
    result = runner.invoke(app, ["inspect", str(ckpt), "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["plannable"] is False


def test_deepseek_v4_config_contradicting_tensors(tiny, tmp_path: Path) -> None:
    ckpt = _edit_config(tiny("deepseek-v4"), tmp_path / "c", o_groups=2, n_routed_experts=6)
    with pytest.raises(PlanError) as exc:
        plan_checkpoint(open_checkpoint(ckpt), 2)
    msg = str(exc.value)
    assert "layers.0.attn.wo_a.weight': shape [512, 256] (F8_E4M3), but config.json implies [256, 512]" in msg
    assert "config.json says 6" in msg


def test_odd_expert_shape_fails_at_plan(tmp_path: Path) -> None:
    """One expert's w2 of another shape: refused by plan, not only later by split."""
    import torch

    from shardsmith.testing import tiny_mixtral
    from shardsmith.testing.tiny import write_checkpoint

    src = open_checkpoint(tiny_mixtral(tmp_path / "src", layers=1, experts=2))
    tensors = {n: src.read(n) for n in src.tensors}
    tensors["model.layers.0.block_sparse_moe.experts.1.w2.weight"] = torch.zeros(192, 500, dtype=torch.bfloat16)
    tensors["model.layers.0.block_sparse_moe.experts.1.w1.weight"] = torch.zeros(500, 192, dtype=torch.bfloat16)
    tensors["model.layers.0.block_sparse_moe.experts.1.w3.weight"] = torch.zeros(500, 192, dtype=torch.bfloat16)
    cfg = json.loads((src.root / "config.json").read_text())
    bad = write_checkpoint(tmp_path / "bad", tensors, cfg)
    with pytest.raises(PlanError) as exc:
        plan_checkpoint(open_checkpoint(bad), 1)
    assert "w1.weight': shape [500, 192]" in str(exc.value)


def test_plan_usage_errors(tiny) -> None:
    for args, fragment in ((["--tp", "0"], "--tp must be at least 1, got 0"),
                           (["--tp", "2", "--align", "0"], "--align must be at least 1"),
                           (["--tp", "2", "--tensors"], "use it with --json")):
        result = runner.invoke(app, ["plan", str(tiny("mixtral")), *args])
        assert exit_code_for(result.exception) == 1 and fragment in str(result.exception)


def test_expert_of_another_dtype_cannot_stack(tmp_path: Path) -> None:
    import torch

    from shardsmith.testing import tiny_mixtral
    from shardsmith.testing.tiny import write_checkpoint

    src = open_checkpoint(tiny_mixtral(tmp_path / "src", layers=1, experts=2))
    tensors = {n: src.read(n) for n in src.tensors}
    name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    tensors[name] = tensors[name].to(torch.float16)
    bad = write_checkpoint(tmp_path / "bad", tensors, json.loads((src.root / "config.json").read_text()))
    with pytest.raises(PlanError, match=r"experts.1.w1.weight: F16\[512, 192\] but .*experts.0.w1.weight is BF16"):
        plan_checkpoint(open_checkpoint(bad), 2)
