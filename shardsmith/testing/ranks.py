"""Run a function on ``world_size`` real processes (``spawn``) that meet over torch.distributed.

Used by the tests and benchmarks that need real ranks (gloo on CPU, NCCL on GPUs) without the
serving launcher. ``target(rank, world_size, port, *args, queue)`` runs in each process; rank 0
puts one ``(status, payload)`` tuple on ``queue``: ``("ok", result)`` or ``("error", traceback)``.
"""

from __future__ import annotations

from typing import Any, Callable

from shardsmith.runtime.serve.launch import free_port


def run_ranks(target: Callable[..., None], world_size: int, *args: Any, timeout: float = 300.0,
              join_timeout: float = 30.0) -> Any:
    """Start the ranks, wait for rank 0's report, then reap every process (killing stragglers).

    Returns:
        rank 0's payload.

    Raises:
        RuntimeError: rank 0 reported an error (its message is the payload).
        queue.Empty: no report within ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, *args, queue)) for r in range(world_size)]
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
