"""A tiny gpt-oss checkpoint in the release format (names, dtypes and layouts of ``openai/gpt-oss-20b``
at small sizes).

Formats: routed experts MXFP4 (:mod:`shardsmith.testing.mxfp4`: U8 ``*_blocks`` ``[E, N, K/32, 16]``
and U8 E8M0 ``*_scales`` ``[E, N, K/32]``) with BF16 biases; ``gate_up_proj`` rows interleave gate
and up (row ``2j`` is gate channel ``j``, row ``2j + 1`` up channel ``j``, as transformers'
``GptOssExperts`` reads ``gate_up[..., ::2]`` / ``[..., 1::2]``); everything else BF16: q/k/v/o with
biases, per-head ``sinks``, a router with bias, norms, untied embedding and LM head. Layers
alternate sliding-window and full attention; RoPE is YaRN with the release's parameters.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .mxfp4 import quantize_mxfp4
from .tiny import _Gen, write_checkpoint


def tiny_gpt_oss(root: Path, *, layers: int = 4, hidden: int = 128, heads: int = 8, kv_heads: int = 4, head_dim: int = 16,
                 intermediate: int = 256, experts: int = 8, top_k: int = 4, vocab: int = 512, sliding_window: int = 8,
                 seed: int = 0) -> Path:
    """Write a ``GptOssForCausalLM`` checkpoint under ``root`` and return ``root``.

    Shapes (``H`` hidden, ``n``/``k`` query/KV heads, ``d`` head_dim, ``E`` experts, ``I``
    intermediate): ``q_proj [n*d, H]``, ``k_proj``/``v_proj [k*d, H]``, ``o_proj [H, n*d]`` (all
    with biases), ``sinks [n]``, ``router [E, H]`` + ``[E]``, ``gate_up_proj_blocks [E, 2I, H/32, 16]``
    + scales ``[E, 2I, H/32]`` + bias ``[E, 2I]``, ``down_proj_blocks [E, H, I/32, 16]`` + scales
    ``[E, H, I/32]`` + bias ``[E, H]``. ``H`` and ``I`` must be multiples of 32.
    """
    g, t = _Gen(seed), {}
    bf = torch.bfloat16
    t["model.embed_tokens.weight"] = g.w(vocab, hidden, std=0.5).to(bf)
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = g.norm(hidden)
        a = f"{p}.self_attn"
        for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
            t[f"{a}.{proj}.weight"] = g.w(rows, hidden).to(bf)
            t[f"{a}.{proj}.bias"] = g.w(rows, std=0.1).to(bf)
        t[f"{a}.o_proj.weight"] = g.w(hidden, heads * head_dim).to(bf)
        t[f"{a}.o_proj.bias"] = g.w(hidden, std=0.1).to(bf)
        t[f"{a}.sinks"] = g.w(heads, std=1.0).to(bf)
        t[f"{p}.post_attention_layernorm.weight"] = g.norm(hidden)
        m = f"{p}.mlp"
        t[f"{m}.router.weight"] = g.w(experts, hidden).to(bf)
        t[f"{m}.router.bias"] = g.w(experts, std=0.5).to(bf)
        # std 0.25 on gate/up: the clamp at swiglu_limit (7) binds on some channels of a tiny model too
        blocks, scales = quantize_mxfp4(g.w(experts, 2 * intermediate, hidden, std=0.25))
        t[f"{m}.experts.gate_up_proj_blocks"], t[f"{m}.experts.gate_up_proj_scales"] = blocks, scales
        t[f"{m}.experts.gate_up_proj_bias"] = g.w(experts, 2 * intermediate, std=0.5).to(bf)
        blocks, scales = quantize_mxfp4(g.w(experts, hidden, intermediate))
        t[f"{m}.experts.down_proj_blocks"], t[f"{m}.experts.down_proj_scales"] = blocks, scales
        t[f"{m}.experts.down_proj_bias"] = g.w(experts, hidden, std=0.5).to(bf)
    t["model.norm.weight"] = g.norm(hidden)
    t["lm_head.weight"] = g.w(vocab, hidden).to(bf)
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_local_experts": experts,
        "num_experts_per_tok": top_k, "experts_per_token": top_k, "sliding_window": sliding_window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5, "rope_theta": 150000, "initial_context_length": 4096, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "router_aux_loss_coef": 0.9,
        "output_router_logits": False, "use_cache": True, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }
    return write_checkpoint(root, t, config, max_shard_bytes=1 << 20)


def gpt_oss_20b_headers(root: Path, *, layers: int = 2) -> Path:
    """``openai/gpt-oss-20b``'s tensor names, dtypes and shapes as a header-only checkpoint (no data).

    Release shapes: hidden 2880, 64 query / 8 KV heads of 64, 32 experts of intermediate 2880
    (90 MXFP4 blocks: uneven shares at TP 4), vocab 201088; only the first ``layers`` of 24.
    """
    from .headers import write_header_only

    hidden, inter, experts, vocab, q, kv = 2880, 2880, 32, 201088, 64 * 64, 8 * 64
    specs = {"model.embed_tokens.weight": ("BF16", [vocab, hidden])}
    for i in range(layers):
        p, a, x = f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp.experts"
        specs[f"{p}.input_layernorm.weight"] = ("BF16", [hidden])
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            specs[f"{a}.{proj}.weight"], specs[f"{a}.{proj}.bias"] = ("BF16", [rows, hidden]), ("BF16", [rows])
        specs[f"{a}.o_proj.weight"], specs[f"{a}.o_proj.bias"] = ("BF16", [hidden, q]), ("BF16", [hidden])
        specs[f"{a}.sinks"] = ("BF16", [64])
        specs[f"{p}.post_attention_layernorm.weight"] = ("BF16", [hidden])
        specs[f"{p}.mlp.router.weight"], specs[f"{p}.mlp.router.bias"] = ("BF16", [experts, hidden]), ("BF16", [experts])
        specs[f"{x}.gate_up_proj_blocks"] = ("U8", [experts, 2 * inter, hidden // 32, 16])
        specs[f"{x}.gate_up_proj_scales"] = ("U8", [experts, 2 * inter, hidden // 32])
        specs[f"{x}.gate_up_proj_bias"] = ("BF16", [experts, 2 * inter])
        specs[f"{x}.down_proj_blocks"] = ("U8", [experts, hidden, inter // 32, 16])
        specs[f"{x}.down_proj_scales"] = ("U8", [experts, hidden, inter // 32])
        specs[f"{x}.down_proj_bias"] = ("BF16", [experts, hidden])
    specs["model.norm.weight"] = ("BF16", [hidden])
    specs["lm_head.weight"] = ("BF16", [vocab, hidden])
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
              "num_hidden_layers": layers, "num_local_experts": experts, "num_experts_per_tok": 4,
              "vocab_size": vocab, "sliding_window": 128, "swiglu_limit": 7.0, "rope_theta": 150000,
              "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "original_max_position_embeddings": 4096, "truncate": False},
              "quantization_config": {"quant_method": "mxfp4"}}
    return write_header_only(root, specs, config)
