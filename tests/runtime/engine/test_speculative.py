"""Speculative decoding (:mod:`shardsmith.runtime.engine.speculative`): the n-gram lookup and
acceptance rule on their own; speculative sampling's tokens distributed as the target's (a
statistical test against an independent softmax / top-p); then greedy decoding through the real
:class:`Scheduler` with drafts checked in one chunk per sequence gives the tokens decoding without
them gives (float32), in batches with a sampled sequence whose top-k of 1 makes it greedy too, and a
seeded sampled request repeats itself: n-gram drafts on the tiny Mixtral and
Qwen3-MoE at world sizes 1 and 2 and on the real SmolLM2 MoE rewriting a paragraph (where most drafts
are accepted); DeepSeek-V3's MTP drafts at world sizes 1 and 2, its cache after rejected drafts, and
planted drafts that are always right (all accepted) or always wrong (none).
"""

from __future__ import annotations

import pytest
import torch

from shardsmith.errors import UsageError
from shardsmith.runtime.engine.speculative import SpeculativeConfig, accepted, ngram_draft
from shardsmith.testing.ranks import run_gloo


def test_the_draft_follows_the_latest_earlier_occurrence() -> None:
    cfg = SpeculativeConfig(k=3, min_ngram=1, max_ngram=3)
    assert ngram_draft([5, 6, 7, 8, 9, 1, 5, 6, 7], cfg) == [8, 9, 1]  # "5 6 7" seen before: what followed
    assert ngram_draft([1, 2, 3, 9, 2, 3, 4, 2, 3], cfg) == [4, 2, 3]  # the latest "2 3" wins
    assert ngram_draft([1, 2, 3, 4], cfg) == []  # nothing repeats
    assert ngram_draft([7, 1, 7], SpeculativeConfig(k=5)) == [1, 7]  # fewer than k follow
    assert accepted([4, 5, 6], [4, 5, 9, 1]) == 3 and accepted([4, 5, 6], [1, 5, 6, 7]) == 1
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == 4 and accepted([], [3]) == 1
    assert SpeculativeConfig(k=0).problems() and SpeculativeConfig(min_ngram=3, max_ngram=2).problems()


