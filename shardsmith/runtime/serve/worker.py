"""The engine thread: load, warm up, then serve every request through one continuous batch.

The engine is driven by exactly one thread (load, warm-up, every step, shutdown), so the
collectives rank 0 issues are totally ordered and the other ranks, in ``Engine.follow()``, see
the same sequence. HTTP handlers :meth:`EngineWorker.submit` a :class:`Job` into a bounded waiting
queue (``max_queue``; past it :class:`QueueFull`, a 429); the thread loops over engine steps
(:class:`~shardsmith.runtime.engine.scheduler.Scheduler`): before each step it admits waiting jobs
into free slots (FIFO) and drops jobs whose client went away (their slots are free at once);
each step advances every running sequence by one token (a new one's prompt in chunks of
``prefill_chunk`` tokens) and pushes :class:`TextEvent` items into each job's ``asyncio.Queue``
with ``loop.call_soon_threadsafe``, so the event loop never blocks on the engine. Each job's text
side is a push-style :class:`TextStream` (incremental detokenizer, EOS, stop strings).

A request the engine refuses up front (``UsageError``: nothing was broadcast yet) fails alone.
Any other exception from the engine (a rank died: gloo/NCCL report a closed peer) is fatal: every
running and queued job gets a 500, ``/health`` turns 503, and ``on_fatal`` stops the server, so
the launcher exits non-zero instead of hanging.

Stopping (SIGINT/SIGTERM): :meth:`EngineWorker.interrupt` ends every running job (at the next
step boundary) and every queued one with :class:`ServerStopping` (streams send it as their last
event), so the HTTP server's graceful shutdown has nothing left to wait for. A load still running
when the stop comes is not waited for (the process exits under it) and never reports "ready".
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from shardsmith import settings
from shardsmith.errors import RankLostError, UsageError
from shardsmith.runtime.engine.engine import Engine
from shardsmith.runtime.engine.scheduler import Scheduler, Sequence, verify_rows
from shardsmith.runtime.serve.http_limits import DEFAULT_MAX_QUEUE
from shardsmith.runtime.serve.metrics import Metrics
from shardsmith.runtime.serve.startup import CLOCK
from shardsmith.runtime.serve.step_trace import open_step_trace
from shardsmith.runtime.serve.tokenizer import Codec, IncrementalDetokenizer, StopStrings

log = logging.getLogger(__name__)

BUILD_STOP_TIMEOUT_S = 300.0  # how long a stop waits for a deferred decode bucket being built (EngineWorker.stop)


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


class TextStream:
    """One sequence's text side, push-style: a step in, a :class:`TextEvent` out.

    Incremental detokenization, EOS, stop strings: the text never runs past a stop string (the stop
    string itself is not returned, as in OpenAI's API); an EOS token adds no text. The event with a
    ``finish_reason`` is the last; after a stop string the caller ends the sequence.

    Args:
        codec: the tokenizer; prompt_ids: the prompt (seeds the detokenizer window);
        stop: stop strings; eos_token_ids: ids whose text is not output when they end the text;
        include_stop: the stop string or stop token's text is output too;
        skip_special_tokens: special tokens decode to no text.
    """

    def __init__(self, codec: Codec, prompt_ids: list[int], *, stop: Iterable[str] = (),
                 eos_token_ids: Iterable[int] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(codec, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._stops = StopStrings(list(stop), include=include_stop)
        self._eos = frozenset() if include_stop else frozenset(eos_token_ids)

    def push(self, step: Any) -> TextEvent:
        """The text event of ``step`` (``token_id``, ``finished``, ``finish_reason``)."""
        finished = bool(step.finished)
        piece = "" if (finished and step.token_id in self._eos) else self._detok.push(step.token_id)
        if finished:
            piece += self._detok.flush()
        text, stopped = self._stops.push(piece)
        if stopped:
            return TextEvent(text, step, "stop")
        if finished:
            return TextEvent(text + self._stops.flush(), step, step.finish_reason or "length")
        return TextEvent(text, step)


def stream_text(steps: Iterable, codec: Codec, prompt_ids: list[int], *, stop: Iterable[str] = (),
                eos_token_ids: Iterable[int] = ()) -> Iterator[TextEvent]:
    """:class:`TextStream` over a step iterator (``Engine.generate``), pull-style; when a stop string
    ends the text early the step iterator is closed, which ends its generation."""
    text = TextStream(codec, prompt_ids, stop=stop, eos_token_ids=eos_token_ids)
    try:
        for step in steps:
            ev = text.push(step)
            yield ev
            if ev.finish_reason is not None:
                return
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()


class ServerStopping(Exception):
    """The server is stopping (a signal): the request ends now, with this message."""


class QueueFull(Exception):
    """The waiting queue is full (``max_queue``): the request is refused now (HTTP 429).

    Attributes:
        retry_after: seconds after which a retry may find room (a whole number, at least 1).
    """

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


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
        cancelled: set by the handler when the client went away; the sequence leaves at the next
            step boundary and its slot is freed.
        arrival: perf_counter at submit; tokens: tokens sent so far; last: when the last one was.
        include_stop, skip_special_tokens: the text side's options (:class:`TextStream`).
    """

    prompt_ids: list[int]
    params: Any
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    last: float = 0.0
    text: TextStream | None = None
    seq: Any = None
    include_stop: bool = False
    skip_special_tokens: bool = True
    constraint: Any = None  # its grammar's TokenConstraint (structured output), or None

    def emit(self, item: TextEvent | Exception | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # loop closed: the server is gone
            pass


def _put_all(items: list[tuple[asyncio.Queue, TextEvent]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def emit_all(pairs: list[tuple[Job, TextEvent]]) -> None:
    """Deliver one step's events with one ``call_soon_threadsafe`` per event loop (one wake-up of
    the loop per step, not one per sequence), in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for job, ev in pairs:
        by_loop.setdefault(job.loop, []).append((job.events, ev))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # loop closed: the server is gone
            pass


def set_switch_interval() -> float:
    """Apply ``SHARDSMITH_TUNING=switch_interval_ms`` (milliseconds, > 0) as the interpreter's thread
    switch interval (``sys.setswitchinterval``) and return the interval in force, in seconds.

    The engine thread holds the GIL only between device waits; when a step's result is ready while
    the event loop runs Python (sending other streams' events), the engine waits for the loop to
    release the GIL: at an I/O call, or at the latest after the switch interval (Python's default:
    5 ms, two decode steps at 8 streams on an H200). Unset: the default stays.

    Raises:
        UsageError: the value is not a positive number (:mod:`shardsmith.settings`).
    """
    ms = settings.current().switch_interval_ms
    if ms is not None:
        sys.setswitchinterval(ms / 1e3)
    return sys.getswitchinterval()


class EngineWorker:
    """Owns the engine on one thread and runs the continuous batch.

    Attributes:
        state: loading, ready, failed or stopped.
        engine: the engine once loaded; ``codec``: its tokenizer (from ``engine.root``).
        error: why the engine failed, if it did.

    Args:
        load: builds the engine (``Engine.load(...)``); runs on the worker thread.
        metrics: updated with load time, readiness, queue and batch sizes, per-token latencies.
        on_fatal: called once, with a message, when the engine fails (load error or dead rank).
        max_queue: jobs that may wait for a slot (>= 0); one more is refused (:class:`QueueFull`).
        prefill_chunk: prompt tokens per engine step (:class:`~shardsmith.runtime.engine.scheduler.Scheduler`;
            None: its default for the engine's device).
        decode_prompt_tokens: prompts of at most this many tokens go through decode rows (None: the
            device's default, :func:`~shardsmith.runtime.engine.scheduler.default_decode_prompt_tokens`).
        prefix_caching: reuse the prefixes finished requests leave in their slots (the scheduler's).
        speculative: the scheduler's n-gram speculation config, or None.
        defer_buckets: ready once the one-row decode step is built; the other batch buckets are built
            one at a time while no request runs or waits (``Engine.build_bucket``).

    Raises:
        UsageError: ``$SHARDSMITH_STEP_TRACE`` cannot be opened, or ``SHARDSMITH_TUNING``'s ``overlap_steps`` is
            neither 0 nor 1 (before anything loads).
    """

    def __init__(self, load: Callable[[], Any], *, metrics: Metrics, on_fatal: Callable[[str], None],
                 max_queue: int = DEFAULT_MAX_QUEUE, prefill_chunk: int | None = None,
                 decode_prompt_tokens: int | None = None, prefix_caching: bool = True,
                 speculative: Any = None, defer_buckets: bool = False) -> None:
        self._load = load
        self.defer_buckets = defer_buckets
        self._building_since: float | None = None  # perf_counter() when the deferred bucket build now running began
        self.metrics = metrics
        self._on_fatal = on_fatal
        self.max_queue, self.prefill_chunk, self.decode_prompt_tokens = max_queue, prefill_chunk, decode_prompt_tokens
        self.prefix_caching, self.speculative = prefix_caching, speculative
        self._waiting: collections.deque[Job] = collections.deque()
        self._held = False  # the oldest waiting job waits for KV blocks with slots free (set by _admit)
        self._wake = threading.Condition()
        self._stop_requested = False
        self._thread = threading.Thread(target=self._run, name="shardsmith-engine", daemon=True)
        self._started = time.perf_counter()
        self.state = State.LOADING
        self.error: str | None = None
        self.load_error: Exception | None = None  # what the load raised (its class sets the exit code)
        self.engine: Engine | None = None
        self.codec: Codec | None = None
        self.stopping: str | None = None  # why, once interrupt() was called
        self._running: list[Job] = []
        self._sched: Scheduler | None = None
        settings.current()  # a bad setting (SHARDSMITH_TUNING, ...) fails now, not after the load
        self._trace = open_step_trace()

    def start(self) -> None:
        set_switch_interval()
        self._thread.start()

    def submit(self, *jobs: Job) -> None:
        """Queue ``jobs`` for slots (FIFO), all or none (a request's ``n`` choices). Jobs submitted
        while slots are free wait only for the next step boundary: they do not count against
        ``max_queue``, unless the oldest waiting job waits for KV cache blocks (or behind a preempted
        sequence): then no free slot takes one before blocks come back.

        Raises:
            QueueFull: the jobs do not fit: ``max_queue`` would be exceeded beyond the free slots.
        """
        with self._wake:
            held = self._held and bool(self._waiting)
            free = self._sched.free_slots if self._sched is not None and not held else 0
            if len(self._waiting) + len(jobs) > self.max_queue + free:
                why = (f"for KV cache blocks ({self._sched.free_slots} of {self._slots()} sequence slots free)"
                       if held else f"for one of {self._slots()} sequence slots")
                raise QueueFull(f"the server is busy: {len(self._waiting)} requests are waiting {why} "
                                f"(--max-queue {self.max_queue}); retry later", retry_after=self._retry_after())
            self.metrics.queued(+len(jobs))
            self._waiting.extend(jobs)
            self._wake.notify()

    def capacity(self) -> int:
        """Jobs that can ever be queued or running at once: the slots plus ``max_queue``."""
        return self._slots() + self.max_queue

    def _slots(self) -> int:
        return self.engine.max_num_seqs if self.engine is not None else 1

    def _retry_after(self) -> int:
        """Seconds a refused client should wait: about one request's duration so far (at least 1)."""
        mean = self.metrics.mean_duration()
        return max(1, round(mean)) if mean else 1

    def interrupt(self, message: str) -> None:
        """End every running job (at the next step boundary) and every queued one with
        :class:`ServerStopping`; refuse jobs submitted later. Any thread; not from a signal
        handler (it takes the queue's lock)."""
        self.stopping = message
        for job in list(self._running):
            job.cancelled.set()
            job.emit(ServerStopping(message))
        self._drain(message, stopping=True)
        with self._wake:
            self._wake.notify()

    def stop(self, timeout: float = 30.0, *, build_timeout: float = BUILD_STOP_TIMEOUT_S) -> bool:
        """Finish the running and queued jobs, shut the engine down (followers exit), join. False on timeout.

        A deferred decode bucket being built when the stop comes (a compile and a graph capture: tens of
        seconds on a cold cache, and not interruptible) is waited for up to ``build_timeout`` seconds
        more, so a stop right after ready ends cleanly rather than as a failure."""
        with self._wake:
            self._stop_requested = True
            self._wake.notify()
        self._thread.join(timeout)
        since = self._building_since
        if self._thread.is_alive() and since is not None:
            log.info("stopping once the decode bucket being built is done (building for %.1f s)",
                     time.perf_counter() - since)
            self._thread.join(build_timeout)
        return not self._thread.is_alive()

    def _fail(self, message: str, *, report: bool = True) -> None:
        """The engine failed: ``/health`` turns 503 with ``message``; logged here unless the caller
        reports it (``report=False``: a load error, which the server raises to the launcher)."""
        self.error = message
        self.state = State.FAILED
        self.metrics.set_ready(False)
        if report:
            log.error(message)
        self._on_fatal(message)

    def _run(self) -> None:
        try:
            self.engine = self._load()
            self.codec = Codec(self.engine.root)
            if rows := verify_rows(self.engine, self.speculative):  # drafts ride in the decode step: its
                self.engine.reserve_rows(rows)                        # buckets, warmed with the others
            self.engine.warmup(defer_buckets=self.defer_buckets and self.engine.bucket_builds_compile)
            offload = self.engine.offload
            if offload is not None:
                self.metrics.offload = offload
                log.info("%s", offload.ready_line())
            self._sched = Scheduler(self.engine, prefill_chunk=self.prefill_chunk,
                                    decode_prompt_tokens=self.decode_prompt_tokens, prefix_caching=self.prefix_caching,
                                    speculative=self.speculative)
        except Exception as e:  # noqa: BLE001 - any load failure ends the server with its reason
            log.debug("engine load failed", exc_info=True)
            if self.stopping is not None:  # a rank went down with the stop: not a failure to report
                self.state = State.STOPPED
                return
            self.load_error = e
            self._fail(f"engine failed to load: {type(e).__name__}: {e}", report=False)
            self._drain(f"engine failed to load: {e}")
            return
        if self.stopping is not None:  # stopped while loading: release the followers, never say "ready"
            self._shutdown()
            self._drain(self.stopping, stopping=True)
            return
        self.state = State.READY
        e = self.engine
        state_bytes, slots = int(getattr(e, "state_bytes", 0)), self._slots()
        since_command = CLOCK.since_command()
        self.metrics.set_ready(True, load_seconds=float(getattr(e, "load_seconds", 0.0)),
                               ready_seconds=time.perf_counter() - self._started, start_phases=CLOCK.phases,
                               command_to_ready=since_command)
        self.metrics.set_capacity(max_num_seqs=slots, state_bytes=state_bytes, max_queue=self.max_queue)
        self.metrics.prefix = self._sched.prefix
        self.metrics.spec = self._sched.spec if self._sched.speculative is not None else None
        self._count_buckets()
        kv = getattr(e, "kv_blocks", None)
        positions = kv.tokens if kv is not None else slots * int(getattr(e, "max_seq_len", 0) or 1)
        self.metrics.bytes_per_position = state_bytes / max(1, positions)
        self.metrics.kv = kv
        if since_command is not None:
            log.info("ready %.1f s after the command: before the load %s; load %.1f s, warm-up %.1f s", since_command,
                     ", ".join(f"{k} {v:.2f} s" for k, v in CLOCK.phases.items()) or "unknown",
                     float(getattr(e, "load_seconds", 0.0)), float(getattr(e, "warmup_seconds", 0.0)))
        log.info("ready: every rank loaded and warmed up in %.1f s (warm-up %.1f s: %d kernel launches); %d "
                 "sequence slot(s) of %d tokens (%.1f MiB of per-sequence state on rank 0), up to %d waiting, "
                 "prefill chunks of %d tokens, prompts of <= %d tokens fed through decode steps, steps %s, "
                 "prefix caching %s, decode buckets %s built%s",
                 time.perf_counter() - self._started,
                 float(getattr(e, "warmup_seconds", 0.0)), int(getattr(e, "warmup_launches", 0)), slots,
                 getattr(e, "max_seq_len", 0), state_bytes / 2**20, self.max_queue, self._sched.prefill_chunk,
                 self._sched.decode_prompt_tokens, "overlapped" if self._sched.overlap else "plain",
                 "on" if self._sched.prefix.enabled else "off", ", ".join(map(str, e.built_buckets())) or "none",
                 f" ({', '.join(map(str, e.pending_buckets))} to build when idle)" if e.pending_buckets else "")
        if e.pending_lengths:
            log.info("decode pieces at longer lengths to build when idle (rows x length bucket): %s",
                     ", ".join(f"{r}x{L}" for r, L in e.pending_lengths))
        try:
            self._loop()
        finally:
            if self._trace is not None:
                self._trace.close()
        if self.state is State.READY:
            self._shutdown()

    def _loop(self) -> None:
        """Admit, step, emit, until :meth:`stop` with nothing left (or a failure)."""
        while True:
            with self._wake:  # idle until a job, a stop() or an interrupt() (which drops the running jobs)
                if self._trace is not None and not self._running and not self._waiting:
                    self._trace.flush()
                while not self._running and not self._waiting and not self._stop_requested and not self._can_build():
                    self._wake.wait()
                if not self._running and not self._waiting and self._stop_requested:
                    return
                build = not self._running and not self._waiting
            try:
                if build:  # idle: build a deferred decode bucket (a request that comes meanwhile waits for it)
                    self._building_since = time.perf_counter()
                    try:
                        self._sched.build_bucket()
                    finally:
                        self._building_since = None
                    self._count_buckets()
                    continue
                self._drop_cancelled()
                self._admit()
                if self._running:
                    self._step()
            except Exception as e:  # noqa: BLE001 - a failed step means a rank is gone or the engine broke
                self._step_failed(e)
                return

    def _can_build(self) -> bool:
        return self._sched.can_build()

    def _count_buckets(self) -> None:
        self.metrics.buckets = (len(self.engine.built_buckets()), len(self.engine.pending_buckets))
        self.metrics.lengths_pending = len(self.engine.pending_lengths)

    def _admit(self) -> None:
        """Move waiting jobs into free slots, oldest first (each refused alone on a UsageError), while the
        KV cache has room for the oldest (:meth:`Scheduler.can_admit`)."""
        while self._sched.free_slots:
            with self._wake:
                if not self._waiting:
                    self._held = False
                    return
                job = self._waiting[0]
            if self.stopping is None and not job.cancelled.is_set() and \
                    not self._sched.can_admit(job.prompt_ids):
                with self._wake:  # it waits for blocks (or behind a preempted sequence): free slots take no one
                    self._held = True
                return
            with self._wake:
                self._held = False
                self._waiting.popleft()
            if self.stopping is not None:
                self._reject(job, self.stopping, stopping=True)
                continue
            if job.cancelled.is_set():
                self._reject(job, "the client went away")
                continue
            job.seq = Sequence(job.prompt_ids, job.params, tag=job, constraint=job.constraint)
            try:
                self._sched.admit(job.seq)
            except UsageError as e:  # refused before any step was broadcast: the engine is still in step
                self.metrics.queued(-1)
                job.emit(e)
                continue
            job.text = TextStream(self.codec, job.prompt_ids, stop=job.stop, eos_token_ids=job.params.stop_token_ids,
                                  include_stop=job.include_stop, skip_special_tokens=job.skip_special_tokens)
            job.last = job.arrival
            self._running.append(job)
            self.metrics.started(len(job.prompt_ids), queue_seconds=time.perf_counter() - job.arrival)

    def _drop_cancelled(self) -> None:
        """Jobs whose client went away, or all of them when stopping, leave now: their slots are free."""
        for job in [j for j in self._running if j.cancelled.is_set() or self.stopping is not None]:
            if self.stopping is not None:
                job.emit(ServerStopping(self.stopping))
            self._finish(job, emit_done=False)

    def _step(self) -> None:
        t0 = time.perf_counter()
        outputs = self._sched.step()
        self.metrics.batch(self._sched.last_batch, len(self._running))
        self.metrics.preemptions = self._sched.preemptions
        now = time.perf_counter()
        events = [(seq.tag, seq.tag.text.push(out)) for seq, out in outputs]
        # recorded before any event leaves: a client that read its last token sees this step counted
        text_end = time.perf_counter()
        self.metrics.step_time(engine_seconds=now - t0, output_seconds=text_end - now)
        for job, _ in events:
            self.metrics.token(first=job.tokens == 0, since=now - job.last)
            job.tokens, job.last = job.tokens + 1, now
        emit_all(events)
        for job, ev in events:
            if ev.finish_reason is not None:  # a stop token or length (already left), or a stop string
                self._finish(job, emit_done=True)
        if self._trace is not None:
            self._trace.step(t0, now, text_end, time.perf_counter(), self._sched, len(self._running), len(self._waiting))

    def _finish(self, job: Job, *, emit_done: bool) -> None:
        self._running.remove(job)
        self._sched.abort(job.seq)  # releases the slot on every rank (no-op when it already left)
        self.metrics.finished(time.perf_counter() - job.arrival)
        if emit_done:
            job.emit(None)

    def _step_failed(self, e: Exception) -> None:
        log.debug("engine step failed", exc_info=True)
        running, self._running = self._running, []
        for job in running:
            self.metrics.finished(time.perf_counter() - job.arrival)
        if self.stopping is not None:  # the stop's signal reached the other ranks too (a process group)
            for job in running:
                job.emit(ServerStopping(self.stopping))
            self.state = State.STOPPED
            self._drain(self.stopping, stopping=True)
            return
        for job in running:
            job.emit(RuntimeError(f"engine failed: {type(e).__name__}: {e}"))
        self._fail(f"engine failed during generation ({type(e).__name__}: {e}); "
                   f"a rank has probably died; stopping the server")
        self._drain("engine failed; the server is stopping")

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
        """Refuse every waiting job with ``message``."""
        while True:
            with self._wake:
                if not self._waiting:
                    return
                job = self._waiting.popleft()
            self._reject(job, message, stopping=stopping)
