"""Continuous batching, engine side (issue 14), for the Mixtral family: B sequences in B slots decode
in one step through the model's pieces (run eagerly on CPU), padded to a batch bucket, and every
row gives the logits that sequence gives alone (float32, up to matmul rounding; greedy tokens
identical), at world sizes 1 and 2. Padding rows change no state; a chunked prefill equals a whole one.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardsmith.errors import UsageError
from shardsmith.runtime.engine.cuda_graphs import buckets_for
from shardsmith.runtime.engine.scheduler import CUDA_PREFILL_CHUNK, DEFAULT_PREFILL_CHUNK, Scheduler, default_prefill_chunk
from shardsmith.testing.ranks import run_ranks

PROMPTS = [[3, 17, 42, 99, 5, 8, 61, 7, 200, 13], [11, 12], [250, 4, 9, 77, 31], [5]]
STEPS = 5
SLOTS = 4  # buckets 1, 2, 4: three sequences run as a bucket of 4 with one padding row


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[tuple[str, int], Path]:
    from shardsmith.testing.tiny import tiny_mixtral, tiny_qwen_moe
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("batched")
    srcs = {"mixtral": tiny_mixtral(root / "mixtral"),
            "qwen2": tiny_qwen_moe(root / "qwen2", qwen2=True, dense_layers=(1,))}
    out = {}
    for name, src in srcs.items():
        for ws in (1, 2):
            out[name, ws] = root / f"{name}-tp{ws}"
            split_checkpoint(src, out[name, ws], world_size=ws)
    return out


def _alone(eng, prompt: list[int]) -> list[torch.Tensor]:
    """Logits of ``prompt``'s prefill and ``STEPS`` greedy one-token steps, in slot 0, by itself."""
    out = [eng.prefill(0, prompt)[-1]]
    for i in range(STEPS):
        out.append(eng.decode([int(out[-1].argmax())], [len(prompt) + i], [0])[0])
    eng.release(0)
    return out


def _together(eng, prompts: list[list[int]], slots: list[int], chunk: int) -> list[list[torch.Tensor]]:
    """The same sequences in ``slots``, prefilled in chunks of ``chunk`` tokens, then decoded in one
    batch per step (each row's next token its own greedy choice)."""
    out = []
    for prompt, slot in zip(prompts, slots):
        for start in range(0, len(prompt), chunk):
            logits = eng.prefill(slot, prompt[start: start + chunk], start)
        out.append([logits[-1]])
    for i in range(STEPS):
        ids = [int(rows[-1].argmax()) for rows in out]
        logits = eng.decode(ids, [len(p) + i for p in prompts], slots)
        for b, rows in enumerate(out):
            rows.append(logits[b])
    for slot in slots:
        eng.release(slot)
    return out


def _run(pack: str, rank: int, world_size: int) -> dict:
    from shardsmith.runtime.engine.engine import Engine

    eng = Engine.load(pack, rank=rank, world_size=world_size, dtype=torch.float32, max_seq_len=32, max_num_seqs=SLOTS)
    if rank != 0:
        eng.follow()
        return {}
    try:
        alone = [_alone(eng, p) for p in PROMPTS[:3]]
        together = _together(eng, PROMPTS[:3], [2, 0, 3], chunk=3)
        untouched = eng.kv_blocks.held(1) == 0 and eng.model.lengths[1] == 0  # slot 1: no block, no position
        buckets = sorted(eng.runner.sets)
        four = _together(eng, PROMPTS, [0, 1, 2, 3], chunk=32)
        return {"alone": [[t.numpy() for t in r] for r in alone],
                "together": [[t.numpy() for t in r] for r in together],
                "four": [[t.numpy() for t in r] for r in four[:3]], "untouched": untouched, "buckets": buckets,
                "state_bytes": eng.state_bytes, "max_num_seqs": eng.max_num_seqs}
    finally:
        eng.shutdown()


