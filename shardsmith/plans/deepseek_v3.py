"""DeepSeek-V3 plan (Hugging Face names, ``model.layers.N.self_attn.q_b_proj``; FP8 with F32
``weight_scale_inv`` on 128x128 blocks, ragged edges such as ``kv_a_proj_with_mqa``'s 576 rows).

Source of the layout: DeepSeek-V3 ``inference/model.py`` (MLA ``wq_b`` and ``wkv_b``
column-parallel by heads, ``wo`` row-parallel, ``wq_a``/``wkv_a`` and norms replicated, dense
first layers, experts split on the intermediate dim) mapped to the HF names by
``inference/convert.py``'s table.

===============================================  ================  ================================
tensor                                           layout            unit
===============================================  ================  ================================
embed_tokens, lm_head, MTP embed/shared_head      vocab-parallel    rows
self_attn.q_b_proj / q_proj                      head-grouped d0   ``qk_nope + qk_rope`` rows (192)
self_attn.kv_b_proj                              head-grouped d0   ``qk_nope + v_head`` rows (256)
self_attn.o_proj                                 head-grouped d1   ``v_head_dim`` columns (128)
self_attn.q_a_proj, kv_a_proj_with_mqa, norms    replicated
mlp.gate_proj/up_proj, down_proj (dense, shared) tp-within-expert  rows d0 / columns d1
mlp.experts.E.* (banks)                          tp-within-expert  rows d0 / columns d1
mlp.gate (router + e_score_correction_bias)      replicated
MTP eh_proj, enorm, hnorm, shared_head.norm      replicated
===============================================  ================  ================================

Heads are not merged with FP8 blocks: 192-row query heads cut 128-row blocks unless each rank
holds an even number of them, so e.g. world_size=128 is refused naming the cut.
"""

from __future__ import annotations

from ..checkpoint.config import config_int
from .core import BankArray, BankRole, Layout, Plan, Rule

L = r"(model\.layers\.\d+)"


def build(config: dict, world_size: int) -> Plan:
    """The DeepSeek-V3 plan for ``world_size`` ranks (cuts inside blocks fail at resolve time).

    Raises:
        SourceError: ``qk_nope_head_dim``, ``qk_rope_head_dim`` or ``v_head_dim`` missing from
            config.json or not a valid count.
    """
    nope, rope = config_int(config, "qk_nope_head_dim"), config_int(config, "qk_rope_head_dim")
    v_head = config_int(config, "v_head_dim")
    rules = (
        Rule(r"model\.embed_tokens\.weight|" + L + r"\.embed_tokens\.weight", Layout.VOCAB, 0,
             note="vocab-parallel embedding (MTP layer's copy too)"),
        Rule(r"lm_head\.weight|" + L + r"\.shared_head\.head\.weight", Layout.VOCAB, 0, note="vocab-parallel LM head"),
        Rule(r"model\.norm\.weight|" + L + r"\.(input_layernorm|post_attention_layernorm|enorm|hnorm|shared_head\.norm)\.weight|"
             + L + r"\.eh_proj\.weight", Layout.REPLICATED, note="norms and the MTP projection"),
        Rule(L + r"\.self_attn\.(q_b_proj|q_proj)\.weight", Layout.HEAD_GROUPED, 0, nope + rope, merge_block=False,
             note="MLA query up-projection: whole heads"),
        Rule(L + r"\.self_attn\.kv_b_proj\.weight", Layout.HEAD_GROUPED, 0, nope + v_head, merge_block=False,
             note="MLA KV up-projection: whole heads"),
        Rule(L + r"\.self_attn\.o_proj\.weight", Layout.HEAD_GROUPED, 1, v_head, merge_block=False,
             note="output projection: partial sums, one all-reduce"),
        Rule(L + r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_a_layernorm|kv_a_layernorm)\.weight",
             Layout.REPLICATED, note="MLA down-projections and latent norms"),
        Rule(L + r"\.mlp\.gate\.(weight|e_score_correction_bias)", Layout.REPLICATED, note="router"),
        Rule(L + r"\.mlp\.experts\.(\d+)\.gate_proj\.weight", Layout.EXPERT, 0, bank=BankRole(BankArray.GATE_UP, 0)),
        Rule(L + r"\.mlp\.experts\.(\d+)\.up_proj\.weight", Layout.EXPERT, 0, bank=BankRole(BankArray.GATE_UP, 1)),
        Rule(L + r"\.mlp\.experts\.(\d+)\.down_proj\.weight", Layout.EXPERT, 1, bank=BankRole(BankArray.DOWN, 0)),
        Rule(L + r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight", Layout.EXPERT, 0,
             note="dense MLP / shared expert gate and up"),
        Rule(L + r"\.mlp\.(shared_experts\.)?down_proj\.weight", Layout.EXPERT, 1, note="dense MLP / shared expert down"),
    )
    return Plan("deepseek-v3", rules)
