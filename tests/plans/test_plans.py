"""Plans as data: share arithmetic, family tables, and byte-exact rebuild from per-rank slices."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardsmith.checkpoint import open_checkpoint
from shardsmith.dtypes import DTYPES
from shardsmith.errors import PlanError
from shardsmith.plans import Layout, Plan, Rule, Split, partition_units, plan_checkpoint
from shardsmith.plans.core import kv_copies
from shardsmith.plans.resolve import resolve
from shardsmith.plans.serialize import plan_from_dict, plan_to_dict
from shardsmith.pack.banks import bank_specs, cut

# world sizes each tiny family must plan at (V3: 8 192-row heads cut 128-row blocks at TP=3;
# V4: 8 heads and 4 output groups do not divide by 3)
WORLDS = {
    "mixtral": (1, 2, 3, 4), "mixtral-fp8": (1, 2, 3, 4), "mixtral-tied": (1, 2, 3, 4), "qwen3-moe": (1, 2, 3, 4),
    "qwen2-moe": (1, 2, 3, 4), "deepseek-v3": (1, 2, 4), "deepseek-v4": (1, 2, 4),
}


@given(size=st.integers(1, 5000), unit=st.integers(1, 300), world=st.integers(1, 16))
def test_partition_tiles_axis_front_loaded(size: int, unit: int, world: int) -> None:
    n_units = -(-size // unit)
    if n_units < world:
        with pytest.raises(PlanError, match="cannot give each"):
            partition_units(size, unit, world)
        return
    shares = partition_units(size, unit, world)
    assert [s for s, _ in shares] == [sum(n for _, n in shares[:r]) for r in range(world)]
    assert sum(n for _, n in shares) == size
    units = [-(-n // unit) for _, n in shares]
    assert max(units) - min(units) <= 1 and units == sorted(units, reverse=True)
    assert all(s % unit == 0 for s, _ in shares)  # every cut on a unit boundary


def test_partition_examples_from_deployments() -> None:
    assert [n for _, n in partition_units(2304, 128, 4)] == [640, 640, 512, 512]
    assert [n for _, n in partition_units(129280, 128, 4)] == [32384, 32384, 32256, 32256]
    assert partition_units(576, 128, 2) == [(0, 384), (384, 192)]  # ragged last block
    with pytest.raises(PlanError, match="not 3 equal shares"):
        partition_units(64, 1, 3, exact=True)


def test_kv_copies_cover_each_query_heads_kv() -> None:
    q = partition_units(9 * 64, 64, 4)  # 9 query heads: 3/2/2/2
    assert kv_copies(q, 64, 3, 64) == [(0, 64), (64, 64), (64, 128), (128, 64)]


def _rebuild(raw: np.ndarray, tp, world: int) -> np.ndarray:
    """Reassemble a tensor from every rank's shard independently of `cut`'s own indexing."""
    if tp.shard_dim is None:
        for r in range(world):
            assert np.array_equal(cut(raw, tp, r), raw)
        return raw
    d, shape = tp.shard_dim, tp.shape
    per = 2 if DTYPES[tp.dtype].bits == 4 and d == len(shape) - 1 else 1
    outer, n = math.prod(shape[:d]), shape[d] // per
    out = np.zeros((outer, n, raw.size // max(outer * n, 1)), dtype=np.uint8)
    seen = np.zeros(n, dtype=np.int64)
    for r in range(world):
        local = cut(raw, tp, r).reshape(outer, -1, out.shape[2])
        pos = 0
        for start, length in tp.ranges[r]:
            s, ln = start // per, length // per
            piece = local[:, pos : pos + ln]
            if seen[s : s + ln].any():  # only kv-copies may repeat, and the copies must agree
                assert tp.split is Split.KV_COPIES
                assert np.array_equal(out[:, s : s + ln], piece)
            out[:, s : s + ln] = piece
            seen[s : s + ln] += 1
            pos += ln
        assert pos == local.shape[1]
    assert seen.min() >= 1, f"{tp.name}: indices never covered"
    if tp.split is not Split.KV_COPIES:
        assert seen.max() == 1, f"{tp.name}: indices covered twice"
    return out.reshape(-1)


@pytest.mark.parametrize("family", sorted(WORLDS))
def test_rebuild_every_tensor_byte_for_byte(family: str, tiny) -> None:
    ckpt = open_checkpoint(tiny(family))
    for world in WORLDS[family]:
        plan = plan_checkpoint(ckpt, world)
        assert plan_from_dict(plan_to_dict(plan)) == plan
        assert plan.tensors.keys() == ckpt.tensors.keys()
        for name, tp in plan.tensors.items():
            raw = ckpt.raw(ckpt.tensors[name])
            assert np.array_equal(_rebuild(raw, tp, world), raw), (family, world, name)
            for r in range(world):
                assert cut(raw, tp, r).size == tp.local_nbytes(r)


@pytest.mark.parametrize("family,gate,up,down", [
    ("mixtral", "block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
    ("deepseek-v4", "ffn.experts.{e}.w1.weight", "ffn.experts.{e}.w3.weight", "ffn.experts.{e}.w2.weight"),
])
def test_expert_bank_layout(family: str, gate: str, up: str, down: str, tiny) -> None:
    """gate_up[e] = [w1 shard; w3 shard] and down[e] = w2 shard, checked with torch indexing."""
    ckpt = open_checkpoint(tiny(family))
    prefix = "model.layers.1." if family == "mixtral" else "layers.1."
    plan = plan_checkpoint(ckpt, 2)
    for r in range(2):
        specs = {s.name: s for s in bank_specs(plan, r)[prefix.rstrip(".")]}
        arrays = {}
        for name, spec in specs.items():
            buf = np.zeros(spec.nbytes, dtype=np.uint8)
            for (e, seg), src in spec.members.items():
                o = spec.slot_offset(e, seg)
                buf[o : o + spec.slot_nbytes] = cut(ckpt.raw(ckpt.tensors[src]), plan.tensors[src], r)
            arrays[name] = torch.from_numpy(buf).reshape(spec.shape[0], spec.shape[1], -1)
        for e in range(plan.experts[prefix.rstrip(".")]):
            w1, w3, w2 = (ckpt.read(prefix + p.format(e=e)).view(torch.uint8) for p in (gate, up, down))
            (s0, n0), = plan.tensors[prefix + gate.format(e=e)].ranges[r]
            (s2, n2), = plan.tensors[prefix + down.format(e=e)].ranges[r]
            per = w1.shape[1] // (plan.tensors[prefix + gate.format(e=e)].shape[1])  # bytes per stored element
            assert torch.equal(arrays["gate_up"][e], torch.cat([w1[s0 : s0 + n0], w3[s0 : s0 + n0]]))
            assert torch.equal(arrays["down"][e], w2[:, s2 * per : (s2 + n2) * per])


def test_deepseek_v4_real_inventory(real_v4) -> None:
    shapes = {}
    for world in (1, 2, 4, 8):
        plan = plan_checkpoint(real_v4, world)
        shapes[world] = plan
        assert len(plan.experts) == 46  # 43 layers + 3 MTP layers, 160 experts each
        assert set(plan.experts.values()) == {160}
    p4 = shapes[4].tensors
    assert p4["layers.3.attn.wq_b.weight"].local_shape(1) == (8192, 1024)
    assert p4["layers.3.attn.wq_b.scale"].local_shape(1) == (64, 8)
    assert p4["layers.3.attn.wo_a.weight"].local_shape(2) == (2048, 4096)
    assert p4["layers.3.attn.wo_b.weight"].local_shape(3) == (4096, 2048)
    assert p4["layers.3.attn.attn_sink"].ranges[3] == ((48, 16),)
    assert p4["layers.3.ffn.experts.7.w2.weight"].local_shape(0) == (4096, 256)  # 512 FP4 values
    assert p4["layers.3.ffn.experts.7.w2.scale"].local_shape(0) == (4096, 16)
    assert p4["layers.3.ffn.experts.7.w1.weight"].local_shape(0) == (512, 2048)
    assert p4["layers.0.ffn.gate.tid2eid"].layout is Layout.REPLICATED
    assert p4["embed.weight"].layout is Layout.VOCAB
    aligned = plan_checkpoint(real_v4, 4, align=128)
    assert [n for (_, n), in aligned.tensors["embed.weight"].ranges] == [32384, 32384, 32256, 32256]
    with pytest.raises(PlanError, match="world_size=16 does not divide o_groups=8"):
        plan_checkpoint(real_v4, 16)
    b1, b2 = shapes[1].rank_bytes(0)["expert_banks"], shapes[2].rank_bytes(1)["expert_banks"]
    assert b1 == 2 * b2  # TP-within-expert halves each rank's expert bytes


def test_smollm2_shapes_plan_at_2_3_4(tmp_path) -> None:
    """SmolLM2-135M's shapes (9 q / 3 KV heads of 64, hidden 576, intermediate 1536), header only."""
    from shardsmith.testing.headers import smollm2_moe_headers

    bf16 = open_checkpoint(smollm2_moe_headers(tmp_path / "bf16", fp8=False))
    fp8 = open_checkpoint(smollm2_moe_headers(tmp_path / "fp8", fp8=True))
    q, k, o = ("model.layers.0.self_attn." + n + ".weight" for n in ("q_proj", "k_proj", "o_proj"))
    expected_q = {2: [384, 192], 3: [192] * 3, 4: [192, 128, 128, 128]}
    for world, rows in expected_q.items():
        p = plan_checkpoint(bf16, world)
        assert [p.tensors[q].local_shape(r)[0] for r in range(world)] == rows
        assert [p.tensors[o].local_shape(r)[1] for r in range(world)] == rows
        assert not p.notes
    assert plan_checkpoint(bf16, 4).tensors[k].ranges == (((0, 64),), ((64, 64),), ((64, 128),), ((128, 64),))
    p2 = plan_checkpoint(fp8, 2)  # KV-group cuts at 384 / 128 rows are whole 128-row blocks
    assert p2.tensors[q].ranges == (((0, 384),), ((384, 192),)) and not p2.notes
    assert p2.tensors[q + "_scale_inv"].ranges == (((0, 3),), ((3, 2),))
    for world in (3, 4):
        p = plan_checkpoint(fp8, world)
        assert p.tensors[q].layout is Layout.REPLICATED
        assert "attention replicated" in p.notes[0] and "128x128 FP8 blocks" in p.notes[0]
        w1 = p.tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"]
        assert [w1.local_shape(r)[0] for r in range(world)] == [1536 // world] * world


def test_rule_errors_name_the_tensor(tiny) -> None:
    ckpt = open_checkpoint(tiny("mixtral"))
    plan = Plan("toy", (Rule(r"model\.embed_tokens\.weight", Layout.VOCAB, 0),))
    with pytest.raises(PlanError, match="model.norm.weight' matches no rule of the toy plan"):
        resolve(plan, ckpt.tensors, ckpt.config, 2)
    both = Plan("toy", (Rule(r".*", Layout.REPLICATED), Rule(r"lm_head\.weight", Layout.VOCAB, 0)))
    with pytest.raises(PlanError, match="'lm_head.weight' matches 2 rules"):
        resolve(both, ckpt.tensors, ckpt.config, 2)


def test_orphan_and_misshapen_scales(tiny) -> None:
    ckpt = open_checkpoint(tiny("deepseek-v4"))
    tensors = dict(ckpt.tensors)
    del tensors["layers.0.attn.wq_a.weight"]
    with pytest.raises(PlanError, match="scale tensor 'layers.0.attn.wq_a.scale' has no weight"):
        resolve(_v4_plan(ckpt), tensors, ckpt.config, 2)
    tensors = dict(ckpt.tensors)
    s = tensors["layers.0.attn.wkv.scale"]
    tensors[s.name] = type(s)(s.name, s.dtype, (3, 2), s.file, s.offset, 6)
    with pytest.raises(PlanError, match=r"layers.0.attn.wkv.scale: shape \[3, 2\] does not match fp8-block blocks"):
        resolve(_v4_plan(ckpt), tensors, ckpt.config, 2)


def _v4_plan(ckpt):
    from shardsmith.plans import build_plan

    return build_plan(ckpt.config, 2)


def test_unknown_architecture_lists_known() -> None:
    from shardsmith.plans import build_plan

    with pytest.raises(PlanError, match="unknown architecture 'LlamaForCausalLM'; known: .*DeepseekV4ForCausalLM"):
        build_plan({"architectures": ["LlamaForCausalLM"]}, 2)


def test_block_cut_refused_with_tensor_dim_size_block_world(tiny) -> None:
    ckpt = open_checkpoint(tiny("deepseek-v3"))
    with pytest.raises(PlanError) as exc:
        plan_checkpoint(ckpt, 3)
    msg = str(exc.value)
    assert "model.layers.0.self_attn.q_b_proj.weight dim 0" in msg and "size 1536" in msg
    assert "128-element quantization block" in msg and "world_size=3" in msg


def test_more_ranks_than_query_heads_names_the_valid_sizes() -> None:
    from shardsmith.plans import hf_moe

    config = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    with pytest.raises(PlanError, match=r"9 query heads cannot be split over world_size=13 .*valid world sizes: 1 to 9"):
        hf_moe.build(config, 13)