def _target(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """An independent reference of the sampled distribution: softmax at ``temperature``, then the smallest
    set of best tokens whose mass reaches ``top_p``, renormalised (rows of ``logits`` ``[G, V]``)."""
    out = []
    for row in logits.double():
        probs = torch.softmax(row / temperature, dim=-1)
        order = torch.argsort(probs, descending=True)
        keep, mass = [], 0.0
        for t in order.tolist():
            keep.append(t)
            mass += float(probs[t])
            if mass >= top_p:
                break
        kept = torch.zeros_like(probs)
        kept[keep] = probs[keep]
        out.append(kept / kept.sum())
    return torch.stack(out)


def test_speculative_sampling_gives_the_targets_distribution() -> None:
    """Each emitted token of :func:`sample_verified` follows the target: the first token, the second given
    the first draft token was accepted, and so on, up to the extra token after every draft token was
    accepted: over 20,000 verify steps every token's share is within 4.5 binomial standard deviations of
    its probability (and a token the filters remove never comes). A removed draft token is never accepted."""
    from shardsmith.runtime.engine.sampling import SamplingParams
    from shardsmith.runtime.engine.speculative import sample_verified

    torch.manual_seed(0)
    logits = torch.randn(4, 7) * 1.5
    params = SamplingParams(temperature=0.8, top_p=0.9)
    target = _target(logits, 0.8, 0.9)
    # row 0's second best (often rejected: the residual is drawn), then rows 1 and 2's best (often accepted)
    draft = [int(torch.argsort(target[i], descending=True)[int(i == 0)]) for i in range(3)]
    gen = torch.Generator().manual_seed(1)
    runs = [sample_verified(logits, draft, params, gen) for _ in range(20_000)]
    for i in range(4):  # position i, among the runs that accepted draft[:i]
        at = [r[i] for r in runs if len(r) > i and r[:i] == draft[:i]]
        n = len(at)
        seen = torch.bincount(torch.tensor(at), minlength=7).double() / n
        bound = 4.5 * (target[i] * (1 - target[i]) / n).sqrt()  # each token's share, binomial, 4.5 sigma
        assert n > 1000 and bool(((seen - target[i]).abs() <= bound).all()), (i, n, seen, target[i])
    masked = int(torch.argmin(target[0]))
    assert target[0, masked] == 0
    assert all(r[0] != masked for r in (sample_verified(logits, [masked], params, gen) for _ in range(2000)))


REPEATING = [3, 17, 42, 99, 5, 8, 61, 7, 3, 17, 42, 99, 5, 8, 61, 7, 3, 17]


def _decode(engine, prompts, params, speculative, *, runs: bool = True):
    from shardsmith.runtime.engine.scheduler import Scheduler, Sequence

    sched = Scheduler(engine, prefill_chunk=64, decode_prompt_tokens=0, overlap=False, prefix_caching=False,
                      speculative=speculative, verify_runs=runs)
    seqs = [Sequence(p, sp) for p, sp in zip(prompts, params)]
    for s in seqs:
        sched.admit(s)
    tokens = {id(s): [] for s in seqs}
    while sched.running:
        for seq, out in sched.step():
            tokens[id(seq)].append(out.token_id)
    return [tokens[id(s)] for s in seqs], sched.spec


def _cases():
    from shardsmith.runtime.engine.sampling import SamplingParams

    prompts = [REPEATING, REPEATING[3:] + [11, 12], [250, 4, 9, 77, 31]]
    # the third is sampled through speculative sampling; top-k 1 makes its distribution a point mass on the
    # greedy token, so its tokens too must be plain decoding's
    params = [SamplingParams(max_tokens=20, stop_token_ids=()), SamplingParams(max_tokens=13, stop_token_ids=()),
              SamplingParams(max_tokens=9, temperature=0.9, top_k=1, seed=5, stop_token_ids=())]
    return prompts, params


def _load(path, rank=0, world_size=1, mtp_layers=0):
    from shardsmith.runtime.engine.engine import Engine

    return Engine.load(path, rank=rank, world_size=world_size, dtype=torch.float32, from_checkpoint=True,
                       max_seq_len=64, max_num_seqs=3, cuda_graphs=False, mtp_layers=mtp_layers)


def _load_mtp(path, rank=0, world_size=1):
    return _load(path, rank, world_size, mtp_layers=1)


NGRAM, MTP = SpeculativeConfig(k=4), SpeculativeConfig(k=3, method="mtp")


def _both(engine, cfg: SpeculativeConfig = NGRAM, *, runs: bool = True) -> dict:
    prompts, params = _cases()
    plain, _ = _decode(engine, prompts, params, None)
    spec, stats = _decode(engine, prompts, params, cfg, runs=runs)
    return {"plain": plain, "spec": spec, "steps": stats.steps, "accepted": stats.accepted, "drafted": stats.drafted}


def _check(out: dict) -> None:
    assert out["spec"] == out["plain"], "speculation changed the greedy tokens"
    assert out["steps"] > 0 and out["drafted"] >= out["accepted"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "deepseek-v3", "deepseek-v4"])
def test_greedy_tokens_are_those_of_plain_decoding(tiny, family) -> None:
    """Where the decode step takes verify runs (every family here), the drafts ride in the batched step:
    no verify chunk of its own, and steps that hold a sequence's consecutive positions in several rows
    (V4: its window rings grown by the draft's rows, its compressors taking a run's rows in order and
    taking rejected ones back)."""
    engine = _load(tiny(family))
    chunks, runs = [], []
    prefill, decode = engine.prefill, engine.decode

    def counted_prefill(*a, **kw):
        chunks.append(kw.get("speculative", False))
        return prefill(*a, **kw)

    def counted_decode(ids, starts, slots, **kw):
        runs.append(len(slots) - len(set(slots)))
        return decode(ids, starts, slots, **kw)

    engine.prefill, engine.decode = counted_prefill, counted_decode
    out = _both(engine)
    _check(out)
    assert engine.verify_runs and not any(chunks) and max(runs) > 0
    assert engine.max_rows == 3 + NGRAM.k  # the scheduler reserved the draft's rows


def _tp2(path: str, cfg: SpeculativeConfig, rank: int, world_size: int):
    engine = _load(path, rank, world_size, mtp_layers=int(cfg.method == "mtp"))
    if rank != 0:
        engine.follow()
        return None
    try:
        return _both(engine, cfg)
    finally:
        engine.shutdown()


