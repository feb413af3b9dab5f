"""Plain prompts are tokenized as transformers' ``tokenizer(prompt)`` does, per tokenizer family,
without ever doubling a BOS the text already starts with (issue 13's BOS bug).

Families: the tiny DeepSeek tokenizer as ``shardsmith.testing.tokenizer`` writes it (no BOS added),
the same with DeepSeek-V3/V4's release configuration (``add_bos_token: true`` and a
``TemplateProcessing`` post-processor putting BOS first), a Llama/Mixtral-style Metaspace BPE
(``<s> $A``), and the real SmolLM2 tokenizer (byte-level, no BOS).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from shardsmith.runtime.serve.tokenizer import Codec  # noqa: E402
from shardsmith.testing.tokenizer import BOS, CORPUS, deepseek_tokenizer  # noqa: E402

PROMPTS = ("Hello there", "The capital of France is", " leading space", "café, naïve 🙂 日本", "x")


def _deepseek_release(root: Path) -> Path:
    """The tiny DeepSeek tokenizer configured as DeepSeek-V3/V4 ship theirs: BOS added by the post-processor."""
    deepseek_tokenizer(root)
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 0)])
    tok.save(str(root / "tokenizer.json"))
    cfg = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg |= {"add_bos_token": True, "tokenizer_class": "LlamaTokenizerFast"}
    (root / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    return root


def _llama_style(root: Path) -> Path:
    """A Metaspace BPE with ``<s> $A`` as Mixtral's and Llama's ``tokenizer.json`` have."""
    root.mkdir(parents=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                           show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.save(str(root / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
           "add_bos_token": True, "add_eos_token": False}
    (root / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return root


@pytest.fixture(params=["deepseek-tiny", "deepseek-release", "llama-style", "smollm2"])
def tokenizer_dir(request, tmp_path: Path) -> tuple[Path, str | None]:
    """``(directory, BOS text or None when this tokenizer adds none)``."""
    if request.param == "deepseek-tiny":
        return deepseek_tokenizer(tmp_path / "tok"), None
    if request.param == "deepseek-release":
        return _deepseek_release(tmp_path / "tok"), BOS
    if request.param == "llama-style":
        return _llama_style(tmp_path / "tok"), "<s>"
    src = request.getfixturevalue("smollm2_bf16")
    dst = tmp_path / "tok"
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst, None


def test_plain_prompts_match_transformers(tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    root, bos = tokenizer_dir
    ref, codec = AutoTokenizer.from_pretrained(str(root)), Codec(root)
    for prompt in PROMPTS:
        want = ref(prompt)["input_ids"]
        assert codec.encode_prompt(prompt) == want, prompt
        if bos is not None:  # the configuration adds BOS: one more token than the raw text
            assert want[0] == ref.convert_tokens_to_ids(bos) and len(want) == len(codec.encode(prompt)) + 1


def test_text_starting_with_bos_gets_no_second_one(tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    root, bos = tokenizer_dir
    if bos is None:
        pytest.skip("this tokenizer adds no BOS")
    ref, codec = AutoTokenizer.from_pretrained(str(root)), Codec(root)
    bos_id = ref.convert_tokens_to_ids(bos)
    ids = codec.encode_prompt(f"{bos}Hello there")
    assert ids == ref(f"{bos}Hello there", add_special_tokens=False)["input_ids"]
    assert ids[0] == bos_id and ids[1] != bos_id
    assert ref(f"{bos}Hello there")["input_ids"][:2] == [bos_id, bos_id]  # what transformers itself would send
