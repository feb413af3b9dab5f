"""DeepSeek-V4 per-sequence slots and the batched decode step (issue 14, model side).

The tiny release-format checkpoint (window 16, CSA ratio 4 with the indexer's top-16, HCA ratio 128;
see ``shardsmith.testing.tiny_v4``), float32, at world sizes 1 and 2 (real gloo ranks). Prompts of
37, 71 and 124 tokens pass the window, fill 9, 17 and 31 CSA entries (the last two more than the
indexer keeps) and, decoding from position 124, the third one's HCA compressor completes its first
entry inside a batched step. Every batched step runs the decode pieces eagerly (the engine's order:
``decode_step``, ``embed_ids``, per layer ``attn_in`` / ``attn_core`` / ``ffn_block``, ``logits``)
with the rows in a shuffled slot order and one padding row (a copy of row 0). The reference for each
sequence is the same sequence decoded alone, greedily, by :meth:`DeepseekV4.forward` in a fresh
one-slot model.
"""

from __future__ import annotations

import random
import traceback
from pathlib import Path

import pytest
import torch

from shardsmith.errors import UsageError
from shardsmith.testing.ranks import run_ranks

PROMPTS = [torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(n)) for n in (37, 71, 124)]
STEPS = 6
MAX_SEQ_LEN = 136
ATOL = 1e-4  # float32 logits (|logits| < 5): rows batched together differ only by matmul blocking


def load(pack: Path, rank: int = 0, world_size: int = 1, *, max_num_seqs: int = 1, max_seq_len: int = MAX_SEQ_LEN):
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4

    weights = load_rank_weights(pack, rank=rank, world_size=world_size)
    return DeepseekV4.from_weights(weights, dtype=torch.float32, max_seq_len=max_seq_len, max_num_seqs=max_num_seqs)


@torch.inference_mode()
def batched_step(model, ids: list[int], starts: list[int], slots: list[int], bucket: int, *,
                 pad_atol: float = 0.0) -> torch.Tensor:
    """One batched decode step through the pieces, eagerly, padded to ``bucket`` rows with copies of
    row 0 (as the engine's DecodeGraphs does); logits of the real rows ``[len(ids), V]``.

    Also checks that the padding rows' logits are row 0's (within ``pad_atol``: past 8 rows the CPU
    GEMM's tail rows may sum in another order).
    """
    real = len(ids)
    pad = bucket - real
    ids_t = torch.tensor(ids + [ids[0]] * pad)
    step = model.decode_step(ids_t, starts + [starts[0]] * pad, slots + [slots[0]] * pad, real)
    (h,) = model.embed_ids(ids_t)
    for layer in model.decode_layers:
        a = layer.attn_in(h, *layer.attn_in_args(step))
        (h,) = layer.ffn_block(h, *layer.attn_core(a, step))
    (logits,) = model.logits(h)
    torch.testing.assert_close(logits[real:], logits[:1].expand(pad, -1), atol=pad_atol, rtol=0)
    return logits[:real]


