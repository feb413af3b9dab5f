"""DeepSeek-V4 runtime pieces: config reading, FP4/UE8M0 dequantization, YaRN, strict loading,
and the oracle's premise (our dequantized copy equals transformers' own FP8/FP4 loading)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from shardsmith.errors import RuntimeLoadError
from shardsmith.runtime.models.deepseek_v4 import V4Args
from shardsmith.runtime.models.deepseek_v4.ops import apply_rope, inv_freq
from shardsmith.runtime.layers.quant import dequantize_fp4, ue8m0_to_float
from shardsmith.testing.quant import dequantize_fp4_group, quantize_fp4_group

# the release's config.json, verbatim in the shipped header sample (and beside the checkout in shared/)
REAL_CONFIG = Path(__file__).parents[2] / "fixtures/deepseek-v4-flash-sample/release-config.json"


def test_release_config_is_read_like_transformers() -> None:
    if not REAL_CONFIG.is_file():
        pytest.skip("real inventory not present")
    from transformers import DeepseekV4Config

    raw = json.loads(REAL_CONFIG.read_text())
    args, hf = V4Args.from_config(raw), DeepseekV4Config(**raw)
    kinds = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
    assert args.kinds == tuple(kinds[t] for t in hf.layer_types)  # 46 ratios for 43 layers
    assert args.n_hash_layers == hf.mlp_layer_types.count("hash_moe") == 3
    assert args.rope_dim == hf.qk_rope_head_dim == 64
    assert args.ratios[:4] == (0, 0, 4, 128)
    assert args.yarn == {"factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0, "beta_slow": 1.0}


def test_yarn_frequencies_match_transformers() -> None:
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    raw = json.loads(REAL_CONFIG.read_text()) if REAL_CONFIG.is_file() else None
    if raw is None:
        pytest.skip("real inventory not present")
    rot = DeepseekV4RotaryEmbedding(DeepseekV4Config(**raw))
    args = V4Args.from_config(raw)
    torch.testing.assert_close(inv_freq(args.rope_dim, args.compress_theta, args.yarn), rot.compress_inv_freq)
    torch.testing.assert_close(inv_freq(args.rope_dim, args.rope_theta), rot.main_inv_freq)
    assert rot.compress_attention_scaling == 1.0


def test_bad_config_is_refused() -> None:
    base = {"num_hidden_layers": 2, "head_dim": 8, "compress_ratios": [0, 8]}
    with pytest.raises(RuntimeLoadError, match=r"compress_ratios \[8\]"):
        V4Args.from_config(base)
    with pytest.raises(RuntimeLoadError, match="missing field"):
        V4Args.from_config({**base, "compress_ratios": [0, 4]})


def test_fp4_dequantization_matches_reference() -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    packed, scale = quantize_fp4_group(w)
    torch.testing.assert_close(dequantize_fp4(packed, scale, torch.float32), dequantize_fp4_group(packed, scale),
                               atol=0, rtol=0)
    assert ue8m0_to_float(torch.tensor([2.0 ** -3, 1.0, 64.0]).to(torch.float8_e8m0fnu)).tolist() == [0.125, 1.0, 64.0]
    # rows starting at odd byte offsets cannot be read as 16-bit words: the per-byte table, same values
    wide = torch.cat((torch.zeros(48, 1, dtype=torch.int8), packed), dim=1)[:, 1:]
    assert wide.stride(0) % 2 == 1
    torch.testing.assert_close(dequantize_fp4(wide, scale, torch.float32), dequantize_fp4_group(packed, scale),
                               atol=0, rtol=0)
    # batched experts [E, R, C/2] (the decode paths' gathers)
    both = dequantize_fp4(torch.stack((packed, packed.flip(0))), torch.stack((scale, scale.flip(0))), torch.bfloat16)
    torch.testing.assert_close(both[1], dequantize_fp4_group(packed.flip(0), scale.flip(0)).bfloat16(), atol=0, rtol=0)


def test_rope_inverse_restores_input() -> None:
    x = torch.randn(5, 3, 16)
    cos, sin = (torch.arange(5)[:, None] * inv_freq(8, 10000.0)[None]).cos(), (torch.arange(5)[:, None] * inv_freq(8, 10000.0)[None]).sin()
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., :8], x[..., :8])  # leading channels untouched
    torch.testing.assert_close(apply_rope(y, cos, -sin), x)
    assert math.isclose(float(y[1, 0, 8:10].norm()), float(x[1, 0, 8:10].norm()), rel_tol=1e-5)


def test_missing_and_unexpected_tensors_are_all_listed(tiny) -> None:
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4, assign_weights
    from shardsmith.runtime.layers.parallel import Shards
    from shardsmith.runtime.engine.loader import load_rank_weights

    w = load_rank_weights(tiny("deepseek-v4"), rank=0, world_size=1, from_checkpoint=True)
    model = DeepseekV4(V4Args.from_config(w.config), Shards(w.plan, 0, torch.float32))
    dense = w.dense()
    dense.pop("layers.1.attn.indexer.wq_b.scale")
    dense["layers.0.attn.extra.weight"] = torch.zeros(2)
    with pytest.raises(RuntimeLoadError) as e:
        assign_weights(model, dense, w.banks(), device=torch.device("cpu"))
    assert "layers.1.attn.indexer.wq_b.weight_scale_inv" in str(e.value) and "layers.0.attn.extra.weight" in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="transformers' FP8 loader needs accelerate")
def test_dequantized_copy_equals_transformers_fp8_loading(tiny, tmp_path: Path) -> None:
    """The oracle premise: transformers' own FP8/FP4 CPU dequantization gives the copy's values exactly."""
    from shardsmith.testing.reference import dequantized_copy
    from transformers import DeepseekV4ForCausalLM

    src = tiny("deepseek-v4")
    native = DeepseekV4ForCausalLM.from_pretrained(str(src), dtype=torch.float32).state_dict()
    copy = DeepseekV4ForCausalLM.from_pretrained(str(dequantized_copy(src, tmp_path / "d")), dtype=torch.float32).state_dict()
    assert native.keys() == copy.keys()
    for name, t in native.items():
        assert torch.equal(t, copy[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 64), (1, 2, 128)])
def test_rope_pairs_equal_rope_bitwise(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The decode step's fewer-op RoPE (tables built once per step) gives the reference's bits, both ways."""
    from shardsmith.runtime.models.deepseek_v4.ops import apply_rope, apply_rope_pairs, inv_freq, rope_cos_sin, rope_pairs

    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (shape[0],), generator=g)
    cos, sin = rope_cos_sin(positions, inv_freq(32, 10000.0))  # r = 32 trailing channels
    for sign in (1, -1):  # the forward and the inverse rotation
        cs, sn = rope_pairs(cos, sign * sin)
        torch.testing.assert_close(apply_rope_pairs(x, cs, sn), apply_rope(x, cos, sign * sin), rtol=0, atol=0)