def test_a_seeded_sampled_request_repeats_itself_with_speculation(tiny) -> None:
    from shardsmith.runtime.engine.sampling import SamplingParams

    engine = _load(tiny("mixtral"))
    params = [SamplingParams(max_tokens=24, temperature=0.7, top_p=0.95, seed=11, stop_token_ids=())] * 2
    prompts = [REPEATING, REPEATING[5:]]
    first, stats = _decode(engine, prompts, params, NGRAM)
    again, _ = _decode(engine, prompts, params, NGRAM)
    assert first == again and stats.steps > 0 and stats.drafted > 0
    assert all(len(t) == 24 for t in first)


def test_greedy_tokens_at_world_size_2(tiny) -> None:
    _check(run_gloo(_tp2, 2, str(tiny("mixtral")), NGRAM, timeout=300))


def test_a_bad_config(tiny) -> None:
    from shardsmith.runtime.engine.scheduler import Scheduler

    with pytest.raises(UsageError, match="num_speculative_tokens must be in 1..16"):
        Scheduler(_load(tiny("mixtral")), speculative=SpeculativeConfig(k=0))


@pytest.mark.parametrize("runs", [True, False], ids=["runs", "chunks"])
def test_deepseek_v4_takes_back_rejected_drafts(tiny, runs: bool) -> None:
    """V4's window ring and compressors cannot rewind by position: each verify run (or chunk) is saved
    and its rejected rows taken back. The tiny V4's 16-token window wraps and its ratio-4 windows
    complete inside verify runs; greedy tokens stay plain decoding's."""
    out = _both(_load(tiny("deepseek-v4")), runs=runs)
    _check(out)
    assert out["drafted"] > out["accepted"]  # some drafts were rejected and taken back


def test_deepseek_v4_speculation_at_world_size_2(tiny) -> None:
    _check(run_gloo(_tp2, 2, str(tiny("deepseek-v4")), NGRAM, timeout=300))


def test_smollm2_rewriting_a_paragraph_accepts_most_drafts(smollm2_pack) -> None:
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.engine.sampling import SamplingParams
    from shardsmith.runtime.serve.tokenizer import Codec

    pack = smollm2_pack(1)
    codec = Codec(pack)
    text = ("The harbour market opens at dawn. Fishermen bring their catch to the stone quay, and traders "
            "from the valley arrive with cheese, wool and apples. By noon the stalls are empty and the gulls "
            "take what is left.")
    prompt = codec.encode(f"Copy this paragraph exactly.\n\n{text}\n\nCopy:\n{text[:40]}")
    engine = Engine.load(pack, rank=0, world_size=1, dtype=torch.float32, max_seq_len=256, max_num_seqs=1)
    params = [SamplingParams(max_tokens=40, stop_token_ids=codec.eos_token_ids)]
    plain, _ = _decode(engine, [prompt], params, None)
    spec, stats = _decode(engine, [prompt], params, SpeculativeConfig(k=4))
    assert spec == plain
    assert stats.acceptance_rate > 0.5 and stats.emitted / stats.steps > 2, stats


# ---------------------------------------------------------------- MTP drafts (DeepSeek-V3's MTP layer)


