"""Prefix reuse across requests (:mod:`shardsmith.runtime.engine.prefix_cache`): the slot policy on
its own, then conversations through the real :class:`Scheduler` on tiny checkpoints in float32: a
turn that resends the history and adds to it resumes the previous turn's slot, computes only the
new tokens, and gives the tokens and (up to the rounding of a different chunking) the logits that
computing the whole prompt gives. The Mixtral family, DeepSeek-V3 and gpt-oss resume any prefix;
DeepSeek-V4 (window ring, compressors and indexer that cannot rewind) resumes a slot's whole history
only, across several compression-block boundaries. World sizes 1 and 2 (gloo).
"""

from __future__ import annotations

import pytest
import torch

from shardsmith.runtime.engine.prefix_cache import PrefixCache, shared_prefix
from shardsmith.testing.ranks import run_gloo

# ------------------------------------------------------------------ the policy


def test_shared_prefix() -> None:
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert shared_prefix([1, 2, 3, 4], [1, 2]) == 2
    assert shared_prefix([], [1]) == 0 and shared_prefix([7], [8]) == 0


def test_longest_shared_prefix_wins_and_one_token_is_always_computed() -> None:
    cache = PrefixCache(4, rewinds=True)
    cache.keep(0, [1, 2, 3, 4, 5])
    cache.keep(1, [1, 9])
    cache.keep(3, [1, 2, 3])
    assert cache.choose([0, 1, 2, 3], [1, 2, 3, 4, 7, 8]) == (0, 4)
    assert cache.held[0] == ()  # taken: what it held is no longer offered
    assert cache.choose([1, 2, 3], [1, 2, 3]) == (3, 2)  # the whole prompt held: its last token is computed
    assert (cache.stats.queries, cache.stats.hits, cache.stats.query_tokens, cache.stats.hit_tokens) == (2, 2, 9, 6)


def test_nothing_shared_takes_an_empty_slot_then_the_least_recently_used() -> None:
    cache = PrefixCache(3, rewinds=True)
    cache.keep(0, [5, 6])
    cache.keep(1, [7, 8])
    assert cache.choose([0, 1, 2], [1, 2, 3]) == (2, 0)  # slot 2 held nothing
    cache.keep(2, [9, 9])
    assert cache.choose([0, 1, 2], [1, 2, 3]) == (0, 0)  # slot 0 was released first
    assert cache.held_positions() == 4 and cache.stats.hits == 0


def test_a_state_that_cannot_rewind_resumes_only_its_whole_history() -> None:
    cache = PrefixCache(2, rewinds=False)
    cache.keep(0, [1, 2, 3, 4])
    assert cache.reusable(0, [1, 2, 3, 9, 9]) == 0  # shares 3 of 4: the ring and compressors cannot go back
    assert cache.reusable(0, [1, 2, 3, 4, 5]) == 4
    assert cache.reusable(0, [1, 2, 3, 4]) == 0  # nothing left to compute once the last token is held back
    off = PrefixCache(2, rewinds=True, enabled=False)
    off.keep(1, [1, 2, 3])
    assert off.choose([0, 1], [1, 2, 3, 4]) == (0, 0) and off.held == [(), ()]
    with pytest.raises(ValueError, match="no free slot"):
        off.choose([], [1])


# ------------------------------------------------------------------ conversations through the scheduler

TURNS = ([3, 17, 42, 99, 5, 8, 61, 7, 200, 13, 44, 12, 9],  # the first user message
         [31, 7, 250, 4, 9],  # what each later turn adds after the previous answer
         [77, 31, 18, 2, 6, 90, 11])
ANSWER = 6  # greedy tokens per turn


