"""gpt-oss plan (Hugging Face release names: ``model.layers.N.mlp.experts.gate_up_proj_blocks``, ...).

Source of the layout: OpenAI's gpt-oss reference (``torch/model.py``: experts as stacked
``[E, ...]`` MXFP4 tensors, gate and up interleaved on the output dim, SwiGLU with ``alpha`` and
``limit``, per-head attention sinks), transformers' ``modeling_gpt_oss.py`` and its MXFP4 loader
(``integrations/mxfp4.py``) for names and block layout, and gpt-fast ``tp.py`` for the splits.

The routed experts are already stacked per layer in the source, so they are planned as whole
tensors split TP-within-expert (every expert cut on its intermediate dim) and land in the dense
files with their rank-local shapes, not in per-expert bank slots. The share unit is one MXFP4
block of the down projection's input: 32 intermediate channels, i.e. 64 interleaved gate/up rows
(32 pairs; a pair is never cut in half) and one ``[.., 16]`` block column of ``down_proj_blocks``.
Every expert tensor of a layer is dealt the same number of those units, front-loaded, so a rank's
gate/up pairs, their biases, their scales and its down columns cover the same channels.
``--align`` does not apply to them (the unit is fixed by the MXFP4 block).

=========================================  ================  ======================================
tensor (I = intermediate, E = experts)     layout            unit
=========================================  ================  ======================================
embed_tokens, lm_head                      vocab-parallel    rows
self_attn.q_proj (weight, bias), sinks     head-grouped d0   KV group (query heads reading one KV head)
self_attn.k_proj / v_proj (weight, bias)   head-grouped d0   KV head (``kv-copies`` past the KV heads)
self_attn.o_proj.weight                    head-grouped d1   KV group columns
experts.gate_up_proj_blocks/_scales/_bias  tp-within-expert  d1: 64 rows = 32 interleaved gate/up pairs
experts.down_proj_blocks/_scales           tp-within-expert  d2: one 32-channel block
experts.down_proj_bias, o_proj.bias        replicated        added once, after the all-reduce
router (weight, bias), norms               replicated
=========================================  ================  ======================================
"""

from __future__ import annotations

from ..errors import PlanError
from .core import Layout, Plan, Rule, Split

L = r"(model\.layers\.\d+)"
MX_BLOCK = 32  # elements per MXFP4 scale (OCP MX spec)
ARCHITECTURES = ("GptOssForCausalLM",)


