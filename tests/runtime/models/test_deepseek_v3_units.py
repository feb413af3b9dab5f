"""DeepSeek-V3 pieces without running the model: the release's shapes built on ``meta`` (header-only
checkpoint, no data), YaRN against transformers' own functions, and configs the runtime refuses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch


@pytest.mark.parametrize("world_size", [4, 8])
def test_release_shapes_build_on_meta(tmp_path: Path, world_size: int) -> None:
    """The release's per-layer shapes (header-only): whole heads per rank, the 576-value latent cache,
    7168x2048 experts split on the intermediate dim, 3 dense layers, the MTP layer not built."""
    from shardsmith.checkpoint import open_checkpoint
    from shardsmith.plans import plan_checkpoint
    from shardsmith.runtime.layers.parallel import Shards
    from shardsmith.runtime.models.deepseek_v3 import DeepseekV3, V3Args
    from shardsmith.runtime.models.deepseek_v3.moe import MoE
    from shardsmith.testing.tiny_v3 import deepseek_v3_headers

    ckpt = open_checkpoint(deepseek_v3_headers(tmp_path / "v3", layers=4))
    plan = plan_checkpoint(ckpt, world_size)
    rank = world_size - 1
    model = DeepseekV3(V3Args.from_config(ckpt.config), Shards(plan, rank, torch.bfloat16))
    heads = 128 // world_size
    assert len(model.model.layers) == 4 and [isinstance(la.mlp, MoE) for la in model.model.layers] == [False] * 3 + [True]
    attn = model.model.layers[3].self_attn
    assert attn.n_heads == heads and attn.c + attn.rope == 576
    assert tuple(attn.q_b_proj.weight.shape) == (heads * 192, 1536)
    assert tuple(attn.kv_b_proj.weight.shape) == (heads * 256, 512)
    assert tuple(attn.o_proj.weight.shape) == (7168, heads * 128)
    assert tuple(attn.kv_a_proj_with_mqa.weight_scale_inv.shape) == (5, 56)  # 576 rows: a ragged edge block
    bank = model.model.layers[3].mlp.experts
    assert tuple(bank.gate_up.shape) == (256, 2 * 2048 // world_size, 7168) and bank.gate_up.dtype == torch.float8_e4m3fn
    assert tuple(model.lm_head.weight.shape) == (129280 // world_size, 7168)


def test_yarn_matches_transformers() -> None:
    """RoPE frequencies, the cos/sin scale and the softmax scale as transformers computes them, for the
    release config (factor 40, mscale = mscale_all_dim) and the tiny one (mscale != mscale_all_dim)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from shardsmith.runtime.models.deepseek_v3.config import V3Args, rope_frequencies
    from shardsmith.testing.tiny_v3 import DEEPSEEK_V3_CONFIG, YARN

    tiny = DEEPSEEK_V3_CONFIG | {"rope_scaling": YARN, "max_position_embeddings": 512}  # the tiny checkpoints' RoPE
    for config in (DEEPSEEK_V3_CONFIG, tiny):
        hf = DeepseekV3Config(**{k: v for k, v in config.items() if k != "quantization_config"})
        inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
        args = V3Args.from_config(config)
        got_inv, got_scale = rope_frequencies(args)
        torch.testing.assert_close(got_inv, inv, atol=0, rtol=0)
        assert got_scale == pytest.approx(scale, rel=1e-12)
        assert args.softmax_scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 192 ** -0.5), rel=1e-12)
    assert rope_frequencies(V3Args.from_config(tiny))[1] != 1.0  # the tiny config exercises the cos/sin scale


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' (supported: sigmoid)"),
    ({"topk_method": "greedy"}, "topk_method 'greedy' (supported: noaux_tc)"),
    ({"n_group": 3}, "n_routed_experts 256 not divisible by n_group 3"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported"),
])
def test_unsupported_configs_are_refused(change: dict, message: str) -> None:
    from shardsmith.errors import RuntimeLoadError
    from shardsmith.runtime.models.deepseek_v3 import V3Args
    from shardsmith.testing.tiny_v3 import DEEPSEEK_V3_CONFIG

    with pytest.raises(RuntimeLoadError, match=re.escape(message)):
        V3Args.from_config(DEEPSEEK_V3_CONFIG | change)


@pytest.mark.parametrize("chunks", [[20], [12, 8]], ids=["one-chunk", "two-chunks"])
def test_prefill_chunks_attend_without_a_mask_as_with_one(tiny, monkeypatch, chunks: list[int]) -> None:
    """A prefill chunk's expanded MLA heads through SDPA's causal kernels (``chunk_sdpa``: CUDA's path, the
    queries at the end of the positions, no ``[T, S]`` mask; forced here) give the masked path's logits, from
    position 0 and after a first chunk (a lower-right causal bias)."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.models.deepseek_v3 import attention

    eng = Engine.load(tiny("deepseek-v3"), rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True,
                      max_seq_len=32)
    prompt = [(5 * i + 7) % 300 for i in range(20)]

    def logits() -> torch.Tensor:
        eng.release(0)
        out, at = [], 0
        for n in chunks:
            out.append(eng.model(torch.tensor(prompt[at:at + n]), at, last_only=False).float())
            at += n
        return torch.cat(out)
    want = logits()
    calls = []
    real = attention.causal_chunk_attention
    monkeypatch.setattr(attention, "chunk_sdpa", lambda x: True)
    monkeypatch.setattr(attention, "causal_chunk_attention", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    got = logits()
    layers = len(eng.model.model.layers)
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    assert calls == [s for s in starts for _ in range(layers)]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
