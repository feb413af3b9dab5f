"""DeepSeek's Python message encoder (a checkpoint's ``encoding/`` folder), run only when trusted.

DeepSeek-V3.2 and DeepSeek-V4 releases ship no Jinja chat template: their prompt format is a
Python module, ``encoding/encoding_dsv4.py`` (``encoding_dsv32.py`` for V3.2), whose
``encode_messages(messages, thinking_mode, ...) -> str`` renders OpenAI-style messages into the
prompt text. We call it as vLLM's DeepSeek-V4 tokenizer wrapper does, in non-thinking mode:
``encode_messages(messages, thinking_mode="chat")``.

Loading the module runs code that came with the checkpoint, so it is opt-in
(``--trust-remote-code``, as in transformers and vLLM). It is loaded from its file by
``importlib`` under a private module name; ``sys.path`` is left alone, and ``sys.modules`` holds
the module only under that name.

Example:
    >>> enc = MessageEncoding.from_dir(Path("ckpt"), trust_remote_code=True)  # doctest: +SKIP
    >>> enc.render([{"role": "user", "content": "Hi"}])  # doctest: +SKIP
    '<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>'
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from shardsmith.errors import ChatTemplateError, UsageError

ENCODING_DIR = "encoding"


class RemoteCodeError(ChatTemplateError, UsageError):
    """The chat format is code shipped with the checkpoint and ``--trust-remote-code`` was not given."""


def encoding_module_path(root: Path) -> Path:
    """The one ``encoding/encoding_*.py`` of checkpoint (or pack) ``root``.

    Raises:
        ChatTemplateError: none, or more than one (all named).
    """
    found = sorted((Path(root) / ENCODING_DIR).glob("encoding_*.py"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise ChatTemplateError(f"{Path(root) / ENCODING_DIR}: expected exactly one encoding_*.py "
                                f"(DeepSeek's message encoder), found {names}")
    return found[0]


class MessageEncoding:
    """A checkpoint's ``encode_messages``, with :class:`~shardsmith.runtime.serve.chat.ChatTemplate`'s ``render``.

    Attributes:
        source: the module file, for messages.
    """

    def __init__(self, path: Path) -> None:
        self.source = str(path)
        name = f"shardsmith_remote_code.{path.stem}_{hashlib.sha256(self.source.encode()).hexdigest()[:12]}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look a module up by name while it runs
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any failure of checkpoint code is reported the same way
            del sys.modules[name]
            raise ChatTemplateError(f"{path}: importing the checkpoint's message encoder failed: "
                                    f"{type(e).__name__}: {e}") from e
        self._encode = getattr(module, "encode_messages", None)
        if not callable(self._encode):
            raise ChatTemplateError(f"{path}: defines no encode_messages(messages, thinking_mode, ...)")

    @classmethod
    def from_dir(cls, root: Path, *, trust_remote_code: bool) -> "MessageEncoding":
        """Load the encoder of checkpoint (or pack) ``root``.

        Raises:
            RemoteCodeError: ``trust_remote_code`` is False (says why and how to allow it).
            ChatTemplateError: no single ``encoding_*.py``, or it fails to import or lacks
                ``encode_messages``.
        """
        path = encoding_module_path(root)
        if not trust_remote_code:
            raise RemoteCodeError(f"{path}: this checkpoint's chat format is Python code shipped with it (DeepSeek's "
                                  f"encoding/ folder, no chat template); running it needs --trust-remote-code on "
                                  f"serve/generate (read the file first); or send a rendered prompt (/v1/completions, "
                                  f"generate without --chat)")
        return cls(path)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Return the prompt text for ``messages``.

        DeepSeek's encoder always ends a conversation whose last message is the user's with the
        assistant prefix, so ``add_generation_prompt`` has no effect; ``kwargs`` go to
        ``encode_messages`` (default ``thinking_mode="chat"``), except ``thinking`` (the
        ``chat_template_kwargs`` switch vLLM takes for DeepSeek): true asks for
        ``thinking_mode="thinking"``, false for ``"chat"``.

        Raises:
            ChatTemplateError: the encoder raised, or returned something other than a string.
        """
        try:
            if "thinking" in kwargs:
                kwargs = {k: v for k, v in kwargs.items() if k != "thinking"} | \
                    {"thinking_mode": "thinking" if kwargs["thinking"] else "chat"}
            text = self._encode([dict(m) for m in messages], **({"thinking_mode": "chat"} | kwargs))
        except Exception as e:  # noqa: BLE001
            raise ChatTemplateError(f"{self.source}: encode_messages rejected the messages: "
                                    f"{type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise ChatTemplateError(f"{self.source}: encode_messages returned {type(text).__name__}, not str")
        return text