def _rank_main(rank: int, world_size: int, port: int, pack: str, queue) -> None:
    try:
        from shardsmith.runtime.engine.dist import init_distributed

        init_distributed(rank, world_size, master_port=port)
        out = _run(pack, rank, world_size)
        if rank == 0:
            queue.put(("ok", out))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def _check(out: dict) -> None:
    assert out["untouched"], "the padding row (a copy of slot 2's row) wrote into the unused slot 1"
    assert out["buckets"] == [1, 4], out["buckets"]  # three rows ran as the bucket of 4
    assert out["max_num_seqs"] == SLOTS and out["state_bytes"] > 0
    for run in ("together", "four"):
        for b, (want, have) in enumerate(zip(out["alone"], out[run])):
            for i, (w, h) in enumerate(zip(want, have)):
                torch.testing.assert_close(torch.from_numpy(h), torch.from_numpy(w), atol=2e-5, rtol=1e-5,
                                           msg=f"{run}: sequence {b} step {i}")
                assert h.argmax() == w.argmax(), (run, b, i)


@pytest.mark.parametrize("family", ["mixtral", "qwen2"])
def test_batched_rows_equal_each_sequence_alone_world_size_1(packs, family):
    _check(_run(str(packs[family, 1]), 0, 1))


def test_batched_rows_equal_each_sequence_alone_across_ranks(packs):
    _check(run_ranks(_rank_main, 2, str(packs["mixtral", 2]), timeout=300))


def test_state_bytes_cover_every_slot_and_bad_batches_are_refused(packs):
    from shardsmith.runtime.engine.engine import Engine

    one = Engine.load(packs["mixtral", 1], rank=0, world_size=1, dtype=torch.float32, max_seq_len=16, max_num_seqs=1)
    three = Engine.load(packs["mixtral", 1], rank=0, world_size=1, dtype=torch.float32, max_seq_len=16, max_num_seqs=3)
    # 2 layers x (K + V) x 3 KV heads x 16 positions x 64 dims x 4 bytes, per slot
    assert one.state_bytes == 2 * 2 * 3 * 16 * 64 * 4 and three.state_bytes == 3 * one.state_bytes
    assert three.runner.buckets == (1, 2, 3)
    three.prefill(0, [1, 2])
    with pytest.raises(UsageError, match=r"decode needs 1\.\.3 rows"):
        three.decode([1] * 4, [2] * 4, [0, 1, 2, 0])
    with pytest.raises(UsageError, match=r"a slot appears twice in \[0, 0\]"):
        three.decode([1, 1], [2, 2], [0, 0])
    with pytest.raises(UsageError, match=r"slot\(s\) \[3\] outside \[0, 3\)"):
        three.prefill(3, [1])
    with pytest.raises(UsageError, match=r"positions \[0, 17\) of slot 1 do not fit max_seq_len=16"):
        three.prefill(1, [1] * 17)
    with pytest.raises(UsageError, match="max_num_seqs must be >= 1, got 0"):
        Engine.load(packs["mixtral", 1], rank=0, world_size=1, max_num_seqs=0)


def test_buckets():
    assert buckets_for(1) == (1,) and buckets_for(8) == (1, 2, 4, 8) and buckets_for(6) == (1, 2, 4, 6)


def _schedule(eng, prompts: list[list[int]], params: list, chunk: int,
              decode_prompt: int = 0, overlap: bool = False) -> tuple[list[list[int]], list[str], list[int]]:
    """Every sequence through one Scheduler until all leave: (tokens, finish reasons, batch sizes)."""
    from shardsmith.runtime.engine.scheduler import Scheduler, Sequence

    sched = _schedule.last = Scheduler(eng, prefill_chunk=chunk, decode_prompt_tokens=decode_prompt, overlap=overlap)
    seqs = [Sequence(p, sp) for p, sp in zip(prompts, params)]
    for seq in seqs:
        sched.admit(seq)
    tokens, reasons, batches = {id(s): [] for s in seqs}, {}, []
    while sched.running:
        for seq, out in sched.step():
            tokens[id(seq)].append(out.token_id)
            if out.finished:
                reasons[id(seq)] = out.finish_reason
        batches.append(sched.last_batch)
    assert sched.free_slots == eng.max_num_seqs  # every slot back
    return [tokens[id(s)] for s in seqs], [reasons[id(s)] for s in seqs], batches


