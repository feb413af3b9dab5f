"""A small DeepSeek-style tokenizer for tiny test checkpoints, with either chat format DeepSeek ships.

:func:`deepseek_tokenizer` trains a byte-level BPE (``tokenizers``) on :data:`CORPUS` with
DeepSeek's special tokens at ids 0-5 (``<｜begin▁of▁sentence｜>`` = 0 and ``<｜end▁of▁sentence｜>``
= 1, the tiny checkpoints' ``bos_token_id``/``eos_token_id``) and writes ``tokenizer.json`` and
``tokenizer_config.json`` into a checkpoint directory, plus the chat format:

- ``chat="template"``: a Jinja ``chat_template`` in ``tokenizer_config.json`` (DeepSeek-V3 style);
- ``chat="encoding"``: no template, an ``encoding/encoding_dsv4.py`` instead, as DeepSeek-V4's
  release ships. The module written here (:data:`ENCODING_MODULE`) is our stand-in for the
  release's: same entry point (``encode_messages(messages, thinking_mode, ...) -> str``) and the
  same text for system/user/assistant turns, not DeepSeek's code.

Both render ``[system, user]`` as ``<｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>``
(non-thinking mode: the assistant turn opens with ``</think>``).

Example:
    >>> deepseek_tokenizer(tmp_path / "ckpt", vocab_size=512, chat="encoding")  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)  # ids 0..5

CORPUS = """\
Shardsmith splits Hugging Face mixture-of-experts checkpoints into per-rank tensor-parallel packs,
verifies them, and serves them over an OpenAI-compatible HTTP API. Every rank loads only its own
shards from memory-mapped files; rank zero drives the others step by step over a small command
channel. The capital of France is Paris. Water boils at one hundred degrees Celsius at sea level.
The three primary colours are red, yellow and blue. What is the capital of Germany? It is Berlin.
DeepSeek-V4 uses a shared latent key-value head, compressed sparse attention with a lightning
indexer, heavily compressed attention, manifold-constrained hyper-connections, and experts stored
in four-bit floating point with one scale per thirty-two values. Hello, how are you today? I am
fine, thank you. Please answer briefly: which river flows through London? The Thames does.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 3.14159. Punctuation: ( ) [ ] { } < > ; : , . ! ? " '
Some words with accents: café, naïve, résumé, über, Ångström; and a few others: 日本, 東京, 🙂.
"""

# DeepSeek-V3-style Jinja template producing the same text as ENCODING_MODULE in chat mode.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜></think>{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)

ENCODING_MODULE = '''\
"""Stand-in for DeepSeek-V4's ``encoding/encoding_dsv4.py``, written by shardsmith's test helper.

Not DeepSeek's code: the same entry point and the same text for system, user and assistant turns
(no tools, no reasoning effort). ``thinking_mode`` is "chat" (assistant turns open with
``</think>``) or "thinking" (the last one opens with ``<think>``).
"""

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, THINK, END_THINK = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"


def encode_messages(messages, thinking_mode, context=None, drop_thinking=True, add_default_bos_token=True,
                    reasoning_effort=None):
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = BOS if add_default_bos_token else ""
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            out += content
        elif role == "user":
            think = THINK if thinking_mode == "thinking" and i == last_user else END_THINK
            out += USER + content + ASSISTANT + think
        elif role == "assistant":
            out += content + EOS
        else:
            raise ValueError(f"unknown role {role!r}")
    return out
'''


def deepseek_tokenizer(root: Path, *, vocab_size: int = 512, chat: str | None = "template") -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and the chat format into ``root``.

    Args:
        root: the checkpoint directory (created if missing).
        vocab_size: tokens including the six special ones (at most the model's vocabulary).
        chat: ``template`` (Jinja in ``tokenizer_config.json``), ``encoding``
            (``encoding/encoding_dsv4.py``, no template) or None (neither).

    Returns:
        ``root``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if chat not in ("template", "encoding", None):
        raise ValueError(f"chat must be 'template', 'encoding' or None, got {chat!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "add_bos_token": False, "add_eos_token": False, "model_max_length": 1024}
    if chat == "template":
        config["chat_template"] = TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    if chat == "encoding":
        (root / "encoding").mkdir(exist_ok=True)
        (root / "encoding" / "encoding_dsv4.py").write_text(ENCODING_MODULE, encoding="utf-8")
    return root
