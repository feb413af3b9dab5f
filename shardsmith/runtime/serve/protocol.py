"""OpenAI-compatible request models and error bodies for ``/v1/completions`` and ``/v1/chat/completions``.

Fields follow the OpenAI API reference (Completions, legacy; Chat Completions). Every model uses
``extra="forbid"``: a field OpenAI does not define is a 400, so a typo (``max_token``) is reported
rather than silently ignored. Every model is also ``strict``: a field OpenAI types as integer,
number or boolean takes that JSON type only (``"max_tokens": "3"`` is a 400, as is ``3.0``; an
integer is a valid number). Fields OpenAI defines but the runtime does not implement are
accepted at their neutral value (``echo=false``) and refused otherwise, naming the field;
``response_format`` takes ``text``, ``json_object`` and ``json_schema``
(:mod:`~shardsmith.runtime.serve.structured`), ``tools`` and ``tool_choice`` OpenAI's function
tools (:mod:`~shardsmith.runtime.serve.tools`). ``user``, ``store``, ``metadata`` and ``service_tier``
are accepted and ignored (nothing is stored; no tier applies), as vLLM does. ``top_k`` is an
extension (vLLM spells it the same way). A union field's failed branches are reported as one
message naming the types it takes (pydantic reports one error per branch).

Every string in a request, keys included, must be encodable as UTF-8: JSON's ``\\ud800`` escape
decodes to a lone surrogate, which no tokenizer takes and no response could echo, so it is a 400
naming the field (``code: invalid_unicode``).

Errors use OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from shardsmith.runtime.serve.structured import schema_of

MAX_LOGPROBS = 20
MAX_N = 128  # choices per request (OpenAI's bound)
MAX_STOP = 4
ACCEPTED_FIELDS_DOC = "GET /openapi.json, or docs/serving.md's 'Request fields' table"
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids per request
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request.

    Attributes:
        prompt_ids: prompt tokens; params: the engine's ``SamplingParams``; stop: stop strings;
        want_logprobs: the response carries ``logprobs``; n: choices (sequences from this prompt).
    """

    prompt_ids: list[int]
    params: Any
    stop: list[str]
    want_logprobs: bool
    n: int = 1
    include_stop: bool = False
    skip_special_tokens: bool = True
    constraints: tuple[Any, ...] = ()  # one token constraint per choice (structured output), or none
    tools: Any = None  # the request's ToolPlan (tools.py): how its answers become tool_calls, or None
    reasoning: Any = None  # its Reasoning (reasoning.py) when the model has a thinking mode, else None


class APIError(Exception):
    """An OpenAI-style error response.

    Attributes:
        status: HTTP status (400 invalid request, 404 unknown model, 429 queue full, 503 not ready,
            500 engine failure).
        message: what is wrong and the rule or limit involved.
        type: OpenAI's error type (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, if any.
        code: a short machine code, if any.
        headers: extra response headers (a 429's ``Retry-After``).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def lone_surrogate(value: Any, where: str = "") -> tuple[str, str] | None:
    """``(field path, the offending string)`` of the first string (or key) in ``value`` that is not
    valid Unicode (a lone surrogate from a JSON ``\\ud800`` escape), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body", value
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            key = str(k).encode("utf-8", "backslashreplace").decode("utf-8")  # the path itself must be valid
            path = f"{where}.{key}" if where else key
            if (hit := lone_surrogate(k, path)) or (hit := lone_surrogate(v, path)):
                return hit
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if hit := lone_surrogate(v, f"{where}.{i}" if where else str(i)):
                return hit
    return None


