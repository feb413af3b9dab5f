"""The OpenAI-compatible HTTP API on rank 0 (FastAPI + uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE streaming),
``GET /v1/models``, ``GET /v1/models/{model}`` (OpenAI's ``models.retrieve``), ``GET /health``
(503 until every rank has loaded and warmed up), ``GET /metrics`` (Prometheus text,
:mod:`.metrics`), ``GET /openapi.json`` (the schema FastAPI derives from :mod:`.protocol`).
Every error, 404 and 405 included (a 405 names the allowed methods in ``Allow``), has OpenAI's
error body. A client that goes away ends its request, streaming or not: the engine stops
generating for it at the next token.

A request is validated completely (body size, schema, supported options, model name, chat
template, prompt + ``max_tokens`` within the context) before it is queued, so a bad request costs
no engine time and gets a 4xx with OpenAI's error body. A body over ``max_request_bytes`` is a 413
before it is parsed; template rendering and tokenization run in a worker thread, so a long prompt
never stalls the event loop (``/health`` and other requests stay responsive). Good requests join the
engine thread's waiting queue (:mod:`.worker`: a continuous batch of up to ``max_num_seqs``
sequences, admitted in arrival order); past ``max_queue`` waiting requests a new one gets a 429
(OpenAI's error body, ``type: requests``, ``code: rate_limit_exceeded``) with ``Retry-After``.
Handlers await their tokens on an ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardsmith.errors import UsageError
from shardsmith.runtime.serve.chat import ChatTemplate, ChatTemplateError, load_chat_format
from shardsmith.runtime.serve.encoding import MessageEncoding, RemoteCodeError
from shardsmith.runtime.serve.http_limits import DEFAULT_MAX_REQUEST_BYTES, HTTPLimits
from shardsmith.runtime.serve.metrics import Metrics
from shardsmith.runtime.serve.streaming import Reply, chat_response, completion_response
from shardsmith.runtime.serve.reasoning import END as END_THINK
from shardsmith.runtime.serve.reasoning import Reasoning, prompt_opens_thinking
from shardsmith.runtime.serve.structured import Grammars, schema_of
from shardsmith.runtime.serve.tools import (GENERIC, ToolPlan, call_schema, detect_format, history_for_template,
                                            tools_system_text)
from shardsmith.runtime.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, Prepared, invalid,
                                               validation_error)
from shardsmith.runtime.serve.worker import EngineWorker, Job, QueueFull, ServerStopping, State, TextEvent

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Service:
    """Request preparation and execution over one :class:`EngineWorker`.

    ``trust_remote_code`` lets a checkpoint without a chat template render chats with its own
    Python encoder (DeepSeek's ``encoding/``, :mod:`.encoding`).
    """

    def __init__(self, worker: EngineWorker, *, model_name: str, metrics: Metrics, trust_remote_code: bool = False,
                 chat_template: Path | None = None) -> None:
        self.worker, self.model_name, self.metrics = worker, model_name, metrics
        self.trust_remote_code, self.chat_template = trust_remote_code, chat_template
        self.created = int(time.time())
        self._template: ChatTemplate | MessageEncoding | ChatTemplateError | None = None
        self._defaults: dict[str, Any] | None = None
        self._grammars: Grammars | None = None

    def grammars(self, engine) -> Grammars:
        """The structured-output compiler over this model's tokenizer (made on first use)."""
        if self._grammars is None:
            codec = self.worker.codec
            vocab = int(getattr(engine, "vocab_size", 0) or codec.vocab_size)
            self._grammars = Grammars(codec.tokenizer_json(), vocab, codec.eos_token_ids)
        return self._grammars

    def _ready_engine(self):
        state = self.worker.state
        if state is State.LOADING:
            raise APIError(503, "the model is still loading; poll GET /health", type="server_error", code="model_not_ready")
        if state is not State.READY:
            raise APIError(503, f"the engine is not available: {self.worker.error or state.value}",
                           type="server_error", code="engine_unavailable")
        return self.worker.engine

    def _generation_defaults(self, root: Path) -> dict[str, Any]:
        if self._defaults is None:
            cfg: dict = {}
            if (root / "generation_config.json").is_file():
                cfg = json.loads((root / "generation_config.json").read_text(encoding="utf-8"))
            self._defaults = {"temperature": float(cfg.get("temperature", 1.0)) if cfg.get("do_sample", True) else 0.0,
                              "top_p": float(cfg.get("top_p", 1.0)), "top_k": int(cfg.get("top_k", 0) or 0)}
        return self._defaults

    def template(self, root: Path) -> ChatTemplate | MessageEncoding:
        if self._template is None:
            try:
                self._template = load_chat_format(root, trust_remote_code=self.trust_remote_code,
                                                  template_file=self.chat_template)
            except ChatTemplateError as e:
                self._template = e
        if isinstance(self._template, ChatTemplateError):
            code = "trust_remote_code_required" if isinstance(self._template, RemoteCodeError) else "chat_template_missing"
            raise invalid(str(self._template), "messages", code)
        return self._template

    def prepare(self, req: CompletionRequest | ChatCompletionRequest) -> Prepared:
        """Validate ``req`` fully and build the engine request.

        Raises:
            APIError: 400 (invalid or unsupported), 404 (unknown model), 503 (not ready).
        """
        from shardsmith.runtime.engine.engine import SamplingParams

        if req.model != self.model_name:
            raise APIError(404, f"model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        req.check_supported()
        stop = req.stop_list()
        prompt = req.single_prompt() if isinstance(req, CompletionRequest) else None
        engine = self._ready_engine()
        codec = self.worker.codec
        tool_plan = reasoning = None
        if isinstance(req, ChatCompletionRequest):
            template = self.template(engine.root)
            text = render_chat(template, req)
            if (mode := req.tool_mode()) != "none":
                names = frozenset(t["function"]["name"] for t in req.tools)
                source = getattr(template, "text", "")
                fmt = (detect_format(source) or GENERIC) if mode == "auto" else None
                tool_plan = ToolPlan(mode, fmt, names, req.tool_choice)
            if isinstance(template, MessageEncoding) or END_THINK in getattr(template, "text", ""):
                reasoning = Reasoning(prompt_opens_thinking(text))
            prompt_ids, param, max_tokens = codec.encode(text), "messages", req.requested_max_tokens()
            want, top_n = req.logprobs, req.top_logprobs or 0
        else:
            if isinstance(prompt, str):
                prompt_ids = codec.encode_prompt(prompt)  # BOS as the tokenizer adds it
            else:
                prompt_ids = list(prompt)
                vocab = min(codec.vocab_size, getattr(engine, "vocab_size", codec.vocab_size))
                bad = [t for t in prompt_ids if not 0 <= t < vocab]
                if bad:
                    raise invalid(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}", "prompt")
            param, max_tokens = "prompt", req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
            want, top_n = req.logprobs is not None, req.logprobs or 0
        ctx, n_prompt = engine.max_seq_len, len(prompt_ids)
        if n_prompt == 0:
            raise invalid("the prompt is empty after tokenization", param)
        if max_tokens is None:
            max_tokens = ctx - n_prompt
        if n_prompt + max_tokens > ctx or max_tokens < 1:
            raise invalid(f"this model's maximum context length is {ctx} tokens; the request needs "
                          f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} for the completion)",
                          param if n_prompt >= ctx else "max_tokens", "context_length_exceeded")
        d = self._generation_defaults(engine.root)
        vocab = min(codec.vocab_size, getattr(engine, "vocab_size", codec.vocab_size))
        bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab]
        if bad:
            raise invalid(f"'stop_token_ids' must be token ids in [0, {vocab}), got {bad[:5]}", "stop_token_ids")
        stops = tuple(dict.fromkeys([*([] if req.ignore_eos else codec.eos_token_ids), *(req.stop_token_ids or ())]))
        min_tokens = req.min_tokens or 0
        if min_tokens > max_tokens:
            raise invalid(f"'min_tokens' ({min_tokens}) is more than the completion may hold ({max_tokens} tokens)",
                          "min_tokens")
        top_k = d["top_k"] if req.top_k is None else max(req.top_k, 0)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=d["temperature"] if req.temperature is None else req.temperature,
            top_k=top_k, top_p=d["top_p"] if req.top_p is None else req.top_p,
            seed=req.seed, stop_token_ids=stops, logprobs=top_n if want else 0,
            min_p=req.min_p or 0.0, min_tokens=min_tokens,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
            logit_bias=req.bias_pairs(vocab))
        n = req.n or 1
        if n > (cap := self.worker.capacity()):
            raise invalid(f"n={n} choices cannot run at once on this server: it holds {cap} sequences "
                          f"(--max-num-seqs slots plus --max-queue)", "n")
        constraints: tuple[Any, ...] = ()
        schema = schema_of(req.response_format) if isinstance(req, ChatCompletionRequest) else None
        if tool_plan is not None and tool_plan.mode == "forced":
            try:
                schema = call_schema(req.tools, req.tool_choice)
            except KeyError as e:
                raise invalid(f"'tool_choice' names function {e}, which is not among 'tools'", "tool_choice") from None
        if schema is not None:
            grammars = self.grammars(engine)
            try:
                grammar = grammars.compile(schema)
            except ValueError as e:
                raise invalid(str(e), "tools" if tool_plan is not None else "response_format") from None
            constraints = tuple(grammars.matcher(grammar) for _ in range(n))
        # tool markup may be special tokens (DeepSeek's): the text keeps them for the parser
        # the parsers read markup that may be special tokens (DeepSeek's tool calls, <think>): the text keeps them
        skip_special = req.skip_special_tokens and reasoning is None and not (tool_plan is not None and tool_plan.mode == "auto")
        return Prepared(prompt_ids, params, stop, want, n, req.include_stop_str_in_output, skip_special,
                        constraints, tool_plan, reasoning)

    def submit(self, p: Prepared) -> list[Job]:
        """Queue the request's ``n`` choices on the engine thread, all or none (before any response
        byte is sent). Choice i of a seeded request samples with ``seed + i`` (mod 2**64), so the
        choices differ and each is reproducible alone.

        Raises:
            APIError: 429 when ``max_queue`` requests are already waiting (with ``Retry-After``).
        """
        loop, seed = asyncio.get_running_loop(), p.params.seed
        jobs = [Job(p.prompt_ids, p.params if seed is None or i == 0 else dataclasses.replace(p.params, seed=_nth_seed(seed, i)),
                    tuple(p.stop), loop, include_stop=p.include_stop, skip_special_tokens=p.skip_special_tokens,
                    constraint=p.constraints[i] if p.constraints else None)
                for i in range(p.n)]
        try:
            self.worker.submit(*jobs)
        except QueueFull as e:
            raise APIError(429, str(e), type="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from e
        return jobs

    def reply(self, p: Prepared) -> Reply:
        """Submit ``p`` (:meth:`submit`: a 429 here, before any response byte) and return what the
        response body needs of it: a :class:`~shardsmith.runtime.serve.streaming.Reply`, whose
        ``events`` are :meth:`choices` of its jobs.

        Raises:
            APIError: 429 when the waiting queue is full.
        """
        jobs = self.submit(p)
        return Reply(self.model_name, self.worker.codec, self.metrics, p, jobs, self.choices(jobs))

    async def choices(self, jobs: list[Job]) -> AsyncIterator[tuple[int, TextEvent | None]]:
        """``(i, event)`` of the submitted ``jobs`` (choice i) as they arrive, then ``(i, None)`` when
        choice i ends. One choice is read directly (the common case, no task per token); several are
        merged through a queue, one task each. Every job is cancelled when the caller stops reading.

        Raises:
            APIError: any choice's error (:meth:`events`), which ends them all.
        """
        if len(jobs) == 1:
            async for ev in self.events(jobs[0]):
                yield 0, ev
            yield 0, None
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, job: Job) -> None:
            try:
                async for ev in self.events(job):
                    queue.put_nowait((i, ev))
                queue.put_nowait((i, None))
            except APIError as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            left = len(jobs)
            while left:
                i, item = await queue.get()
                if isinstance(item, APIError):
                    raise item
                left -= item is None
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for job in jobs:
                job.cancelled.set()

    async def events(self, job: Job) -> AsyncIterator[TextEvent]:
        """Yield the submitted ``job``'s text events as they arrive."""
        try:
            while (item := await job.events.get()) is not None:
                if isinstance(item, UsageError):
                    raise invalid(f"the engine refused the request: {item}")
                if isinstance(item, ServerStopping):
                    raise APIError(503, str(item), type="server_error", code="server_shutting_down")
                if isinstance(item, Exception):
                    raise APIError(500, str(item), type="server_error", code="engine_failed")
                yield item
        finally:
            job.cancelled.set()  # no-op when done; stops generation when the client went away


