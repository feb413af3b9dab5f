"""Structured output: ``response_format`` ``json_object`` and ``json_schema`` enforced token by token
with llguidance (Microsoft's grammar engine, the one vLLM and SGLang offer beside xgrammar: a Rust
wheel with no dependencies; its masks take tens of microseconds at a 129k-token vocabulary).

A request's schema is compiled to an llguidance grammar once, in the request's preparation, and
checked against the model's tokenizer there (a bad schema is a 400 naming ``response_format``);
each choice then gets its own matcher (:class:`GrammarConstraint`), which the scheduler asks for
the next token's bitmask and tells each chosen token
(:mod:`~shardsmith.runtime.engine.constraints`). When the grammar is complete the matcher allows
only the end-of-sequence tokens, so the answer ends there with ``finish_reason`` ``stop``; a
``max_tokens`` limit can still cut it short (``length``), as OpenAI's does.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import torch

__all__ = ["GrammarConstraint", "Grammars", "schema_of"]

log = logging.getLogger("shardsmith.runtime.serve")

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def schema_of(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks for: None for ``text`` (or none), ``{"type":
    "object"}`` for ``json_object``, ``json_schema.schema`` for ``json_schema`` (OpenAI's shape:
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``).

    Raises:
        ValueError: another type, or a ``json_schema`` without an object ``schema`` (the message
            names what is wrong).
    """
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("'response_format' of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}")
        return schema
    raise ValueError(f"'response_format' type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


class Grammars:
    """The model's tokenizer in llguidance's form (built on first use, ~1 s) and the compiled
    grammars of requests.

    Args:
        tokenizer_json: the checkpoint's ``tokenizer.json`` text; vocab: the logits' width (tokens
            past the tokenizer's are never allowed); eos_token_ids: what ends a sequence.
    """

    def __init__(self, tokenizer_json: str, vocab: int, eos_token_ids: tuple[int, ...]) -> None:
        self._json, self.vocab, self.eos = tokenizer_json, vocab, list(eos_token_ids)

    @functools.cached_property
    def tokenizer(self) -> Any:
        import llguidance

        return llguidance.LLTokenizer(self._json, n_vocab=self.vocab, eos_token=self.eos or None)

    def compile(self, schema: dict[str, Any]) -> str:
        """The llguidance grammar of JSON schema ``schema``, checked against the tokenizer.

        Raises:
            ValueError: the schema cannot be compiled (llguidance's message).
        """
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if error:
            raise ValueError(f"the JSON schema cannot be enforced: {messages[0]}")
        return grammar

    def matcher(self, grammar: str) -> "GrammarConstraint":
        """A fresh :class:`GrammarConstraint` of a grammar :meth:`compile` made."""
        import llguidance

        return GrammarConstraint(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0))


class GrammarConstraint:
    """One choice's llguidance matcher, as a :class:`~shardsmith.runtime.engine.constraints.TokenConstraint`.

    A token the matcher refuses (only possible if a mask was not applied) puts it in its error
    state; it is logged once and the sequence continues unconstrained rather than failing the
    batch's step.
    """

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.failed = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.failed:
            return  # the row keeps allow_all's bits
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def advance(self, token: int) -> None:
        if self.failed:
            return
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            self.failed = True
            log.warning("structured output: token %d left the grammar (%s); the rest of this answer is unconstrained",
                        token, self.matcher.get_error())

    @property
    def complete(self) -> bool:
        """Whether the output so far is a whole document of the grammar."""
        return self.matcher.is_accepting()
