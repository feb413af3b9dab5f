"""Per-sequence slots and batched decode steps of DeepSeek-V3 and gpt-oss (issue 14, model side).

For each family, at world sizes 1 and 2 (real gloo ranks), float32, tiny checkpoints split here:
three prompts of different lengths are prefilled into slots (one in chunks), then decoded together
by batched steps run through the layers' pieces (:func:`run_step`, a small eager copy of the
engine's runner) with the rows in a shuffled order and padding rows up to a bucket; one sequence
finishes, its slot is released and a fourth prompt is prefilled into it between steps and joins.
Every row's logits equal (to float32 rounding) and its greedy token equals that sequence decoded
alone; a prefill or step changes only its own slots' positions (padding rows change nothing).
The same models refuse bad slots and positions with :class:`~shardsmith.errors.UsageError`.
"""

from __future__ import annotations

import random
import traceback
from pathlib import Path

import pytest
import torch

from shardsmith.errors import UsageError
from shardsmith.testing.ranks import run_ranks

PROMPTS = (7, 12, 4, 5)  # prompt lengths; the 4th joins when the 3rd leaves
STEPS = (6, 6, 2, 4)  # greedy steps per sequence
SLOTS = (2, 0, 3)  # first three sequences' slots; the 4th takes the 3rd's slot
N_SLOTS, MAX_SEQ, CHUNK = 4, 40, 5
ATOL = 1e-4  # float32 logits (|logits| < 6); batch vs alone differ only by matmul blocking (~1e-6)
POS_DIM = {"v3": 0, "gpt-oss": 1}  # the pools' dim of pool positions (V3 [P * B, c]; gpt-oss [K, P * B, d])


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    """Tiny DeepSeek-V3 (FP8, q latent, dense first layer) and gpt-oss (sliding window 8) packs at TP 1 and 2."""
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss
    from shardsmith.testing.tiny_v3 import tiny_deepseek_v3_model
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("slots")
    ckpts = {"v3": tiny_deepseek_v3_model(root / "v3"), "gpt-oss": tiny_gpt_oss(root / "oss")}
    out = {}
    for family, ckpt in ckpts.items():
        for ws in (1, 2):
            out[family, ws] = root / f"{family}-tp{ws}"
            split_checkpoint(ckpt, out[family, ws], world_size=ws)
    return out


def load(path: Path, rank: int, world_size: int, offload=None):
    from shardsmith.runtime.engine.engine import Engine

    return Engine.load(path, rank=rank, world_size=world_size, dtype=torch.float32, max_seq_len=MAX_SEQ,
                       offload=offload).model


def run_step(model, ids: list[int], starts: list[int], slots: list[int], real: int, *, split: bool) -> torch.Tensor:
    """One batched step through the pieces, as the engine's runner: logits ``[B, V]``.

    ``split``: MoE layers run ``ffn_in`` -> experts (``decode_slots``/``apply_slots``) -> ``ffn_out``
    instead of ``ffn_block``.
    """
    with torch.inference_mode():
        t = torch.tensor(ids)
        step = model.decode_step(t, starts, slots, real)
        (h,) = model.embed_ids(t)
        for layer in model.decode_layers:
            a = layer.attn_in(h, *layer.attn_in_args(step))
            mid = layer.attn_core(a, step)
            if layer.experts is None or not split:
                (h,) = layer.ffn_block(h, *mid)
                continue
            *carry, x, index, weight = layer.ffn_in(h, *mid)
            slot_ids, routed = layer.experts.decode_slots(x, index, weight)
            if slot_ids is not None:
                routed = layer.experts.apply_slots(x, weight, slot_ids)
            (h,) = layer.ffn_out(*carry, x, weight, routed)
        return model.logits(h)[0]


def caches(model) -> list[torch.Tensor]:
    """Every per-sequence cache array (``cache_*`` of each layer's attention)."""
    return [v for layer in model.decode_layers for k, v in vars(layer.self_attn).items() if k.startswith("cache_")]