def alone(pack: Path, prompt: torch.Tensor, steps: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """``prompt`` decoded greedily alone in a fresh one-slot model: logits ``[1 + steps, V]`` (the
    prompt's last position, then each step's)."""
    model = load(pack, rank, world_size)
    logits = [model(prompt, 0)[0]]
    for i in range(steps):
        logits.append(model(logits[-1].argmax().view(1), prompt.shape[0] + i)[0])
    return torch.stack(logits)


def batched(pack: Path, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
    """The three prompts prefilled into slots 2, 0, 1 of a 3-slot model, decoded together for
    :data:`STEPS` shuffled steps; sequence 1 is then released, restarted from a new prompt while the
    others keep decoding (its slot is refilled by a one-token prompt first, then a second restart).

    Returns per sequence its logits ``[1 + steps, V]`` (``"seq{i}"``; ``"restart"`` for the new one).
    """
    model = load(pack, rank, world_size, max_num_seqs=3)
    slot_of = [2, 0, 1]
    logits = {i: [model(p, 0, slot=slot_of[i])[0]] for i, p in enumerate(PROMPTS)}
    pos = [p.shape[0] for p in PROMPTS]
    order = random.Random(0)

    def decode(seqs: list[int], key: dict[int, str]) -> None:
        seqs = order.sample(seqs, len(seqs))  # a shuffled slot order every step
        ids = [int(logits[key.get(i, i)][-1].argmax()) for i in seqs]
        out = batched_step(model, ids, [pos[i] for i in seqs], [slot_of[i] for i in seqs], bucket=4)
        for row, i in enumerate(seqs):
            logits[key.get(i, i)].append(out[row])
            pos[i] += 1

    for _ in range(STEPS):
        decode([0, 1, 2], {})
    # release sequence 1's slot: its old position is refused, the other slots are untouched
    state = {n: t.clone() for n, t in _state(model).items()}
    model.release(slot_of[1])
    with pytest.raises(UsageError, match=f"slot {slot_of[1]}.*position 0"):
        model.decode_step(torch.tensor([1]), [pos[1]], [slot_of[1]])
    model(PROMPTS[1][:1], 0, slot=slot_of[1])  # a one-token prompt, then a restart over it
    logits["restart"] = [model(PROMPTS[1][:50], 0, slot=slot_of[1])[0]]
    for name, t in _state(model).items():
        others = [s for s in range(3) if s != slot_of[1]]
        assert torch.equal(t[others], state[name][others]), name
    pos[1] = 50
    for _ in range(STEPS):
        decode([0, 1, 2], {1: "restart"})
    return {("restart" if i == "restart" else f"seq{i}"): torch.stack(v) for i, v in logits.items()}


def _state(model) -> dict[str, torch.Tensor]:
    """Every per-slot state tensor of ``model`` (``[N, ...]``), by a readable name."""
    return {f"layers.{i}.{j}": t for i, layer in enumerate(model.layers) for j, t in enumerate(layer.attn.state())}


def references(pack: Path, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
    out = {f"seq{i}": alone(pack, p, 2 * STEPS if i != 1 else STEPS, rank, world_size) for i, p in enumerate(PROMPTS)}
    out["restart"] = alone(pack, PROMPTS[1][:50], STEPS, rank, world_size)
    return out


def check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every row's logits within :data:`ATOL` of the sequence alone, greedy tokens identical."""
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert got[name].argmax(-1).tolist() == want[name].argmax(-1).tolist(), name
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")


def _rank_main(rank: int, world_size: int, port: int, pack: str, queue) -> None:
    try:
        from shardsmith.runtime.engine.dist import init_distributed

        torch.set_num_threads(1)
        init_distributed(rank, world_size, master_port=port)
        out = {"got": batched(Path(pack), rank, world_size), "want": references(Path(pack), rank, world_size)}
        if rank == 0:
            queue.put(("ok", {k: {n: t.numpy() for n, t in v.items()} for k, v in out.items()}))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


@pytest.mark.parametrize("world_size", [1, 2])
def test_batched_steps_match_each_sequence_alone(tiny_v4_packs, world_size: int) -> None:
    """Real rank processes (gloo, one thread each: the in-process run oversubscribes a shared CPU)."""
    out = run_ranks(_rank_main, world_size, str(tiny_v4_packs[world_size]), timeout=600)
    check({n: torch.from_numpy(a) for n, a in out["got"].items()}, {n: torch.from_numpy(a) for n, a in out["want"].items()})


def test_chunked_prefill_equals_one_shot(tiny_v4_packs) -> None:
    """Chunks of 5, 1, 17 and 101 tokens (across ratio, window and HCA boundaries) in slot 0 give the
    one-shot prefill's logits in slot 1, and the two slots then decode the same tokens."""
    model = load(tiny_v4_packs[1], max_num_seqs=2)
    prompt = PROMPTS[2]
    one_shot = model(prompt, 0, last_only=False, slot=1)
    bounds = [0, 5, 6, 23, 124]
    chunked = torch.cat([model(prompt[a:b], a, last_only=False, slot=0) for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(chunked, one_shot, atol=ATOL, rtol=0)
    assert model.positions == [124, 124]
    tok = one_shot[-1].argmax().item()
    for pos in range(124, 128):  # 127 completes the first HCA window
        out = batched_step(model, [tok, tok], [pos, pos], [1, 0], bucket=2)
        torch.testing.assert_close(out[0], out[1], atol=ATOL, rtol=0)
        assert out[0].argmax() == out[1].argmax()
        tok = out[0].argmax().item()


def test_state_is_preallocated_per_slot(tiny_v4_packs) -> None:
    """``state_bytes``: window ring and compressor state of every slot and the scratch slot (the
    docstrings' shapes), float32."""
    one, three = load(tiny_v4_packs[1]), load(tiny_v4_packs[1], max_num_seqs=3)
    a = one.args
    per_slot = 0
    for kind, r in zip(a.kinds, a.ratios):
        per_slot += a.window * a.head_dim
        compressors = {"sliding": [], "hca": [(a.head_dim, False)],
                       "csa": [(a.head_dim, True), (a.index_head_dim, True)]}[kind]
        for d, overlap in compressors:
            width = 2 * d if overlap else d
            per_slot += 2 * r * width + (2 * r * d if overlap else 0) + MAX_SEQ_LEN // r * d
    assert one.state_bytes() == 2 * 4 * per_slot and three.state_bytes() == (3 + 1) * 4 * per_slot
    assert three.max_num_seqs == 3 and three.scratch == 3 and three.SUPPORTS_BATCHING and three.STATIC_DECODE
    with pytest.raises(UsageError, match=r"slot 3 is out of range"):
        three.release(three.scratch)


def test_bad_rows_are_refused_and_change_nothing(tiny_v4_packs) -> None:
    model = load(tiny_v4_packs[1], max_num_seqs=2, max_seq_len=40)
    model(PROMPTS[0][:10], 0, slot=0)
    model(PROMPTS[1][:7], 0, slot=1)
    ids = torch.tensor([3, 4])
    cases = [
        (lambda: model.decode_step(ids, [10, 6], [0, 1]), r"slot 1: .*position 7\); got start=6 .*cannot rewind"),
        (lambda: model.decode_step(ids, [10, 7], [0, 2]), r"slot 2 is out of range: .*slots 0\.\.1"),
        (lambda: model.decode_step(ids, [10, 7], [0, -1]), r"slot -1 is out of range"),
        (lambda: model.decode_step(ids, [10, 10], [0, 0]), r"each real row must be a different slot"),
        (lambda: model.decode_step(ids, [10, 7], [0, 1], real=1), r"padding rows \[1\] must copy row 0"),
        (lambda: model.decode_step(ids, [10, 7], [0, 1], real=0), r"real=0 must be in \[1, 2\]"),
        (lambda: model.decode_step(ids, [10], [0, 1]), r"2 ids, 1 starts and 2 slots"),
        (lambda: model(PROMPTS[0][:1], 11, slot=0), r"slot 0: .*position 10\); got start=11"),
        (lambda: model(PROMPTS[0][:31], 10, slot=0), r"slot 0: 41 positions exceed max_seq_len=40"),
        (lambda: model(PROMPTS[0][:1], 0, slot=2), r"slot 2 is out of range"),
        (lambda: model.release(5), r"slot 5 is out of range"),
        (lambda: model(PROMPTS[0][:0], 10, slot=0), r"slot 0: a step needs at least one token, got 0"),
    ]
    for call, match in cases:
        with pytest.raises(UsageError, match=match):
            call()
    assert model.positions == [10, 7]  # a refused step advanced nothing
    # the old single-row form is slot 0
    step = model.decode_step(torch.tensor([3]), 10)
    assert (step.slots, step.starts, step.real) == ([0], [10], 1) and model.positions == [11, 7]


def test_a_model_without_slots_says_to_set_them_up(tiny_v4_packs) -> None:
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.runtime.layers.parallel import Shards
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4, V4Args

    w = load_rank_weights(tiny_v4_packs[1], rank=0, world_size=1)
    model = DeepseekV4(V4Args.from_config(w.config), Shards(w.plan, 0, torch.float32))  # on meta, no setup_cache
    with pytest.raises(UsageError, match=r"no slots yet: call setup_cache"):
        model(torch.tensor([1]), 0)
    with pytest.raises(UsageError, match=r"max_num_seqs >= 1.*max_num_seqs=0"):
        model.setup_cache(16, torch.device("meta"), torch.float32, max_num_seqs=0)


def test_batched_decode_step_has_no_host_sync(tiny_v4_packs) -> None:
    """Batched steps on ``meta`` (no data to read): two slots and a padding row, through positions 0..4,
    so every compressor completes a CSA window inside a step; logits keep the bucket's shape."""
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.runtime.layers.parallel import Shards
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4, V4Args

    w = load_rank_weights(tiny_v4_packs[1], rank=0, world_size=1)
    model = DeepseekV4(V4Args.from_config(w.config), Shards(w.plan, 0, torch.float32))
    model.setup_cache(64, torch.device("meta"), torch.float32, max_num_seqs=2)
    ids = torch.empty(3, dtype=torch.int64, device="meta")
    for pos in range(5):
        step = model.decode_step(ids, [pos, pos, pos], [1, 0, 1], real=2)
        (h,) = model.embed_ids(ids)
        for layer in model.decode_layers:
            (h,) = layer.ffn_block(h, *layer.attn_core(layer.attn_in(h, *layer.attn_in_args(step)), step))
        assert model.logits(h)[0].shape == (3, model.args.vocab_size)
    assert model.positions == [5, 5]


def test_verify_runs_equal_a_chunk_and_are_taken_back_exactly(tiny_v4_packs) -> None:
    """After ``reserve_runs``, one batched step holds a 6-row run (more rows than a CSA window: two of
    its rows share a pending column), a 3-row run and a single row, in shuffled slots with padding.
    Each run's rows give the logits of the same tokens as one prefill chunk, across the window ring's
    wrap and CSA windows completed inside the run; the third sequence reaches 127, where its HCA
    window completes. Rows are then taken back (4 of 6, 1 of 3) and every sequence decodes on as a
    sequence that never saw the rejected tokens: the same logits as the chunk path's model, which
    took the same tokens back from its saved chunk."""
    gen = torch.Generator().manual_seed(3)
    run_model = load(tiny_v4_packs[1], max_num_seqs=3)
    run_model.reserve_runs(3 + 8)  # steps of up to 11 rows, K = 9 rows per slot at most
    assert run_model.runs == 9 and run_model.layers[0].attn.win.shape[1] == run_model.args.window + 8
    ref = load(tiny_v4_packs[1], max_num_seqs=3)
    slot_of = [1, 2, 0]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2][:121]]
    for m in (run_model, ref):
        for i, p in enumerate(prompts):
            m(p, 0, slot=slot_of[i])
    pos = [p.shape[0] for p in prompts]
    drafts = [torch.randint(2, 512, (6,), generator=gen).tolist(), torch.randint(2, 512, (3,), generator=gen).tolist(),
              torch.randint(2, 512, (7,), generator=gen).tolist()]
    rows = {0: 6, 1: 3, 2: 1}
    order = [1, 2, 0]  # sequence order of the rows (runs stay whole)
    ids, starts, slots = [], [], []
    for i in order:
        ids += drafts[i][:rows[i]]
        starts += range(pos[i], pos[i] + rows[i])
        slots += [slot_of[i]] * rows[i]
    out = batched_step(run_model, ids, starts, slots, bucket=11, pad_atol=ATOL)
    keep = {0: 2, 1: 2, 2: 1}  # 4 of 6 and 1 of 3 taken back; the single row stays
    at = 0
    for i in order:  # the chunk path: one sequence's chunk saved, checked and taken back at a time
        ref.speculate(slot_of[i], rows[i])
        want = ref(torch.tensor(drafts[i][:rows[i]]), pos[i], last_only=False, slot=slot_of[i])
        torch.testing.assert_close(out[at:at + rows[i]], want, atol=ATOL, rtol=0)
        assert out[at:at + rows[i]].argmax(-1).tolist() == want.argmax(-1).tolist()
        ref.restore(slot_of[i], pos[i] + keep[i])
        at += rows[i]
    for i in order:
        run_model.restore(slot_of[i], pos[i] + keep[i])
        pos[i] += keep[i]
    assert run_model.positions == ref.positions
    for _ in range(8):  # the third passes 127: its first HCA window completes
        seqs = [0, 1, 2]
        toks = [drafts[i][-1] for i in seqs]
        got = batched_step(run_model, toks, [pos[i] for i in seqs], [slot_of[i] for i in seqs], bucket=4)
        want = batched_step(ref, toks, [pos[i] for i in seqs], [slot_of[i] for i in seqs], bucket=4)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        for row, i in enumerate(seqs):
            drafts[i].append(int(got[row].argmax()))
            pos[i] += 1
    assert pos[2] > 128


def test_runs_past_the_reserve_are_refused(tiny_v4_packs) -> None:
    model = load(tiny_v4_packs[1], max_num_seqs=2, max_seq_len=40)
    model(PROMPTS[0][:10], 0, slot=0)
    with pytest.raises(UsageError, match=r"each real row must be a different slot.*reserve_runs"):
        model.decode_step(torch.tensor([3, 4]), [10, 11], [0, 0])
    model.reserve_runs(2 + 2)  # K = 3; the state is allocated anew: every slot forgotten
    assert model.positions == [0, 0]
    model(PROMPTS[0][:10], 0, slot=0)
    with pytest.raises(UsageError, match=r"runs of \{0: 4\} rows .* at most 3 per slot"):
        model.decode_step(torch.tensor([3, 4, 5, 6]), [10, 11, 12, 13], [0, 0, 0, 0])
    with pytest.raises(UsageError, match=r"not one verify run"):
        model.decode_step(torch.tensor([3, 4]), [10, 12], [0, 0])
    model(PROMPTS[1][:5], 0, slot=1)
    with pytest.raises(UsageError, match=r"rows of slots \[0\] are not next to each other"):
        model.decode_step(torch.tensor([3, 7, 4]), [10, 5, 11], [0, 1, 0])
    assert model.positions == [10, 5]
