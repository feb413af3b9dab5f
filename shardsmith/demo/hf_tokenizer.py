"""Write a Hugging Face tokenizer (``tokenizer.json`` + configs) from a GGUF's BPE vocabulary.

The GGUF (``tokenizer.ggml.model = gpt2``, ``tokenizer.ggml.pre = smollm``) holds a byte-level BPE:
vocabulary strings in GPT-2's byte-to-unicode alphabet, ``"left right"`` merges in priority
order, and token types (3 = control). We rebuild it with the ``tokenizers`` library:

- model: ``BPE(vocab, merges)``, no unknown token (byte-level covers every byte), no BOS added
  (``tokenizer.ggml.add_bos_token = false``).
- pre-tokenizer: llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` splits every digit (``\\p{N}``), then
  applies the GPT-2 regex; in ``tokenizers`` terms ``Digits(individual_digits=True)`` followed by
  ``ByteLevel(add_prefix_space=False, use_regex=True)``, as SmolLM2's own ``tokenizer.json``.
- control tokens (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ...) become special added
  tokens, matched whole in the text as llama.cpp does when parsing specials.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SourceError
from .gguf_source import GGUFModel

CONTROL = 3  # llama.cpp LLAMA_TOKEN_TYPE_CONTROL


def build_tokenizer(model: GGUFModel):
    """Return a ``tokenizers.Tokenizer`` equivalent to the GGUF's tokenizer.

    Args:
        model: the GGUF's vocabulary (id order), merges (priority order) and token types.

    Returns:
        A byte-level BPE ``tokenizers.Tokenizer`` with the control tokens as special added tokens
        (ids unchanged: they are already in the vocabulary).

    Raises:
        SourceError: a merge is not ``"left right"`` or names a piece outside the vocabulary.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(model.tokens)}
    if len(vocab) != len(model.tokens):
        raise SourceError(f"GGUF vocabulary has {len(model.tokens) - len(vocab)} duplicate tokens")
    merges: list[tuple[str, str]] = []
    bad = []
    for m in model.merges:
        parts = m.split(" ")
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab or "".join(parts) not in vocab:
            bad.append(repr(m))
        else:
            merges.append((parts[0], parts[1]))
    if bad:
        raise SourceError(f"GGUF has {len(bad)} malformed BPE merges: {', '.join(bad[:5])}", bad)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    specials = [t for t, ty in zip(model.tokens, model.token_types) if ty == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def write_tokenizer(out_dir: Path, model: GGUFModel) -> list[str]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``.

    ``tokenizer_config.json`` carries the GGUF chat template and BOS / EOS / PAD / UNK tokens
    (for SmolLM2: ``<|im_start|>``, ``<|im_end|>``, ``<|im_end|>``, ``<|endoftext|>``) and names
    ``PreTrainedTokenizerFast``, which loads ``tokenizer.json`` as is.

    Returns:
        The file names written, relative to ``out_dir``.

    Raises:
        SourceError: see :func:`build_tokenizer`.
    """
    out_dir = Path(out_dir)
    tok = build_tokenizer(model)
    tok.save(str(out_dir / "tokenizer.json"))
    s = model.shape
    name = model.tokens
    control = {i: t for i, (t, ty) in enumerate(zip(model.tokens, model.token_types)) if ty == CONTROL}
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in control.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for i, t in control.items() if i not in {s.bos_id, s.eos_id}],
        "bos_token": name[s.bos_id],
        "eos_token": name[s.eos_id],
        "pad_token": name[s.pad_id],
        "unk_token": name[s.unk_id],
        "chat_template": model.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": s.context_length,
    }
    generation = {"bos_token_id": s.bos_id, "eos_token_id": s.eos_id, "pad_token_id": s.pad_id}
    for fname, obj in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        (out_dir / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
