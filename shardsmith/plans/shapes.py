"""Check that ``config.json`` agrees with the tensors before planning from it.

Plans take their units (heads, output groups, experts) from the config; a config that contradicts
the tensors would cut a head in half or size banks wrongly while every byte still "verifies". Each
family lists the shapes its config implies (logical ``[out, in]``; FP4 packed in ``I8``/``U8``
halves the last dim) and the layer and expert counts; every mismatch is reported at once.
"""

from __future__ import annotations

import re

from ..checkpoint import TensorInfo
from ..checkpoint.config import config_int
from ..errors import PlanError, format_problems
from .gpt_oss import expected_shapes as gpt_oss_shapes

Expect = list[tuple[str, tuple[int, ...]]]  # (regex over tensor names, expected logical shape)
Counts = list[tuple[str, str, int]]  # (regex whose group 1 is a layer index, label, expected count)


def _ints(config: dict, *keys: str) -> list[int]:
    return [config_int(config, k) for k in keys]


def _hf_moe(config: dict) -> tuple[Expect, Counts, int]:
    hidden, heads, vocab, layers = _ints(config, "hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers")
    kv = config_int(config, "num_key_value_heads", default=heads)
    d = config_int(config, "head_dim", default=0) or hidden // heads
    experts = config_int(config, "num_local_experts", default=0) or config_int(config, "num_experts", default=0)
    inter = (config_int(config, "moe_intermediate_size", default=0)
             or config_int(config, "intermediate_size", default=0))
    L = r"model\.layers\.\d+"
    expect = [
        (r"model\.embed_tokens\.weight|lm_head\.weight", (vocab, hidden)),
        (L + r"\.self_attn\.q_proj\.weight", (heads * d, hidden)),
        (L + r"\.self_attn\.(k_proj|v_proj)\.weight", (kv * d, hidden)),
        (L + r"\.self_attn\.o_proj\.weight", (hidden, heads * d)),
        (L + r"\.(block_sparse_moe|mlp)\.gate\.weight", (experts, hidden)),
        (L + r"\.(block_sparse_moe|mlp)\.experts\.\d+\.(w1|w3|gate_proj|up_proj)\.weight", (inter, hidden)),
        (L + r"\.(block_sparse_moe|mlp)\.experts\.\d+\.(w2|down_proj)\.weight", (hidden, inter)),
    ]
    return expect, [(r"model\.layers\.(\d+)\.", "num_hidden_layers", layers)], experts


