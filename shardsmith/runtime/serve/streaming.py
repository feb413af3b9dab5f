"""Response bodies for the two generation endpoints: one JSON object, or SSE chunks.

Shapes follow the OpenAI API reference. Streaming sends ``data: {json}\\n\\n`` events and a final
``data: [DONE]``; with ``stream_options.include_usage`` every chunk carries ``"usage": null`` and a
last chunk with empty ``choices`` carries the counts. An engine failure after the stream started
is sent as an ``{"error": ...}`` event before ``[DONE]`` (the status line is already out).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from shardsmith.runtime.serve.protocol import SSE_DONE, APIError, chat_logprobs, completion_logprobs, sse, usage

CLIENT_CLOSED = 499  # nginx's code for a client that went away mid-response; used in metrics only


def _gone(svc, path: str) -> Response:
    """The client went away: count it; the response goes nowhere."""
    svc.metrics.request_done(path, CLIENT_CLOSED)
    return Response(status_code=CLIENT_CLOSED)


async def _collect(events: AsyncIterator) -> tuple[str, list, list[int], str | None]:
    text, steps, offsets, finish = "", [], [], None
    async for ev in events:
        offsets.append(len(text))
        text += ev.text
        steps.append(ev.step)
        finish = ev.finish_reason
    return text, steps, offsets, finish


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


def _sse_response(svc, path: str, chunks: Callable[[], AsyncIterator[dict[str, Any]]], job) -> StreamingResponse:
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
            svc.metrics.request_done(path, status)

    # the job ends with the response, even one whose client left before its first byte (body never ran)
    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(job.cancelled.set),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def completion_response(svc, p, *, stream: bool, include_usage: bool, request=None):
    """``/v1/completions`` body for the prepared request ``p`` (a dict, or a streaming response);
    ``request``: the HTTP request, watched for a disconnect (:func:`until_disconnected`)."""
    path, codec, n_prompt = "/v1/completions", svc.worker.codec, len(p.prompt_ids)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": svc.model_name}
    job = svc.submit(p)  # a 429 here, before any byte is sent
    if not stream:
        if (got := await until_disconnected(request, _collect(svc.events(job)))) is None:
            job.cancelled.set()
            return _gone(svc, path)
        text, steps, offsets, finish = got
        svc.metrics.request_done(path, 200)
        lp = completion_logprobs(steps, codec, offsets) if p.want_logprobs else None
        return head | {"choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
                       "usage": usage(n_prompt, len(steps))}

    extra = {"usage": None} if include_usage else {}

    async def chunks():
        n, offset = 0, 0
        async for ev in svc.events(job):
            n += 1
            if not ev.text and ev.finish_reason is None and not p.want_logprobs:
                continue
            lp = completion_logprobs([ev.step], codec, [offset]) if p.want_logprobs else None
            offset += len(ev.text)
            yield head | {"choices": [{"index": 0, "text": ev.text, "logprobs": lp,
                                       "finish_reason": ev.finish_reason}]} | extra
        if include_usage:
            yield head | {"choices": [], "usage": usage(n_prompt, n)}

    return _sse_response(svc, path, chunks, job)


async def chat_response(svc, p, *, stream: bool, include_usage: bool, request=None):
    """``/v1/chat/completions`` body for the prepared request ``p``; ``request`` as in :func:`completion_response`."""
    path, codec, n_prompt = "/v1/chat/completions", svc.worker.codec, len(p.prompt_ids)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": svc.model_name}
    job = svc.submit(p)  # a 429 here, before any byte is sent
    if not stream:
        if (got := await until_disconnected(request, _collect(svc.events(job)))) is None:
            job.cancelled.set()
            return _gone(svc, path)
        text, steps, _, finish = got
        svc.metrics.request_done(path, 200)
        return head | {"object": "chat.completion",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                    "logprobs": chat_logprobs(steps, codec) if p.want_logprobs else None,
                                    "finish_reason": finish}],
                       "usage": usage(n_prompt, len(steps))}

    head = head | {"object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, *, logprobs=None, finish=None) -> dict[str, Any]:
        return head | {"choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]} | extra

    async def chunks():
        yield chunk({"role": "assistant", "content": ""})
        n, finish = 0, None
        async for ev in svc.events(job):
            n += 1
            finish = ev.finish_reason
            if ev.text or p.want_logprobs:
                yield chunk({"content": ev.text}, logprobs=chat_logprobs([ev.step], codec) if p.want_logprobs else None)
        yield chunk({}, finish=finish or "length")
        if include_usage:
            yield head | {"choices": [], "usage": usage(n_prompt, n)}

    return _sse_response(svc, path, chunks, job)
