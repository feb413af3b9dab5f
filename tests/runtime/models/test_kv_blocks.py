"""The KV cache in blocks (the Mixtral family): the block tables' bookkeeping, and numerics.

Bookkeeping: a slot holds exactly the blocks of its positions after each step (growing, giving back
after a rewind, none once released), grows into the block after its last one when it can (a slice
of the pool; a new sequence starts halfway along the largest free run to leave room for that), refuses a step the free blocks cannot hold with the numbers and changes nothing then.

Numerics (Qwen3-MoE of the Mixtral family, DeepSeek-V3's latent cache, gpt-oss's sliding and full
layers; batched decode steps through the scheduler): sequences whose blocks are scattered over the pool
(two slots decoding in turns, blocks of 4 positions, a pool of exactly their blocks, so the second one
runs into the first one's blocks and goes on elsewhere) give the logits of the same sequences alone in a pool of
contiguous slots, and transformers' logits on the same checkpoint.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from shardsmith.errors import UsageError
from shardsmith.runtime.models.kv_blocks import KVBlocks, KVCacheFull

CPU = torch.device("cpu")


def test_a_slot_holds_the_blocks_of_its_positions():
    kv = KVBlocks(8, 4, 3, 16)
    kv.fit({0: 10})
    assert kv.tables[0] == [0, 1, 2] and kv.blocks_free() == 5
    assert kv.index(0, 2, 9, CPU) == slice(2, 9)  # consecutive blocks: a view of the pool
    kv.fit({1: 5})  # a new sequence starts halfway along the largest free run, 3..7
    kv.fit({0: 13})  # so slot 0 still grows into the block after its last one
    assert kv.tables == [[0, 1, 2, 3], [5, 6], []] and kv.index(0, 0, 13, CPU) == slice(0, 13)
    kv.fit({1: 16})  # past the pool's end: slot 1 goes on in the free block 4
    assert kv.tables[1] == [5, 6, 7, 4]
    assert kv.index(1, 0, 16, CPU).tolist() == [*range(20, 32), 16, 17, 18, 19]
    assert kv.index(1, 11, 14, CPU).tolist() == [31, 16, 17]
    rows = kv.gather([1, 0, 2], 14, CPU)  # a batched step's reads: past a slot's blocks, pool position 0
    assert rows.tolist() == [[*range(20, 32), 16, 17], list(range(14)), [0] * 14]
    assert kv.positions([1, 0], [12, 5], CPU).tolist() == [16, 5]
    kv.fit({0: 3})  # a rewind gives back the blocks past the end
    assert kv.tables[0] == [0] and kv.blocks_free() == 3
    kv.fit({0: 6})  # and grows into the block after its last one again
    assert kv.tables[0] == [0, 1] and kv.index(0, 0, 6, CPU) == slice(0, 6)
    kv.release(1)
    assert kv.tables[1] == [] and kv.blocks_free() == 6


def test_blocks_out_of_order_that_span_a_run_are_gathered_not_sliced():
    """A table whose first and last blocks are as far apart as a run's, in another order (0, 3, 2: a
    slot grew into what another one gave back), is read through its gather index."""
    kv = KVBlocks(4, 2, 3, 8)
    kv.fit({0: 2})
    kv.fit({1: 2})  # halfway along the free run 1..3: block 2
    kv.fit({2: 2})  # the first of the runs 1 and 3
    kv.fit({0: 4})  # block 1 is taken: slot 0 goes on in block 3
    kv.release(1)
    kv.release(2)
    kv.fit({0: 6})  # past the pool's end: halfway along the free run 1..2
    assert kv.tables[0] == [0, 3, 2]
    assert kv.index(0, 0, 6, CPU).tolist() == [0, 1, 6, 7, 4, 5]


def test_a_step_the_pool_cannot_hold_is_refused_and_changes_nothing():
    kv = KVBlocks(8, 4, 3, 16)
    kv.fit({0: 12})
    before = [list(t) for t in kv.tables]
    with pytest.raises(KVCacheFull) as e:
        kv.fit({1: 16, 2: 8})
    assert str(e.value) == ("the KV cache is full: slot 1 to 16 positions, slot 2 to 8 positions needs 6 more block(s) "
                            "of 4 positions and 5 of 8 are free (--kv-cache-tokens 32)")
    assert kv.tables == before and kv.blocks_free() == 5
    kv.fit({0: 4, 1: 16})  # slot 0 gives back two blocks in the same step: slot 1's four fit
    assert kv.tables[0] == [0] and kv.tables[1] == [4, 5, 6, 7] and kv.blocks_free() == 3


def test_a_pool_must_hold_one_sequence_of_the_longest_length():
    with pytest.raises(UsageError, match=r"holds 12 tokens \(3 blocks of 4\); one sequence of max_seq_len=16 needs 16"):
        KVBlocks(3, 4, 2, 16)


def _decode_in_turns(model, prompts: list[list[int]], steps: int, slots: list[int]) -> list[torch.Tensor]:
    """Prefill each prompt in its slot, then ``steps`` one-token steps, the slots taking turns (each
    slot's next token is its own greedy choice); the logits of every step per sequence, stacked."""
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    pending = []
    for i, (p, s) in enumerate(zip(prompts, slots)):
        logits = model(torch.tensor(p), 0, slot=s)
        out[i].append(logits[-1])
        pending.append(int(logits[-1].argmax()))
    for t in range(steps):
        for i, (p, s) in enumerate(zip(prompts, slots)):
            logits = model(torch.tensor([pending[i]]), len(p) + t, slot=s)
            out[i].append(logits[-1])
            pending[i] = int(logits[-1].argmax())
    return [torch.stack(o) for o in out]


def _build(path, max_seq_len: int = 64, **cache):
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.runtime.models.registry import family_for

    weights = load_rank_weights(path, rank=0, world_size=1, from_checkpoint=True)
    model, _ = family_for(weights.config).build(weights, rank=0, dtype=torch.float32, device=CPU)
    model.setup_cache(max_seq_len, CPU, torch.float32, **cache)
    return model.eval()


@pytest.fixture(scope="module")
def mixtral(tiny):
    def build(max_seq_len: int = 64, **cache):
        return _build(tiny("qwen3-moe"), max_seq_len, **cache)

    return build


PROMPTS = [[3, 17, 42, 99, 5, 8, 61], [250, 11, 64, 7, 3, 3, 90, 12, 5]]


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory) -> dict:
    """Qwen3-MoE, a DeepSeek-V3 in float32 weights (no FP8 blocks), which transformers loads as is, and gpt-oss
    (sliding and full layers, sinks; MXFP4 experts that transformers dequantizes itself)."""
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss
    from shardsmith.testing.tiny_v3 import tiny_deepseek_v3_model

    root = tmp_path_factory.mktemp("kv-blocks")
    return {"qwen3-moe": tiny("qwen3-moe"),
            "deepseek-v3": tiny_deepseek_v3_model(root / "v3", fp8=False, q_lora=None, rope_interleave=False, seed=1),
            "gpt-oss": tiny_gpt_oss(root / "gpt-oss")}