def _ONLY(*values: Any) -> dict[str, Any]:
    """Schema-only hint for an OpenAI field accepted at its neutral value(s) alone: ``/openapi.json``
    says so (clients and fuzzers then send what is served); validation is ``check_supported``'s."""
    return {"enum": [*values, None]}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: cumulative usage on every chunk


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 (or 0) for all
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)  # choices: n sequences from the one prompt, each its own slot
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None
    # vLLM's extensions, which load tools (guidellm, aiperf) and chat front ends send
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if (hit := lone_surrogate(data)) is not None:
            where, text = hit
            raise PydanticCustomError("invalid_unicode", "'{where}' is not valid Unicode: {text} holds a lone UTF-16 "
                                      "surrogate (a \\ud800-\\udfff escape without its pair)",
                                      {"where": where, "text": ascii(text)[:80]})
        return data

    def stop_list(self) -> list[str]:
        """``stop`` as a list (at most :data:`MAX_STOP`, none empty)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise invalid(f"'stop' takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
        if any(s == "" for s in stops):
            raise invalid("'stop' strings must not be empty", "stop")
        return stops

    def bias_pairs(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token_id, bias)`` pairs, ids ascending.

        Raises:
            APIError: a key that is not a token id in ``[0, vocab)``, or a bias outside [-100, 100].
        """
        out = []
        for key, value in (self.logit_bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise invalid(f"'logit_bias' keys are token ids, got {key!r}", "logit_bias") from None
            if not 0 <= tid < vocab:
                raise invalid(f"'logit_bias' token id {tid} is outside the vocabulary [0, {vocab})", "logit_bias")
            if not -100 <= value <= 100:
                raise invalid(f"'logit_bias' values must be in [-100, 100], got {value} for token {tid}", "logit_bias")
            out.append((tid, float(value)))
        if len(out) > MAX_LOGIT_BIAS:
            raise invalid(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens, got {len(out)}", "logit_bias")
        return tuple(sorted(out))

    def check_supported(self) -> None:
        """Refuse options at values this server does not take (field combinations)."""
        if self.stream_options is not None and not self.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (one prompt only)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, json_schema_extra=_ONLY(False))
    best_of: int | None = Field(None, json_schema_extra=_ONLY(1))
    suffix: str | None = Field(None, json_schema_extra=_ONLY(""))

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise invalid("'echo' is not supported", "echo")
        if self.best_of not in (None, 1):
            raise invalid(f"only best_of=1 is supported, got {self.best_of}", "best_of")
        if self.suffix:
            raise invalid("'suffix' is not supported", "suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids.

        Raises:
            APIError: a batch of several prompts, or an empty prompt.
        """
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise invalid(f"only one prompt per request is supported, got {len(p)}", "prompt")
            p = p[0]
        if len(p) == 0:
            raise invalid("'prompt' must not be empty", "prompt")
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's thinking, sent back (DeepSeek's API, vLLM)

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        parts = data.get("content") if isinstance(data, dict) else None
        for i, part in enumerate(parts if isinstance(parts, list) else []):
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(f"content part {i} has type {part.get('type')!r}: only text parts "
                                 f"({{'type': 'text', 'text': ...}}) are supported (no images, audio or files)")
        return data

    @model_validator(mode="after")
    def _content_given(self) -> "ChatMessage":
        # OpenAI: content is required except on an assistant message carrying tool_calls or a refusal
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise ValueError(f"a '{self.role}' message needs 'content' (a string or a list of text parts), got null")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the template expects it: ``content`` a string, unset fields left out."""
        out = self.model_dump(exclude_none=True, exclude={"content", "refusal"})
        if isinstance(self.content, list):
            out["content"] = "".join(p.text for p in self.content)
        else:
            out["content"] = self.content or ""
        return out


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = Field(
        None, json_schema_extra={"properties": {"type": {"enum": ["text", "json_object", "json_schema"]}}})
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # accepted and ignored, as vLLM does: nothing is stored, no tier or metadata applies to a local server
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's chat extensions: the template's own options, and where the prompt ends
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def _check_tools(self) -> None:
        """``tools``: OpenAI's function tools, names unique; ``tool_choice``: ``none``, ``auto``,
        ``required`` or ``{"type": "function", "function": {"name": one of the tools}}``."""
        names = []
        for i, t in enumerate(self.tools or ()):
            fn = t.get("function") if isinstance(t, dict) else None
            if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not fn["name"]:
                raise invalid(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                              f"{{...}}}}}}", "tools")
            if not isinstance(fn.get("parameters", {}), dict):
                raise invalid(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            names.append(fn["name"])
        if len(set(names)) != len(names):
            raise invalid(f"tool names must be unique, got {names}", "tools")
        c = self.tool_choice
        if isinstance(c, dict):
            name = (c.get("function") or {}).get("name") if c.get("type") == "function" else None
            if name not in names:
                raise invalid(f"'tool_choice' names function {name!r}, which is not among 'tools' ({names})",
                              "tool_choice")
        elif c not in (None, "none", "auto", "required"):
            raise invalid(f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {c!r}", "tool_choice")
        if (c == "required" or isinstance(c, dict)) and not names:
            raise invalid(f"'tool_choice' {c!r} needs 'tools'", "tool_choice")
        if self.forced_tools() and schema_of(self.response_format) is not None:
            raise invalid("'response_format' and a 'required' or named 'tool_choice' both constrain the answer: "
                          "give one", "response_format")

    def tool_mode(self) -> str:
        """``none`` (no tools, or ``tool_choice`` none), ``auto`` (the default with tools) or ``forced``
        (``required`` or a named function)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        return "forced" if self.forced_tools() else "auto"

    def forced_tools(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    def check_supported(self) -> None:
        super().check_supported()
        try:
            schema_of(self.response_format)
        except ValueError as e:
            raise invalid(str(e), "response_format") from None
        self._check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise invalid("give 'max_completion_tokens' or 'max_tokens', not both", "max_completion_tokens")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("'continue_final_message' continues the last message: set 'add_generation_prompt' "
                          "to false", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise invalid(f"'continue_final_message' needs an assistant message last, got "
                          f"'{self.messages[-1].role}'", "continue_final_message")
        reserved = {"messages", "add_generation_prompt"} & set(self.chat_template_kwargs or {})
        if reserved:
            raise invalid(f"'chat_template_kwargs' may not set {sorted(reserved)}: they are request fields",
                          "chat_template_kwargs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def validation_error(errors: list[dict[str, Any]], *, content_type: str | None = None) -> APIError:
    """One 400 from pydantic/FastAPI validation errors (malformed JSON, wrong types, unknown fields).

    ``content_type`` is the request's header: a body that is not a JSON object is reported as
    such, naming the content type when it is not JSON (FastAPI then does not parse the body).
    """
    parts, param, unions = [], None, {}
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        kind = e.get("type", "")
        tag = next((i for i, x in enumerate(loc) if x in _UNION_MEMBERS), None)
        if tag is not None:  # one branch of a union field (str | list[...]): said once per field, below
            unions.setdefault(".".join(loc[:tag]), []).append(loc[tag])
            continue
        if kind == "invalid_unicode":
            return invalid(str(e.get("msg")), (e.get("ctx") or {}).get("where"), "invalid_unicode")
        if kind == "json_invalid":
            ctx = (e.get("ctx") or {}).get("error", "")
            return invalid(f"request body is not valid JSON: {ctx}".rstrip(": "), code="invalid_json")
        if not loc and kind in ("model_attributes_type", "model_type", "dict_type"):
            media = (content_type or "").split(";")[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                got = f"Content-Type '{media}'" if media else "no Content-Type"
                return invalid(f"the request body must be JSON sent with Content-Type: application/json, got {got}",
                               code="invalid_json")
            return invalid("the request body must be a JSON object", code="invalid_json")
        where = ".".join(loc) or "body"
        param = param or where
        if kind == "missing" and not loc:
            parts.append("the request body is empty: send a JSON object")
        elif kind == "extra_forbidden":
            parts.append(f"unknown field '{where}'")
        elif kind == "missing":
            parts.append(f"missing required field '{where}'")
        else:
            parts.append(f"'{where}': {str(e.get('msg', 'invalid value')).removeprefix('Value error, ')}")
    for where, members in unions.items():
        param = param or where
        kinds = [_UNION_MEMBERS[m] for m in dict.fromkeys(members)]
        parts.append(f"'{where}' must be {', '.join(kinds[:-1])} or {kinds[-1]}" if len(kinds) > 1 else
                     f"'{where}' must be {kinds[0]}")
    if any(e.get("type") == "extra_forbidden" for e in errors):
        parts.append(f"the accepted fields: {ACCEPTED_FIELDS_DOC}")
    return invalid("; ".join(parts) or "invalid request", param)


# pydantic's names for the members of this module's union fields, as a message says them
_UNION_MEMBERS = {"str": "a string", "list[str]": "a list of strings", "list[int]": "a list of token ids",
                  "list[list[int]]": "a list of token-id lists", "list[TextPart]": "a list of text parts",
                  "dict[str,any]": "an object"}


# Responses. Token strings and bytes come from the tokenizer (``Codec.token_str`` / ``token_bytes``).

def finite(logprob: float) -> float:
    """JSON has no -inf: OpenAI reports impossible tokens as -9999.0."""
    return logprob if math.isfinite(logprob) else -9999.0


def completion_logprobs(steps: list, codec, offsets: list[int]) -> dict[str, Any]:
    """Legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``.

    Args:
        steps: ``StepOutput`` records (``token_id``, ``logprob``, ``top_logprobs`` ``((id, lp), ...)``).
        offsets: per step, the character offset in the completion text where its text starts.
    """
    return {"tokens": [codec.token_str(s.token_id) for s in steps],
            "token_logprobs": [finite(s.logprob) for s in steps],
            "top_logprobs": [{codec.token_str(t): finite(lp) for t, lp in s.top_logprobs} for s in steps],
            "text_offset": list(offsets)}


def chat_logprobs(steps: list, codec) -> dict[str, Any]:
    """Chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``."""
    def entry(token_id: int, lp: float) -> dict[str, Any]:
        raw = codec.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": finite(lp), "bytes": list(raw)}

    return {"content": [entry(s.token_id, s.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in s.top_logprobs]}
                        for s in steps], "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage`` object; ``cached_tokens``: prompt tokens a previous request's state served
    (``prompt_tokens_details``, as OpenAI and vLLM report prefix-cache hits)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` passed as a string)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