def test_scheduler_chunks_prompts_and_samples_each_sequence_alone(packs):
    """Chunked prefill gives the whole prompt's tokens; seeded sampling draws the same tokens in a
    batch as alone (one generator per sequence); each sequence leaves at its own max_tokens."""
    from shardsmith.runtime.engine.engine import Engine, SamplingParams

    eng = Engine.load(packs["mixtral", 1], rank=0, world_size=1, dtype=torch.float32, max_seq_len=32, max_num_seqs=3)
    prompts = PROMPTS[:3]
    greedy = [SamplingParams(max_tokens=n) for n in (6, 4, 5)]
    seeded = [SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, seed=s) for n, s in ((6, 1), (4, 2), (5, 3))]
    whole, reasons, _ = _schedule(eng, prompts, greedy, chunk=64)
    chunked, _, batches = _schedule(eng, prompts, greedy, chunk=4)
    assert chunked == whole and [len(t) for t in whole] == [6, 4, 5] and reasons == ["length"] * 3
    assert max(batches) == 3 and 0 in batches  # a prefill-only step, then all three decoding together
    alone = [_schedule(eng, [p], [sp], chunk=4)[0][0] for p, sp in zip(prompts, seeded)]
    assert _schedule(eng, prompts, seeded, chunk=4)[0] == alone
    with pytest.raises(UsageError, match="prefill_chunk must be >= 1 token, got 0"):
        _schedule(eng, prompts, greedy, chunk=0)
    # the default chunk: 512 tokens on a CPU, 2048 on a GPU
    assert Scheduler(eng, decode_prompt_tokens=0, overlap=False).prefill_chunk == DEFAULT_PREFILL_CHUNK == 512
    assert default_prefill_chunk(SimpleNamespace(device="cuda:0")) == CUDA_PREFILL_CHUNK == 2048


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v4"])
def test_short_prompts_fed_through_decode_rows_give_the_prefill_tokens(packs, tiny_v4_packs, family):
    """``decode_prompt_tokens``: a short prompt goes through the batched decode step one token per
    row (from position 0 of a slot another sequence used before); the greedy tokens equal those of
    a prefill, seeded draws equal the sequence's alone, and a fed prompt's first token comes with
    the batch (no step of its own)."""
    from shardsmith.runtime.engine.engine import Engine, SamplingParams

    pack = packs["mixtral", 1] if family == "mixtral" else tiny_v4_packs[1]
    eng = Engine.load(pack, rank=0, world_size=1, dtype=torch.float32, max_seq_len=32, max_num_seqs=3)
    prompts = PROMPTS[:3]  # 10, 2 and 5 tokens: with 5, the last two are fed through decode rows
    greedy = [SamplingParams(max_tokens=n) for n in (5, 4, 3)]
    seeded = [SamplingParams(max_tokens=4, temperature=1.0, seed=s) for s in (1, 2, 3)]
    prefilled, _, _ = _schedule(eng, prompts, greedy, chunk=64)
    fed, reasons, batches = _schedule(eng, prompts, greedy, chunk=64, decode_prompt=5)
    assert fed == prefilled and reasons == ["length"] * 3
    assert batches[:3] == [2, 3, 3]  # step 1: the 10-token prefill beside two fed rows; then all three as rows
    if family == "mixtral":  # the sampling side is the scheduler's, not the model's: once is enough
        alone = [_schedule(eng, [p], [sp], chunk=64, decode_prompt=5)[0][0] for p, sp in zip(prompts, seeded)]
        assert _schedule(eng, prompts, seeded, chunk=64, decode_prompt=5)[0] == alone


