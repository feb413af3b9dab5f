"""Response bodies for the two generation endpoints: one JSON object, or SSE chunks.

Shapes follow the OpenAI API reference. Streaming sends ``data: {json}\\n\\n`` events and a final
``data: [DONE]``; with ``stream_options.include_usage`` every chunk carries ``"usage": null`` (with
``continuous_usage_stats`` too: the counts so far) and a last chunk with empty ``choices`` carries
the counts. An engine failure after the stream started
is sent as an ``{"error": ...}`` event before ``[DONE]`` (the status line is already out).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from shardsmith.runtime.serve.metrics import Metrics
from shardsmith.runtime.serve.protocol import (SSE_DONE, APIError, Prepared, chat_logprobs, completion_logprobs, sse,
                                               usage)
from shardsmith.runtime.serve.tokenizer import Codec
from shardsmith.runtime.serve.worker import Job, TextEvent

CLIENT_CLOSED = 499  # nginx's code for a client that went away mid-response; used in metrics only


@dataclass(frozen=True, slots=True)
class Reply:
    """A submitted request, all a response body needs of it (built by ``Service.reply``).

    Attributes:
        model_name: the id responses carry; codec: the tokenizer (logprobs' token strings);
        metrics: where the request's status is counted; prepared: the validated request;
        jobs: its ``prepared.n`` engine jobs (cancelled when the response ends);
        events: ``(choice, event)`` as they arrive, ``(choice, None)`` when a choice ends.
    """

    model_name: str
    codec: Codec
    metrics: Metrics
    prepared: Prepared
    jobs: list[Job]
    events: AsyncIterator[tuple[int, TextEvent | None]]

    def cached_tokens(self) -> int:
        """Prompt tokens its first choice took from a slot's earlier state (0 before admission)."""
        seq = self.jobs[0].seq if self.jobs else None
        return int(getattr(seq, "reused", 0) or 0)


def _gone(r: Reply, path: str) -> Response:
    """The client went away: count it; the response goes nowhere."""
    r.metrics.request_done(path, CLIENT_CLOSED)
    return Response(status_code=CLIENT_CLOSED)


async def _collect(choices: AsyncIterator, n: int) -> list[tuple[str, list, list[int], str | None]]:
    """Each of the ``n`` choices' ``(text, steps, offsets, finish_reason)`` from ``Service.choices``."""
    out = [("", [], [], None) for _ in range(n)]
    async for i, ev in choices:
        if ev is None:
            continue
        text, steps, offsets, _ = out[i]
        offsets.append(len(text))
        steps.append(ev.step)
        out[i] = (text + ev.text, steps, offsets, ev.finish_reason)
    return out


async def until_disconnected(request, work: Awaitable):
    """``await work``, cancelled when the client disconnects first (then None).

    Starlette notices a disconnect only while it streams; a JSON response is written at the end,
    so without this a request whose client gave up would hold the engine until it finished. The
    request body is already read: the next ASGI message is ``http.disconnect``.
    """
    task = asyncio.ensure_future(work)
    if request is None:
        return await task

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()  # the engine job sees it through Service.events' finally (Job.cancelled)
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


def _cancel(jobs) -> Callable[[], None]:
    def cancel() -> None:
        for job in jobs:
            job.cancelled.set()
    return cancel


def _sse_response(r: Reply, path: str, chunks: Callable[[], AsyncIterator[dict[str, Any]]]) -> StreamingResponse:
    async def body():
        status = CLIENT_CLOSED
        try:
            try:
                async for obj in chunks():
                    yield sse(obj)
                status = 200
            except APIError as e:
                status = e.status
                yield sse(e.body())
            yield SSE_DONE
        finally:
            r.metrics.request_done(path, status)

    # the jobs end with the response, even one whose client left before its first byte (body never ran)
    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(_cancel(r.jobs)),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def completion_response(r: Reply, *, stream: bool, include_usage: bool, continuous_usage: bool = False,
                              request=None):
    """``/v1/completions`` body for the submitted request ``r`` (a dict, or a streaming response) with
    its ``n`` choices (``index`` 0..n-1); ``request``: the HTTP request, watched for a disconnect
    (:func:`until_disconnected`); ``continuous_usage``: every chunk carries the usage so far."""
    p, codec = r.prepared, r.codec
    path, n_prompt = "/v1/completions", len(p.prompt_ids)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": r.model_name}
    if not stream:
        if (got := await until_disconnected(request, _collect(r.events, p.n))) is None:
            _cancel(r.jobs)()
            return _gone(r, path)
        r.metrics.request_done(path, 200)
        choices = [{"index": i, "text": text, "logprobs": completion_logprobs(steps, codec, offsets) if p.want_logprobs
                    else None, "finish_reason": finish} for i, (text, steps, offsets, finish) in enumerate(got)]
        return head | {"choices": choices, "usage": usage(n_prompt, sum(len(c[1]) for c in got), r.cached_tokens())}

    def extra(n: int) -> dict[str, Any]:
        return {"usage": usage(n_prompt, n, r.cached_tokens()) if continuous_usage else None} if include_usage else {}

    async def chunks():
        n, offset = 0, [0] * p.n
        async for i, ev in r.events:
            if ev is None:
                continue
            n += 1
            if not ev.text and ev.finish_reason is None and not p.want_logprobs:
                continue
            lp = completion_logprobs([ev.step], codec, [offset[i]]) if p.want_logprobs else None
            offset[i] += len(ev.text)
            yield head | {"choices": [{"index": i, "text": ev.text, "logprobs": lp,
                                       "finish_reason": ev.finish_reason}]} | extra(n)
        if include_usage:
            yield head | {"choices": [], "usage": usage(n_prompt, n, r.cached_tokens())}

    return _sse_response(r, path, chunks)


async def chat_response(r: Reply, *, stream: bool, include_usage: bool, continuous_usage: bool = False, request=None):
    """``/v1/chat/completions`` body for the submitted request ``r`` (its ``n`` choices); ``request`` as
    in :func:`completion_response`."""
    p, codec = r.prepared, r.codec
    path, n_prompt = "/v1/chat/completions", len(p.prompt_ids)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": r.model_name}
    if not stream:
        if (got := await until_disconnected(request, _collect(r.events, p.n))) is None:
            _cancel(r.jobs)()
            return _gone(r, path)
        r.metrics.request_done(path, 200)
        choices = []
        for i, (text, steps, _, finish) in enumerate(got):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if p.reasoning is not None:
                message["reasoning_content"], text = p.reasoning.split(text)
                message["content"] = text
            if p.tools is not None:
                message["content"], calls = p.tools.split(text)
                if calls:
                    message["tool_calls"] = [c.openai() for c in calls]
                    finish = "tool_calls"
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": chat_logprobs(steps, codec) if p.want_logprobs else None})
        return head | {"object": "chat.completion", "choices": choices,
                       "usage": usage(n_prompt, sum(len(c[1]) for c in got), r.cached_tokens())}

    head = head | {"object": "chat.completion.chunk"}

    def chunk(i: int, delta: dict, n: int, *, logprobs=None, finish=None) -> dict[str, Any]:
        extra = {"usage": usage(n_prompt, n, r.cached_tokens()) if continuous_usage else None} if include_usage else {}
        return head | {"choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]} | extra

    async def chunks():
        for i in range(p.n):
            yield chunk(i, {"role": "assistant", "content": ""}, 0)
        n, finish = 0, [None] * p.n
        calls = [p.tools.stream() if p.tools is not None else None for _ in range(p.n)]  # held-back tool markup
        thoughts = [p.reasoning.stream() if p.reasoning is not None else None for _ in range(p.n)]
        async for i, ev in r.events:
            if ev is None:  # choice i ended
                reasoning, text = thoughts[i].finish() if thoughts[i] is not None else ("", "")
                if calls[i] is not None:
                    text = calls[i].push(text)
                    rest, made = calls[i].finish()
                    text += rest
                if reasoning:
                    yield chunk(i, {"reasoning_content": reasoning}, n)
                if text:
                    yield chunk(i, {"content": text}, n)
                if calls[i] is not None and made:
                    yield chunk(i, {"tool_calls": [c.openai(index=k) for k, c in enumerate(made)]}, n)
                    finish[i] = "tool_calls"
                yield chunk(i, {}, n, finish=finish[i] or "length")
                continue
            n += 1
            finish[i] = ev.finish_reason
            reasoning, text = thoughts[i].push(ev.text) if thoughts[i] is not None else ("", ev.text)
            if calls[i] is not None:
                text = calls[i].push(text)
            lp = chat_logprobs([ev.step], codec) if p.want_logprobs else None
            if reasoning:
                yield chunk(i, {"reasoning_content": reasoning}, n, logprobs=None if text else lp)
            if text or (p.want_logprobs and not reasoning):
                yield chunk(i, {"content": text}, n, logprobs=lp)
        if include_usage:
            yield head | {"choices": [], "usage": usage(n_prompt, n, r.cached_tokens())}

    return _sse_response(r, path, chunks)
