"""Render a checkpoint's chat template into prompt text, as transformers' ``apply_chat_template`` does.

Sources, in order:

- ``tokenizer_config.json``'s ``chat_template``: a Jinja string, or a list of
  ``{"name", "template"}`` entries of which ``"default"`` is used.
- a sibling ``chat_template.jinja`` file (transformers >= 4.43 saves it there).
- without a template, DeepSeek's ``encoding/`` folder (a Python encoder, not Jinja): run by
  :func:`load_chat_format` through :mod:`.encoding` only with ``trust_remote_code``;
  :meth:`ChatTemplate.from_dir` refuses it.

The Jinja environment copies transformers' (``utils/chat_template_utils.py``): sandboxed and
immutable, ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter without HTML escaping, and the globals ``raise_exception`` and ``strftime_now``. The template
sees ``messages``, ``add_generation_prompt`` and the special tokens by name (``bos_token``,
``eos_token``, ...), so the rendered text is byte-identical to transformers' for the same config.

Example:
    >>> tpl = ChatTemplate.from_dir(Path("ckpt"))  # doctest: +SKIP
    >>> tpl.render([{"role": "user", "content": "Hi"}])  # doctest: +SKIP
    '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from shardsmith.errors import ChatTemplateError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def token_content(value: Any) -> str | None:
    """A special token as written in ``tokenizer_config.json``: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (assistant-mask marker)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to.

    Attributes:
        source: where the template came from (file and key), for messages.
        text: the template itself (what it mentions: ``tools``, a tool-call markup).
        special_tokens: ``bos_token``, ``eos_token``, ... as strings, passed to the template.
    """

    def __init__(self, template: str, *, source: str, special_tokens: dict[str, str]) -> None:
        import jinja2

        self.source, self.text = source, template
        self.special_tokens = dict(special_tokens)
        try:
            self._template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{source}: chat template does not compile: {e}") from e

    @classmethod
    def from_dir(cls, root: Path) -> "ChatTemplate":
        """Load the chat template of the checkpoint (or pack) directory ``root``.

        Raises:
            ChatTemplateError: no template in ``tokenizer_config.json`` nor ``chat_template.jinja``,
                a template list without ``"default"``, or only a DeepSeek-V4 ``encoding/`` folder.
        """
        root = Path(root)
        cfg_path = root / "tokenizer_config.json"
        cfg: dict = {}
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        specials = {k: v for k in SPECIAL_TOKEN_KEYS if (v := token_content(cfg.get(k))) is not None}
        template = cfg.get("chat_template")
        source = f"{cfg_path}: chat_template"
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise ChatTemplateError(f"{cfg_path}: chat_template list has no 'default' entry "
                                        f"(names: {sorted(map(str, named))})")
            template, source = named["default"], f"{cfg_path}: chat_template['default']"
        if template is None and (root / "chat_template.jinja").is_file():
            template, source = (root / "chat_template.jinja").read_text(encoding="utf-8"), str(root / "chat_template.jinja")
        if template is None:
            if (root / "encoding").is_dir():
                raise ChatTemplateError(f"{root}: the chat format is a DeepSeek-V4 encoding/ folder (Python, not a "
                                        f"template); load it with load_chat_format(trust_remote_code=True)")
            raise ChatTemplateError(f"{root}: no chat template (tokenizer_config.json has no chat_template and "
                                    f"there is no chat_template.jinja); use /v1/completions instead")
        if not isinstance(template, str):
            raise ChatTemplateError(f"{source} must be a string, got {type(template).__name__}")
        return cls(template, source=source, special_tokens=specials)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Return the prompt text for ``messages`` (``[{"role", "content", ...}]``).

        Raises:
            ChatTemplateError: the template raised (``raise_exception``, e.g. roles not alternating)
                or failed on the given messages.
        """
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **kwargs)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on the messages: {type(e).__name__}: {e}") from e


def has_template(root: Path) -> bool:
    """Whether ``root`` has a Jinja chat template (``tokenizer_config.json`` or ``chat_template.jinja``)."""
    cfg_path = Path(root) / "tokenizer_config.json"
    if cfg_path.is_file() and json.loads(cfg_path.read_text(encoding="utf-8")).get("chat_template") is not None:
        return True
    return (Path(root) / "chat_template.jinja").is_file()


def load_chat_format(root: Path, *, trust_remote_code: bool = False, template_file: Path | None = None):
    """The chat format of checkpoint (or pack) ``root``: its Jinja template, else DeepSeek's
    ``encoding/``; ``template_file``: a Jinja template used instead (``serve --chat-template``).

    Returns a :class:`ChatTemplate` or an :class:`~shardsmith.runtime.serve.encoding.MessageEncoding`;
    both have ``render(messages)`` and ``source``.

    Raises:
        RemoteCodeError: only an ``encoding/`` folder, and ``trust_remote_code`` is False.
        ChatTemplateError: no chat format, or a broken one.
    """
    root = Path(root)
    if template_file is not None:
        try:
            text = Path(template_file).read_text(encoding="utf-8")
        except OSError as e:
            raise ChatTemplateError(f"--chat-template {template_file}: cannot read it ({e.strerror})") from e
        specials = ChatTemplate.from_dir(root).special_tokens if has_template(root) else {}
        return ChatTemplate(text, source=str(template_file), special_tokens=specials)
    if not has_template(root) and (root / "encoding").is_dir():
        from shardsmith.runtime.serve.encoding import MessageEncoding

        return MessageEncoding.from_dir(root, trust_remote_code=trust_remote_code)
    return ChatTemplate.from_dir(root)