def _conversation(engine, *, prefix_caching: bool, chunk: int = 5) -> dict:
    """Three turns, each prompt the previous prompt, its answer and the turn's new tokens; then an
    unrelated prompt. Returns each turn's tokens, reused counts, slots and the cache's counters."""
    from shardsmith.runtime.engine.sampling import SamplingParams
    from shardsmith.runtime.engine.scheduler import Scheduler, Sequence

    sched = Scheduler(engine, prefill_chunk=chunk, decode_prompt_tokens=0, overlap=False, prefix_caching=prefix_caching)
    history, out = [], {"tokens": [], "reused": [], "slots": []}
    unrelated = [150, 151, 152]
    for turn, added in enumerate((*TURNS, unrelated)):
        prompt = history + added if 0 < turn < len(TURNS) else list(added)
        seq = Sequence(prompt, SamplingParams(max_tokens=ANSWER, temperature=0.0, stop_token_ids=()))
        sched.admit(seq)
        tokens = []
        while sched.running:
            tokens += [o.token_id for _, o in sched.step()]
        out["tokens"].append(tokens)
        out["reused"].append(seq.reused)
        out["slots"].append(seq.slot)
        history = prompt + tokens
    st = sched.prefix.stats
    out["stats"] = (st.queries, st.hits, st.query_tokens, st.hit_tokens)
    return out