def _deepseek_v4(config: dict) -> tuple[Expect, Counts, int]:
    hidden, heads, d, vocab, layers = _ints(config, "hidden_size", "num_attention_heads", "head_dim", "vocab_size",
                                            "num_hidden_layers")
    q_lora, groups, o_lora, experts, inter = _ints(config, "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts",
                                                   "moe_intermediate_size")
    L = r"(layers|mtp)\.\d+"
    expect = [
        (r"embed\.weight|head\.weight", (vocab, hidden)),
        (L + r"\.attn\.wq_a\.weight", (q_lora, hidden)),
        (L + r"\.attn\.wq_b\.weight", (heads * d, q_lora)),
        (L + r"\.attn\.wkv\.weight", (d, hidden)),
        (L + r"\.attn\.wo_a\.weight", (groups * o_lora, heads * d // groups)),
        (L + r"\.attn\.wo_b\.weight", (hidden, groups * o_lora)),
        (L + r"\.attn\.attn_sink", (heads,)),
        (L + r"\.ffn\.gate\.weight", (experts, hidden)),
        (L + r"\.ffn\.experts\.\d+\.(w1|w3)\.weight", (inter, hidden)),
        (L + r"\.ffn\.experts\.\d+\.w2\.weight", (hidden, inter)),
    ]
    # MTP layers are not counted: the release's dspark drafts carry more than num_nextn_predict_layers
    return expect, [(r"layers\.(\d+)\.", "num_hidden_layers", layers)], experts


def _deepseek_v3(config: dict) -> tuple[Expect, Counts, int]:
    hidden, heads, vocab, layers = _ints(config, "hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers")
    nope, rope, v, kv_lora, experts, inter = _ints(config, "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                   "kv_lora_rank", "n_routed_experts", "moe_intermediate_size")
    q_lora = config_int(config, "q_lora_rank", default=0)
    L = r"model\.layers\.\d+"
    expect = [
        (r"model\.embed_tokens\.weight|lm_head\.weight", (vocab, hidden)),
        (L + r"\.self_attn\.kv_a_proj_with_mqa\.weight", (kv_lora + rope, hidden)),
        (L + r"\.self_attn\.kv_b_proj\.weight", (heads * (nope + v), kv_lora)),
        (L + r"\.self_attn\.o_proj\.weight", (hidden, heads * v)),
        (L + r"\.mlp\.gate\.weight", (experts, hidden)),
        (L + r"\.mlp\.experts\.\d+\.(gate_proj|up_proj)\.weight", (inter, hidden)),
        (L + r"\.mlp\.experts\.\d+\.down_proj\.weight", (hidden, inter)),
    ]
    if q_lora:
        expect.append((L + r"\.self_attn\.q_b_proj\.weight", (heads * (nope + rope), int(q_lora))))
    mtp = config_int(config, "num_nextn_predict_layers", default=0)
    return expect, [(r"model\.layers\.(\d+)\.", "num_hidden_layers + num_nextn_predict_layers", layers + mtp)], experts


FAMILY_SHAPES = {"deepseek-v4": _deepseek_v4, "deepseek-v3": _deepseek_v3, "mixtral": _hf_moe,
                 "gpt-oss": gpt_oss_shapes}


def _logical(info: TensorInfo) -> tuple[int, ...]:
    if info.dtype in ("I8", "U8") and info.shape:  # two e2m1 values per byte on the last dim
        return (*info.shape[:-1], info.shape[-1] * 2)
    return info.shape


def check_shapes(family: str, config: dict, tensors: dict[str, TensorInfo], experts: dict[str, int]) -> None:
    """Compare the shapes and counts ``config`` implies with the tensors.

    Args:
        family: plan family; experts: routed experts found per MoE layer key (from the plan).

    Raises:
        PlanError: listing every tensor whose shape, and every count, disagrees with config.json.
        SourceError: a field the family's shapes need is missing from config.json or not a count.
    """
    if family not in FAMILY_SHAPES:
        return
    expect, counts, n_experts = FAMILY_SHAPES[family](config)
    compiled = [(re.compile(p), shape) for p, shape in expect]
    problems = []
    for name, info in tensors.items():
        for rx, shape in compiled:
            if rx.fullmatch(name):
                got = _logical(info) if len(shape) == 2 else info.shape
                if tuple(got) != shape:
                    problems.append(f"tensor {name!r}: shape {list(info.shape)} ({info.dtype}), but config.json implies {list(shape)}")
                break
    for pattern, key, want in counts:
        found = len({m.group(1) for n in tensors if (m := re.match(pattern, n))})
        if found != want:
            problems.append(f"the tensors hold {found} layers matching {pattern!r}; config.json's {key} says {want}")
    bad = {layer: n for layer, n in experts.items() if n != n_experts}
    if n_experts and bad:
        layer, n = next(iter(bad.items()))
        problems.append(f"{len(bad)} MoE layer(s) hold {n} routed experts (e.g. {layer}); config.json says {n_experts}")
    if problems:
        raise PlanError(format_problems("config.json disagrees with the checkpoint's tensors", problems))


def check_banks(tensors: dict) -> None:
    """Every routed expert of a layer must have the same dtype and shape per bank slot, since a
    bank stacks them into one ``[E, ...]`` array.

    Args:
        tensors: the resolved plan's :class:`~shardsmith.plans.resolve.TensorPlan` by name.

    Raises:
        PlanError: naming each odd expert tensor against the first of its slot.
    """
    first: dict[tuple, object] = {}
    problems = []
    for tp in tensors.values():
        if tp.bank is None:
            continue
        key = (tp.bank.layer, tp.bank.array_name, tp.bank.segment)
        ref = first.setdefault(key, tp)
        if (tp.dtype, tp.shape) != (ref.dtype, ref.shape):
            problems.append(f"{tp.name}: {tp.dtype}{list(tp.shape)} but {ref.name} is {ref.dtype}{list(ref.shape)}; "
                            f"all experts of {tp.bank.layer} must match to stack into one bank")
    if problems:
        raise PlanError(format_problems("routed experts of one layer differ", problems))
