"""Mixtral / Qwen3-MoE / Qwen2-MoE plan (Hugging Face names, ``model.layers.N.self_attn.q_proj``).

Source of the layout: gpt-fast ``tp.py`` and ``mixtral-moe`` (q/k/v column-parallel, o row-parallel,
experts split on the intermediate dim), vLLM's ``MixtralForCausalLM`` (KV heads replicated when
world_size exceeds them) and transformers' model files for the names.

Attention is split by whole KV groups (a KV head with the query heads that read it), front-loaded
when world_size does not divide the groups (3 groups at TP=2: 2 + 1). When world_size exceeds the
KV heads, whole query heads are dealt instead and each rank holds a copy of every KV head its query
heads read (``kv-copies``). When any of those cuts would fall inside an FP8 block (SmolLM2's 64-row
heads on 128x128 blocks at TP=3), attention is replicated and the plan says so and why.

====================================================  ================  ========================
tensor                                                layout            unit
====================================================  ================  ========================
embed_tokens, lm_head                                 vocab-parallel    rows
self_attn.q/k/v_proj (weight, bias)                   head-grouped d0   KV group / head rows
self_attn.o_proj                                      head-grouped d1   KV group / head columns
experts.E.w1|gate_proj, w3|up_proj / w2|down_proj     tp-within-expert  rows d0 / columns d1
shared_expert(s).gate/up/down, dense mlp              tp-within-expert  rows d0 / columns d1
norms, router gate, shared_expert_gate                replicated
====================================================  ================  ========================
"""

from __future__ import annotations

from ..checkpoint.config import CONFIG, config_int
from ..errors import PlanError, SourceError
from .core import BankArray, BankRole, Layout, Plan, Rule, Split, check_block_cuts, partition_units

L = r"(model\.layers\.\d+)"
MOE = r"(?:block_sparse_moe|mlp)"
ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


def _attention_rules(config: dict, world_size: int) -> tuple[tuple[Rule, ...], tuple[str, ...]]:
    heads = config_int(config, "num_attention_heads")
    kv = config_int(config, "num_key_value_heads", default=heads)
    head_dim = config_int(config, "head_dim", default=0) or config_int(config, "hidden_size") // heads
    if heads % kv:
        raise SourceError(f"{CONFIG}: num_key_value_heads is {kv}, which does not divide num_attention_heads={heads} "
                          f"(every KV head serves a whole number of query heads)")
    group = heads // kv
    qkv = r"\.self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)"
    q = r"\.self_attn\.q_proj\.(weight|bias)"
    k_v = r"\.self_attn\.(k_proj|v_proj)\.(weight|bias)"
    o = r"\.self_attn\.o_proj\.weight"
    norms = Rule(L + r"\.self_attn\.(q_norm|k_norm)\.weight|" + L + r"\.self_attn\.o_proj\.bias",
                 Layout.REPLICATED, note="per-head norms; o_proj bias added once after the all-reduce")
    if heads < world_size:
        raise PlanError(f"attention: {heads} query heads cannot be split over world_size={world_size} (each rank "
                        f"needs a whole query head); valid world sizes: 1 to {heads}")
    if world_size <= kv:
        how = f"whole KV groups ({kv} groups of {group} query heads)"
        rules = (
            Rule(L + q, Layout.HEAD_GROUPED, 0, group * head_dim, merge_block=False, note=how),
            Rule(L + k_v, Layout.HEAD_GROUPED, 0, head_dim, merge_block=False, note=how),
            Rule(L + o, Layout.HEAD_GROUPED, 1, group * head_dim, merge_block=False, note=how),
        )
        q_unit = group * head_dim
    else:
        how = f"whole query heads; KV heads copied to each rank that reads them ({kv} < world_size)"
        rules = (
            Rule(L + q, Layout.HEAD_GROUPED, 0, head_dim, merge_block=False, note=how),
            Rule(L + k_v, Layout.HEAD_GROUPED, 0, head_dim, Split.KV_COPIES, merge_block=False,
                 kv_for=(head_dim, group, heads), note=how),
            Rule(L + o, Layout.HEAD_GROUPED, 1, head_dim, merge_block=False, note=how),
        )
        q_unit = head_dim
    qc = config.get("quantization_config") or {}
    block = (qc.get("weight_block_size") or [1])[0] if qc else 1
    if block > 1:
        try:
            shares = partition_units(heads * head_dim, q_unit, world_size, what="q_proj dim 0")
            check_block_cuts([(s,) for s in shares], block, heads * head_dim, what="q_proj dim 0",
                             world_size=world_size)
            if world_size <= kv:
                kv_shares = partition_units(kv * head_dim, head_dim, world_size, what="k_proj dim 0")
                check_block_cuts([(s,) for s in kv_shares], block, kv * head_dim, what="k_proj dim 0",
                                 world_size=world_size)
        except PlanError as e:
            note = (f"attention replicated: {head_dim}-row heads split at world_size={world_size} would cut "
                    f"{block}x{block} FP8 blocks ({e})")
            return (Rule(L + qkv + "|" + L + o, Layout.REPLICATED, note=note), norms), (note,)
    return (*rules, norms), ()


def build(config: dict, world_size: int) -> Plan:
    """The Mixtral / Qwen-MoE plan for ``world_size`` ranks.

    Raises:
        PlanError: more ranks than query heads (naming the valid sizes).
        SourceError: a config.json field the attention split needs is missing or not a valid count.
    """
    attn, notes = _attention_rules(config, world_size)
    rules = (
        Rule(r"model\.embed_tokens\.weight", Layout.VOCAB, 0, note="vocab-parallel embedding"),
        Rule(r"lm_head\.weight", Layout.VOCAB, 0, note="vocab-parallel LM head (absent when tied)"),
        Rule(r"model\.norm\.weight|" + L + r"\.(input_layernorm|post_attention_layernorm)\.weight",
             Layout.REPLICATED, note="norms"),
        *attn,
        Rule(L + r"\." + MOE + r"\.gate\.weight|" + L + r"\.mlp\.shared_expert_gate\.weight", Layout.REPLICATED,
             note="router: identical routing on every rank"),
        Rule(L + r"\." + MOE + r"\.experts\.(\d+)\.(w1|gate_proj)\.weight", Layout.EXPERT, 0,
             bank=BankRole(BankArray.GATE_UP, 0)),
        Rule(L + r"\." + MOE + r"\.experts\.(\d+)\.(w3|up_proj)\.weight", Layout.EXPERT, 0,
             bank=BankRole(BankArray.GATE_UP, 1)),
        Rule(L + r"\." + MOE + r"\.experts\.(\d+)\.(w2|down_proj)\.weight", Layout.EXPERT, 1,
             bank=BankRole(BankArray.DOWN, 0)),
        Rule(L + r"\.mlp\.(shared_experts?\.)?(gate_proj|up_proj)\.weight", Layout.EXPERT, 0,
             note="shared expert / dense MLP gate and up"),
        Rule(L + r"\.mlp\.(shared_experts?\.)?down_proj\.weight", Layout.EXPERT, 1,
             note="shared expert / dense MLP down"),
    )
    return Plan("mixtral", rules, notes)
