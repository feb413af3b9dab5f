"""DeepSeek's ``encoding/`` chat format (:mod:`shardsmith.runtime.serve.encoding`): opt-in, loaded from its
file without touching ``sys.path``, and every way it can be broken reported clearly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardsmith.errors import UsageError
from shardsmith.runtime.serve.chat import ChatTemplate, ChatTemplateError, load_chat_format
from shardsmith.runtime.serve.encoding import MessageEncoding, RemoteCodeError
from shardsmith.testing.tokenizer import deepseek_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]
EXPECTED = ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜>"
            "<｜User｜>Again<｜Assistant｜></think>")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-formats")
    return {chat: deepseek_tokenizer(root / chat, vocab_size=300, chat=chat) for chat in ("template", "encoding")}


def test_template_and_encoding_render_alike(dirs: dict[str, Path]) -> None:
    path = list(sys.path)
    template = load_chat_format(dirs["template"])
    encoding = load_chat_format(dirs["encoding"], trust_remote_code=True)
    assert isinstance(template, ChatTemplate) and isinstance(encoding, MessageEncoding)
    assert template.render(MESSAGES) == encoding.render(MESSAGES) == EXPECTED
    assert encoding.render(MESSAGES[:2], thinking_mode="thinking").endswith("<｜Assistant｜><think>")
    assert sys.path == path and "encoding_dsv4" not in sys.modules


def test_encoding_needs_trust_remote_code(dirs: dict[str, Path]) -> None:
    with pytest.raises(RemoteCodeError, match="encoding_dsv4.py.*--trust-remote-code") as e:
        load_chat_format(dirs["encoding"])
    assert isinstance(e.value, UsageError) and isinstance(e.value, ChatTemplateError)
    with pytest.raises(ChatTemplateError, match="DeepSeek-V4 encoding/"):
        ChatTemplate.from_dir(dirs["encoding"])


def test_generate_chat_refuses_before_ranks_start(dirs: dict[str, Path]) -> None:
    from typer.testing import CliRunner

    from shardsmith.cli import app

    args = ["generate", str(dirs["encoding"]), "--from-checkpoint", "--tp", "1", "--chat", "--prompt", "Hi"]
    r = CliRunner().invoke(app, args, standalone_mode=False)
    assert isinstance(r.exception, RemoteCodeError)


@pytest.mark.parametrize("source, match", [
    ("raise RuntimeError('boom')\n", "importing the checkpoint's message encoder failed: RuntimeError: boom"),
    ("x = 1\n", "defines no encode_messages"),
    ("def encode_messages(messages, thinking_mode):\n    raise ValueError('bad role')\n",
     "encode_messages rejected the messages: ValueError: bad role"),
    ("def encode_messages(messages, thinking_mode):\n    return [1]\n", "returned list, not str"),
])
def test_broken_encoders_are_reported(tmp_path: Path, source: str, match: str) -> None:
    (tmp_path / "encoding").mkdir()
    (tmp_path / "encoding" / "encoding_dsv4.py").write_text(source)
    with pytest.raises(ChatTemplateError, match=match):
        load_chat_format(tmp_path, trust_remote_code=True).render(MESSAGES)


def test_exactly_one_encoder(tmp_path: Path) -> None:
    (tmp_path / "encoding").mkdir()
    with pytest.raises(ChatTemplateError, match="exactly one encoding_\\*.py.*found none"):
        load_chat_format(tmp_path, trust_remote_code=True)
    for name in ("encoding_dsv32.py", "encoding_dsv4.py"):
        (tmp_path / "encoding" / name).write_text("")
    with pytest.raises(ChatTemplateError, match="found encoding_dsv32.py, encoding_dsv4.py"):
        load_chat_format(tmp_path, trust_remote_code=True)
