"""The one registry (``shardsmith/families.py``): what plan, split, the runtime and the Mixtral config
read from it."""

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


def test_the_runtime_refuses_a_family_it_plans_but_cannot_serve() -> None:
    from shardsmith.runtime.models.registry import family_for

    assert not families.DEEPSEEK_V3.servable
    with pytest.raises(RuntimeLoadError, match="'DeepseekV3ForCausalLM' \\(DeepSeek-V3\\) can be planned and split "
                                               "but is not served by this runtime yet \\(supported: DeepseekV4"):
        family_for({"architectures": ["DeepseekV3ForCausalLM"]})


def test_plan_and_split_warn_that_v3_is_not_served(tiny, tmp_path) -> None:
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
