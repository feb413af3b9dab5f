"""Chat templates rendered by :mod:`shardsmith.runtime.serve.chat` against transformers' ``apply_chat_template``.

Both read the same ``tokenizer_config.json`` (a tiny byte-level BPE trained in ``tmp_path``);
the rendered text and the token ids must be identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardsmith.runtime.serve.chat import ChatTemplate, ChatTemplateError
from shardsmith.runtime.serve.tokenizer import Codec

transformers = pytest.importorskip("transformers")

CHATML = (  # SmolLM2-Instruct's template (as in its GGUF and tokenizer_config.json)
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
STRICT = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
  {%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}{%- continue -%}{%- endif -%}
  {%- if (m['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0)) -%}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif -%}
  {%- if m['role'] == 'user' -%}[INST] {% if ns.system %}{{ ns.system }}\n\n{% endif %}{{ m['content'] }} [/INST]
  {%- else -%}{% generation %} {{ m['content'] }}{% endgeneration %}{{ eos_token }}{%- endif -%}
{%- endfor -%}
{%- if messages | length > 9 %}{{ raise_exception('too long') }}{% endif -%}
{{ '' if add_generation_prompt else '' }}<meta>{{ {'n': messages | length, 'note': 'é<&>'} | tojson }}</meta>"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Héllo 日本語 🙂"}, {"role": "assistant", "content": "Hi!"},
     {"role": "user", "content": "Again"}],
]


def _tokenizer_dir(path: Path, template) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The capital of France is Paris.", "Hello world, héllo wörld", "[INST] Be brief. [/INST]"] * 5, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
           "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "rstrip": False,
                         "normalized": False, "single_word": False, "special": True}, "unk_token": "<|endoftext|>",
           "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("template", [CHATML, STRICT, [{"name": "tool_use", "template": "{{ raise_exception('no') }}"},
                                                       {"name": "default", "template": CHATML}]],
                         ids=["chatml", "strict", "named-list"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(tmp_path: Path, template, add_generation_prompt: bool) -> None:
    root = _tokenizer_dir(tmp_path / "tok", template)
    ref = transformers.AutoTokenizer.from_pretrained(str(root))
    ours, codec = ChatTemplate.from_dir(root), Codec(root)
    for messages in CONVERSATIONS:
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        got = ours.render(messages, add_generation_prompt=add_generation_prompt)
        assert got == want
        ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert codec.encode(got) == list(ids)


def test_raise_exception_in_template(tmp_path: Path) -> None:
    root = _tokenizer_dir(tmp_path / "tok", STRICT)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        transformers.AutoTokenizer.from_pretrained(str(root)).apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        ChatTemplate.from_dir(root).render(bad)


def test_missing_template_is_a_clear_error(tmp_path: Path) -> None:
    root = _tokenizer_dir(tmp_path / "tok", None)
    with pytest.raises(ChatTemplateError, match="no chat template.*completions"):
        ChatTemplate.from_dir(root)
    (root / "encoding").mkdir()
    with pytest.raises(ChatTemplateError, match="DeepSeek-V4 encoding/"):
        ChatTemplate.from_dir(root)
    (root / "chat_template.jinja").write_text(CHATML)
    assert ChatTemplate.from_dir(root).render(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_named_list_without_default(tmp_path: Path) -> None:
    root = _tokenizer_dir(tmp_path / "tok", [{"name": "tool_use", "template": CHATML}])
    with pytest.raises(ChatTemplateError, match="no 'default' entry"):
        ChatTemplate.from_dir(root)


def test_sandbox_blocks_attribute_escape(tmp_path: Path) -> None:
    root = _tokenizer_dir(tmp_path / "tok", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_dir(root).render(CONVERSATIONS[0])