def _attention_rules(config: dict, world_size: int) -> tuple[Rule, ...]:
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    group = heads // kv
    if heads % kv:
        raise PlanError(f"gpt-oss: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    if heads < world_size:
        raise PlanError(f"gpt-oss attention: {heads} query heads cannot be split over world_size={world_size} "
                        f"(each rank needs a whole query head); valid world sizes: 1 to {heads}")
    q, k_v = r"\.self_attn\.q_proj\.(weight|bias)", r"\.self_attn\.(k_proj|v_proj)\.(weight|bias)"
    o, sinks = r"\.self_attn\.o_proj\.weight", r"\.self_attn\.sinks"
    if world_size <= kv:
        how = f"whole KV groups ({kv} groups of {group} query heads)"
        return (
            Rule(L + q, Layout.HEAD_GROUPED, 0, group * head_dim, merge_block=False, note=how),
            Rule(L + sinks, Layout.HEAD_GROUPED, 0, group, merge_block=False, note="per-head sinks: " + how),
            Rule(L + k_v, Layout.HEAD_GROUPED, 0, head_dim, merge_block=False, note=how),
            Rule(L + o, Layout.HEAD_GROUPED, 1, group * head_dim, merge_block=False, note=how),
        )
    how = f"whole query heads; KV heads copied to each rank that reads them ({kv} < world_size)"
    return (
        Rule(L + q, Layout.HEAD_GROUPED, 0, head_dim, merge_block=False, note=how),
        Rule(L + sinks, Layout.HEAD_GROUPED, 0, 1, merge_block=False, note="per-head sinks: " + how),
        Rule(L + k_v, Layout.HEAD_GROUPED, 0, head_dim, Split.KV_COPIES, merge_block=False,
             kv_for=(head_dim, group, heads), note=how),
        Rule(L + o, Layout.HEAD_GROUPED, 1, head_dim, merge_block=False, note=how),
    )


def valid_world_sizes(config: dict) -> list[int]:
    """World sizes (up to 64) the plan accepts: at most one rank per query head and per 32-channel block."""
    limit = min(int(config["num_attention_heads"]), int(config["intermediate_size"]) // MX_BLOCK)
    return list(range(1, min(limit, 64) + 1))


def build(config: dict, world_size: int) -> Plan:
    """The gpt-oss plan for ``world_size`` ranks.

    Raises:
        PlanError: ``intermediate_size`` or ``hidden_size`` not a multiple of the 32-element MXFP4
            block, fewer 32-channel blocks or query heads than ranks (naming the valid sizes), or
            query heads not a multiple of the KV heads.
    """
    for key in ("hidden_size", "intermediate_size", "num_attention_heads"):
        if config.get(key) is None:
            raise PlanError(f"config.json lacks {key}, needed to plan gpt-oss")
    inter, hidden = int(config["intermediate_size"]), int(config["hidden_size"])
    for key, n in (("intermediate_size", inter), ("hidden_size", hidden)):
        if n % MX_BLOCK:
            raise PlanError(f"gpt-oss: {key}={n} is not a multiple of the {MX_BLOCK}-element MXFP4 block")
    if inter // MX_BLOCK < world_size:
        raise PlanError(f"gpt-oss experts: intermediate_size={inter} holds {inter // MX_BLOCK} MXFP4 blocks of "
                        f"{MX_BLOCK} channels, fewer than world_size={world_size} (a rank needs whole blocks); "
                        f"valid world sizes: {', '.join(map(str, valid_world_sizes(config)))}")
    x = r"\.mlp\.experts\."
    pairs = f"{MX_BLOCK} interleaved gate/up pairs per unit (never split between gate and up)"
    rules = (
        Rule(r"model\.embed_tokens\.weight", Layout.VOCAB, 0, note="vocab-parallel embedding"),
        Rule(r"lm_head\.weight", Layout.VOCAB, 0, note="vocab-parallel LM head"),
        Rule(r"model\.norm\.weight|" + L + r"\.(input_layernorm|post_attention_layernorm)\.weight",
             Layout.REPLICATED, note="norms"),
        *_attention_rules(config, world_size),
        Rule(L + r"\.self_attn\.o_proj\.bias", Layout.REPLICATED, note="o_proj bias: added once after the all-reduce"),
        Rule(L + r"\.mlp\.router\.(weight|bias)", Layout.REPLICATED, note="router: identical routing on every rank"),
        Rule(L + x + r"gate_up_proj_(blocks|scales|bias)", Layout.EXPERT, 1, 2 * MX_BLOCK, merge_block=False,
             note="expert gate/up, MXFP4 blocks, scales and bias: " + pairs),
        Rule(L + x + r"down_proj_(blocks|scales)", Layout.EXPERT, 2, 1, merge_block=False,
             note=f"expert down, MXFP4: one {MX_BLOCK}-channel input block per unit; scales follow their blocks"),
        Rule(L + x + r"down_proj_bias", Layout.REPLICATED,
             note="expert down bias: whole on every rank, added once after the all-reduce"),
    )
    notes = (f"gpt-oss experts are stacked MXFP4 tensors: split TP-within-expert in {MX_BLOCK}-channel blocks and "
             "stored in the dense files (no per-expert bank slots); --align does not apply to them",)
    return Plan("gpt-oss", rules, notes)


def expected_shapes(config: dict) -> tuple[list[tuple[str, tuple[int, ...]]], list[tuple[str, str, int]], int]:
    """Shapes ``config.json`` implies for a gpt-oss checkpoint, for :func:`~shardsmith.plans.shapes.check_shapes`.

    Returns:
        ``(expect, counts, 0)``: ``expect`` pairs a name regex with its stored shape (MXFP4 as
        ``[E, N, K/32, 16]`` blocks and ``[E, N, K/32]`` scales, which pins K and the block layout);
        ``counts`` the layer count. Experts are counted by the shapes (they are not bank slots).

    Raises:
        PlanError: config.json lacks a field the shapes need.
    """
    keys = ("hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers", "intermediate_size",
            "num_local_experts")
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise PlanError(f"config.json lacks {', '.join(missing)}, needed to plan gpt-oss")
    hidden, heads, vocab, layers, inter, n_exp = (int(config[k]) for k in keys)
    kv = int(config.get("num_key_value_heads") or heads)
    d = int(config.get("head_dim") or hidden // heads)
    b = MX_BLOCK
    x = L + r"\.mlp\.experts\."
    expect = [
        (r"model\.embed_tokens\.weight|lm_head\.weight", (vocab, hidden)),
        (L + r"\.self_attn\.q_proj\.weight", (heads * d, hidden)),
        (L + r"\.self_attn\.(k_proj|v_proj)\.weight", (kv * d, hidden)),
        (L + r"\.self_attn\.q_proj\.bias", (heads * d,)),
        (L + r"\.self_attn\.(k_proj|v_proj)\.bias", (kv * d,)),
        (L + r"\.self_attn\.o_proj\.weight", (hidden, heads * d)),
        (L + r"\.self_attn\.sinks", (heads,)),
        (L + r"\.mlp\.router\.weight", (n_exp, hidden)),
        (L + r"\.mlp\.router\.bias", (n_exp,)),
        (x + r"gate_up_proj_blocks", (n_exp, 2 * inter, hidden // b, b // 2)),
        (x + r"gate_up_proj_scales", (n_exp, 2 * inter, hidden // b)),
        (x + r"gate_up_proj_bias", (n_exp, 2 * inter)),
        (x + r"down_proj_blocks", (n_exp, hidden, inter // b, b // 2)),
        (x + r"down_proj_scales", (n_exp, hidden, inter // b)),
        (x + r"down_proj_bias", (n_exp, hidden)),
    ]
    return expect, [(r"model\.layers\.(\d+)\.", "num_hidden_layers", layers)], 0