def changed(before: list[torch.Tensor], model, pos_dim: int) -> set[tuple[int, int]]:
    """``(slot, position)`` pairs whose cache entries differ from ``before`` in any layer: each changed pool
    position (dim ``pos_dim`` of the pools in blocks) named by the slot and position whose block holds it
    now, or ``(-1, pool position)`` where no slot's block does."""
    kv, out = model.kv, set()
    B = kv.block_size
    owner = {b * B + o: (s, i * B + o) for s, table in enumerate(kv.tables) for i, b in enumerate(table)
             for o in range(B)}
    for a, b in zip(before, caches(model)):
        rows = (a != b).movedim(pos_dim, 0).flatten(1).any(-1).nonzero().flatten().tolist()
        out |= {owner.get(r, (-1, r)) for r in rows}
    return out


def alone(model, prompts: list[list[int]]) -> list[dict]:
    """Each prompt decoded by itself in a one-slot model: prefill logits, then greedy step logits."""
    model.setup_cache(MAX_SEQ, torch.device("cpu"), torch.float32, max_num_seqs=1)
    out = []
    for ids, steps in zip(prompts, STEPS):
        prefill = model(torch.tensor(ids), 0, last_only=False)
        logits, tokens = [prefill[-1]], []
        for i in range(steps):
            tokens.append(int(logits[-1].argmax()))
            logits.append(model(torch.tensor(tokens[-1:]), len(ids) + i)[0])
        out.append({"prefill": prefill, "logits": torch.stack(logits), "tokens": tokens})
    return out


def scenario(model, family: str) -> dict:
    """The batched run (see the module docstring); returns its measurements (identical on every rank)."""
    if family == "v3-expanded":  # DeepSeek-V3 with kv_b_proj expanded (not absorbed) in every step
        model.set_absorb("never")
        family = "v3"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 512, (n,), generator=gen).tolist() for n in PROMPTS]
    ref = alone(model, prompts)
    model.setup_cache(MAX_SEQ, torch.device("cpu"), torch.float32, max_num_seqs=N_SLOTS)
    res = {"max_diff": 0.0, "tokens": {}, "want": {i: r["tokens"] for i, r in enumerate(ref)}, "stray": [],
           "max_num_seqs": model.max_num_seqs, "state_bytes": model.state_bytes(), "buckets": []}
    pos_dim, rng = POS_DIM[family], random.Random(0)
    running: dict[int, dict] = {}

    def prefill(i: int, slot: int, chunk: int | None) -> None:
        ids, before = prompts[i], [c.clone() for c in caches(model)]
        parts = [(s, ids[s: s + chunk]) for s in range(0, len(ids), chunk)] if chunk else [(0, ids)]
        got = torch.cat([model(torch.tensor(p), s, last_only=False, slot=slot) for s, p in parts])
        res["max_diff"] = max(res["max_diff"], float((got - ref[i]["prefill"]).abs().max()))
        res["stray"] += sorted(changed(before, model, pos_dim) - {(slot, p) for p in range(len(ids))})
        running[i] = {"slot": slot, "pos": len(ids), "logits": got[-1], "n": 0}
        res["tokens"][i] = []

    def check(i: int) -> None:  # a sequence's latest logits against its alone run at the same step
        seq = running[i]
        res["max_diff"] = max(res["max_diff"], float((seq["logits"] - ref[i]["logits"][seq["n"]]).abs().max()))

    for i, slot in enumerate(SLOTS):
        prefill(i, slot, CHUNK if i == 0 else None)
    k = 0
    while running:
        for i in [i for i in running if running[i]["n"] == STEPS[i]]:  # done: leave, free the slot
            check(i)
            slot = running.pop(i)["slot"]
            model.release(slot)
            if i == 2:  # the waiting prompt joins in the freed slot
                prefill(3, slot, None)
        rows = list(running)
        if not rows:
            break
        rng.shuffle(rows)
        for i in rows:
            check(i)
            res["tokens"][i].append(int(running[i]["logits"].argmax()))
        real = len(rows)
        bucket = real if k == 2 else 4  # padding rows up to a bucket of 4, but one step without
        pad = bucket - real
        # padding rows copy row 0's start and slot; their id differs here (the engine copies it too),
        # so that a padding row that wrote its state or leaked into a real row would show (its own
        # output is ignored)
        ids = [res["tokens"][i][-1] for i in rows] + [(res["tokens"][rows[0]][-1] + 1) % 512] * pad
        starts = [running[i]["pos"] for i in rows] + [running[rows[0]]["pos"]] * pad
        slots = [running[i]["slot"] for i in rows] + [running[rows[0]]["slot"]] * pad
        res["buckets"].append((real, bucket))
        before = [c.clone() for c in caches(model)]
        logits = run_step(model, ids, starts, slots, real, split=k % 2 == 1)
        res["stray"] += sorted(changed(before, model, pos_dim) - set(zip(slots[:real], starts[:real])))
        for b, i in enumerate(rows):
            running[i].update(pos=running[i]["pos"] + 1, logits=logits[b], n=running[i]["n"] + 1)
        k += 1
    return res


