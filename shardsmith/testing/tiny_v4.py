"""A tiny DeepSeek-V4 checkpoint in the release format (names, dtypes and shape formulas of
``deepseek-v4-flash``'s headers in ``shared/real-inventories/``, at small sizes).

Formats: FP8 e4m3 dense linears with UE8M0 ``.scale`` on 128x128 blocks; routed experts FP4 e2m1
packed two per ``I8`` with UE8M0 ``.scale`` per 1x32; embeddings, norms, compressors and router in
BF16/F32; hash-routed first layers carry ``gate.tid2eid`` instead of ``gate.bias``;
``compress_ratios`` longer than the layer count (the release lists MTP layers too).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tiny import Tensors, _Gen, _linear, write_checkpoint


def tiny_deepseek_v4(root: Path, *, layers: int = 4, hidden: int = 256, heads: int = 8, head_dim: int = 128,
                     q_lora: int = 128, o_groups: int = 4, o_lora: int = 128, rope_dim: int = 32, experts: int = 8,
                     moe_intermediate: int = 512, top_k: int = 2, vocab: int = 512, hash_layers: int = 1,
                     index_heads: int = 4, index_head_dim: int = 64, hc_mult: int = 4, mtp_layers: int = 1,
                     compress_ratios: tuple[int, ...] | None = None, seed: int = 0) -> Path:
    """Write a ``DeepseekV4ForCausalLM`` checkpoint under ``root`` and return ``root``.

    Shapes (``H`` hidden, ``n`` heads, ``d`` head_dim, ``G`` o_groups, ``E`` experts, ``I`` expert
    intermediate): ``wq_a [q_lora, H]``, ``wq_b [n*d, q_lora]``, ``wkv [d, H]``,
    ``wo_a [G*o_lora, n*d/G]``, ``wo_b [H, G*o_lora]``, ``attn_sink [n]``; compressor of ratio
    ``r``: ``ape [r, c*d]``, ``wkv``/``wgate [c*d, H]`` with ``c = 2`` for ratio 4 (overlapping
    windows) else 1; the indexer (ratio-4 layers) the same at ``index_head_dim`` plus
    ``wq_b [index_heads*index_head_dim, q_lora]`` and ``weights_proj [index_heads, H]``;
    experts ``w1``/``w3 [I, H/2]`` I8 + ``[I, H/32]`` scales, ``w2 [H, I/2]`` + ``[H, I/32]``;
    mixers ``hc_*_fn [(2+m)*m, m*H]``.
    """
    ratios = list(compress_ratios or ([0, 4, 128, 4, 128, 4, 128, 4][:layers] + [0] * (mtp_layers + 1)))
    g, t = _Gen(seed), {}
    bf, f32 = torch.bfloat16, torch.float32
    t["embed.weight"] = g.w(vocab, hidden, std=0.5).to(bf)
    mix = (2 + hc_mult) * hc_mult

    def compressor(out: Tensors, p: str, ratio: int, dim: int) -> None:
        c = 2 if ratio == 4 else 1
        out[f"{p}.ape"] = g.w(ratio, c * dim, std=0.02).to(f32)
        out[f"{p}.norm.weight"] = g.norm(dim)
        out[f"{p}.wgate.weight"] = g.w(c * dim, hidden).to(bf)
        out[f"{p}.wkv.weight"] = g.w(c * dim, hidden).to(bf)

    def block(p: str, i: int) -> None:
        a = f"{p}.attn"
        t[f"{a}.attn_sink"] = g.w(heads, std=0.5).to(f32)
        ratio = ratios[i] if i < len(ratios) else 0
        if ratio:
            compressor(t, f"{a}.compressor", ratio, head_dim)
        if ratio == 4:
            compressor(t, f"{a}.indexer.compressor", ratio, index_head_dim)
            t[f"{a}.indexer.weights_proj.weight"] = g.w(index_heads, hidden).to(bf)
            _linear(t, f"{a}.indexer.wq_b.weight", g.w(index_heads * index_head_dim, q_lora), "fp8-ue8m0")
        t[f"{a}.kv_norm.weight"] = g.norm(head_dim)
        t[f"{a}.q_norm.weight"] = g.norm(q_lora)
        _linear(t, f"{a}.wq_a.weight", g.w(q_lora, hidden), "fp8-ue8m0")
        _linear(t, f"{a}.wq_b.weight", g.w(heads * head_dim, q_lora), "fp8-ue8m0")
        _linear(t, f"{a}.wkv.weight", g.w(head_dim, hidden), "fp8-ue8m0")
        _linear(t, f"{a}.wo_a.weight", g.w(o_groups * o_lora, heads * head_dim // o_groups), "fp8-ue8m0")
        _linear(t, f"{a}.wo_b.weight", g.w(hidden, o_groups * o_lora), "fp8-ue8m0")
        t[f"{p}.attn_norm.weight"] = g.norm(hidden)
        t[f"{p}.ffn_norm.weight"] = g.norm(hidden)
        f = f"{p}.ffn"
        t[f"{f}.gate.weight"] = g.w(experts, hidden).to(bf)
        if p.startswith("layers.") and i < hash_layers:
            t[f"{f}.gate.tid2eid"] = torch.stack([torch.randperm(experts, generator=g.g)[:top_k] for _ in range(vocab)]).long()
        else:
            t[f"{f}.gate.bias"] = g.w(experts, std=0.1).to(f32)
        for e in range(experts):
            _linear(t, f"{f}.experts.{e}.w1.weight", g.w(moe_intermediate, hidden), "fp4")
            _linear(t, f"{f}.experts.{e}.w2.weight", g.w(hidden, moe_intermediate), "fp4")
            _linear(t, f"{f}.experts.{e}.w3.weight", g.w(moe_intermediate, hidden), "fp4")
        _linear(t, f"{f}.shared_experts.w1.weight", g.w(moe_intermediate, hidden), "fp8-ue8m0")
        _linear(t, f"{f}.shared_experts.w2.weight", g.w(hidden, moe_intermediate), "fp8-ue8m0")
        _linear(t, f"{f}.shared_experts.w3.weight", g.w(moe_intermediate, hidden), "fp8-ue8m0")
        for kind in ("attn", "ffn"):
            t[f"{p}.hc_{kind}_base"] = g.w(mix, std=0.1).to(f32)
            t[f"{p}.hc_{kind}_fn"] = g.w(mix, hc_mult * hidden, std=0.01).to(f32)
            t[f"{p}.hc_{kind}_scale"] = g.w(3, std=0.1).to(f32)

    for i in range(layers):
        block(f"layers.{i}", i)
    t["hc_head_base"] = g.w(hc_mult, std=0.1).to(f32)
    t["hc_head_fn"] = g.w(hc_mult, hc_mult * hidden, std=0.01).to(f32)
    t["hc_head_scale"] = g.w(1, std=0.1).to(f32)
    t["head.weight"] = g.w(vocab, hidden).to(bf)
    t["norm.weight"] = g.norm(hidden)
    for j in range(mtp_layers):
        p = f"mtp.{j}"
        block(p, layers + j)
        t[f"{p}.main_norm.weight"] = g.norm(hidden)
        _linear(t, f"{p}.main_proj.weight", g.w(hidden, 3 * hidden), "fp8-ue8m0")
        t[f"{p}.norm.weight"] = g.norm(hidden)
        t[f"{p}.hc_head_base"] = g.w(hc_mult, std=0.1).to(f32)
        t[f"{p}.hc_head_fn"] = g.w(hc_mult, hc_mult * hidden, std=0.01).to(f32)
        t[f"{p}.hc_head_scale"] = g.w(1, std=0.1).to(f32)
    config = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": vocab,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 1,
        "head_dim": head_dim, "qk_rope_head_dim": rope_dim, "q_lora_rank": q_lora, "o_groups": o_groups,
        "o_lora_rank": o_lora, "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_intermediate, "num_hash_layers": hash_layers, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "norm_topk_prob": True, "topk_method": "noaux_tc", "swiglu_limit": 10.0,
        "hc_mult": hc_mult, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "index_n_heads": index_heads,
        "index_head_dim": index_head_dim, "index_topk": 16, "sliding_window": 16, "compress_ratios": ratios,
        "compress_rope_theta": 160000, "rope_theta": 10000, "num_nextn_predict_layers": mtp_layers,
        "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "hidden_act": "silu", "expert_dtype": "fp4",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    }
    return write_checkpoint(root, t, config, max_shard_bytes=2 << 20)
