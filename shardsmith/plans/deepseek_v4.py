"""DeepSeek-V4 plan (release checkpoint names: ``embed.weight``, ``layers.N.attn.wq_b.weight``, ...).

Source of the layout: DeepSeek-V4 ``inference/model.py`` (``ColumnParallelLinear`` for ``wq_b``,
grouped ``wo_a`` by output group, ``RowParallelLinear`` for ``wo_b``, experts split on their
intermediate dim) and the release's ``config.json``.

=====================================  ================  =========================================
tensor                                 layout            unit
=====================================  ================  =========================================
embed, head                            vocab-parallel    rows (plus ``--align``)
attn.wq_b                              head-grouped d0   ``head_dim`` rows (512), equal shares
attn.wo_a                              head-grouped d0   ``o_lora_rank`` rows (one output group)
attn.wo_b                              row-parallel d1   ``o_lora_rank`` columns
attn.attn_sink                         head-grouped d0   one head
ffn.shared_experts.w1/w3, w2           tp-within-expert  rows d0 / columns d1
ffn.experts.E.w1/w3, w2 (banks)        tp-within-expert  rows d0 / columns d1 (FP4: 32 elements)
wq_a, wkv, norms, compressor, indexer,
gate (router), hc_* mixers, mtp extras replicated
=====================================  ================  =========================================
"""

from __future__ import annotations

from ..checkpoint.config import config_int
from ..errors import PlanError
from .core import BankArray, BankRole, Layout, Plan, Rule, Split

L = r"((?:layers|mtp)\.\d+)"  # layer key: a backbone layer or an MTP draft layer


def valid_world_sizes(config: dict) -> list[int]:
    """World sizes (up to 64) that divide both the attention heads and ``o_groups``."""
    heads, groups = config_int(config, "num_attention_heads"), config_int(config, "o_groups", default=1)
    return [w for w in range(1, 65) if heads % w == 0 and groups % w == 0]


def build(config: dict, world_size: int) -> Plan:
    """The DeepSeek-V4 plan for ``world_size`` ranks.

    Raises:
        PlanError: ``world_size`` does not divide the heads or ``o_groups`` (wq_b and wo_a are
            split by whole heads and whole output groups), naming the valid sizes.
        SourceError: ``num_attention_heads``, ``head_dim``, ``o_groups`` or ``o_lora_rank`` not a
            valid count in config.json (or the first two missing).
    """
    heads = config_int(config, "num_attention_heads")
    head_dim = config_int(config, "head_dim")
    groups = config_int(config, "o_groups", default=1)
    o_rank = config_int(config, "o_lora_rank", default=0) or head_dim * heads // groups
    for what, n in (("num_attention_heads", heads), ("o_groups", groups)):
        if n % world_size:
            raise PlanError(
                f"DeepSeek-V4: world_size={world_size} does not divide {what}={n} (wq_b is split by "
                f"whole heads and wo_a by whole output groups); valid world sizes: "
                f"{', '.join(map(str, valid_world_sizes(config)))}"
            )
    exact = Split.EXACT
    rules = (
        Rule(r"embed\.weight", Layout.VOCAB, 0, note="vocab-parallel embedding: masked lookup + all-reduce"),
        Rule(r"head\.weight", Layout.VOCAB, 0, note="vocab-parallel LM head: all-gather of logits"),
        Rule(r"norm\.weight|hc_head_(base|fn|scale)", Layout.REPLICATED, note="final norm and head mixer"),
        Rule(L + r"\.attn\.wq_b\.weight", Layout.HEAD_GROUPED, 0, head_dim, exact, merge_block=False,
             note="query up-projection: whole heads"),
        Rule(L + r"\.attn\.wo_a\.weight", Layout.HEAD_GROUPED, 0, o_rank, exact, merge_block=False,
             note="grouped low-rank output projection: whole output groups"),
        Rule(L + r"\.attn\.wo_b\.weight", Layout.ROW, 1, o_rank, exact, merge_block=False,
             note="output projection: partial sums, one all-reduce"),
        Rule(L + r"\.attn\.attn_sink", Layout.HEAD_GROUPED, 0, 1, exact, merge_block=False, note="per-head sinks"),
        Rule(L + r"\.attn\.(wq_a|wkv)\.weight|" + L + r"\.attn\.(q_norm|kv_norm)\.weight",
             Layout.REPLICATED, note="query down-projection and shared latent KV"),
        Rule(L + r"\.attn\.(compressor|indexer)\..+", Layout.REPLICATED, note="compressors and Lightning Indexer"),
        Rule(L + r"\.ffn\.gate\.(weight|bias|tid2eid)", Layout.REPLICATED,
             note="router: every rank makes the same routing and cache decisions"),
        Rule(L + r"\.ffn\.shared_experts\.w[13]\.weight", Layout.EXPERT, 0, note="shared expert gate/up"),
        Rule(L + r"\.ffn\.shared_experts\.w2\.weight", Layout.EXPERT, 1, note="shared expert down"),
        Rule(L + r"\.ffn\.experts\.(\d+)\.w1\.weight", Layout.EXPERT, 0, bank=BankRole(BankArray.GATE_UP, 0)),
        Rule(L + r"\.ffn\.experts\.(\d+)\.w3\.weight", Layout.EXPERT, 0, bank=BankRole(BankArray.GATE_UP, 1)),
        Rule(L + r"\.ffn\.experts\.(\d+)\.w2\.weight", Layout.EXPERT, 1, bank=BankRole(BankArray.DOWN, 0)),
        Rule(L + r"\.(attn_norm|ffn_norm)\.weight|" + L + r"\.hc_(attn|ffn)_(base|fn|scale)", Layout.REPLICATED,
             note="norms and hyper-connection mixers"),
        Rule(r"mtp\.\d+\.(main_norm\.weight|main_proj\.weight|norm\.weight|hc_head_(base|fn|scale)|"
             r"confidence_head\..+|markov_head\..+|enorm\.weight|hnorm\.weight|e_proj\.weight|h_proj\.weight)",
             Layout.REPLICATED, note="MTP draft-layer extras (kept in packs, not run yet)"),
    )
    return Plan("deepseek-v4", rules)
