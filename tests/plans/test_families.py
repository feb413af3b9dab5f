"""The one registry (``shardsmith/families.py``): what plan, split, the runtime and the Mixtral config
read from it, and the quantization block the plan keeps per tensor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from shardsmith import families
from shardsmith.cli import app
from shardsmith.errors import PlanError, RuntimeLoadError

runner = CliRunner()


def test_the_registry_imports_without_torch() -> None:
    code = "import sys, shardsmith.families as f; f.family_of({'model_type': 'mixtral'}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("config, arch", [
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "mixtral"}, "Qwen3MoeForCausalLM"),  # the list wins
    ({"model_type": "qwen2_moe"}, "Qwen2MoeForCausalLM"),
    ({"model_type": "deepseek_v3"}, "DeepseekV3ForCausalLM"),
    ({"model_type": "llama"}, "llama"),  # unknown: named as given
])
def test_one_rule_names_the_architecture(config: dict, arch: str) -> None:
    from shardsmith.plans import family_of
    from shardsmith.runtime.models.registry import family_for

    assert families.architecture_of(config) == arch
    if arch in families.ARCHITECTURES:
        assert family_of(config) == arch
        if families.ARCHITECTURES[arch].family.servable:
            assert family_for(config).name == families.ARCHITECTURES[arch].family.label
    else:
        with pytest.raises(PlanError, match=f"unknown architecture '{arch}'"):
            family_of(config)
        with pytest.raises(RuntimeLoadError, match=f"architecture '{arch}' is not supported by the runtime"):
            family_for(config)


def test_every_reader_agrees_with_the_registry() -> None:
    from shardsmith.plans import FAMILIES
    from shardsmith.runtime.models.mixtral.config import FAMILIES as MIXTRAL_VARIANTS

    assert {a: f for a, (f, _) in FAMILIES.items()} == {a.name: a.family.name for a in families.ARCHITECTURES.values()}
    assert MIXTRAL_VARIANTS == {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
                                "Qwen2MoeForCausalLM": "qwen2_moe"}
    for fam in {a.family for a in families.ARCHITECTURES.values()}:
        assert callable(families.load(fam.plan))
        if fam.servable:
            assert callable(families.load(fam.runtime))


@pytest.fixture
def v3_unservable(monkeypatch):
    """The registry as it was before DeepSeek-V3 was served: planned and split, no runtime builder."""
    import dataclasses

    fam = dataclasses.replace(families.DEEPSEEK_V3, runtime=None)
    monkeypatch.setitem(families.ARCHITECTURES, "DeepseekV3ForCausalLM",
                        families.Architecture("DeepseekV3ForCausalLM", "deepseek_v3", fam))
    return fam


def test_every_planned_family_is_served_today() -> None:
    assert all(a.family.servable for a in families.ARCHITECTURES.values())
    assert {"DeepseekV3ForCausalLM", "GptOssForCausalLM"} <= set(families.served())


def test_the_runtime_refuses_a_family_it_plans_but_cannot_serve(v3_unservable) -> None:
    from shardsmith.runtime.models.registry import family_for

    with pytest.raises(RuntimeLoadError, match="'DeepseekV3ForCausalLM' \\(DeepSeek-V3\\) can be planned and split "
                                               "but is not served by this runtime yet \\(supported: DeepseekV4"):
        family_for({"architectures": ["DeepseekV3ForCausalLM"]})


def test_plan_and_split_warn_when_the_runtime_cannot_serve(tiny, tmp_path, v3_unservable) -> None:
    ckpt = str(tiny("deepseek-v3"))
    table = runner.invoke(app, ["plan", ckpt, "--tp", "2"])
    assert table.exit_code == 0, table.output
    assert "warning: the runtime cannot serve DeepSeek-V3 yet" in table.output
    plan = runner.invoke(app, ["plan", ckpt, "--tp", "2", "--json"])
    assert plan.exit_code == 0 and json.loads(plan.stdout)["servable"] is False
    split = runner.invoke(app, ["split", ckpt, str(tmp_path / "out"), "--tp", "1", "--json"])
    assert split.exit_code == 0, split.output
    assert json.loads(split.stdout)["servable"] is False
    served = runner.invoke(app, ["plan", str(tiny("mixtral")), "--tp", "2", "--json"])
    assert json.loads(served.stdout)["servable"] is True and "warning" not in served.output


def test_detect_quant_uses_the_block_read_once() -> None:
    from shardsmith.checkpoint.reader import TensorInfo
    from shardsmith.plans.resolve import detect_quant, fp8_block_size

    assert fp8_block_size({}) == (128, 128)
    assert fp8_block_size({"quantization_config": {"weight_block_size": [64, 32]}}) == (64, 32)
    w = TensorInfo("a.weight", "F8_E4M3", (128, 96), "f", 0, 128 * 96)
    s = TensorInfo("a.weight_scale_inv", "F32", (2, 3), "f", 0, 24)
    assert detect_quant(w, {w.name: w, s.name: s}, (64, 32)).block == (64, 32)
    with pytest.raises(PlanError, match="does not match fp8-block blocks \\[128, 128\\]"):
        detect_quant(w, {w.name: w, s.name: s}, (128, 128))


def test_the_plan_keeps_each_quantized_tensors_block_and_reads_old_plans(tiny) -> None:
    from shardsmith.checkpoint import open_checkpoint
    from shardsmith.plans import plan_checkpoint
    from shardsmith.plans.serialize import plan_from_dict, plan_to_dict

    plan = plan_checkpoint(open_checkpoint(tiny("deepseek-v4")), 2)
    blocks = {(tp.quant, tp.dtype): tp.block for tp in plan.tensors.values()}
    assert blocks[("fp8-block", "F8_E4M3")] == (128, 128) and blocks[("fp8-block", "F8_E8M0")] == (128, 128)
    assert blocks[("fp4-group", "I8")] == (1, 16)
    assert all(tp.block == () for tp in plan.tensors.values() if tp.quant == "none")
    data = plan_to_dict(plan)
    assert plan_from_dict(json.loads(json.dumps(data))) == plan
    for d in data["tensors"].values():  # a plan.json written before the block was kept
        assert ("block" in d) == (d["quant"] != "none")
        d.pop("block", None)
    assert plan_from_dict(data) == plan