@pytest.mark.parametrize("case", ["qwen3-moe", "deepseek-v3", "gpt-oss"])
def test_scattered_blocks_give_the_logits_of_contiguous_slots_and_of_transformers(checkpoints, case):
    from transformers import AutoModelForCausalLM

    from shardsmith.parity.reference import plain_pytorch_kwargs

    steps = 9
    ends = [len(p) + steps for p in PROMPTS]
    paged = _build(checkpoints[case], 32, max_num_seqs=3, kv_cache_tokens=sum(-(-e // 4) * 4 for e in ends),
                   block_size=4)  # a pool of exactly their blocks
    got = _decode_in_turns(paged, PROMPTS, steps, slots=[2, 0])
    tables = [paged.kv.tables[2], paged.kv.tables[0]]
    assert any(any(b != a + 1 for a, b in pairwise(t)) for t in tables), tables  # the pool's end forced a gather
    assert not all(isinstance(paged.kv.index(s, 0, e, CPU), slice) for s, e in zip((2, 0), ends))

    alone = _build(checkpoints[case], max_num_seqs=1)  # one sequence at a time: its blocks are one slice of the pool
    ref = AutoModelForCausalLM.from_pretrained(checkpoints[case], dtype=torch.float32,
                                               **plain_pytorch_kwargs(checkpoints[case])).eval()
    for prompt, logits in zip(PROMPTS, got):
        want = _decode_in_turns(alone, [prompt], steps, slots=[0])[0]
        alone.release(0)
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
        tokens = prompt + [int(x) for x in logits.argmax(-1)[:-1]]
        with torch.no_grad():
            hf = ref(torch.tensor([tokens])).logits[0, len(prompt) - 1:]
        torch.testing.assert_close(logits, hf, atol=1e-4, rtol=1e-4)


def test_release_gives_every_block_back_and_a_full_pool_refuses_a_step(mixtral):
    model = mixtral(max_num_seqs=2, kv_cache_tokens=64, block_size=4)
    model(torch.tensor(PROMPTS[0] * 8), 0, slot=0)  # 56 positions: 14 of the 16 blocks
    with pytest.raises(KVCacheFull, match="slot 1 to 9 positions needs 3 more block"):
        model(torch.tensor(PROMPTS[1]), 0, slot=1)
    assert model.kv.held(1) == 0 and model.lengths[1] == 0
    model.release(0)
    assert model.kv.blocks_free() == 16
    model(torch.tensor(PROMPTS[1]), 0, slot=1)
    assert model.kv.held(1) == 3


# ------------------------------------------------------------------ admission through the scheduler

REQUESTS = [([3, 17, 42, 99, 5, 8, 61, 7, 200], 5), ([250, 11, 64, 7, 3, 3, 90], 30),
            ([31, 7, 250, 4, 9, 77, 31, 18], 5), ([2, 6, 90, 11, 150, 151], 5)]
# three requests that each grow to 3 blocks of 16 in a pool of 4 (so two are preempted on the way): greedy,
# seeded sampling, and a repetition penalty (its counts follow the sequence into its new slot)
GROWING = [([3, 17, 42, 99, 5, 8, 61, 7], {}), ([250, 11, 64, 7, 3, 3, 90, 4], {"temperature": 0.8, "seed": 7}),
           ([31, 7, 250, 4, 9, 77, 31], {"repetition_penalty": 1.3})]


def _load(path: str, rank: int = 0, world_size: int = 1, **kw):
    from shardsmith.runtime.engine.engine import Engine

    return Engine.load(path, rank=rank, world_size=world_size, dtype=torch.float32, from_checkpoint=True,
                       max_seq_len=48, max_num_seqs=4, cuda_graphs=False, **kw)


def _serve(engine, requests=None, overlap: bool = False) -> dict:
    """``requests`` (``(prompt, sampling fields)``, 30 tokens each; default: :data:`GROWING`) through one
    scheduler, admitted oldest first whenever :meth:`Scheduler.can_admit` says there is room (never while a
    preempted sequence waits). Returns each request's tokens, the sequences that ran in each step, the
    preemptions and the blocks each slot held at the end."""
    from shardsmith.runtime.engine.sampling import SamplingParams
    from shardsmith.runtime.engine.scheduler import Scheduler, Sequence

    sched = Scheduler(engine, prefill_chunk=8, decode_prompt_tokens=0, overlap=overlap)
    waiting = [Sequence(p, SamplingParams(**({"max_tokens": 30, "temperature": 0.0} | kw)), tag=i)
               for i, (p, kw) in enumerate(requests or GROWING)]
    tokens: dict[int, list[int]] = {i: [] for i in range(len(waiting))}
    together = []
    while waiting or sched.running or sched.preempted:
        while waiting and sched.can_admit(waiting[0].prompt_ids):
            sched.admit(waiting.pop(0))
        if sched.preempted and waiting:
            assert not sched.can_admit(waiting[0].prompt_ids)  # they resume first
        together.append(sorted(s.tag for s in sched.running))
        for seq, out in sched.step():
            tokens[seq.tag].append(out.token_id)
    kv = engine.kv_blocks
    st = sched.prefix.stats
    return {"tokens": tokens, "together": together, "preemptions": sched.preemptions,
            "held": [kv.held(s) for s in range(4)] if kv else None,
            "lookups": (st.queries, st.query_tokens, st.preempted_queries, st.preempted_query_tokens)}


def _tp2_serve(path: str, kw: dict, rank: int, world_size: int):
    engine = _load(path, rank, world_size, **kw)
    if rank != 0:
        engine.follow()
        return None
    try:
        return _serve(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("case,world_size,overlap", [("qwen3-moe", 1, False), ("qwen3-moe", 1, True),
                                                     ("qwen3-moe", 2, False), ("deepseek-v3", 1, False),
                                                     ("gpt-oss", 1, False)])
def test_the_last_arrived_is_preempted_and_resumes_with_the_same_tokens(checkpoints, case, world_size, overlap):
    """A pool of 96 positions (6 blocks of 16) under 4 slots of 48: three requests of 7-8 prompt tokens
    and 30 generated ones (3 blocks each by their end, 9 together) are all admitted (one block each and
    one of growth per running sequence), and as they grow the last arrived is preempted (its slot
    released on every rank); it resumes when the pool holds it again, its generated tokens computed again. Every request's tokens (greedy, seeded
    sampling, a repetition penalty) are those of slots that each hold 48 positions, where nothing is
    preempted; overlapped steps read their step in flight before a preemption."""
    from shardsmith.testing.ranks import run_gloo

    path = str(checkpoints[case])
    if world_size == 1:
        paged = _serve(_load(path, kv_cache_tokens=96), overlap=overlap)
        full = _serve(_load(path), overlap=overlap)
    else:
        paged = run_gloo(_tp2_serve, 2, path, {"kv_cache_tokens": 96}, timeout=300)
        full = run_gloo(_tp2_serve, 2, path, {}, timeout=300)
    assert paged["tokens"] == full["tokens"]
    assert [len(t) for t in paged["tokens"].values()] == [30] * len(GROWING)
    assert full["preemptions"] == 0 and paged["preemptions"] >= 1
    prompts = sum(len(p) for p, _ in GROWING)  # a resume is counted apart from the requests' own lookups
    assert paged["lookups"][:2] == full["lookups"][:2] == (len(GROWING), prompts)
    assert paged["lookups"][2] == paged["preemptions"] and paged["lookups"][3] > 16 * paged["lookups"][2]
    assert full["lookups"][2:] == (0, 0)
    assert paged["together"][0] == [0, 1, 2]  # all admitted on their prompts' blocks
    assert [0, 1] in paged["together"] and [2] in paged["together"]  # preempted, then resumed alone
    assert sum(paged["held"]) <= 6


def test_a_preempted_sequence_that_is_aborted_stops_waiting(checkpoints) -> None:
    """Aborting a sequence while it waits to resume (a client that went away) drops it: nothing of it
    runs again, and the others' tokens are unchanged."""
    from shardsmith.runtime.engine.sampling import SamplingParams
    from shardsmith.runtime.engine.scheduler import Scheduler, Sequence

    path = str(checkpoints["qwen3-moe"])
    alone = _serve(_load(path), GROWING[:2])["tokens"]
    engine = _load(path, kv_cache_tokens=96)
    sched = Scheduler(engine, prefill_chunk=8, decode_prompt_tokens=0, overlap=False)
    seqs = [Sequence(p, SamplingParams(**({"max_tokens": 30, "temperature": 0.0} | kw)), tag=i)
            for i, (p, kw) in enumerate(GROWING)]
    for seq in seqs:
        sched.admit(seq)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while not sched.preempted:
        for seq, out in sched.step():
            tokens[seq.tag].append(out.token_id)
    assert sched.preempted == [seqs[2]] and seqs[2].slot == -1 and seqs[2].recompute > 0
    sched.abort(seqs[2])
    assert not sched.preempted
    while sched.running or sched.preempted:
        for seq, out in sched.step():
            tokens[seq.tag].append(out.token_id)
    assert tokens[0] == alone[0] and tokens[1] == alone[1]


def test_a_kept_prefix_is_given_up_only_when_that_makes_room(checkpoints) -> None:
    """Pool of 4 blocks of 16: a finished 9 + 5-token request keeps its slot's block for reuse. A running
    request of 24 prompt tokens needs 2 blocks and one of growth: a prompt that needs two waits and the
    prefix stays; one that needs one block takes the prefix's place."""
    from shardsmith.runtime.engine.sampling import SamplingParams
    from shardsmith.runtime.engine.scheduler import Scheduler, Sequence

    engine = _load(str(checkpoints["qwen3-moe"]), kv_cache_tokens=64)
    kv, sched = engine.kv_blocks, Scheduler(engine, prefill_chunk=64, decode_prompt_tokens=0, overlap=False)

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=())

    first = Sequence(REQUESTS[0][0], params(5))
    sched.admit(first)
    while sched.running:
        sched.step()
    kept = first.slot
    assert kv.held(kept) == 1 and sched.prefix.held[kept]
    sched.admit(Sequence([(7 * i) % 200 + 1 for i in range(24)], params(5)))  # 24 + 1 positions: 2 blocks
    sched.step()
    two = [5, 6, 7] * 6  # 18 + 1 positions: two blocks
    assert not sched.can_admit(two)
    assert kv.held(kept) == 1 and sched.prefix.held[kept]  # not given up for nothing
    assert sched.can_admit(REQUESTS[3][0])
    assert kv.held(kept) == 0 and not sched.prefix.held[kept]
