"""Header-only checkpoints (``X.safetensors.json``): plan real shapes without their data."""

from __future__ import annotations

import json
from pathlib import Path

from ..dtypes import DTYPES

Spec = dict[str, tuple[str, list[int]]]  # name -> (dtype, shape)


def write_header_only(root: Path, specs: Spec, config: dict, *, shard: str = "model-00001-of-00001.safetensors") -> Path:
    """Write ``config.json``, an index, and one shard's raw header JSON (no data) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    header, pos = {}, 0
    for name, (dt, shape) in specs.items():
        n = DTYPES[dt].nbytes(shape)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    (root / (shard + ".json")).write_text(json.dumps(header))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard for k in specs}}))
    (root / "config.json").write_text(json.dumps(config))
    return root


def smollm2_moe_headers(root: Path, *, fp8: bool, layers: int = 2, experts: int = 8) -> Path:
    """SmolLM2-135M's shapes as an 8-expert Mixtral (9 query / 3 KV heads of 64, hidden 576,
    intermediate 1536, vocab 49152, tied embeddings), optionally with FP8 128x128 block scales."""
    hidden, inter, vocab, q, kv = 576, 1536, 49152, 9 * 64, 3 * 64
    specs: Spec = {"model.embed_tokens.weight": ("BF16", [vocab, hidden])}

    def lin(name: str, rows: int, cols: int) -> None:
        specs[name] = ("F8_E4M3" if fp8 else "BF16", [rows, cols])
        if fp8:
            specs[name + "_scale_inv"] = ("F32", [-(-rows // 128), -(-cols // 128)])

    for i in range(layers):
        p = f"model.layers.{i}"
        specs[f"{p}.input_layernorm.weight"] = ("BF16", [hidden])
        lin(f"{p}.self_attn.q_proj.weight", q, hidden)
        lin(f"{p}.self_attn.k_proj.weight", kv, hidden)
        lin(f"{p}.self_attn.v_proj.weight", kv, hidden)
        lin(f"{p}.self_attn.o_proj.weight", hidden, q)
        specs[f"{p}.post_attention_layernorm.weight"] = ("BF16", [hidden])
        specs[f"{p}.block_sparse_moe.gate.weight"] = ("BF16", [experts, hidden])
        for e in range(experts):
            lin(f"{p}.block_sparse_moe.experts.{e}.w1.weight", inter, hidden)
            lin(f"{p}.block_sparse_moe.experts.{e}.w2.weight", hidden, inter)
            lin(f"{p}.block_sparse_moe.experts.{e}.w3.weight", inter, hidden)
    specs["model.norm.weight"] = ("BF16", [hidden])
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
              "num_hidden_layers": layers, "num_local_experts": experts, "num_experts_per_tok": 2,
              "vocab_size": vocab, "tie_word_embeddings": True}
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    return write_header_only(root, specs, config)
