"""Tiny checkpoints in the real on-disk formats of every supported family, for tests and examples.

Every builder writes a Hugging Face checkpoint directory (``config.json``, sharded safetensors,
``model.safetensors.index.json``) with the release's tensor names, dtypes and quantization
formats at small sizes, from seeded random values, and returns its path. Sizes are chosen so the
interesting cases occur: ragged FP8 edge blocks, uneven head shares, more ranks than KV heads.

Example:
    >>> from shardsmith.testing.tiny import tiny_deepseek_v4
    >>> ckpt = tiny_deepseek_v4(tmp_path / "v4")  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .quant import quantize_fp4_group, quantize_fp8_block

Tensors = dict[str, torch.Tensor]


def write_checkpoint(root: Path, tensors: Tensors, config: dict, *, max_shard_bytes: int = 1 << 20,
                     extra_files: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` as a sharded safetensors checkpoint with an index and ``config.json``.

    Args:
        root: directory to create (parents too).
        tensors: name -> tensor, written in this order; a shard closes once it passes
            ``max_shard_bytes`` (bytes).
        extra_files: relative path -> text, written alongside (tokenizer files, ...).

    Returns:
        ``root``.
    """
    root.mkdir(parents=True, exist_ok=True)
    shards: list[Tensors] = [{}]
    size = 0
    for name, t in tensors.items():
        if size >= max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += t.numel() * t.element_size()
    weight_map = {}
    n = len(shards)
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(root / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    for rel, text in (extra_files or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


class _Gen:
    """Seeded random tensors of plausible scale."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def w(self, *shape: int, std: float | None = None) -> torch.Tensor:
        std = std if std is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=self.g) * std

    def norm(self, n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=self.g)).to(torch.bfloat16)


def _linear(out: Tensors, name: str, w: torch.Tensor, fmt: str) -> None:
    """Store weight ``name`` (``...weight``) as bf16, FP8 (F32 or UE8M0 scale) or packed FP4."""
    stem = name[: -len(".weight")]
    if fmt == "bf16":
        out[name] = w.to(torch.bfloat16)
    elif fmt == "fp8":  # DeepSeek-V3 / Qwen3-FP8: F32 weight_scale_inv
        out[name], out[stem + ".weight_scale_inv"] = quantize_fp8_block(w)
    elif fmt == "fp8-ue8m0":  # DeepSeek-V4: UE8M0 .scale
        out[name], out[stem + ".scale"] = quantize_fp8_block(w, ue8m0=True)
    elif fmt == "fp4":  # DeepSeek-V4 experts: e2m1 in I8, 1x32 UE8M0 .scale
        out[name], out[stem + ".scale"] = quantize_fp4_group(w)
    else:
        raise ValueError(f"unknown format {fmt!r}")


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def tiny_mixtral(root: Path, *, fp8: bool = False, layers: int = 2, hidden: int = 192, heads: int = 6, kv_heads: int = 3,
                 head_dim: int = 64, intermediate: int = 512, experts: int = 4, vocab: int = 320, seed: int = 0,
                 tie_embeddings: bool = False) -> Path:
    """A ``MixtralForCausalLM`` checkpoint; with ``fp8`` every attention and expert linear is FP8
    with F32 ``weight_scale_inv`` on 128x128 blocks (hidden 192 = 1.5 blocks: ragged edges; 64-row
    heads: at TP=2 the KV-group split is block-aligned, at TP=3 attention is replicated)."""
    g, fmt, t = _Gen(seed), ("fp8" if fp8 else "bf16"), {}
    t["model.embed_tokens.weight"] = g.w(vocab, hidden, std=0.5).to(torch.bfloat16)
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = g.norm(hidden)
        for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
            _linear(t, f"{p}.self_attn.{proj}.weight", g.w(rows, hidden), fmt)
        _linear(t, f"{p}.self_attn.o_proj.weight", g.w(hidden, heads * head_dim), fmt)
        t[f"{p}.post_attention_layernorm.weight"] = g.norm(hidden)
        t[f"{p}.block_sparse_moe.gate.weight"] = g.w(experts, hidden).to(torch.bfloat16)
        for e in range(experts):
            q = f"{p}.block_sparse_moe.experts.{e}"
            _linear(t, f"{q}.w1.weight", g.w(intermediate, hidden), fmt)
            _linear(t, f"{q}.w2.weight", g.w(hidden, intermediate), fmt)
            _linear(t, f"{q}.w3.weight", g.w(intermediate, hidden), fmt)
    t["model.norm.weight"] = g.norm(hidden)
    if not tie_embeddings:
        t["lm_head.weight"] = g.w(vocab, hidden).to(torch.bfloat16)
    config = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_local_experts": experts, "num_experts_per_tok": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": tie_embeddings, "torch_dtype": "bfloat16", "sliding_window": None,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    if fp8:
        config["quantization_config"] = dict(FP8_CONFIG)
    return write_checkpoint(root, t, config)


def tiny_qwen_moe(root: Path, *, qwen2: bool = False, layers: int = 2, hidden: int = 128, heads: int = 5, kv_heads: int = 5,
                  head_dim: int = 32, moe_intermediate: int = 96, experts: int = 6, top_k: int = 2, vocab: int = 300,
                  dense_layers: tuple[int, ...] = (), seed: int = 0) -> Path:
    """A ``Qwen3MoeForCausalLM`` checkpoint (q/k norms), or with ``qwen2`` a ``Qwen2MoeForCausalLM``
    one (q/k/v biases, a shared expert and its sigmoid gate). ``dense_layers`` get a dense MLP."""
    g, t = _Gen(seed), {}
    bf = torch.bfloat16
    t["model.embed_tokens.weight"] = g.w(vocab, hidden, std=0.5).to(bf)
    inter = 2 * moe_intermediate
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = g.norm(hidden)
        for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
            t[f"{p}.self_attn.{proj}.weight"] = g.w(rows, hidden).to(bf)
            if qwen2:
                t[f"{p}.self_attn.{proj}.bias"] = g.w(rows, std=0.1).to(bf)
        t[f"{p}.self_attn.o_proj.weight"] = g.w(hidden, heads * head_dim).to(bf)
        if not qwen2:
            t[f"{p}.self_attn.q_norm.weight"] = g.norm(head_dim)
            t[f"{p}.self_attn.k_norm.weight"] = g.norm(head_dim)
        t[f"{p}.post_attention_layernorm.weight"] = g.norm(hidden)
        if i in dense_layers:
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
                t[f"{p}.mlp.{proj}.weight"] = g.w(*shape).to(bf)
            continue
        t[f"{p}.mlp.gate.weight"] = g.w(experts, hidden).to(bf)
        for e in range(experts):
            for proj, shape in (("gate_proj", (moe_intermediate, hidden)), ("up_proj", (moe_intermediate, hidden)),
                                ("down_proj", (hidden, moe_intermediate))):
                t[f"{p}.mlp.experts.{e}.{proj}.weight"] = g.w(*shape).to(bf)
        if qwen2:
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
                t[f"{p}.mlp.shared_expert.{proj}.weight"] = g.w(*shape).to(bf)
            t[f"{p}.mlp.shared_expert_gate.weight"] = g.w(1, hidden).to(bf)
    t["model.norm.weight"] = g.norm(hidden)
    t["lm_head.weight"] = g.w(vocab, hidden).to(bf)
    arch, mtype = ("Qwen2MoeForCausalLM", "qwen2_moe") if qwen2 else ("Qwen3MoeForCausalLM", "qwen3_moe")
    config = {
        "architectures": [arch], "model_type": mtype, "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "moe_intermediate_size": moe_intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": top_k,
        "norm_topk_prob": not qwen2, "decoder_sparse_step": 1, "mlp_only_layers": list(dense_layers),
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "attention_bias": qwen2, "use_sliding_window": False,
    }
    if qwen2:
        config["shared_expert_intermediate_size"] = inter
    return write_checkpoint(root, t, config)


def tiny_deepseek_v3(root: Path, *, layers: int = 2, hidden: int = 256, heads: int = 8, q_lora: int = 192, kv_lora: int = 128,
                     nope: int = 128, rope: int = 64, v_head: int = 128, intermediate: int = 512, moe_intermediate: int = 512,
                     experts: int = 4, vocab: int = 512, mtp: bool = True, seed: int = 0) -> Path:
    """A ``DeepseekV3ForCausalLM`` checkpoint: FP8 with F32 ``weight_scale_inv`` on 128x128 blocks,
    ragged edges (``q_lora`` 192, ``kv_a_proj_with_mqa`` 192 rows), a dense first layer, a shared
    expert, and an MTP layer at index ``layers`` (embed, enorm, hnorm, eh_proj, shared_head)."""
    g, t = _Gen(seed), {}
    bf = torch.bfloat16
    t["model.embed_tokens.weight"] = g.w(vocab, hidden, std=0.5).to(bf)

    def layer(i: int) -> None:
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = g.norm(hidden)
        _linear(t, f"{p}.self_attn.q_a_proj.weight", g.w(q_lora, hidden), "fp8")
        t[f"{p}.self_attn.q_a_layernorm.weight"] = g.norm(q_lora)
        _linear(t, f"{p}.self_attn.q_b_proj.weight", g.w(heads * (nope + rope), q_lora), "fp8")
        _linear(t, f"{p}.self_attn.kv_a_proj_with_mqa.weight", g.w(kv_lora + rope, hidden), "fp8")
        t[f"{p}.self_attn.kv_a_layernorm.weight"] = g.norm(kv_lora)
        _linear(t, f"{p}.self_attn.kv_b_proj.weight", g.w(heads * (nope + v_head), kv_lora), "fp8")
        _linear(t, f"{p}.self_attn.o_proj.weight", g.w(hidden, heads * v_head), "fp8")
        t[f"{p}.post_attention_layernorm.weight"] = g.norm(hidden)
        if i == 0:
            for proj, shape in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)), ("down_proj", (hidden, intermediate))):
                _linear(t, f"{p}.mlp.{proj}.weight", g.w(*shape), "fp8")
            return
        t[f"{p}.mlp.gate.weight"] = g.w(experts, hidden).to(bf)
        t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(experts)
        for e in range(experts):
            for proj, shape in (("gate_proj", (moe_intermediate, hidden)), ("up_proj", (moe_intermediate, hidden)),
                                ("down_proj", (hidden, moe_intermediate))):
                _linear(t, f"{p}.mlp.experts.{e}.{proj}.weight", g.w(*shape), "fp8")
        for proj, shape in (("gate_proj", (moe_intermediate, hidden)), ("up_proj", (moe_intermediate, hidden)),
                            ("down_proj", (hidden, moe_intermediate))):
            _linear(t, f"{p}.mlp.shared_experts.{proj}.weight", g.w(*shape), "fp8")

    for i in range(layers):
        layer(i)
    t["model.norm.weight"] = g.norm(hidden)
    t["lm_head.weight"] = g.w(vocab, hidden).to(bf)
    if mtp:
        p = f"model.layers.{layers}"
        t[f"{p}.embed_tokens.weight"] = g.w(vocab, hidden, std=0.5).to(bf)
        t[f"{p}.enorm.weight"], t[f"{p}.hnorm.weight"] = g.norm(hidden), g.norm(hidden)
        _linear(t, f"{p}.eh_proj.weight", g.w(hidden, 2 * hidden), "fp8")
        layer(layers)
        t[f"{p}.shared_head.norm.weight"] = g.norm(hidden)
        t[f"{p}.shared_head.head.weight"] = g.w(vocab, hidden).to(bf)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "moe_intermediate_size": moe_intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": q_lora, "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v_head, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "num_nextn_predict_layers": int(mtp), "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "quantization_config": dict(FP8_CONFIG), "bos_token_id": 0, "eos_token_id": 1,
    }
    return write_checkpoint(root, t, config)
