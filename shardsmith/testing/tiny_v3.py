"""A tiny DeepSeek-V3 checkpoint for runtime numerics: every feature the model has, at small sizes.

:func:`~shardsmith.testing.tiny.tiny_deepseek_v3` is the plan/split fixture (FP8, one expert
group, zero correction bias, no YaRN). This builder adds what the runtime must get right: BF16
or FP8 (F32 ``weight_scale_inv`` on 128x128 blocks, ragged edges: ``q_lora`` 192 and
``kv_a_proj_with_mqa`` ``kv_lora + rope`` = 192 rows), YaRN ``rope_scaling`` with ``mscale`` !=
``mscale_all_dim`` (so both the cos/sin scale and the softmax mscale are exercised), expert
groups with ``topk_group`` < ``n_group``, a random ``e_score_correction_bias``, first dense layers,
a shared expert, ``q_lora_rank`` null (plain ``q_proj``) on request, and an MTP layer.

Sizes divide at TP 1, 2 and 4: 8 heads of 192 query / 256 KV rows / 128 output columns (two
heads per rank at TP 4: whole 128-row blocks), intermediates of 512 (128 per rank at TP 4).

Example:
    >>> ckpt = tiny_deepseek_v3_model(tmp_path / "v3", fp8=True)  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

import torch

from .headers import Spec, write_header_only
from .tiny import FP8_CONFIG, _Gen, _linear, write_checkpoint

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.707}


def tiny_deepseek_v3_model(root: Path, *, fp8: bool = True, layers: int = 3, dense_layers: int = 1,
                           hidden: int = 256, heads: int = 8, q_lora: int | None = 192, kv_lora: int = 128,
                           nope: int = 128, rope: int = 64, v_head: int = 128, intermediate: int = 512,
                           moe_intermediate: int = 512, experts: int = 8, shared: int = 1, top_k: int = 3,
                           n_group: int = 4, topk_group: int = 2, vocab: int = 512, yarn: bool = True,
                           rope_interleave: bool | None = None, mtp: bool = True, seed: int = 0) -> Path:
    """Write a ``DeepseekV3ForCausalLM`` checkpoint under ``root`` and return ``root``.

    Shapes (``H`` hidden, ``n`` heads, ``E`` experts, ``I``/``I_e`` dense/expert intermediate):
    ``q_a_proj [q_lora, H]``, ``q_b_proj [n*(nope+rope), q_lora]`` (or ``q_proj [n*(nope+rope), H]``),
    ``kv_a_proj_with_mqa [kv_lora+rope, H]``, ``kv_b_proj [n*(nope+v), kv_lora]``, ``o_proj [H, n*v]``;
    dense ``mlp.{gate,up}_proj [I, H]``, ``down_proj [H, I]``; MoE ``mlp.gate.weight [E, H]`` BF16,
    ``e_score_correction_bias [E]`` F32, experts and ``shared_experts`` at ``I_e`` (shared:
    ``shared * I_e``). Linears are FP8 (F32 ``weight_scale_inv``) with ``fp8``, else BF16; the
    MTP layer sits at index ``layers``. ``rope_interleave`` None leaves the key out, as the release
    does (transformers then interleaves); False asks for rotate-half RoPE.
    """
    g, t = _Gen(seed), {}
    fmt, bf = ("fp8" if fp8 else "bf16"), torch.bfloat16
    t["model.embed_tokens.weight"] = g.w(vocab, hidden, std=0.5).to(bf)

    def mlp(p: str, inter: int) -> None:
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            _linear(t, f"{p}.{proj}.weight", g.w(*shape), fmt)

    def layer(i: int) -> None:
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = g.norm(hidden)
        a = f"{p}.self_attn"
        if q_lora:
            _linear(t, f"{a}.q_a_proj.weight", g.w(q_lora, hidden), fmt)
            t[f"{a}.q_a_layernorm.weight"] = g.norm(q_lora)
            _linear(t, f"{a}.q_b_proj.weight", g.w(heads * (nope + rope), q_lora), fmt)
        else:
            _linear(t, f"{a}.q_proj.weight", g.w(heads * (nope + rope), hidden), fmt)
        _linear(t, f"{a}.kv_a_proj_with_mqa.weight", g.w(kv_lora + rope, hidden), fmt)
        t[f"{a}.kv_a_layernorm.weight"] = g.norm(kv_lora)
        _linear(t, f"{a}.kv_b_proj.weight", g.w(heads * (nope + v_head), kv_lora), fmt)
        _linear(t, f"{a}.o_proj.weight", g.w(hidden, heads * v_head), fmt)
        t[f"{p}.post_attention_layernorm.weight"] = g.norm(hidden)
        if i < dense_layers:
            mlp(f"{p}.mlp", intermediate)
            return
        t[f"{p}.mlp.gate.weight"] = g.w(experts, hidden).to(bf)
        t[f"{p}.mlp.gate.e_score_correction_bias"] = g.w(experts, std=0.05)
        for e in range(experts):
            mlp(f"{p}.mlp.experts.{e}", moe_intermediate)
        if shared:
            mlp(f"{p}.mlp.shared_experts", shared * moe_intermediate)

    for i in range(layers):
        layer(i)
    t["model.norm.weight"] = g.norm(hidden)
    t["lm_head.weight"] = g.w(vocab, hidden).to(bf)
    if mtp:
        p = f"model.layers.{layers}"
        t[f"{p}.embed_tokens.weight"] = g.w(vocab, hidden, std=0.5).to(bf)
        t[f"{p}.enorm.weight"], t[f"{p}.hnorm.weight"] = g.norm(hidden), g.norm(hidden)
        _linear(t, f"{p}.eh_proj.weight", g.w(hidden, 2 * hidden), fmt)
        layer(layers)
        t[f"{p}.shared_head.norm.weight"] = g.norm(hidden)
        t[f"{p}.shared_head.head.weight"] = g.w(vocab, hidden).to(bf)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "moe_intermediate_size": moe_intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": q_lora, "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v_head, "n_routed_experts": experts,
        "n_shared_experts": shared, "num_experts_per_tok": top_k, "first_k_dense_replace": dense_layers,
        "moe_layer_freq": 1, "n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_nextn_predict_layers": int(mtp), "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": dict(YARN) if yarn else None, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if fp8:
        config["quantization_config"] = dict(FP8_CONFIG)
    if rope_interleave is not None:
        config["rope_interleave"] = rope_interleave
    return write_checkpoint(root, t, config, max_shard_bytes=4 << 20)


# The published deepseek-ai/DeepSeek-V3 config.json (R1 and V3.1 differ in nothing the runtime reads)
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": dict(FP8_CONFIG), "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}


def deepseek_v3_headers(root: Path, *, layers: int = 4) -> Path:
    """A header-only (``.safetensors.json``) DeepSeek-V3 with the release's per-layer shapes and dtypes:
    the first ``min(layers, 3)`` layers dense, the rest MoE (256 experts of 7168x2048), then the MTP
    layer; FP8 linears with F32 ``weight_scale_inv`` (``kv_a_proj_with_mqa``: 576 rows, 4.5 blocks)."""
    c = DEEPSEEK_V3_CONFIG
    H, V, E, I_e = c["hidden_size"], c["vocab_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    n, qk, kv, c_kv, v = c["num_attention_heads"], 192, 256, c["kv_lora_rank"], c["v_head_dim"]
    specs: Spec = {"model.embed_tokens.weight": ("BF16", [V, H])}

    def lin(name: str, rows: int, cols: int) -> None:
        specs[name + ".weight"] = ("F8_E4M3", [rows, cols])
        specs[name + ".weight_scale_inv"] = ("F32", [-(-rows // 128), -(-cols // 128)])

    def layer(i: int) -> None:
        p = f"model.layers.{i}"
        specs[f"{p}.input_layernorm.weight"] = ("BF16", [H])
        lin(f"{p}.self_attn.q_a_proj", c["q_lora_rank"], H)
        specs[f"{p}.self_attn.q_a_layernorm.weight"] = ("BF16", [c["q_lora_rank"]])
        lin(f"{p}.self_attn.q_b_proj", n * qk, c["q_lora_rank"])
        lin(f"{p}.self_attn.kv_a_proj_with_mqa", c_kv + 64, H)
        specs[f"{p}.self_attn.kv_a_layernorm.weight"] = ("BF16", [c_kv])
        lin(f"{p}.self_attn.kv_b_proj", n * kv, c_kv)
        lin(f"{p}.self_attn.o_proj", H, n * v)
        specs[f"{p}.post_attention_layernorm.weight"] = ("BF16", [H])
        mlps = [(f"{p}.mlp", c["intermediate_size"])] if i < c["first_k_dense_replace"] else \
            [(f"{p}.mlp.experts.{e}", I_e) for e in range(E)] + [(f"{p}.mlp.shared_experts", I_e)]
        if i >= c["first_k_dense_replace"]:
            specs[f"{p}.mlp.gate.weight"] = ("BF16", [E, H])
            specs[f"{p}.mlp.gate.e_score_correction_bias"] = ("F32", [E])
        for q, inter in mlps:
            lin(f"{q}.gate_proj", inter, H)
            lin(f"{q}.up_proj", inter, H)
            lin(f"{q}.down_proj", H, inter)

    for i in range(layers):
        layer(i)
    specs["model.norm.weight"] = ("BF16", [H])
    specs["lm_head.weight"] = ("BF16", [V, H])
    p = f"model.layers.{layers}"  # the MTP layer
    specs[f"{p}.embed_tokens.weight"] = ("BF16", [V, H])
    specs[f"{p}.enorm.weight"] = specs[f"{p}.hnorm.weight"] = ("BF16", [H])
    lin(f"{p}.eh_proj", H, 2 * H)
    layer(layers)
    specs[f"{p}.shared_head.norm.weight"] = ("BF16", [H])
    specs[f"{p}.shared_head.head.weight"] = ("BF16", [V, H])
    return write_header_only(root, specs, {**c, "num_hidden_layers": layers})


__all__ = ["DEEPSEEK_V3_CONFIG", "YARN", "deepseek_v3_headers", "tiny_deepseek_v3_model"]