def test_mtp_greedy_tokens_are_those_of_plain_decoding(tiny) -> None:
    _check(_both(_load_mtp(tiny("deepseek-v3")), MTP))


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_mtp_with_offloaded_experts_drafts_as_resident(tiny, backend: str) -> None:
    """The MTP layer's experts join the expert cache as one more layer (host computed, or a 4-slot cache on
    a CPU pool): its drafts are the resident layer's, so as many are accepted, and the tokens are plain
    decoding's."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.offload import OffloadConfig

    resident = _both(_load_mtp(tiny("deepseek-v3")), MTP)
    offload = OffloadConfig(backend=backend, probe=False, **({"cache_slots": 4} if backend == "gpu" else {}))
    engine = Engine.load(tiny("deepseek-v3"), rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True,
                         max_seq_len=64, max_num_seqs=3, cuda_graphs=False, mtp_layers=1, offload=offload)
    assert engine.offload.layers[-1] == f"model.layers.{engine.model.args.n_layers}"  # the MTP layer's bank too
    out = _both(engine, MTP)
    _check(out)
    assert (out["spec"], out["drafted"], out["accepted"]) == (resident["spec"], resident["drafted"], resident["accepted"])


def test_mtp_greedy_tokens_at_world_size_2(tiny) -> None:
    _check(run_gloo(_tp2, 2, str(tiny("deepseek-v3")), MTP, timeout=300))


def test_the_mtp_cache_after_speculation_is_a_fresh_prefills(tiny) -> None:
    """After verify chunks with rejected drafts, the MTP layer's cache holds what one prefill of the
    accepted text leaves: the next draft is the same from both."""
    from shardsmith.runtime.engine.sampling import SamplingParams

    engine = _load_mtp(tiny("deepseek-v3"))
    (tokens,), stats = _decode(engine, [REPEATING], [SamplingParams(max_tokens=12, stop_token_ids=())],
                               MTP)
    assert stats.drafted > stats.accepted  # some drafts were rejected: their positions were written over
    text, pending = REPEATING + tokens[:-1], tokens[-1]
    after_spec = engine.model.draft(0, pending, len(text), 3)  # slot 0 ended at len(text) (released: refill)
    engine.prefill(1, text, 0)
    fresh = engine.draft(1, pending, len(text), 3)
    assert len(fresh) == 3 and after_spec in ([], fresh)
    engine.prefill(0, text[:5], 0)
    engine.prefill(0, text[5:], 5)  # two chunks: the MTP pass joins them at the chunk boundary
    assert engine.draft(0, pending, len(text), 3) == fresh


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v4"])
@pytest.mark.parametrize("oracle", [True, False])
def test_planted_drafts_right_and_wrong(tiny, family: str, oracle: bool, monkeypatch) -> None:
    """Drafts that are the plain decode's own next tokens are all accepted; wrong ones never are; the
    output is plain decoding's either way (V3: in place of the MTP layer's; V4: of the n-gram lookup,
    every wrong draft taken back from its window ring and compressors)."""
    from shardsmith.runtime.engine import scheduler
    from shardsmith.runtime.engine.sampling import SamplingParams

    engine = _load_mtp(tiny(family)) if family == "deepseek-v3" else _load(tiny(family))
    params = [SamplingParams(max_tokens=14, stop_token_ids=())]
    (plain,), _ = _decode(engine, [REPEATING], params, None)
    text = REPEATING + plain
    vocab = engine.vocab_size

    def planted(after: int, k: int) -> list[int]:  # the k tokens after position `after`
        want = text[after + 1: after + 1 + k]
        return want if oracle else [(t + 1) % vocab for t in want]

    if family == "deepseek-v3":
        monkeypatch.setattr(engine, "draft", lambda slot, token, pos, k: planted(pos, k))
        cfg = MTP
    else:
        monkeypatch.setattr(scheduler, "ngram_draft", lambda tokens, c: planted(len(tokens) - 1, c.k))
        cfg = SpeculativeConfig(k=3)
    (spec,), stats = _decode(engine, [REPEATING], params, cfg)
    assert spec == plain
    assert stats.drafted > 0 and stats.acceptance_rate == (1.0 if oracle else 0.0), stats


def test_mtp_is_refused_where_it_cannot_run(tiny) -> None:
    from shardsmith.errors import RuntimeLoadError

    with pytest.raises(RuntimeLoadError, match="Mixtral family does not run MTP draft layers"):
        _load_mtp(tiny("mixtral"))
    assert SpeculativeConfig(method="eagle").problems() == ["speculative must be one of ngram, mtp, got 'eagle'"]
    engine = _load(tiny("deepseek-v3"))  # loaded without its MTP layer
    with pytest.raises(UsageError, match="no MTP layer loaded"):
        engine.draft(0, 1, 1, 2)


def test_deepseek_v4_reserving_runs_after_steps_rebuilds_the_pieces(tiny) -> None:
    """Room for runs allocates V4's state anew: every slot is forgotten and the decode pieces built on
    the old state are dropped (a captured graph would point at freed tensors), then rebuilt by the next
    step, whose logits are a model's that never reserved."""
    engine, fresh = _load(tiny("deepseek-v4")), _load(tiny("deepseek-v4"))
    for e in (engine, fresh):
        e.prefill(0, REPEATING)
        e.decode([5], [len(REPEATING)], [0])
    assert engine.runner.built == {1}
    engine.reserve_rows(engine.max_num_seqs + 4)
    assert engine.model.runs == 5 and not engine.runner.built and engine.resume_points(0) == [0]
    engine.prefill(0, REPEATING)
    got = engine.decode([5, 6], [len(REPEATING), len(REPEATING) + 1], [0, 0])  # a run: the pending token, one draft
    fresh.decode([6], [len(REPEATING) + 1], [0])
    fresh.prefill(1, REPEATING)
    want = torch.cat([fresh.decode([5], [len(REPEATING)], [1]), fresh.decode([6], [len(REPEATING) + 1], [1])])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert engine.runner.built


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_deepseek_v4_rollback_runs_as_one_program_per_shape(tiny, monkeypatch, device: str) -> None:
    """Through the decode pieces (captured on CUDA, eager through their static buffers on the CPU) a
    verify run's rollback is one program per (run rows, kept rows), fed the slot, the run's first row
    and its position as device inputs: later rollbacks of other slots and positions reuse it (on CUDA
    a captured graph's replay), and the greedy tokens stay plain decoding's. Planted drafts keep 0, 1
    or 2 of their 3 tokens by position, in two sequences at once."""
    from shardsmith.runtime.engine import scheduler
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.engine.sampling import SamplingParams

    engine = Engine.load(tiny("deepseek-v4"), rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True,
                         max_seq_len=64, max_num_seqs=3, device=device)
    if device == "cpu":
        engine.use_decode_graphs()
    prompts = [REPEATING, REPEATING[3:] + [11, 12]]
    params = [SamplingParams(max_tokens=16, stop_token_ids=())] * 2
    plain, _ = _decode(engine, prompts, params, None)
    texts = [p + out for p, out in zip(prompts, plain)]

    def planted(tokens: list[int], c: SpeculativeConfig) -> list[int]:
        (text,) = [t for t in texts if t[:len(tokens)] == tokens]
        want = text[len(tokens):len(tokens) + c.k]
        right = len(tokens) % 3
        return want[:right] + [(t + 1) % engine.vocab_size for t in want[right:]]

    monkeypatch.setattr(scheduler, "ngram_draft", planted)
    model, rollbacks = engine.model, []
    real = model.rewind_program
    monkeypatch.setattr(model, "rewind_program",
                        lambda rows, kept, at: rollbacks.append((rows, kept, tuple(at.tolist()))) or real(rows, kept, at))
    spec, stats = _decode(engine, prompts, params, SpeculativeConfig(k=3))
    assert spec == plain and 0 < stats.accepted < stats.drafted
    programs = engine.graphs.programs
    assert {key[1:] for key in programs} == {(rows, kept) for rows, kept, _ in rollbacks} and len(programs) > 1
    assert all(key[0] == "rewind_run" for key in programs)
    assert len(rollbacks) > 2 * len(programs)  # each program run again for other slots and positions
    assert {at[0] for *_, at in rollbacks} == {0, 1} and len(set(rollbacks)) == len(rollbacks)
    if device == "cuda":
        assert all(piece.graph is not None for piece in programs.values())