def _usage_options(req: CompletionRequest | ChatCompletionRequest) -> dict[str, bool]:
    """A stream's usage: the last chunk's (``include_usage``), and every chunk's running count too
    (``continuous_usage_stats``, which vLLM honours with ``include_usage``)."""
    opts = req.stream_options
    include = bool(opts and opts.include_usage)
    return {"include_usage": include, "continuous_usage": include and bool(opts and opts.continuous_usage_stats)}


def render_chat(template: ChatTemplate | MessageEncoding, req: ChatCompletionRequest) -> str:
    """The prompt text of a chat request: its messages through ``template`` with the request's
    ``chat_template_kwargs`` and ``add_generation_prompt``; with ``continue_final_message`` the text
    ends where the last (assistant) message's content ends, so the model continues it (vLLM's and
    transformers' ``continue_final_message``).

    Raises:
        APIError: 400 when the template refuses the messages or the final message's content cannot be
            found in the rendered text.
    """
    messages = history_for_template([m.for_template() for m in req.messages])
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tool_mode() != "none":
        if "tools" in getattr(template, "text", "tools"):  # the template lists them (DeepSeek's encoder takes them too)
            kwargs["tools"] = req.tools
        else:  # a template with no place for tools: they go in the system message
            note = tools_system_text(req.tools)
            if messages[0]["role"] == "system":
                messages[0] = messages[0] | {"content": messages[0]["content"] + "\n\n" + note}
            else:
                messages.insert(0, {"role": "system", "content": note})
    try:
        text = template.render(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
    except ChatTemplateError as e:
        raise invalid(str(e), "messages") from e
    if req.continue_final_message:
        final = messages[-1]["content"].strip()
        at = text.rfind(final) if final else -1
        if at < 0:
            raise invalid("'continue_final_message': the chat template does not show the final message's content "
                          "verbatim, so the prompt cannot end inside it", "continue_final_message")
        text = text[:at + len(final)]
    return text


def _nth_seed(seed: int, i: int) -> int:
    """Choice i's seed: ``seed + i``, wrapped into the range requests take (``[-2**63, 2**64)``)."""
    return seed + i - 2**64 if seed + i >= 2**64 else seed + i


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote what the client sent, and that must never
    fail to encode (a lone surrogate)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(request: Request, metrics: Metrics, err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    if request.url.path.startswith("/v1/") and request.method == "POST":
        metrics.request_done(request.url.path, err.status)
    if err.status >= 500 and err.status != 503:
        log.error("%s %s: %s", request.method, request.url.path, err.message)
    return ErrorResponse(err.body(), status_code=err.status, headers=headers)


def _openapi(app: FastAPI, model_name: str) -> dict[str, Any]:
    """FastAPI's schema with ``model`` (request field and ``/v1/models/{model}``) an enum of the one
    model served, so that clients and fuzzers know the one id that is not a 404."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            schema["components"]["schemas"][name]["properties"]["model"]["enum"] = [model_name]
        for param in schema["paths"]["/v1/models/{model}"]["get"].get("parameters", []):
            if param.get("name") == "model":
                param["schema"]["enum"] = [model_name]
        app.openapi_schema = schema
    return app.openapi_schema


class HeadAsGet:
    """ASGI middleware: ``HEAD`` is answered wherever ``GET`` is, with ``GET``'s status and headers
    and no body (RFC 9110 9.3.2; FastAPI's routes take only the methods they name)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app(dict(scope, method="GET"), receive, headers_only)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets a 413 before the app parses it.

    A declared ``Content-Length`` over the limit is refused without reading the body; otherwise
    the body is read (counting, so a chunked upload cannot exceed the limit either) and replayed
    to the app, after which ``receive`` is the server's again (disconnects still reach streams).
    """

    def __init__(self, app, *, limit: int, metrics: Metrics) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, receive, send, int(declared))
        chunks, size, message = [], 0, {"type": "http.request", "body": b"", "more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._reject(scope, receive, send, None)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope, receive, send, declared: int | None) -> None:
        size = f"is {declared} bytes" if declared is not None else f"exceeds {self.limit} bytes"
        err = APIError(413, f"the request body {size}; this server accepts at most {self.limit} bytes "
                            f"(shardsmith serve --max-request-bytes)", code="request_too_large")
        await _error_response(Request(scope), self.metrics, err)(scope, receive, send)


def create_app(worker: EngineWorker, *, model_name: str, metrics: Metrics, trust_remote_code: bool = False,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_model_len: int | None = None,
               chat_template: Path | None = None) -> FastAPI:
    """The FastAPI app over ``worker``; ``model_name`` is the id clients must send as ``model``;
    ``trust_remote_code``: see :class:`Service`; ``max_request_bytes``: see :class:`BodyLimit`;
    ``max_model_len``: the configured context per sequence, which ``/v1/models`` shows while loading;
    ``chat_template``: a Jinja template file used instead of the pack's."""

    app = FastAPI(title="shardsmith", summary="OpenAI-compatible completions and chat completions over a TP pack",
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    svc = Service(worker, model_name=model_name, metrics=metrics, trust_remote_code=trust_remote_code,
                  chat_template=chat_template)
    app.state.service = svc
    app.openapi = lambda: _openapi(app, model_name)
    app.add_middleware(BodyLimit, limit=max_request_bytes, metrics=metrics)
    app.add_middleware(HeadAsGet)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(request, metrics, e, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return _error_response(request, metrics, validation_error(list(e.errors()),
                                                                  content_type=request.headers.get("content-type")))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(request, metrics, APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind),
                               headers=getattr(e, "headers", None))  # 405: Allow

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await completion_response(svc.reply(await run_in_threadpool(svc.prepare, req)), stream=req.stream,
                                         **_usage_options(req), request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await chat_response(svc.reply(await run_in_threadpool(svc.prepare, req)), stream=req.stream,
                                   **_usage_options(req), request=request)

    def card() -> dict[str, Any]:
        engine = worker.engine if worker.state is State.READY else None
        out = {"id": model_name, "object": "model", "created": svc.created, "owned_by": "shardsmith"}
        if engine is not None or max_model_len is not None:
            out["max_model_len"] = engine.max_seq_len if engine is not None else max_model_len
        return out

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if model != model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return card()

    @app.get("/health")
    async def health():
        if worker.state is State.READY:
            return {"status": "ready"}
        body = {"status": worker.state.value} | ({"error": worker.error} if worker.error else {})
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app



def run_server(job: Any, worker: EngineWorker, metrics: Metrics, failed: threading.Event, holder: dict[str, Any]) -> int:
    """Serve ``job`` (a :class:`~.serve_job.ServeJob`, which calls this once its ``worker`` has started
    to load the engine) until SIGINT/SIGTERM or an engine failure; return the exit code (0 clean or
    stopped by SIGTERM, 130 stopped by SIGINT, 1 failed).

    ``failed`` is set, and ``holder["server"]`` (the uvicorn server, put there here) told to exit, by
    the worker's ``on_fatal``; a failure before the server exists stops it as soon as it starts.

    A signal ends every request at once (:meth:`EngineWorker.interrupt`: streams get a last
    error event, then ``[DONE]``), then uvicorn stops and the engine shuts down, releasing the
    other ranks. A signal while the engine is still loading returns at once: the caller exits
    the process under the load.

    Raises:
        Exception: what the engine's load raised, once the HTTP server is down (the launcher
            reports it once; a damaged pack's ``IntegrityError`` exits 2, as ``verify``).
    """
    import signal

    app = create_app(worker, model_name=job.model_name, metrics=metrics, trust_remote_code=job.trust_remote_code,
                     max_request_bytes=job.max_request_bytes, max_model_len=job.max_model_len,
                     chat_template=job.chat_template)
    server = _server(app, host=job.host, port=job.port, worker=worker, limits=job.limits)
    holder["server"] = server
    if failed.is_set():  # the load failed while the app was built: start, and stop at once
        server.should_exit = True
    # Before uvicorn captures the signals, and after it re-raises them on its way out: the same stop.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    log.info("serving %s on http://%s:%d (ready once every rank has loaded and warmed up)",
             job.model_name, job.host, job.port)
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits when it cannot bind
        log.error("HTTP server failed to start on %s:%d (exit %s)", job.host, job.port, e.code)
        failed.set()
    stopped_by = server.stopped_by
    if stopped_by is not None and worker.state is State.LOADING:
        log.info("stopped while loading (%s)", signal.Signals(stopped_by).name)
        return 128 + signal.SIGINT if stopped_by == signal.SIGINT else 0
    if not failed.is_set() and not worker.stop(timeout=15.0):
        log.error("engine did not shut down within 15 s")
        return 1
    log.info("server stopped")
    if failed.is_set() and worker.load_error is not None:
        raise worker.load_error  # reported once by the launcher; its class sets the exit code (2: a damaged pack)
    return 1 if failed.is_set() else 128 + signal.SIGINT if stopped_by == signal.SIGINT else 0


def _server(app: FastAPI, *, host: str, port: int, worker: EngineWorker, limits: HTTPLimits):
    """A ``uvicorn.Server`` whose signal handling first ends every request (:meth:`EngineWorker.interrupt`),
    so its graceful shutdown finds no open stream to wait for and cancel; its connections keep ``limits``."""
    import signal

    import uvicorn

    from shardsmith.runtime.serve.http_limits import limited_protocol

    class Server(uvicorn.Server):
        stopped_by: int | None = None

        def handle_exit(self, sig: int, frame) -> None:
            if self.stopped_by is None:
                self.stopped_by = sig
                why = f"the server is shutting down ({signal.Signals(sig).name})"
                # a thread, not this handler: interrupt() takes locks the interrupted code may hold
                threading.Thread(target=worker.interrupt, args=(why,), name="shardsmith-interrupt", daemon=True).start()
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                                 timeout_graceful_shutdown=5, lifespan="off", http=limited_protocol(limits),
                                 timeout_keep_alive=limits.keep_alive_s))
