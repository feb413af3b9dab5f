"""Text path of the server without an engine: UTF-8-safe incremental detokenization, stop strings,
and :func:`stream_text` over hand-written step records (the fields of the engine's ``StepOutput``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from shardsmith.runtime.serve.tokenizer import REPLACEMENT, Codec, IncrementalDetokenizer, StopStrings
from shardsmith.runtime.serve.worker import stream_text

TEXTS = [
    "The capital of France is Paris.",
    "héllo wörld ünïcode",
    "日本語のテキスト",
    "emoji 🙂🙃 and 👩‍👩‍👧 family",
    "mixed: Paris 🙂 é 日本 \n\t end",
]


@dataclass(frozen=True, slots=True)
class Step:
    """A record with the engine's ``StepOutput`` fields."""

    token_id: int
    logprob: float = -0.5
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finished: bool = False
    finish_reason: str | None = None


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> Codec:
    """A byte-level BPE whose vocabulary has few multi-byte merges, so CJK and emoji split into byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The capital of France is Paris. Hello world."] * 5, trainer)
    tok.save(str(root / "tokenizer.json"))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return Codec(root)


def _steps(ids: list[int], reason: str = "length") -> list[Step]:
    return [Step(t, finished=i == len(ids) - 1, finish_reason=reason if i == len(ids) - 1 else None)
            for i, t in enumerate(ids)]


def test_codec_reads_eos_from_every_config(codec: Codec) -> None:
    assert codec.eos_token_ids == (0, 2)  # generation_config [2] + tokenizer_config "<|endoftext|>" (id 0)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoding_never_splits_a_character(codec: Codec, text: str) -> None:
    prompt = codec.encode("Question:")
    ids = codec.encode(text)
    detok = IncrementalDetokenizer(codec, prompt)
    deltas = [detok.push(t) for t in ids]
    tail = detok.flush()
    assert "".join(deltas) + tail == codec.decode(ids) == text
    assert not any(REPLACEMENT in d for d in deltas)
    if any(ord(c) > 0x7FF for c in text):  # 3- and 4-byte characters really were split across tokens
        assert "" in deltas


def test_truncated_character_flushes_as_replacement(codec: Codec) -> None:
    ids = codec.encode("ok 🙂")
    detok = IncrementalDetokenizer(codec, [])
    out = "".join(detok.push(t) for t in ids[:-1])
    assert out == "ok " and detok.flush() == REPLACEMENT


def test_token_bytes_undo_the_byte_level_alphabet(codec: Codec) -> None:
    ids = codec.encode("é🙂 Paris")
    assert b"".join(codec.token_bytes(t) for t in ids) == "é🙂 Paris".encode()
    assert codec.token_str(codec.encode(" Paris")[0]).startswith(" ")


def test_stop_string_held_back_across_deltas() -> None:
    s = StopStrings(["###", "\nUser:"])
    assert s.push("Paris.#") == ("Paris.", False)
    assert s.push("#") == ("", False)
    assert s.push("x") == ("##x", False)  # not a stop after all: released
    assert s.push("\nUs") == ("", False)
    assert s.push("er: hi") == ("", True)


def test_stop_string_earliest_match_wins_and_flush() -> None:
    s = StopStrings(["cd", "b"])
    assert s.push("abcd") == ("a", True)
    s = StopStrings(["END"])
    assert s.push("the EN") == ("the ", False)
    assert s.flush() == "EN"
    assert StopStrings([]).push("anything") == ("anything", False)


def test_stream_text_stops_at_stop_string_and_closes_the_engine(codec: Codec) -> None:
    ids = codec.encode("The capital is Paris.### and more text")
    closed = []

    def engine_steps():
        try:
            yield from _steps(ids)
        finally:
            closed.append(True)

    events = list(stream_text(engine_steps(), codec, codec.encode("Q:"), stop=["###"]))
    assert "".join(e.text for e in events) == "The capital is Paris."
    assert events[-1].finish_reason == "stop" and closed == [True]
    assert len(events) < len(ids)  # generation ended at the stop string


def test_stream_text_eos_adds_no_text_and_length_flushes_holdback(codec: Codec) -> None:
    ids = codec.encode("Paris") + [2]
    events = list(stream_text(iter(_steps(ids, "stop")), codec, [], eos_token_ids=[2]))
    assert "".join(e.text for e in events) == "Paris" and events[-1].finish_reason == "stop"
    assert [e.step.token_id for e in events] == ids
    ids = codec.encode("Paris, Fra")
    events = list(stream_text(iter(_steps(ids)), codec, [], stop=["France!"]))
    assert "".join(e.text for e in events) == "Paris, Fra" and events[-1].finish_reason == "length"
    assert events[-1].text.endswith("Fra")  # held back until the end


def test_stream_text_utf8_across_tokens(codec: Codec) -> None:
    ids = codec.encode("🙂🙃")
    events = list(stream_text(iter(_steps(ids)), codec, []))
    assert [e.text for e in events if e.text] == ["🙂", "🙃"]
