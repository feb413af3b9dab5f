"""Sampling parameters honoured per row of a batched step, against transformers' own logits processors.

Each adjustment on random logits equals its processor (repetition penalty, min-p, top-k, min new
tokens, a sequence-bias table) or OpenAI's penalty formula; a batch mixing rows with and without
them gives each row what it gets alone; through the scheduler (plain and overlapped steps, prefilled
and fed prompts), a penalised greedy sequence in a batch decodes what ``Engine.generate`` decodes
for it alone, and ``min_tokens`` holds a stop token off.
"""

from __future__ import annotations


import pytest
import torch

from shardsmith.runtime.engine import penalties
from shardsmith.runtime.engine.penalties import TokenCounts
from shardsmith.runtime.engine.sampling import SamplingParams, choose_on_device, param_problems, sorted_filtered

transformers = pytest.importorskip("transformers")
V = 96


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _history(seed: int) -> tuple[list[int], list[int]]:
    """A prompt and generated tokens with repeats (counts above 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (12,), generator=g).tolist(), torch.randint(0, V // 3, (20,), generator=g).tolist()


def _counts(prompt: list[int], generated: list[int], slots: int = 1, slot: int = 0) -> TokenCounts:
    c = TokenCounts(slots, V, torch.device("cpu"))
    c.reset(slot, prompt)
    if generated:
        c.add(torch.full((len(generated),), slot), torch.tensor(generated))
    return c


@pytest.mark.parametrize("r", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_transformers(r: float) -> None:
    prompt, gen = _history(1)
    x = _logits(1, 2)
    want = transformers.RepetitionPenaltyLogitsProcessor(r)(torch.tensor([prompt + gen]), x.clone())
    got = penalties.apply(x, [SamplingParams(repetition_penalty=r)], [0], [len(gen)], _counts(prompt, gen))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_frequency_and_presence_are_openai_formula() -> None:
    """``mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence`` over generated tokens only
    (OpenAI's "Parameter details"); prompt tokens are not counted."""
    prompt, gen = _history(3)
    x = _logits(1, 4)
    c = torch.bincount(torch.tensor(gen), minlength=V).float()
    want = x - c * 0.7 - (c > 0).float() * -1.2
    got = penalties.apply(x, [SamplingParams(frequency_penalty=0.7, presence_penalty=-1.2)], [0], [len(gen)],
                          _counts(prompt, gen))
    torch.testing.assert_close(got, want[0:1].expand_as(got), rtol=0, atol=1e-6)
    assert not torch.equal(_counts(prompt, gen).prompt[0], _counts([], gen).prompt[0])  # the prompt is marked


def test_logit_bias_is_a_sequence_bias_table() -> None:
    x = _logits(1, 5)
    bias = ((3, 5.0), (17, -100.0), (V - 1, 0.25))
    want = transformers.SequenceBiasLogitsProcessor({(t,): v for t, v in bias})(torch.tensor([[1, 2]]), x.clone())
    got = penalties.apply(x, [SamplingParams(logit_bias=bias)], [0], [0], None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("produced", [0, 2, 3])
def test_min_tokens_is_min_new_tokens(produced: int) -> None:
    x = _logits(1, 6)
    stops = (2, 40)
    proc = transformers.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=5, min_new_tokens=3,
                                                          eos_token_id=list(stops))
    want = proc(torch.zeros(1, 5 + produced, dtype=torch.long), x.clone())
    got = penalties.apply(x, [SamplingParams(min_tokens=3, stop_token_ids=stops)], [0], [produced], None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert bool(torch.isinf(got[0, list(stops)]).all()) == (produced < 3)


@pytest.mark.parametrize(("min_p", "top_k", "temperature"), [(0.1, 0, 1.0), (0.05, 10, 0.7), (0.3, 0, 1.5)])
def test_min_p_and_top_k_keep_what_transformers_keeps(min_p: float, top_k: int, temperature: float) -> None:
    """Temperature, top-k, then min-p (transformers' warper order): the same tokens survive."""
    x = _logits(3, 7)
    scores = transformers.TemperatureLogitsWarper(temperature)(None, x.clone())
    if top_k:
        scores = transformers.TopKLogitsWarper(top_k)(None, scores)
    scores = transformers.MinPLogitsWarper(min_p)(None, scores)
    sx, order = sorted_filtered(x, torch.full((3,), temperature), torch.full((3,), top_k), torch.ones(3, dtype=torch.float64),
                                torch.full((3,), min_p))
    kept = torch.zeros(3, V, dtype=torch.bool).scatter_(1, order, torch.isfinite(sx))
    assert torch.equal(kept, torch.isfinite(scores))
    assert kept.sum() < 3 * V  # min-p removed something


def test_rows_in_a_batch_get_what_they_get_alone() -> None:
    """Four rows (a penalised one, a biased one, a min_tokens one, a plain one) in slots 3, 0, 2, 1:
    each row's scores and choice equal its own, computed alone."""
    prompt, gen = _history(8)
    counts = _counts(prompt, gen, slots=4, slot=3)
    counts.reset(2, [1, 2, 3])
    params = [SamplingParams(repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.5),
              SamplingParams(logit_bias=((7, 30.0),)),
              SamplingParams(min_tokens=4, stop_token_ids=(9,), presence_penalty=2.0),
              SamplingParams()]
    slots, produced = [3, 0, 2, 1], [len(gen), 0, 1, 5]
    x = _logits(4, 9)
    together = penalties.apply(x, params, slots, produced, counts)
    for b in range(4):
        alone = penalties.apply(x[b:b + 1], params[b:b + 1], slots[b:b + 1], produced[b:b + 1], counts)
        torch.testing.assert_close(together[b:b + 1], alone, rtol=0, atol=0)
    torch.testing.assert_close(together[3], x[3], rtol=0, atol=0)  # a plain row is untouched
    ids, packed, _ = choose_on_device(x, params, [0.0] * 4, scores=together)
    assert int(ids[1]) == 7  # the bias wins the greedy choice
    raw = torch.log_softmax(x, dim=-1)
    assert torch.allclose(packed[:, 1], raw.gather(1, ids[:, None])[:, 0].double())  # logprobs of the model


def test_counts_add_on_the_device_and_reset_per_sequence() -> None:
    c = TokenCounts(2, V, torch.device("cpu"))
    c.reset(1, [5, 5, 6])
    c.add(torch.tensor([1, 1, 0]), torch.tensor([8, 8, 8]))
    assert c.counts[1, 8] == 2 and c.counts[0, 8] == 1 and c.prompt[1, 5] and c.prompt[1, 6] and not c.prompt[0].any()
    c.reset(1, [])
    assert not c.counts[1].any() and not c.prompt[1].any() and c.counts[0, 8] == 1


def test_ranges_are_checked_by_name() -> None:
    bad = SamplingParams(max_tokens=4, min_p=1.5, min_tokens=5, repetition_penalty=0.0, frequency_penalty=2.5,
                         presence_penalty=-3, logit_bias=((V, 1.0), (3, 101.0)))
    assert param_problems(bad, V) == [
        "min_p must be in [0, 1]", "min_tokens must be in [0, max_tokens=4]", "repetition_penalty must be > 0",
        "frequency_penalty must be in [-2, 2]", "presence_penalty must be in [-2, 2]",
        f"logit_bias token ids must be in [0, {V})", "logit_bias values must be in [-100, 100]"]
    assert param_problems(SamplingParams(min_p=1.0, repetition_penalty=2.0, logit_bias=((0, -100.0),)), V) == []


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.testing.tiny import tiny_mixtral
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("penalties")
    split_checkpoint(tiny_mixtral(root / "src"), root / "tp1", world_size=1)
    return Engine.load(root / "tp1", rank=0, world_size=1, dtype=torch.float32, max_seq_len=48, max_num_seqs=4)


PROMPTS = [[3, 17, 42, 99, 5, 8, 61, 7, 200, 13], [11, 12], [250, 4, 9, 77, 31], [5]]


@pytest.mark.parametrize("overlap", [False, True])
def test_penalised_sequences_in_a_batch_decode_what_they_decode_alone(engine, overlap: bool) -> None:
    """Greedy with penalties and a bias beside plain rows, prompts prefilled (chunked) and fed
    through decode rows: each sequence's tokens are ``Engine.generate``'s for it alone, so the counts
    follow every token, the one in flight included."""
    from shardsmith.runtime.engine.scheduler import Scheduler, Sequence

    params = [SamplingParams(max_tokens=12, repetition_penalty=1.8, frequency_penalty=0.8, presence_penalty=0.6),
              SamplingParams(max_tokens=9),
              SamplingParams(max_tokens=10, frequency_penalty=2.0, logit_bias=((250, -5.0),)),
              SamplingParams(max_tokens=11, presence_penalty=1.5, repetition_penalty=1.3)]
    alone = [[s.token_id for s in engine.generate(p, sp)] for p, sp in zip(PROMPTS, params)]
    plain = [[s.token_id for s in engine.generate(p, SamplingParams(max_tokens=sp.max_tokens))]
             for p, sp in zip(PROMPTS, params)]
    assert alone[0] != plain[0] and alone[2] != plain[2]  # the penalties changed something
    sched = Scheduler(engine, prefill_chunk=4, decode_prompt_tokens=2, overlap=overlap)
    seqs = [Sequence(p, sp) for p, sp in zip(PROMPTS, params)]
    for s in seqs:
        sched.admit(s)
    got: dict[int, list[int]] = {id(s): [] for s in seqs}
    while sched.running:
        for seq, out in sched.step():
            got[id(seq)].append(out.token_id)
    assert [got[id(s)] for s in seqs] == alone


def test_min_tokens_holds_a_stop_token_off(engine) -> None:
    """A stop token that greedy decoding meets at its third token: with ``min_tokens=5`` the
    generation runs on past it, and the stop token still ends it afterwards when it comes."""
    prompt = PROMPTS[0]
    free = [s.token_id for s in engine.generate(prompt, SamplingParams(max_tokens=8))]
    stop = free[2]
    early = list(engine.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=(stop,))))
    assert len(early) == 3 and early[-1].finish_reason == "stop"
    held = list(engine.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=(stop,), min_tokens=5)))
    assert all(s.token_id != stop for s in held[:5]) and len(held) >= 5
