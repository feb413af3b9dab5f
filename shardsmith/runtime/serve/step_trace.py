"""``$SHARDSMITH_STEP_TRACE``: one JSON line per engine step of a serving run (no torch here: the CLI
opens the file once before any rank starts, so a path that cannot be appended to is refused early)."""

from __future__ import annotations

import json
import time
from typing import Any

from shardsmith import settings
from shardsmith.errors import UsageError


class StepTrace:
    """One JSON line per engine step, appended to ``path`` (``$SHARDSMITH_STEP_TRACE``): where a serving
    run's time went, step by step (the histograms in ``/metrics`` keep only sums and buckets).

    Fields (seconds, from ``time.perf_counter``): ``t_s`` the step's start since the trace opened;
    ``gap_s`` since the previous step's end (admission, dropping cancelled jobs, waiting for work or
    for the interpreter lock); ``engine_s`` the engine step (prefill chunks, the batched decode, token
    choice); ``output_s`` the text side; ``emit_s`` handing the events to the event loop; then
    ``rows`` (decode rows), ``feeding_rows`` (of them, rows feeding a prompt token),
    ``prefill_tokens`` (tokens prefilled eagerly), ``running`` and ``waiting`` sequences.
    Lines are buffered and written whenever the batch goes idle, and when the worker stops.

    Raises:
        OSError: ``path`` cannot be opened for appending.
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._t0 = self._end = time.perf_counter()

    def step(self, t0: float, engine_end: float, output_end: float, end: float, sched: Any, running: int,
             waiting: int) -> None:
        """Record one step from its ``perf_counter`` marks (start, engine done, text done, end) and the
        scheduler's counts of that step (``last_batch``, ``last_feeding``, ``last_prefill_tokens``)."""
        self._file.write(json.dumps({
            "t_s": round(t0 - self._t0, 6), "gap_s": round(t0 - self._end, 6), "engine_s": round(engine_end - t0, 6),
            "output_s": round(output_end - engine_end, 6), "emit_s": round(end - output_end, 6),
            "rows": sched.last_batch, "feeding_rows": sched.last_feeding, "prefill_tokens": sched.last_prefill_tokens,
            "running": running, "waiting": waiting}) + "\n")
        self._end = end

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def open_step_trace() -> StepTrace | None:
    """The :class:`StepTrace` that ``$SHARDSMITH_STEP_TRACE`` asks for, None where it is unset.

    Raises:
        UsageError: the file cannot be opened for appending (named, with the reason).
    """
    path = settings.current().step_trace
    try:
        return StepTrace(path) if path else None
    except OSError as e:
        raise UsageError(f"SHARDSMITH_STEP_TRACE={str(path)!r}: cannot append to it ({e.strerror})") from e
