"""Token constraints (:mod:`shardsmith.runtime.engine.constraints`) and structured output with
llguidance (:mod:`shardsmith.runtime.serve.structured`): the bitmask against a per-token reference,
then the real SmolLM2 MoE through the real :class:`Scheduler`: 8 sampled answers under a JSON
schema all parse and validate and end on their own (``stop``), in batches that mix them with an
unconstrained sequence, whose tokens stay those it samples alone.
"""

from __future__ import annotations

import json

import pytest
import torch

from shardsmith.runtime.engine.constraints import allow_all, apply_bitmask, bitmask_width

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}}}


def _reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for r in range(out.shape[0]):
        for t in range(out.shape[1]):
            w = t // 32
            if w >= bitmask.shape[1] or not (int(bitmask[r, w]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab, width", [(64, 2), (70, 3), (70, 2), (1, 1)])
def test_bitmask_matches_the_per_token_reference(vocab: int, width: int) -> None:
    gen = torch.Generator().manual_seed(vocab + width)
    logits = torch.randn(3, vocab, generator=gen)
    mask = torch.randint(-2**31, 2**31 - 1, (3, width), generator=gen, dtype=torch.int64).to(torch.int32)
    mask[1] = -1  # every bit set: nothing refused (up to 32 * width)
    want = _reference(logits, mask)
    assert torch.equal(apply_bitmask(logits.clone(), mask), want)
    assert bitmask_width(vocab) == (vocab + 31) // 32
    assert torch.equal(apply_bitmask(logits.clone(), allow_all(3, vocab)), logits)
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(logits, mask.long())


def test_a_bad_response_format_is_named() -> None:
    from shardsmith.runtime.serve.structured import schema_of

    assert schema_of(None) is None and schema_of({"type": "text"}) is None
    assert schema_of({"type": "json_object"}) == {"type": "object"}
    assert schema_of({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}) == SCHEMA
    with pytest.raises(ValueError, match="needs 'json_schema'"):
        schema_of({"type": "json_schema", "json_schema": {"name": "p"}})
    with pytest.raises(ValueError, match="'yaml' is not one of"):
        schema_of({"type": "yaml"})


@pytest.fixture(scope="module")
def smollm2(smollm2_pack):
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.serve.structured import Grammars
    from shardsmith.runtime.serve.tokenizer import Codec

    pack = smollm2_pack(1)
    engine = Engine.load(pack, rank=0, world_size=1, dtype=torch.float32, max_seq_len=256, max_num_seqs=8)
    codec = Codec(pack)
    return engine, codec, Grammars(codec.tokenizer_json(), engine.vocab_size, codec.eos_token_ids)


def _run(engine, seqs) -> dict[int, list[int]]:
    from shardsmith.runtime.engine.scheduler import Scheduler

    sched = Scheduler(engine, prefill_chunk=256, decode_prompt_tokens=0, overlap=False, prefix_caching=False)
    tokens, waiting, finish = {id(s): [] for s in seqs}, list(seqs), {}
    while waiting or sched.running:
        while waiting and sched.free_slots:
            sched.admit(waiting.pop(0))
        for seq, out in sched.step():
            tokens[id(seq)].append(out.token_id)
            if out.finished:
                finish[id(seq)] = out.finish_reason
    return {k: (v, finish[k]) for k, v in tokens.items()}


def test_sampled_answers_follow_the_schema(smollm2) -> None:
    from shardsmith.runtime.engine.sampling import SamplingParams
    from shardsmith.runtime.engine.scheduler import Sequence

    engine, codec, grammars = smollm2
    grammar = grammars.compile(SCHEMA)
    prompt = codec.encode("A short profile of a painter, as JSON: ")
    stops = codec.eos_token_ids
    free = Sequence(codec.encode("The capital of France is"), SamplingParams(max_tokens=12, stop_token_ids=stops))
    alone = _run(engine, [free])[id(free)]
    free_again = Sequence(free.prompt_ids, free.params)
    seqs = [Sequence(prompt, SamplingParams(max_tokens=80, temperature=1.0, seed=s, stop_token_ids=stops),
                     constraint=grammars.matcher(grammar)) for s in range(8)]
    got = _run(engine, seqs[:2] + [free_again] + seqs[2:])
    assert got[id(free_again)] == alone, "an unconstrained sequence changed beside constrained ones"
    texts = []
    for seq in seqs:
        tokens, finish = got[id(seq)]
        assert finish == "stop" and tokens[-1] in stops, (finish, codec.decode(tokens))
        text = codec.decode(tokens[:-1])
        jsonschema.validate(json.loads(text), SCHEMA)
        assert seq.constraint.complete and not seq.constraint.failed
        texts.append(text)
    assert len(set(texts)) > 1  # sampled, not one answer eight times


def test_an_unenforceable_schema_is_refused(smollm2) -> None:
    _, _, grammars = smollm2
    with pytest.raises(ValueError, match="cannot be enforced"):
        grammars.compile({"type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}})
