"""The engine thread: load, warm up, then serve requests one at a time, feeding text back to asyncio.

The engine is driven by exactly one thread (load, warm-up, every ``generate``, shutdown), so the
collectives rank 0 issues are totally ordered and the other ranks, in ``Engine.follow()``, see
the same sequence. HTTP handlers submit a :class:`Job`; the thread runs jobs in arrival order and
pushes :class:`TextEvent` items into the job's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``, so the event loop never blocks on the engine.

A request the engine refuses up front (``UsageError``: nothing was broadcast yet) fails alone.
Any other exception from the engine (a rank died: gloo/NCCL report a closed peer) is fatal: the job and every queued job get a 500, ``/health`` turns 503, and ``on_fatal`` stops the
server, so the launcher exits non-zero instead of hanging.

Stopping (SIGINT/SIGTERM): :meth:`EngineWorker.interrupt` ends the running job at its next token
and every queued one with :class:`ServerStopping` (streams send it as their last event), so the
HTTP server's graceful shutdown has nothing left to wait for. A load still running when the stop
comes is not waited for (the process exits under it) and never reports "ready".
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from shardsmith.errors import RankLostError, UsageError
from shardsmith.runtime.serve.metrics import Metrics
from shardsmith.runtime.serve.tokenizer import Codec, IncrementalDetokenizer, StopStrings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TextEvent:
    """Text released by one engine step.

    Attributes:
        text: new output text (may be "" while a character or a possible stop string is held).
        step: the engine's ``StepOutput`` for this token (token id, logprob, top logprobs).
        finish_reason: ``"stop"`` or ``"length"`` on the last event, else None.
    """

    text: str
    step: Any
    finish_reason: str | None = None


def stream_text(steps: Iterable, codec: Codec, prompt_ids: list[int], *, stop: Iterable[str] = (),
                eos_token_ids: Iterable[int] = ()) -> Iterator[TextEvent]:
    """Turn engine steps into text events: incremental detokenization, EOS, stop strings.

    The text never runs past a stop string (the stop string itself is not returned, as in
    OpenAI's API); an EOS token adds no text. When a stop string ends the text early the engine's
    step iterator is closed, which ends its generation.

    Args:
        steps: the engine's ``StepOutput`` iterator (``token_id``, ``finished``, ``finish_reason``).
        codec: the tokenizer.
        prompt_ids: the prompt (seeds the detokenizer window).
        stop: stop strings.
        eos_token_ids: ids whose text is not output.
    """
    detok = IncrementalDetokenizer(codec, prompt_ids)
    stops = StopStrings(list(stop))
    eos = frozenset(eos_token_ids)
    try:
        for step in steps:
            finished = bool(step.finished)
            piece = "" if (finished and step.token_id in eos) else detok.push(step.token_id)
            if finished:
                piece += detok.flush()
            text, stopped = stops.push(piece)
            if stopped:
                yield TextEvent(text, step, "stop")
                return
            if finished:
                yield TextEvent(text + stops.flush(), step, step.finish_reason or "length")
                return
            yield TextEvent(text, step)
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()


class ServerStopping(Exception):
    """The server is stopping (a signal): the request ends now, with this message."""


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(eq=False)
class Job:
    """One request for the engine thread.

    Attributes:
        prompt_ids: prompt token ids.
        params: the engine's ``SamplingParams``.
        stop: stop strings.
        loop: the event loop whose ``events`` queue receives :class:`TextEvent`, then ``None``
            (done) or an ``Exception`` (failed).
        cancelled: set by the handler when the client went away; generation stops at the next token.
    """

    prompt_ids: list[int]
    params: Any
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)

    def emit(self, item: TextEvent | Exception | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # loop closed: the server is gone
            pass


class EngineWorker:
    """Owns the engine on one thread.

    Attributes:
        state: loading, ready, failed or stopped.
        engine: the engine once loaded; ``codec``: its tokenizer (from ``engine.root``).
        error: why the engine failed, if it did.

    Args:
        load: builds the engine (``Engine.load(...)``); runs on the worker thread.
        metrics: updated with load time, readiness and per-token latencies.
        on_fatal: called once, with a message, when the engine fails (load error or dead rank).
    """

    def __init__(self, load: Callable[[], Any], *, metrics: Metrics, on_fatal: Callable[[str], None]) -> None:
        self._load = load
        self.metrics = metrics
        self._on_fatal = on_fatal
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="shardsmith-engine", daemon=True)
        self._started = time.perf_counter()
        self.state = State.LOADING
        self.error: str | None = None
        self.engine: Any = None
        self.codec: Codec | None = None
        self.stopping: str | None = None  # why, once interrupt() was called
        self._current: Job | None = None

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` behind the running one (FIFO)."""
        self.metrics.queued(+1)
        self._jobs.put(job)

    def interrupt(self, message: str) -> None:
        """End the running job (at its next token) and every queued one with :class:`ServerStopping`;
        refuse jobs submitted later. Any thread; not from a signal handler (it takes the queue's lock)."""
        self.stopping = message
        job = self._current
        if job is not None:
            job.cancelled.set()
            job.emit(ServerStopping(message))
        self._drain(message, stopping=True)

    def stop(self, timeout: float = 30.0) -> bool:
        """Finish the running job, shut the engine down (followers exit), join. False on timeout."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _fail(self, message: str) -> None:
        self.error = message
        self.state = State.FAILED
        self.metrics.set_ready(False)
        log.error(message)
        self._on_fatal(message)

    def _run(self) -> None:
        try:
            self.engine = self._load()
            self.codec = Codec(self.engine.root)
            self.engine.warmup()
            offload = getattr(self.engine, "offload", None)
            if offload is not None:
                self.metrics.offload = offload
                log.info("%s", offload.ready_line())
        except Exception as e:  # noqa: BLE001 - any load failure ends the server with its reason
            log.debug("engine load failed", exc_info=True)
            if self.stopping is not None:  # a rank went down with the stop: not a failure to report
                self.state = State.STOPPED
                return
            self._fail(f"engine failed to load: {type(e).__name__}: {e}")
            self._drain(f"engine failed to load: {e}")
            return
        if self.stopping is not None:  # stopped while loading: release the followers, never say "ready"
            self._shutdown()
            self._drain(self.stopping, stopping=True)
            return
        self.state = State.READY
        self.metrics.set_ready(True, load_seconds=float(getattr(self.engine, "load_seconds", 0.0)),
                               ready_seconds=time.perf_counter() - self._started)
        log.info("ready: every rank loaded and warmed up in %.1f s", time.perf_counter() - self._started)
        while (job := self._jobs.get()) is not None:
            if self.stopping is not None:
                self._reject(job, self.stopping, stopping=True)
            elif self.state is not State.READY:
                self._reject(job, self.error or "engine is not ready")
            else:
                self._serve(job)
        if self.state is State.READY:
            self._shutdown()

    def _shutdown(self) -> None:
        self.state = State.STOPPED
        self.metrics.set_ready(False)
        try:
            self.engine.shutdown()
        except RankLostError as e:
            if self.stopping is None:
                log.error("engine shutdown failed: %s", e)
            else:  # a signal to the whole process group stopped the other ranks first: nothing to release
                log.info("the other ranks stopped before the engine's shutdown reached them")
        except Exception as e:  # noqa: BLE001
            log.error("engine shutdown failed: %s: %s", type(e).__name__, e)

    def _reject(self, job: Job, message: str, *, stopping: bool = False) -> None:
        self.metrics.queued(-1)
        job.emit(ServerStopping(message) if stopping else RuntimeError(message))

    def _drain(self, message: str, *, stopping: bool = False) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:  # stop() was called: keep its sentinel for the engine thread
                self._jobs.put(None)
                return
            self._reject(job, message, stopping=stopping)

    def _serve(self, job: Job) -> None:
        m = self.metrics
        m.started(len(job.prompt_ids))
        last = job.arrival
        self._current = job
        try:
            if self.stopping is not None:  # interrupt() may have looked before _current was set
                job.emit(ServerStopping(self.stopping))
                return
            if job.cancelled.is_set():
                return
            steps = self.engine.generate(job.prompt_ids, job.params)
            for n, ev in enumerate(stream_text(steps, self.codec, job.prompt_ids, stop=job.stop,
                                               eos_token_ids=job.params.stop_token_ids)):
                now = time.perf_counter()
                m.token(first=n == 0, since=now - last)
                last = now
                job.emit(ev)
                if job.cancelled.is_set():
                    break
        except UsageError as e:  # refused before any step was broadcast: the engine is still in step
            job.emit(e)
            return
        except Exception as e:  # noqa: BLE001 - a failed step means a rank is gone or the engine broke
            log.debug("engine step failed", exc_info=True)
            if self.stopping is not None:  # the stop's signal reached the other ranks too (a process group)
                job.emit(ServerStopping(self.stopping))
                self.state = State.STOPPED
                self._drain(self.stopping, stopping=True)
                return
            job.emit(RuntimeError(f"engine failed: {type(e).__name__}: {e}"))
            self._fail(f"engine failed during generation ({type(e).__name__}: {e}); "
                       f"a rank has probably died; stopping the server")
            self._drain("engine failed; the server is stopping")
            return
        finally:
            self._current = None
            m.finished(time.perf_counter() - job.arrival)
        job.emit(None)