def _resumed_logits(engine) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[T, V]`` of a prompt's tail computed after its first half was left in slot 0 (with a
    decoded token past it, overwritten), and of the whole prompt computed from 0 in slot 1."""
    prompt = TURNS[0] + TURNS[1] + TURNS[2]
    half = len(TURNS[0]) + 2
    engine.prefill(0, prompt[:half])
    engine.decode([5], [half], [0])  # a token the resumed prompt does not have: overwritten
    resumed = engine.prefill(0, prompt[half:], half, last_only=False)
    whole = engine.prefill(1, prompt, 0, last_only=False)[half:]
    return resumed, whole


def _load(pack, rank: int = 0, world_size: int = 1):
    from shardsmith.runtime.engine.engine import Engine

    return Engine.load(pack, rank=rank, world_size=world_size, dtype=torch.float32, from_checkpoint=True,
                       max_seq_len=64, max_num_seqs=3, cuda_graphs=False)


def _check_conversation(on: dict, off: dict, *, rewinds: bool) -> None:
    assert on["tokens"] == off["tokens"], "prefix reuse changed the greedy tokens"
    first, second = len(TURNS[0]), len(TURNS[0]) + ANSWER + len(TURNS[1])
    # a later turn resumes everything the previous turn's slot was fed: its prompt and all but the last answer token
    assert on["reused"][:3] == [0, first + ANSWER - 1, second + ANSWER - 1], on["reused"]
    assert on["slots"][1] == on["slots"][0] and on["slots"][2] == on["slots"][1]
    assert on["reused"][3] == 0 and on["slots"][3] != on["slots"][2]  # unrelated: another (empty) slot
    assert off["reused"] == [0, 0, 0, 0] and off["stats"][1] == 0
    assert on["stats"][:2] == (4, 2) and on["stats"][3] == sum(on["reused"])


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "deepseek-v3", "deepseek-v4"])
def test_a_conversation_resumes_its_slot_and_keeps_its_tokens(tiny, family) -> None:
    engine = _load(tiny(family))
    on = _conversation(engine, prefix_caching=True)
    off = _conversation(_load(tiny(family)), prefix_caching=False)
    _check_conversation(on, off, rewinds=engine.family.rewinds)


@pytest.mark.parametrize("family", ["mixtral", "deepseek-v3"])
def test_a_resumed_prefix_gives_the_whole_prompts_logits(tiny, family) -> None:
    resumed, whole = _resumed_logits(_load(tiny(family)))
    torch.testing.assert_close(resumed, whole, atol=2e-5, rtol=1e-5)
    assert torch.equal(resumed.argmax(-1), whole.argmax(-1))


def test_gpt_oss_resumes_past_its_sliding_window(tmp_path) -> None:
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss

    ckpt = tiny_gpt_oss(tmp_path / "oss", sliding_window=8)  # the resumed tail starts past one window
    resumed, whole = _resumed_logits(_load(ckpt))
    torch.testing.assert_close(resumed, whole, atol=2e-5, rtol=1e-5)
    on = _conversation(_load(ckpt), prefix_caching=True)
    _check_conversation(on, _conversation(_load(ckpt), prefix_caching=False), rewinds=True)


def test_deepseek_v4_continues_its_whole_history_across_block_boundaries(tiny) -> None:
    """Tiny V4: compression ratios 4 and 128, a 16-token window. A slot fed 13 prompt tokens and 5
    decoded ones (positions 0..17: blocks of 4 completed at 4, 8, 12 and 16 between a prefill and
    decode steps) continues with 19 more tokens (past 32: the window turned over twice) and gives
    the logits of the whole 37-token prompt computed from 0; a prompt that shares only part of the
    history starts from 0 instead."""
    from shardsmith.runtime.engine.sampling import SamplingParams
    from shardsmith.runtime.engine.scheduler import Scheduler, Sequence

    engine = _load(tiny("deepseek-v4"))
    assert not engine.family.rewinds
    prompt = TURNS[0]
    engine.prefill(0, prompt)
    fed = list(prompt)
    for i in range(5):
        token = 7 + i
        engine.decode([token], [len(fed)], [0])
        fed.append(token)
    tail = TURNS[1] + TURNS[2] + [1, 2, 3, 4, 5, 6, 7]
    resumed = engine.prefill(0, tail, len(fed), last_only=False)
    whole = engine.prefill(1, fed + tail, 0, last_only=False)[len(fed):]
    torch.testing.assert_close(resumed, whole, atol=5e-5, rtol=1e-5)
    assert torch.equal(resumed.argmax(-1), whole.argmax(-1))

    sched = Scheduler(engine, prefill_chunk=8, decode_prompt_tokens=0, overlap=False)
    first = Sequence(list(prompt), SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=()))
    sched.admit(first)
    while sched.running:
        sched.step()
    held = sched.prefix.held[first.slot]
    assert len(held) == len(prompt) + 2  # the prompt and the two answer tokens fed back
    partial = Sequence(list(held[:-1]) + [99, 98], SamplingParams(max_tokens=1, temperature=0.0, stop_token_ids=()))
    sched.admit(partial)
    assert partial.reused == 0  # shares all but one held token: V4 cannot rewind to it


def _tp2_conversation(pack: str, prefix_caching: bool, rank: int, world_size: int):
    engine = _load(pack, rank, world_size)
    if rank != 0:
        engine.follow()
        return None
    try:
        return _conversation(engine, prefix_caching=prefix_caching)
    finally:
        engine.shutdown()


def test_a_conversation_resumes_at_world_size_2(tiny) -> None:
    """Rank 0 decides the reuse alone; the follower's slots keep their state because nothing is
    released, so both ranks resume at the same position."""
    pack = str(tiny("mixtral"))
    on = run_gloo(_tp2_conversation, 2, pack, True, timeout=300)
    off = run_gloo(_tp2_conversation, 2, pack, False, timeout=300)
    _check_conversation(on, off, rewinds=True)


# ------------------------------------------------------------------ DeepSeek-V4's resume points

EVERY = 128  # the tiny V4's ratios (4, 128) divide it; the release's default is 2048


def _v4(pack, rank: int = 0, world_size: int = 1):
    from shardsmith.runtime.engine.engine import Engine

    engine = Engine.load(pack, rank=rank, world_size=world_size, dtype=torch.float32, max_seq_len=512,
                         max_num_seqs=2, cuda_graphs=False)
    engine.model.snapshot_every = EVERY
    return engine


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ask(sched, tokens: list[int]):
    """Admit one greedy 4-token request of ``tokens`` and step until it ends: ``(sequence, tokens)``."""
    from shardsmith.runtime.engine.sampling import SamplingParams
    from shardsmith.runtime.engine.scheduler import Sequence

    seq = Sequence(tokens, SamplingParams(max_tokens=4, stop_token_ids=()))
    sched.admit(seq)
    out = []
    while sched.running:
        out += [o.token_id for _, o in sched.step()]
    return seq, out


def _resume_run(engine) -> dict:
    """A 300-token prompt prefilled in chunks that end at 128 and 256 (resume points), 3 decoded
    tokens; then slot 0 goes back to 256 and takes 50 other tokens, while slot 1 computes the same
    306 tokens from 0 in the same chunks."""
    first = _tokens(300, 1)
    for lo in (0, 128, 256):
        engine.prefill(0, first[lo:min(lo + 128, 300)], lo)
    for i in range(3):
        engine.decode([7 + i], [300 + i], [0])
    points = engine.resume_points(0)
    tail = _tokens(50, 2)
    try:
        engine.restore(0, 200)
        refused = ""
    except Exception as e:  # noqa: BLE001 - the message is the result
        refused = str(e)
    engine.restore(0, 256)
    resumed = engine.prefill(0, tail, 256, last_only=False)
    for lo in (0, 128):
        engine.prefill(1, first[lo:lo + 128], lo)
    whole = engine.prefill(1, tail, 256, last_only=False)
    return {"points": points, "after": engine.resume_points(0), "refused": refused,
            "resumed": resumed.numpy(), "whole": whole.numpy()}


def _check_resume(out: dict) -> None:
    assert out["points"] == [128, 256, 303]  # the two chunk ends on the multiple, and where it ended
    assert "cannot go back to position 200: it ended at 303; its resume points are [128, 256, 303]" in out["refused"]
    assert out["after"] == [128, 256, 306]  # the points past 256 went with the overwritten positions
    # the state at 256 put back is bit for bit the state a prefill leaves there: the same logits after
    assert (out["resumed"] == out["whole"]).all()


def test_deepseek_v4_goes_back_to_a_resume_point(tiny_v4_packs) -> None:
    _check_resume(_resume_run(_v4(tiny_v4_packs[1])))


def _tp2_resume(pack: str, rank: int, world_size: int):
    engine = _v4(pack, rank, world_size)
    if rank != 0:
        engine.follow()
        return None
    try:
        return _resume_run(engine)
    finally:
        engine.shutdown()


def test_deepseek_v4_resume_points_at_world_size_2(tiny_v4_packs) -> None:
    _check_resume(run_gloo(_tp2_resume, 2, str(tiny_v4_packs[2]), timeout=300))


def test_a_rewritten_turn_resumes_at_the_last_point_before_the_change(tiny_v4_packs) -> None:
    """A template that rewrites an earlier turn (DeepSeek's drops the reasoning of earlier answers):
    the next prompt shares 270 of the slot's tokens, so it resumes at 256 and gives the tokens of the
    same prompt computed from 0."""
    from shardsmith.runtime.engine.scheduler import Scheduler

    first, changed = _tokens(300, 3), _tokens(40, 4)
    runs = {}
    for caching in (True, False):
        sched = Scheduler(_v4(tiny_v4_packs[1]), prefill_chunk=100, decode_prompt_tokens=0, overlap=False,
                          prefix_caching=caching)
        _ask(sched, first)
        runs[caching] = _ask(sched, first[:270] + changed)
    (seq, tokens), (plain, plain_tokens) = runs[True], runs[False]
    assert seq.reused == 256 and plain.reused == 0
    assert tokens == plain_tokens


def test_long_chunks_still_end_on_the_resume_points(tiny_v4_packs) -> None:
    """Chunks longer than the resume spacing (the GPU default is 8192 tokens against 2048) end on a
    multiple of it when they hold one, and at the prompt's last resume point, where the next turn
    resumes; the greedy tokens are those of chunks of one spacing each."""
    from shardsmith.runtime.engine.scheduler import Scheduler

    prompt = _tokens(420, 5)  # resume points at 128, 256, 384; the last one 384

    runs = {}
    for chunk in (300, EVERY):
        engine = _v4(tiny_v4_packs[1])
        calls = []
        prefill = engine.prefill

        def spy(slot, ids, start, **kw):
            calls.append((start, len(ids)))
            return prefill(slot, ids, start, **kw)

        engine.prefill = spy
        sched = Scheduler(engine, prefill_chunk=chunk, decode_prompt_tokens=0, overlap=False)
        _, tokens = _ask(sched, prompt)
        points = engine.resume_points(0)
        reused = _ask(sched, prompt + _tokens(30, 6))[0].reused if chunk == 300 else None  # the next turn: the
        runs[chunk] = (calls, tokens, points, reused)                                     # prompt, not the answer
    (calls, tokens, points, reused), (short_calls, short_tokens, _, _) = runs[300], runs[EVERY]
    # 0..300 would pass 256: it ends there; 256..420 would pass the last point, 384: it ends there
    assert calls[:3] == [(0, 256), (256, 128), (384, 36)], calls
    assert short_calls[:4] == [(0, 128), (128, 128), (256, 128), (384, 36)], short_calls
    assert tokens == short_tokens and points[:2] == [256, 384]
    assert reused == 384  # it parts from the slot's history at 420: back to the last point