def test_deepseek_v4_warm_up_builds_every_rollback_program(tiny) -> None:
    """With room for runs of up to 3 rows the warm-up builds the rollback of each run length to each kept
    length (captured before serving on CUDA) on the scratch slot: no decode step (so no batch bucket is
    built for it), every sequence slot untouched; a rollback afterwards reuses them and is exact."""
    engine = _load(tiny("deepseek-v4"))
    engine.use_decode_graphs()
    engine.reserve_rows(engine.max_num_seqs + 2)
    assert engine.model.runs == 3
    engine.warmup()
    keys = {("rewind_run", 2, 1), ("rewind_run", 3, 1), ("rewind_run", 3, 2)}
    assert set(engine.graphs.programs) == keys and engine.runner.built == {1}
    assert "rollbacks" in engine.warmup_phases and engine.model.positions == [0] * engine.max_num_seqs
    fresh = _load(tiny("deepseek-v4"))
    fresh.reserve_rows(fresh.max_num_seqs + 2)
    for e in (engine, fresh):
        e.prefill(1, REPEATING)
        e.decode([5, 6, 7], [len(REPEATING) + j for j in range(3)], [1] * 3)
        e.restore(1, len(REPEATING) + 2)
    assert set(engine.graphs.programs) == keys
    want = fresh.decode([9], [len(REPEATING) + 2], [1])
    torch.testing.assert_close(engine.decode([9], [len(REPEATING) + 2], [1]), want, atol=1e-5, rtol=0)