def bad_inputs(model) -> list[str]:
    """Each misuse's UsageError message (a missing one is reported as ``no error: ...``)."""
    model.setup_cache(MAX_SEQ, torch.device("cpu"), torch.float32, max_num_seqs=2)
    model(torch.tensor([5, 6, 7]), 0, slot=1)
    one = torch.tensor([8])
    cases = {
        "slot past max_num_seqs": lambda: model(one, 0, slot=2),
        "negative slot": lambda: model(one, 0, slot=-1),
        "start past the slot's end": lambda: model(one, 4, slot=1),
        "start in an empty slot": lambda: model(one, 1, slot=0),
        "past max_seq_len": lambda: model(torch.zeros(MAX_SEQ, dtype=torch.int64), 1, slot=1),
        "release of a bad slot": lambda: model.release(5),
        "step: bad slot": lambda: model.decode_step(torch.tensor([8, 9]), [3, 0], [1, 7]),
        "step: two rows in one slot": lambda: model.decode_step(torch.tensor([8, 9]), [3, 3], [1, 1]),
        "step: padding not a copy of row 0": lambda: model.decode_step(torch.tensor([8, 9]), [3, 0], [1, 0], 1),
        "step: real = 0": lambda: model.decode_step(torch.tensor([8]), [3], [1], 0),
        "step: starts and ids disagree": lambda: model.decode_step(torch.tensor([8, 9]), [3], [1]),
        "step: start past the slot's end": lambda: model.decode_step(torch.tensor([8]), [4], [1]),
    }
    out = []
    for what, fn in cases.items():
        try:
            fn()
            out.append(f"no error: {what}")
        except UsageError as e:
            out.append(str(e))
    model.release(1)
    try:  # a released slot starts over
        model(one, 3, slot=1)
        out.append("no error: a released slot continued")
    except UsageError as e:
        out.append(str(e))
    return out


def _rank_main(rank: int, world_size: int, port: int, path: str, family: str, queue) -> None:
    try:
        from shardsmith.runtime.engine.dist import init_distributed

        init_distributed(rank, world_size, master_port=port)
        res = scenario(load(Path(path), rank, world_size), family)
        if rank == 0:
            queue.put(("ok", res))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("family", ["v3", "gpt-oss"])
def test_batched_steps_equal_each_sequence_alone(packs: dict, family: str, world_size: int) -> None:
    """Rows in shuffled order with padding, a chunked prefill, a released and reused slot: every row's
    logits and greedy tokens are the sequence's own; nothing outside a step's own (slot, position)s changes."""
    path = packs[family, world_size]
    if world_size == 1:
        res = scenario(load(path, 0, 1), family)
    else:
        res = run_ranks(_rank_main, world_size, str(path), family, timeout=300)
    assert res["tokens"] == res["want"]
    assert res["max_diff"] < ATOL, res["max_diff"]
    assert res["stray"] == []
    assert (3, 4) in res["buckets"] and any(r == b for r, b in res["buckets"])  # padded and unpadded steps ran
    assert res["max_num_seqs"] == N_SLOTS


