"""DeepSeek-V3 configuration from ``config.json``, and its YaRN RoPE tables.

Field sources: transformers' ``DeepseekV3Config`` (``configuration_deepseek_v3.py``) and DeepSeek-V3
``inference/model.py`` ``ModelArgs`` (``moe_layer_freq``, ``scoring_func``, ``topk_method``). Both
the v4 spelling (``rope_scaling`` with ``type``) and the v5 one (``rope_parameters`` with
``rope_type``) are read. DeepSeek-R1 and V3.1 share the architecture and the config keys.

YaRN (arXiv 2309.00071) as transformers computes it (``modeling_rope_utils._compute_yarn_parameters``
and ``modeling_deepseek_v3.yarn_apply_mscale``), with ``m(s, k) = 0.1 * k * ln(s) + 1`` for
``s > 1`` (else 1):

==================  ===================================================================
quantity            value
==================  ===================================================================
``inv_freq``        extrapolated ``theta^(-2i/r)`` and interpolated ``/ factor`` frequencies
                    blended by a linear ramp between the correction dims of ``beta_fast``
                    and ``beta_slow`` rotations over ``original_max_position_embeddings``
cos/sin scale       ``m(factor, mscale) / m(factor, mscale_all_dim)`` (or ``attention_factor``)
softmax scale       ``(nope + rope)^-0.5 * m(factor, mscale_all_dim)^2``
==================  ===================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardsmith.errors import RuntimeLoadError

ARCHITECTURES = ("DeepseekV3ForCausalLM", "deepseek_v3")


@dataclass(frozen=True, slots=True)
class V3Args:
    """What the runtime needs from a DeepSeek-V3 ``config.json``.

    Attributes:
        vocab_size, dim, n_layers: V, D and decoder layers (the MTP layers after them are not run).
        n_heads: global attention heads; q_lora_rank: query latent rank (None: a plain ``q_proj``);
        kv_lora_rank: KV latent rank c; qk_nope_dim, qk_rope_dim, v_head_dim: per-head dims.
        inter, moe_inter: intermediate sizes of a dense MLP and of one routed expert (elements);
        n_experts, n_shared, top_k: routed experts, shared experts (their intermediate is
            ``n_shared * moe_inter``), experts per token.
        n_group, topk_group: expert groups and how many of them a token may route to.
        routed_scale, norm_topk: ``routed_scaling_factor`` and ``norm_topk_prob``.
        first_dense, moe_freq: ``first_k_dense_replace`` and ``moe_layer_freq``.
        norm_eps: ``rms_norm_eps`` of the layer norms (the latent norms use 1e-6, as both sources).
        rope: ``rope_parameters`` (``rope_type`` default or yarn, ``rope_theta``, YaRN keys).
        rope_interleave: rotary dims in interleaved pairs (transformers' default, DeepSeek's
            complex-number RoPE) rather than halves.
        max_positions: ``max_position_embeddings`` (YaRN's default ``original`` length).
        n_mtp: ``num_nextn_predict_layers``, the MTP layers after the decoder layers.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    inter: int
    moe_inter: int
    n_experts: int
    n_shared: int
    top_k: int
    n_group: int
    topk_group: int
    routed_scale: float
    norm_topk: bool
    first_dense: int
    moe_freq: int
    norm_eps: float
    rope: dict
    rope_interleave: bool
    max_positions: int
    n_mtp: int = 0

    @classmethod
    def from_config(cls, c: dict) -> "V3Args":
        """Read ``config.json``.

        Raises:
            RuntimeLoadError: a missing field, or a variant this runtime does not run (named with
                its value and the supported ones).
        """
        try:
            args = cls(
                vocab_size=int(c["vocab_size"]), dim=int(c["hidden_size"]), n_layers=int(c["num_hidden_layers"]),
                n_heads=int(c["num_attention_heads"]),
                q_lora_rank=int(c["q_lora_rank"]) if c.get("q_lora_rank") else None,
                kv_lora_rank=int(c["kv_lora_rank"]), qk_nope_dim=int(c["qk_nope_head_dim"]),
                qk_rope_dim=int(c["qk_rope_head_dim"]), v_head_dim=int(c["v_head_dim"]),
                inter=int(c["intermediate_size"]), moe_inter=int(c["moe_intermediate_size"]),
                n_experts=int(c.get("n_routed_experts") or 0), n_shared=int(c.get("n_shared_experts") or 0),
                top_k=int(c["num_experts_per_tok"]), n_group=int(c.get("n_group") or 1),
                topk_group=int(c.get("topk_group") or 1), routed_scale=float(c.get("routed_scaling_factor", 1.0)),
                norm_topk=bool(c.get("norm_topk_prob", True)), first_dense=int(c.get("first_k_dense_replace") or 0),
                moe_freq=int(c.get("moe_layer_freq") or 1), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope=_rope(c), rope_interleave=bool(c.get("rope_interleave", True)),
                max_positions=int(c.get("max_position_embeddings") or 4096),
                n_mtp=int(c.get("num_nextn_predict_layers") or 0),
            )
        except KeyError as e:
            raise RuntimeLoadError(f"config.json: missing field {e.args[0]!r} for DeepseekV3ForCausalLM") from None
        unsupported = [
            f"scoring_func {c['scoring_func']!r} (supported: sigmoid)" if c.get("scoring_func", "sigmoid") != "sigmoid" else "",
            f"topk_method {c['topk_method']!r} (supported: noaux_tc)" if c.get("topk_method", "noaux_tc") != "noaux_tc" else "",
            f"hidden_act {c['hidden_act']!r} (supported: silu)" if c.get("hidden_act", "silu") != "silu" else "",
            "attention_bias true (DeepSeek-V3 has none)" if c.get("attention_bias") else "",
            "tie_word_embeddings true (DeepSeek-V3 has its own lm_head)" if c.get("tie_word_embeddings") else "",
            f"n_routed_experts {args.n_experts} not divisible by n_group {args.n_group}"
            if args.n_experts % args.n_group else "",
            f"topk_group {args.topk_group} > n_group {args.n_group}" if args.topk_group > args.n_group else "",
        ]
        if any(unsupported):
            raise RuntimeLoadError("config.json: this runtime does not run DeepSeek-V3 with "
                                   + "; ".join(u for u in unsupported if u))
        return args

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is MoE (DeepSeek ``inference/model.py``: after the first
        ``first_k_dense_replace`` dense layers, every ``moe_layer_freq``-th)."""
        return self.n_experts > 0 and layer >= self.first_dense and layer % self.moe_freq == 0

    @property
    def softmax_scale(self) -> float:
        """``(nope + rope)^-0.5``, times ``m(factor, mscale_all_dim)^2`` under YaRN (transformers'
        ``yarn_apply_mscale``; DeepSeek ``inference/model.py`` ``MLA.softmax_scale``)."""
        scale = (self.qk_nope_dim + self.qk_rope_dim) ** -0.5
        r = self.rope
        if r["rope_type"] != "default" and r.get("mscale_all_dim"):
            m = _mscale(float(r["factor"]), float(r["mscale_all_dim"]))
            scale *= m * m
        return scale


def _rope(c: dict) -> dict:
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    if rope["rope_type"] not in ("default", "yarn"):
        raise RuntimeLoadError(f"config.json: rope_type {rope['rope_type']!r} is not supported for DeepSeek-V3 "
                               "(supported: default, yarn)")
    if rope["rope_type"] == "yarn":
        rope.setdefault("original_max_position_embeddings", c.get("max_position_embeddings") or 4096)
        if rope.get("factor") is None:
            rope["factor"] = float(c["max_position_embeddings"]) / float(rope["original_max_position_embeddings"])
    return rope


def _mscale(scale: float, k: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * k * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0


def rope_frequencies(args: V3Args) -> tuple[torch.Tensor, float]:
    """``(inv_freq [r/2] float32, cos/sin scale)`` for the rotary dims ``r = qk_rope_head_dim``.

    Source: transformers ``_compute_yarn_parameters`` (``truncate`` true: floor/ceil of the
    correction range, as DeepSeek ``inference/model.py`` ``precompute_freqs_cis``).
    """
    r, dim = args.rope, args.qk_rope_dim
    base = float(r["rope_theta"])
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # [r/2]
    if r["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    factor, original = float(r["factor"]), float(r["original_max_position_embeddings"])
    attention_factor = r.get("attention_factor")
    if attention_factor is None:
        ms, ms_all = r.get("mscale"), r.get("mscale_all_dim")
        attention_factor = (_mscale(factor, float(ms)) / _mscale(factor, float(ms_all))) if ms and ms_all \
            else _mscale(factor)
    beta_fast, beta_slow = float(r.get("beta_fast") or 32), float(r.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if r.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the source: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [r/2]
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


def rope_tables(args: V3Args, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[max_seq_len, r]`` float32 (frequencies duplicated, times the YaRN scale),
    as transformers' ``DeepseekV3RotaryEmbedding`` makes them."""
    inv, scale = rope_frequencies(args)
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)  # [S, r/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, r]
    return emb.cos() * scale, emb.sin() * scale
