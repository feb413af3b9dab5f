"""Run a function on ``world_size`` real processes that meet over torch.distributed.

Used by the tests and benchmarks that need real ranks (gloo on CPU, NCCL on GPUs) without the
serving launcher. ``target(rank, world_size, port, *args, queue)`` runs in each process; rank 0
puts one ``(status, payload)`` tuple on ``queue``: ``("ok", result)`` or ``("error", traceback)``.
:func:`run_gloo` is the common case: ``fn(*args, rank, world_size)`` after ``init_distributed`` on
every rank, rank 0's return value reported.

The processes are forked from a fork server (Python's ``forkserver`` start method) that imported torch once
(:data:`PRELOAD`; nothing of shardsmith, no CUDA context), so a rank starts in milliseconds where a fresh
interpreter spends seconds importing torch (2-core CI: four ``spawn`` ranks 7.5 s before their first line,
forked ones 0.05 s). Like ``spawn``, each rank imports the target's module itself and gets the caller's
``sys.path`` and working directory; it also gets the caller's environment as it is at the call (a fork
server's own is the one it started with), applied before the target runs.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable

from shardsmith.runtime.serve.launch import free_port

PRELOAD = ("torch", "torch._dynamo", "torch.distributed")
"""What the fork server imports once for every rank: third-party modules only (they read no setting of ours)."""


def run_ranks(target: Callable[..., None], world_size: int, *args: Any, timeout: float = 300.0,
              join_timeout: float = 30.0) -> Any:
    """Start the ranks, wait for rank 0's report, then reap every process (killing stragglers).

    Returns:
        rank 0's payload.

    Raises:
        RuntimeError: rank 0 reported an error (its message is the payload).
        queue.Empty: no report within ``timeout`` seconds.
    """
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [rank_process(ctx, target, r, world_size, port, *args, queue) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        status, payload = queue.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=join_timeout)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def rank_context() -> Any:
    """The multiprocessing context ranks start from: the fork server, :data:`PRELOAD` imported in it once."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first process), kept after
    return ctx


def rank_process(ctx: Any, target: Callable[..., None], *args: Any) -> Any:
    """An unstarted ``ctx.Process`` that runs ``target(*args)`` in the caller's environment as it is now."""
    return ctx.Process(target=_with_environment, args=(dict(os.environ), target, *args))


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int, timeout: float = 300.0) -> None:
    """``fn(rank, *args)`` on ``nprocs`` processes, joined (``torch.multiprocessing.spawn(fn, args, nprocs)``
    from the fork server).

    Raises:
        RuntimeError: a process exited non-zero or ran past ``timeout`` seconds (it is killed).
    """
    ctx = rank_context()
    procs = [rank_process(ctx, fn, r, *args) for r in range(nprocs)]
    for p in procs:
        p.start()
    end = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    late = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in late:
        procs[r].kill()
        procs[r].join()
    failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if failed:
        late_note = f"; ran past {timeout} s: {late}" if late else ""
        raise RuntimeError(f"rank processes failed (rank: exit code): {failed}{late_note}")


def _with_environment(env: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """A rank's entry: the caller's environment, then ``target(*args)``."""
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> Any:
    """:func:`run_ranks` of ``fn(*args, rank, world_size)`` on ranks that first join the process group
    (:func:`~shardsmith.runtime.engine.dist.init_distributed`: gloo on CPU); rank 0's return value.

    ``fn`` must be importable by name (a module-level function), as ``spawn`` pickles it.

    Raises:
        RuntimeError: a rank's ``fn`` raised on rank 0 (its traceback is the message).
        queue.Empty: no report within ``timeout`` seconds.
    """
    return run_ranks(_gloo_entry, world_size, fn, args, timeout=timeout)


def _gloo_entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue) -> None:
    try:
        from shardsmith.runtime.engine.dist import init_distributed

        init_distributed(rank, world_size, master_port=port)
        out = fn(*args, rank, world_size)
        if rank == 0:
            queue.put(("ok", out))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
