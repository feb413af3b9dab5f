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


MAX_WORLD_SIZE = 64


def _fp8_block(config: dict) -> int:
    """Rows (= columns) of an FP8 weight block from ``quantization_config``, 1 when unquantized."""
    qc = config.get("quantization_config") or {}
    block = qc.get("weight_block_size") if qc.get("quant_method", "fp8") == "fp8" else None
    return int(block[0]) if block else 1


def world_size_problem(config: dict, world_size: int) -> str | None:
    """Why DeepSeek-V4 cannot be split over ``world_size`` ranks, or ``None`` when it can.

    Constraints, in order: ``wq_b`` is split by whole heads and ``wo_a``/``wo_b`` by whole output
    groups (``world_size`` divides ``num_attention_heads`` and ``o_groups``); with block-FP8 weights
    (``quantization_config.weight_block_size`` B) each rank's ``wq_b`` rows (heads/ws x head_dim)
    and ``wo_a`` rows / ``wo_b`` columns (o_groups/ws x o_lora_rank) are whole blocks, and the
    shared expert's intermediate dim (``moe_intermediate_size``) holds at least one whole block per
    rank. These are the cuts :func:`~shardsmith.plans.resolve.resolve` refuses.
    """
    heads, head_dim = config_int(config, "num_attention_heads"), config_int(config, "head_dim")
    groups = config_int(config, "o_groups", default=1)
    o_rank = config_int(config, "o_lora_rank", default=0) or head_dim * heads // groups
    for what, n in (("num_attention_heads", heads), ("o_groups", groups)):
        if n % world_size:
            return (f"world_size={world_size} does not divide {what}={n} (wq_b is split by whole heads and wo_a by "
                    f"whole output groups)")
    block = _fp8_block(config)
    if block > 1:
        for what, rows in ((f"wq_b rows per rank ({heads // world_size} heads x head_dim {head_dim})",
                            heads // world_size * head_dim),
                           (f"wo_a rows / wo_b columns per rank ({groups // world_size} output groups x o_lora_rank "
                            f"{o_rank})", groups // world_size * o_rank)):
            if rows % block:
                return f"world_size={world_size}: {what} = {rows}, not a whole number of {block}-element FP8 blocks"
        inter = config_int(config, "moe_intermediate_size", default=0)
        if inter and -(-inter // block) < world_size:
            return (f"world_size={world_size}: the shared expert's moe_intermediate_size={inter} holds only "
                    f"{-(-inter // block)} whole {block}-element FP8 blocks, fewer than the ranks")
    return None


def valid_world_sizes(config: dict) -> list[int]:
    """World sizes up to :data:`MAX_WORLD_SIZE` that meet every constraint of :func:`world_size_problem`."""
    return [w for w in range(1, MAX_WORLD_SIZE + 1) if world_size_problem(config, w) is None]


def build(config: dict, world_size: int) -> Plan:
    """The DeepSeek-V4 plan for ``world_size`` ranks.

    Raises:
        PlanError: ``world_size`` breaks a constraint of :func:`world_size_problem` (heads and
            output groups divided whole, FP8 blocks whole), naming it and the valid sizes.
        SourceError: ``num_attention_heads``, ``head_dim``, ``o_groups`` or ``o_lora_rank`` not a
            valid count in config.json (or the first two missing).
    """
    heads = config_int(config, "num_attention_heads")
    head_dim = config_int(config, "head_dim")
    groups = config_int(config, "o_groups", default=1)
    o_rank = config_int(config, "o_lora_rank", default=0) or head_dim * heads // groups
    why = world_size_problem(config, world_size)
    if why:
        raise PlanError(f"DeepSeek-V4: {why}; valid world sizes: {', '.join(map(str, valid_world_sizes(config)))}")
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