@pytest.mark.parametrize("family", ["deepseek-v3", "gpt-oss"])
def test_fed_prompts_give_the_prefill_tokens_in_the_other_families(tiny, tmp_path, family):
    """The same for DeepSeek-V3 (MLA cache) and gpt-oss (sliding window, sinks), greedy, from the checkpoint."""
    from shardsmith.runtime.engine.engine import Engine, SamplingParams
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss

    ckpt = tiny(family) if family != "gpt-oss" else tiny_gpt_oss(tmp_path / "gpt-oss")
    eng = Engine.load(ckpt, rank=0, world_size=1, from_checkpoint=True, dtype=torch.float32, max_seq_len=32,
                      max_num_seqs=3)
    greedy = [SamplingParams(max_tokens=n) for n in (4, 3, 3)]
    prefilled, _, _ = _schedule(eng, PROMPTS[:3], greedy, chunk=64)
    assert _schedule(eng, PROMPTS[:3], greedy, chunk=64, decode_prompt=10)[0] == prefilled


def test_feed_limit_is_the_power_of_two_that_a_prefill_pays_for():
    """The measured default of ``decode_prompt_tokens``: the largest power of two n with n decode steps
    costing no more than one eager prefill, capped at 256 and half the context; 0 below 2 steps."""
    from shardsmith.runtime.engine.scheduler import feed_limit

    assert feed_limit(0.085, 0.0012, 2048) == 64  # the H200 measurement: ratio 70.8
    assert feed_limit(0.064, 0.001, 2048) == 64  # exactly 64 steps: still worth it
    assert feed_limit(0.0639, 0.001, 2048) == 32
    assert feed_limit(1.8, 0.001, 2048) == 256  # capped
    assert feed_limit(1.8, 0.001, 100) == 32  # at most half the context (50 -> 32)
    assert feed_limit(0.0019, 0.001, 2048) == 0  # a prefill costs less than two steps: never fed
    assert feed_limit(0.002, 0.001, 2048) == 2
    assert feed_limit(0.01, 0.0, 2048) == 0 and feed_limit(0.0, 0.01, 2048) == 0  # nothing measured


