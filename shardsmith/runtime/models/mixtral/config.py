"""Model configuration read from ``config.json`` for the Mixtral / Qwen3-MoE / Qwen2-MoE family.

Field sources: transformers' ``MixtralConfig``, ``Qwen3MoeConfig`` and ``Qwen2MoeConfig`` (v4
``rope_theta``/``rope_scaling`` and v5 ``rope_parameters`` spellings both accepted).

=============  ====================  =====================  ==========================
family         experts / per token   router                 attention extras
=============  ====================  =====================  ==========================
mixtral        num_local_experts     softmax, top-k, renorm  ``sliding_window``
qwen3_moe      num_experts           renorm if norm_topk     per-head q/k RMSNorm
qwen2_moe      num_experts           renorm if norm_topk     qkv bias, shared expert
=============  ====================  =====================  ==========================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardsmith import families
from shardsmith.errors import RuntimeLoadError

# architecture -> variant (its model_type), read from the one registry (shardsmith.families)
FAMILIES = {a.name: a.model_type for a in families.ARCHITECTURES.values() if a.family is families.MIXTRAL}


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """What the runtime needs from ``config.json``.

    Attributes:
        family: ``mixtral``, ``qwen3_moe`` or ``qwen2_moe``.
        vocab_size, dim, n_layers: V, D and layers; n_heads, n_kv_heads, head_dim: global heads.
        norm_eps: RMSNorm epsilon; rope: ``rope_parameters`` (``rope_type``, ``rope_theta``, ...).
        tie_embeddings: the LM head is the embedding (no ``lm_head.weight``).
        qkv_bias, o_bias, qk_norm: attention extras.
        n_experts, top_k, norm_topk: routing; moe_prefix: ``block_sparse_moe`` or ``mlp``.
        expert_dim, dense_dim, shared_dim: intermediate sizes of a routed expert, a dense MLP
            and the shared expert (global, elements).
        moe_layers: indices of MoE layers (others are dense MLPs); shared_expert: Qwen2-MoE.
        windows: per layer, the sliding window in tokens or ``None``.
    """

    family: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    rope: dict
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    n_experts: int
    top_k: int
    norm_topk: bool
    expert_dim: int
    dense_dim: int
    shared_dim: int
    moe_prefix: str
    moe_layers: frozenset[int]
    shared_expert: bool
    windows: tuple[int | None, ...]

    @classmethod
    def from_config(cls, c: dict) -> "ModelArgs":
        """Read ``config.json``.

        Raises:
            RuntimeLoadError: an architecture this runtime does not run, or a missing field.
        """
        arch = families.architecture_of(c)
        family = FAMILIES.get(arch)
        if family is None:
            raise RuntimeLoadError(f"architecture {arch!r} is not supported by the runtime "
                                   f"(supported: {', '.join(FAMILIES)})")
        try:
            n_layers, heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
            dim = int(c["hidden_size"])
            if family == "mixtral":
                n_exp, moe_layers, prefix = int(c["num_local_experts"]), range(n_layers), "block_sparse_moe"
            else:
                n_exp, prefix = int(c["num_experts"]), "mlp"
                step, dense = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or ())
                moe_layers = [i for i in range(n_layers) if i not in dense and n_exp > 0 and (i + 1) % step == 0]
            return cls(
                family=family, vocab_size=int(c["vocab_size"]), dim=dim, n_layers=n_layers, n_heads=heads,
                n_kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or dim // heads), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope=_rope(c), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                qkv_bias=bool(c.get("qkv_bias", True)) if family == "qwen2_moe" else bool(c.get("attention_bias", False)),
                o_bias=family == "qwen3_moe" and bool(c.get("attention_bias", False)),
                qk_norm=family == "qwen3_moe", n_experts=n_exp, top_k=int(c["num_experts_per_tok"]),
                norm_topk=True if family == "mixtral" else bool(c.get("norm_topk_prob", False)),
                expert_dim=int(c["intermediate_size"] if family == "mixtral" else c["moe_intermediate_size"]),
                dense_dim=int(c.get("intermediate_size") or 0),
                shared_dim=int(c.get("shared_expert_intermediate_size") or 0),
                moe_prefix=prefix, moe_layers=frozenset(moe_layers), shared_expert=family == "qwen2_moe",
                windows=_windows(c, family, n_layers),
            )
        except KeyError as e:
            raise RuntimeLoadError(f"config.json: missing field {e.args[0]!r} for {arch}") from None


def _rope(c: dict) -> dict:
    rope = dict(c.get("rope_parameters") or {})
    if not rope:
        rope = dict(c.get("rope_scaling") or {})
        rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    if rope["rope_type"] not in ("default", "linear", "llama3"):
        raise RuntimeLoadError(f"config.json: rope_type {rope['rope_type']!r} is not supported "
                               "(supported: default, linear, llama3)")
    return rope


def _windows(c: dict, family: str, n_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows as transformers applies them."""
    window = c.get("sliding_window") or None
    if family != "qwen2_moe":
        return (window,) * n_layers
    types = c.get("layer_types")
    if not types:
        first = int(c.get("max_window_layers") or n_layers)
        types = ["sliding_attention" if c.get("use_sliding_window") and i >= first else "full_attention"
                 for i in range(n_layers)]
    return tuple(window if t == "sliding_attention" else None for t in types)


def rope_tables(args: ModelArgs, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE ``cos``/``sin`` tables ``[max_seq_len, head_dim]`` (float32), halves duplicated.

    ``inv_freq = 1 / theta ** (2i / d)``; ``linear`` divides positions by ``factor``; ``llama3``
    rescales low/medium frequencies (transformers ``modeling_rope_utils``).
    """
    r, d = args.rope, args.head_dim
    inv = 1.0 / (float(r["rope_theta"]) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [d/2]
    if r["rope_type"] == "linear":
        inv = inv / float(r["factor"])
    elif r["rope_type"] == "llama3":
        factor, lo, hi = float(r["factor"]), float(r["low_freq_factor"]), float(r["high_freq_factor"])
        old = float(r["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)  # [S, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, d]
    return emb.cos(), emb.sin()
