"""config.json fields, header-only headers and index entries are checked before use: each bad value is
a SourceError naming the file, the field, the value and the rule, and the CLI exits 1 without a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardsmith.checkpoint import open_checkpoint
from shardsmith.cli import app
from shardsmith.errors import ShardsmithError, SourceError, exit_code_for
from shardsmith.plans import plan_checkpoint
from shardsmith.testing.headers import smollm2_moe_headers

runner = CliRunner()
SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    """A header-only SmolLM2-shaped Mixtral: one layer, two experts."""
    return smollm2_moe_headers(tmp_path / "inv", fp8=False, layers=1, experts=2)


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _refused(root: Path, *fragments: str, tp: int = 2) -> str:
    """`plan` (open + plan) raises SourceError naming every fragment; the CLI exits 1 with it, no traceback."""
    with pytest.raises(SourceError) as exc:
        plan_checkpoint(open_checkpoint(root), tp)
    msg = str(exc.value)
    for f in fragments:
        assert f in msg, (f, msg)
    for args in (["inspect", str(root)], ["plan", str(root), "--tp", str(tp)]):
        result = runner.invoke(app, args, standalone_mode=False)
        assert isinstance(result.exception, ShardsmithError), (args, result.exception)
        assert exit_code_for(result.exception) == 1
    return msg


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_local_experts",
                                   "intermediate_size", "num_attention_heads", "num_key_value_heads"])
@pytest.mark.parametrize("value", ["x", {}, [1], float("nan"), float("inf"), -3, 0, True, 4.0, 1 << 40])
def test_a_count_that_is_not_a_positive_int_is_named(inventory: Path, field: str, value: object) -> None:
    _edit_json(inventory / "config.json", lambda c: c.__setitem__(field, value))
    shown = json.loads(json.dumps(value))  # NaN survives the round trip; repr matches what the reader saw
    _refused(inventory, "config.json", f"{field} is {shown!r}", "must be an integer >= 1")


@pytest.mark.parametrize("value", [8, {"a": 1}, [[]], [], [""], "MixtralForCausalLM"])
def test_architectures_must_be_a_non_empty_list_of_strings(inventory: Path, value: object) -> None:
    _edit_json(inventory / "config.json", lambda c: c.__setitem__("architectures", value))
    _refused(inventory, "config.json: architectures is", "non-empty list of non-empty strings")


def test_kv_heads_must_divide_query_heads(inventory: Path) -> None:
    _edit_json(inventory / "config.json", lambda c: c.__setitem__("num_key_value_heads", 2))  # 9 query heads
    _refused(inventory, "config.json: num_key_value_heads is 2", "does not divide num_attention_heads=9")


@pytest.mark.parametrize("edit, word", [(lambda c: c.pop("num_attention_heads"), "missing"),
                                        (lambda c: c.__setitem__("num_attention_heads", None), "null")])
def test_a_missing_field_is_named_with_the_architecture(inventory: Path, edit, word: str) -> None:
    _edit_json(inventory / "config.json", edit)
    _refused(inventory, f"config.json: field num_attention_heads is {word}", "MixtralForCausalLM")


def test_null_optional_fields_count_as_absent(inventory: Path) -> None:
    """transformers writes unset fields as null: architectures, head_dim, num_key_value_heads."""
    def edit(c: dict) -> None:
        c.update(architectures=None, head_dim=None, num_key_value_heads=3, num_experts=None)

    _edit_json(inventory / "config.json", edit)
    plan = plan_checkpoint(open_checkpoint(inventory), 3)
    assert plan.family == "mixtral"


def test_mixtral_tensors_called_deepseek_v3_name_the_missing_v3_field(inventory: Path) -> None:
    _edit_json(inventory / "config.json", lambda c: c.__setitem__("architectures", ["DeepseekV3ForCausalLM"]))
    _refused(inventory, "config.json: field qk_nope_head_dim is missing", "DeepseekV3ForCausalLM checkpoints need it")


@pytest.mark.parametrize("qc, fragment", [
    ([128, 128], "quantization_config is [128, 128]; it must be a JSON object"),
    ({"weight_block_size": 128}, "weight_block_size is 128; it must be two integers >= 1"),
    ({"weight_block_size": [128, "x"]}, "weight_block_size is [128, 'x']"),
])
def test_quantization_config_shape(inventory: Path, qc: object, fragment: str) -> None:
    _edit_json(inventory / "config.json", lambda c: c.__setitem__("quantization_config", qc))
    _refused(inventory, fragment)


def test_header_only_json_array_is_not_a_json_object(inventory: Path) -> None:
    (inventory / (SHARD + ".json")).write_text("[1, 2]")
    _refused(inventory, f"{SHARD}.json: header is not a JSON object")


@pytest.mark.parametrize("dtype", [[1], 5, None, {"a": "BF16"}])
def test_a_dtype_that_is_not_a_string_is_named(inventory: Path, dtype: object) -> None:
    _edit_json(inventory / (SHARD + ".json"), lambda h: h["model.norm.weight"].__setitem__("dtype", dtype))
    _refused(inventory, f"tensor 'model.norm.weight' has dtype {dtype!r}, which is not a string")


@pytest.mark.parametrize("value, fragment", [
    ("", "'' names no file"),
    ("./", "'./' names no file"),
    ("x" * 1000, "too long for a file name"),
    ("/etc/passwd", "names a path outside the checkpoint directory"),
    ("sub/../" + SHARD, "names a path outside the checkpoint directory"),
    ("a\0b", "contains a NUL byte"),
    ("model-00002-of-00002.safetensors", "neither it nor model-00002-of-00002.safetensors.json exists"),
])
def test_bad_weight_map_values_are_named(inventory: Path, value: str, fragment: str) -> None:
    _edit_json(inventory / "model.safetensors.index.json",
               lambda i: i["weight_map"].__setitem__("model.norm.weight", value))
    _refused(inventory, fragment)


def test_weight_map_value_naming_a_directory(inventory: Path) -> None:
    (inventory / "sub").mkdir()
    _edit_json(inventory / "model.safetensors.index.json",
               lambda i: i["weight_map"].__setitem__("model.norm.weight", "sub"))
    _refused(inventory, "is not a regular file")