def test_default_feed_limit_by_device(packs):
    """CPU: prompts are prefilled (0), and warm-up measures nothing; CUDA without a measurement: 16."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.engine.scheduler import Scheduler, default_decode_prompt_tokens

    eng = Engine.load(packs["mixtral", 1], rank=0, world_size=1, dtype=torch.float32, max_seq_len=32, max_num_seqs=2)
    eng.warmup()
    assert eng.prompt_costs is None and default_decode_prompt_tokens(eng) == 0
    assert Scheduler(eng).decode_prompt_tokens == 0

    class OnCuda:  # what the scheduler reads of an engine: its device, warm-up costs, context and slots
        device, max_seq_len, max_num_seqs, prompt_costs = "cuda:0", 2048, 8, None

    assert default_decode_prompt_tokens(OnCuda()) == 16
    OnCuda.prompt_costs = (0.0127, 0.00111)  # the H200's warm-up: 11.4 steps per prefill, times 8 slots
    assert default_decode_prompt_tokens(OnCuda()) == 64
    OnCuda.max_num_seqs = 1  # one sequence: a prefill stalls nobody else
    assert default_decode_prompt_tokens(OnCuda()) == 8


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v4"])
def test_overlapped_steps_give_the_same_tokens(packs, tiny_v4_packs, family):
    """``overlap``: each all-greedy step is launched before the previous one's tokens are read (its
    tokens fed from the device); every sequence gets the tokens and finish reasons of the plain
    scheduler: prefilled and fed prompts, ``max_tokens`` (the sequence is left out of the next step)
    and a stop token read after its next row was launched (that row is dropped); seeded sampled
    requests overlap too and draw what they draw alone."""
    from shardsmith.runtime.engine.engine import Engine, SamplingParams

    pack = packs["mixtral", 1] if family == "mixtral" else tiny_v4_packs[1]
    eng = Engine.load(pack, rank=0, world_size=1, dtype=torch.float32, max_seq_len=32, max_num_seqs=4)
    greedy = [SamplingParams(max_tokens=n) for n in (7, 3, 6, 5)]
    plain, reasons, _ = _schedule(eng, PROMPTS, greedy, chunk=64, decode_prompt=5)
    assert _schedule(eng, PROMPTS, greedy, chunk=64, decode_prompt=5, overlap=True)[:2] == (plain, reasons)
    assert _schedule.last.overlapped_steps >= 4  # most steps really ran ahead
    assert _schedule(eng, PROMPTS, greedy, chunk=4, overlap=True)[0] == _schedule(eng, PROMPTS, greedy, chunk=4)[0]
    # a stop token: the third token of the first sequence ends it there
    stop = plain[0][2]
    stopping = [SamplingParams(max_tokens=7, stop_token_ids=(stop,))] + greedy[1:]
    want = _schedule(eng, PROMPTS, stopping, chunk=64, decode_prompt=5)
    got = _schedule(eng, PROMPTS, stopping, chunk=64, decode_prompt=5, overlap=True)
    assert got[:2] == want[:2] and got[1][0] == "stop" and got[0][0][-1] == stop
    # seeded sampled requests overlap too (each draw is taken from its generator at launch): the
    # tokens of the plain scheduler, and each what it draws alone
    mixed = greedy[:2] + [SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=3),
                          SamplingParams(max_tokens=4, temperature=1.0, top_k=50, seed=7)]
    alone = [_schedule(eng, [p], [sp], chunk=64, decode_prompt=5)[0][0] for p, sp in zip(PROMPTS[2:], mixed[2:])]
    tokens = _schedule(eng, PROMPTS, mixed, chunk=64, decode_prompt=5, overlap=True)[0]
    assert _schedule.last.overlapped_steps >= 4
    assert tokens == _schedule(eng, PROMPTS, mixed, chunk=64, decode_prompt=5)[0]
    assert tokens[:2] == plain[:2] and tokens[2:] == alone


def test_overlap_needs_one_rank(packs, monkeypatch, caplog, use_settings):
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.engine.scheduler import Scheduler

    eng = Engine.load(packs["mixtral", 1], rank=0, world_size=1, dtype=torch.float32, max_seq_len=32, max_num_seqs=2)
    assert Scheduler(eng).overlap is False  # CPU: plain steps by default
    use_settings(overlap_steps="1")
    assert Scheduler(eng).overlap is True
    monkeypatch.setenv("SHARDSMITH_TUNING", "overlap_steps=yes")
    with pytest.raises(UsageError, match="SHARDSMITH_TUNING: overlap_steps='yes': expected 0 or 1"):
        Scheduler(eng)
    monkeypatch.delenv("SHARDSMITH_TUNING")
    eng.world_size = 2  # what the check reads; no step runs
    with pytest.raises(UsageError, match="overlapped steps run one rank only"):
        Scheduler(eng, overlap=True)
    use_settings(overlap_steps="1")
    with caplog.at_level("WARNING", logger="shardsmith.runtime.engine.scheduler"):
        assert Scheduler(eng).overlap is False  # asked for, but two ranks: plain, and said so
    assert "SHARDSMITH_TUNING=overlap_steps=1 is ignored: overlapped steps run one rank only (world size 2)" in caplog.text
    with pytest.raises(UsageError, match="decode_on_device runs one rank only"):
        eng.decode_on_device(torch.zeros(1, dtype=torch.int64), [0], [0])


def test_a_prefill_arriving_mid_flight_reads_the_step_and_lets_finished_sequences_leave(packs):
    """A prompt that needs a prefill arrives while a step is in flight: that step is read first, and
    a sequence whose token read there ends it (its max_tokens, or a stop token) leaves before the
    next batch is chosen: every sequence gets its tokens once, one finish each, as the plain
    scheduler gives them, whichever step the prefill arrives at."""
    from shardsmith.runtime.engine.engine import Engine, SamplingParams
    from shardsmith.runtime.engine.scheduler import Scheduler, Sequence

    eng = Engine.load(packs["mixtral", 1], rank=0, world_size=1, dtype=torch.float32, max_seq_len=32, max_num_seqs=4)

    def run(overlap: bool, k: int, stop: tuple[int, ...] = ()) -> list[tuple[str, int, bool]]:
        sched = Scheduler(eng, prefill_chunk=64, decode_prompt_tokens=5, overlap=overlap)
        a = Sequence(PROMPTS[0][:3], SamplingParams(max_tokens=4, stop_token_ids=stop))  # fed through decode rows
        b = Sequence(PROMPTS[0], SamplingParams(max_tokens=3))  # 10 tokens: prefilled
        sched.admit(a)
        log, i = [], 0
        while sched.running or i <= k:
            if i == k:
                sched.admit(b)
            log += [("a" if seq is a else "b", out.token_id, out.finished) for seq, out in sched.step()]
            i += 1
        return log

    for k in range(8):
        plain = run(False, k)
        assert run(True, k) == plain, k
        assert [f for who, _, f in plain if who == "a"] == [False] * 3 + [True]
    stop = tuple(t for who, t, _ in run(False, 0) if who == "a")[2:]  # a stops at its third token
    for k in range(8):
        assert run(True, k, stop) == run(False, k, stop), k


def test_a_prompt_prefills_in_shorter_chunks_while_others_decode(packs) -> None:
    """Alone, a prompt takes ``prefill_chunk`` tokens a step; while another sequence decodes, at most
    ``interleaved_chunk`` (so that sequence's next token does not wait for a whole long chunk); the
    tokens are the same either way. On a GPU the model's own chunk is the default (DeepSeek-V4's 8192)."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.engine.sampling import SamplingParams
    from shardsmith.runtime.engine.scheduler import INTERLEAVED_PREFILL_CHUNK, Sequence

    engine = Engine.load(packs["mixtral", 1], rank=0, world_size=1, dtype=torch.float32, max_seq_len=256,
                         max_num_seqs=2, cuda_graphs=False)
    calls: list[tuple[int, int, int]] = []
    prefill = engine.prefill

    def spy(slot, ids, start, **kw):
        calls.append((slot, start, len(ids)))
        return prefill(slot, ids, start, **kw)

    engine.prefill = spy
    prompt = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    outs = {}
    for company in (False, True):
        sched = Scheduler(engine, prefill_chunk=120, decode_prompt_tokens=0, overlap=False)
        assert sched.interleaved_chunk == min(120, INTERLEAVED_PREFILL_CHUNK)
        sched.interleaved_chunk = 50
        calls.clear()
        if company:  # a sequence already decoding when the long prompt arrives
            other = Sequence([5, 6, 7], SamplingParams(max_tokens=40, stop_token_ids=()))
            sched.admit(other)
            sched.step()
        seq = Sequence(prompt, SamplingParams(max_tokens=3, stop_token_ids=()))
        sched.admit(seq)
        out = []
        while seq in sched.running:
            out += [o.token_id for s, o in sched.step() if s is seq]
        outs[company] = ([c[2] for c in calls if c[0] == seq.slot and c[2] > 1], out)
        for s in list(sched.running):
            sched.abort(s)
    assert outs[False][0] == [120, 30] and outs[True][0] == [50, 50, 50], outs
    assert outs[False][1] == outs[True][1] and len(outs[False][1]) == 3
    v4 = SimpleNamespace(prefill_chunk_cuda=8192)
    assert default_prefill_chunk(SimpleNamespace(device="cuda:0", model=v4, offload=None)) == 8192
    assert default_prefill_chunk(SimpleNamespace(device="cuda:0", model=v4, offload=object())) == CUDA_PREFILL_CHUNK
    assert default_prefill_chunk(SimpleNamespace(device="cpu", model=v4, offload=None)) == DEFAULT_PREFILL_CHUNK
