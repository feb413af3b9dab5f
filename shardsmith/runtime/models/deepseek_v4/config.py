"""DeepSeek-V4 configuration read from a release ``config.json`` (or a transformers-style one).

Field sources: the release ``config.json`` of ``deepseek-v4-flash`` and transformers'
``DeepseekV4Config`` (``configuration_deepseek_v4.py``), whose folding of legacy keys we follow:

========================  ==========================================  ============================
release key               meaning                                     transformers spelling
========================  ==========================================  ============================
``compress_ratios``       per layer 0 (sliding), 4 (CSA), 128 (HCA);  ``layer_types``
                          longer than the layer count (MTP entries)
``num_hash_layers``       first layers routed by ``tid2eid[token]``   ``mlp_layer_types``
``qk_rope_head_dim``      trailing RoPE dims of each 512-dim head      ``partial_rotary_factor``
``rope_scaling``          YaRN, compressed layers only                ``rope_parameters.compress``
========================  ==========================================  ============================
"""

from __future__ import annotations

from dataclasses import dataclass

from shardsmith.errors import RuntimeLoadError

KIND_OF_RATIO = {0: "sliding", 4: "csa", 128: "hca"}
_KIND_OF_TYPE = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                 "heavily_compressed_attention": "hca"}


@dataclass(frozen=True, slots=True)
class V4Args:
    """What the DeepSeek-V4 runtime needs from ``config.json`` (global sizes, not per rank).

    Attributes:
        vocab_size, dim (D), n_layers, n_heads, head_dim (d, 512 real), rope_dim (trailing RoPE
        dims of a head), q_lora_rank, o_groups (G), o_lora_rank: attention sizes.
        kinds: per layer ``sliding``, ``csa`` or ``hca``; ratios: per layer compression ratio
        (tokens per compressed entry; 0 for sliding).
        window: sliding window in tokens (a query sees itself and ``window - 1`` earlier tokens).
        index_heads, index_head_dim, index_topk: Lightning Indexer sizes.
        n_experts, top_k, n_hash_layers, routed_scale, swiglu_limit, score_func: MoE routing.
        hc_mult, hc_iters, hc_eps: hyper-connection streams, Sinkhorn iterations and floor.
        norm_eps: RMSNorm epsilon; rope_theta: base of sliding layers; compress_theta and yarn
        (``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, or None):
        RoPE of compressed layers.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    kinds: tuple[str, ...]
    ratios: tuple[int, ...]
    window: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    n_experts: int
    top_k: int
    n_hash_layers: int
    routed_scale: float
    swiglu_limit: float
    score_func: str
    hc_mult: int
    hc_iters: int
    hc_eps: float
    norm_eps: float
    rope_theta: float
    compress_theta: float
    yarn: dict | None

    @classmethod
    def from_config(cls, c: dict) -> "V4Args":
        """Read a release (or transformers-saved) DeepSeek-V4 ``config.json``.

        Raises:
            RuntimeLoadError: a missing field, a compression ratio other than 0/4/128, or a
                router scoring function other than ``sqrtsoftplus``/``sigmoid``/``softmax``.
        """
        try:
            n = int(c["num_hidden_layers"])
            head_dim = int(c["head_dim"])
            kinds = _kinds(c, n)
            rates = dict(c.get("compress_rates") or {})
            csa = int(rates.get("compressed_sparse_attention", c.get("compress_rate_csa", 4)))
            hca = int(rates.get("heavily_compressed_attention", c.get("compress_rate_hca", 128)))
            rope_dim = int(c.get("qk_rope_head_dim") or round(head_dim * float(c.get("partial_rotary_factor") or 0.125)))
            score = str(c.get("scoring_func", "sqrtsoftplus"))
            if score not in ("sqrtsoftplus", "sigmoid", "softmax"):
                raise RuntimeLoadError(f"config.json: scoring_func {score!r} is not supported "
                                       "(supported: sqrtsoftplus, sigmoid, softmax)")
            return cls(
                vocab_size=int(c["vocab_size"]), dim=int(c["hidden_size"]), n_layers=n,
                n_heads=int(c["num_attention_heads"]), head_dim=head_dim, rope_dim=rope_dim,
                q_lora_rank=int(c["q_lora_rank"]), o_groups=int(c["o_groups"]), o_lora_rank=int(c["o_lora_rank"]),
                kinds=kinds, ratios=tuple({"sliding": 0, "csa": csa, "hca": hca}[k] for k in kinds),
                window=int(c["sliding_window"]), index_heads=int(c["index_n_heads"]),
                index_head_dim=int(c["index_head_dim"]), index_topk=int(c["index_topk"]),
                n_experts=int(c["n_routed_experts"]), top_k=int(c["num_experts_per_tok"]),
                n_hash_layers=_hash_layers(c, n), routed_scale=float(c.get("routed_scaling_factor", 1.0)),
                swiglu_limit=float(c.get("swiglu_limit") or 0.0), score_func=score,
                hc_mult=int(c["hc_mult"]), hc_iters=int(c.get("hc_sinkhorn_iters", 20)),
                hc_eps=float(c.get("hc_eps", 1e-6)), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=float(c.get("rope_theta", 10000.0)),
                compress_theta=float(c.get("compress_rope_theta", 160000.0)), yarn=_yarn(c),
            )
        except KeyError as e:
            raise RuntimeLoadError(f"config.json: missing field {e.args[0]!r} for DeepseekV4ForCausalLM") from None


def _kinds(c: dict, n: int) -> tuple[str, ...]:
    types = c.get("layer_types")
    if types:
        return tuple(_KIND_OF_TYPE[t] for t in types[:n])
    ratios = list(c["compress_ratios"])[:n]
    if len(ratios) < n:
        raise RuntimeLoadError(f"config.json: compress_ratios has {len(ratios)} entries for {n} layers")
    bad = sorted({r for r in ratios if r not in KIND_OF_RATIO})
    if bad:
        raise RuntimeLoadError(f"config.json: compress_ratios {bad} not supported (0 sliding, 4 CSA, 128 HCA)")
    return tuple(KIND_OF_RATIO[r] for r in ratios)


def _hash_layers(c: dict, n: int) -> int:
    types = c.get("mlp_layer_types")
    if types:
        return sum(1 for t in types[:n] if t == "hash_moe")
    return min(n, int(c.get("num_hash_layers", 3)))


def _yarn(c: dict) -> dict | None:
    rp = c.get("rope_parameters") or {}
    r = dict(rp["compress"]) if isinstance(rp.get("compress"), dict) else dict(c.get("rope_scaling") or {})
    if (r.get("rope_type") or r.get("type")) != "yarn":
        return None
    return {"factor": float(r["factor"]), "original_max_position_embeddings": int(r["original_max_position_embeddings"]),
            "beta_fast": float(r.get("beta_fast") or 32), "beta_slow": float(r.get("beta_slow") or 1)}