def test_v3_expanded_attention_rows_equal_each_sequence_alone(packs: dict) -> None:
    """The same run with DeepSeek-V3's reference attention path (per-head keys and values expanded
    from the latents, ``set_absorb("never")``) in the prefills, the alone runs and the batched rows."""
    res = scenario(load(packs["v3", 1], 0, 1), "v3-expanded")
    assert res["tokens"] == res["want"] and res["max_diff"] < ATOL and res["stray"] == []


def test_v3_offloaded_experts_in_batched_rows(packs: dict) -> None:
    """DeepSeek-V3 with its routed experts offloaded to a 4-slot cache (a CPU pool): a batched step's
    experts are the union over its rows, through ``decode_slots``; rows still equal each sequence alone."""
    from shardsmith.runtime.offload import OffloadConfig
    from shardsmith.runtime.offload.attach import OffloadedExperts

    model = load(packs["v3", 1], 0, 1, OffloadConfig(backend="gpu", cache_slots=4, probe=False))
    assert model.decode_layers[0].experts is None  # the dense layer
    assert all(isinstance(layer.experts, OffloadedExperts) for layer in model.decode_layers[1:])
    res = scenario(model, "v3")
    assert res["tokens"] == res["want"] and res["max_diff"] < ATOL and res["stray"] == []


@pytest.mark.parametrize("family", ["v3", "gpt-oss"])
def test_state_bytes_and_bad_slots(packs: dict, family: str) -> None:
    """``state_bytes`` counts every slot's cache; bad slots, positions and step rows raise UsageError naming them."""
    model = load(packs[family, 1], 0, 1)
    model.setup_cache(MAX_SEQ, torch.device("cpu"), torch.float32, max_num_seqs=3)
    assert model.SUPPORTS_BATCHING and model.max_num_seqs == 3
    assert model.state_bytes() == sum(c.numel() * 4 for c in caches(model)) > 0
    # pools of blocks: every slot's longest sequence, in whole blocks
    assert all(c.shape[POS_DIM[family]] == model.kv.tokens >= 3 * MAX_SEQ for c in caches(model))
    msgs = bad_inputs(model)
    assert not [m for m in msgs if m.startswith("no error")], msgs
    assert "slot 2 is outside 0..1" in msgs[0] and "slot -1" in msgs[1]
    assert "slot 1 holds 3 positions" in msgs[2] and "start=4" in msgs[2]
    assert f"exceed max_seq_len={MAX_SEQ}" in msgs[4]
    assert "slots [1] appear in more than one real row" in msgs[7]
    assert "padding rows [1] must copy row 0" in msgs[8]
    assert "slot 1 holds 0 positions" in msgs[-1]


@pytest.mark.parametrize("family", ["v3", "gpt-oss"])
def test_engine_decode_graphs_drive_the_pieces_in_the_one_row_form(packs: dict, family: str) -> None:
    """Today's :class:`DecodeGraphs` (``decode_step(ids, start)``, slot 0) on CPU runs the new pieces:
    the same greedy tokens and, to float32 rounding, the same logits as the model's own steps."""
    from shardsmith.runtime.engine.cuda_graphs import DecodeGraphs

    model = load(packs[family, 1], 0, 1)
    prompt = torch.randint(6, 512, (9,), generator=torch.Generator().manual_seed(3))
    runs = {}
    for name, run in (("forward", model), ("graphs", DecodeGraphs(model, torch.device("cpu")))):
        logits, steps = run(prompt, 0), []
        for i in range(5):
            logits = run(logits[-1].argmax().view(1), prompt.shape[0] + i)
            steps.append(logits[0])
        runs[name] = torch.stack(steps)
    assert runs["graphs"].argmax(-1).tolist() == runs["forward"].argmax(-1).tolist()
    torch.testing.assert_close(runs["graphs"], runs["forward"], atol=ATOL, rtol=0)
