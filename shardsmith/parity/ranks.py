"""Run one parity configuration on its own ranks: rank 0 drives, the other ranks follow.

The pattern of :mod:`shardsmith.runtime.serve.launch` and :func:`shardsmith.testing.ranks.run_ranks`:
``world_size`` spawned processes meet over one rendezvous port (gloo on CPU, NCCL on CUDA), each
loads its rank with :meth:`Engine.load`; rank 0 runs the work while the others sit in
:meth:`Engine.follow`. Unlike the launcher's one engine per rank, a parity rank loads two in turn,
the compute dtype and then the reference precision (the noise estimate of
:mod:`shardsmith.parity.compare`), freeing the first before loading the second. Rank 0 saves its
traces with ``torch.save`` to a file and reports the path; any rank's error comes back as its
:data:`~shardsmith.errors.EXIT_CODES` class (an integrity error stays exit 2).
"""

from __future__ import annotations

import gc
import os
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from shardsmith import settings
from shardsmith.errors import EXIT_CODES, RankLostError, ShardsmithError


@dataclass(frozen=True, slots=True)
class RankTask:
    """One configuration's work.

    Attributes:
        path: pack directory; world_size: its ranks; device: ``cpu`` or ``cuda``.
        dtype, ref_dtype: compute dtype and reference precision (torch dtypes).
        prompts: token ids per prompt; max_tokens, top_k: greedy tokens and probed tokens per step.
        probes: the first configuration's :class:`~shardsmith.parity.collect.Probe` per prompt, or None.
        layers: record decoder-layer outputs; verify_hashes: passed to ``Engine.load``.
        max_seq_len: KV positions (prompt + max_tokens at least); out: where rank 0 saves its traces.
    """

    path: Path
    world_size: int
    device: str
    dtype: object
    ref_dtype: object
    prompts: list[list[int]]
    max_tokens: int
    top_k: int
    probes: list | None
    layers: bool
    verify_hashes: bool
    max_seq_len: int
    out: Path


# The Triton kernels (FP8 linears, fused experts) take bf16/f16/f32 only: a float64 reference run
# (of a float32 run) loads with the PyTorch paths they replace (env read once, at load).


def _load(task: RankTask, rank: int, dtype):
    import torch

    from shardsmith.runtime.engine.engine import Engine

    if dtype == torch.float64:
        os.environ.update(settings.overrides(fp8_dense="reference", fused_experts="reference"))  # this rank process only

    # cuda_graphs off: a graphed decode step runs the layers' pieces, not the model's forward, so the
    # output hook of collect.greedy would see only the prefill (the pieces run the same kernels)
    return Engine.load(task.path, rank=rank, world_size=task.world_size, device=task.device, dtype=dtype,
                       verify_hashes=task.verify_hashes, max_seq_len=task.max_seq_len, max_num_seqs=1,
                       cuda_graphs=False)


def rank_main(rank: int, task: RankTask, port: int, reports) -> None:
    """Body of one rank process (spawned); rank 0 puts ``("ok", path)`` on ``reports``."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    try:
        import torch

        from shardsmith.parity.collect import dtype_phase, reference_phase
        from shardsmith.runtime.engine.dist import clamp_threads, init_distributed

        init_distributed(rank, task.world_size, master_port=port, device=task.device)
        clamp_threads(task.world_size)
        engine = _load(task, rank, task.dtype)
        if rank != 0:
            engine.follow()
            del engine
            gc.collect()
            _load(task, rank, task.ref_dtype).follow()
            return
        try:
            runs = dtype_phase(engine, task.prompts, max_tokens=task.max_tokens, top_k=task.top_k,
                               probes=task.probes, layers=task.layers)
        finally:
            engine.shutdown()
        del engine
        gc.collect()
        engine = _load(task, rank, task.ref_dtype)
        try:
            traces = reference_phase(engine, task.prompts, runs, layers=task.layers)
        finally:
            engine.shutdown()
        torch.save(traces, task.out)
        reports.put(("ok", rank, "", str(task.out)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it as its class
        from shardsmith.runtime.serve.launch import error_class

        text = str(e) if isinstance(e, ShardsmithError) else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        reports.put(("error", rank, error_class(e).__name__, text[:20_000]))


def run_task(task: RankTask, *, timeout_s: float = 3600.0) -> list:
    """Spawn ``task.world_size`` ranks, wait for rank 0's traces, reap every process.

    Returns:
        rank 0's list of :class:`~shardsmith.parity.compare.Trace`, one per prompt.

    Raises:
        ShardsmithError: a rank's error as its class (``IntegrityError`` for a damaged pack, ...);
            ``RankLostError`` when ranks exit without a report or nothing comes within ``timeout_s``.
    """
    import torch
    import torch.multiprocessing as mp

    from shardsmith.runtime.serve.launch import free_port

    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    port = free_port()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = str(max(1, cores // task.world_size))
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
    os.environ.setdefault("OMP_NUM_THREADS", threads)  # read by OpenMP when a child imports torch
    os.environ.setdefault("MKL_NUM_THREADS", threads)
    if task.device == "cpu" and Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [ctx.Process(target=rank_main, args=(r, task, port, reports), name=f"shardsmith-parity-rank-{r}")
             for r in range(task.world_size)]
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    errors: list[tuple[int, str, str]] = []
    result = None
    deadline = time.monotonic() + timeout_s
    try:
        while result is None and time.monotonic() < deadline:
            try:
                status, rank, cls, payload = reports.get(timeout=0.5)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            if status == "ok":
                result = payload
            else:
                errors.append((rank, cls, payload))
                if rank == 0:
                    break
    finally:
        for p in procs:
            p.join(timeout=30 if result is not None else 5)
            if p.is_alive():
                p.kill()
                p.join()
    if result is None:
        _raise(errors, procs, task)
    return torch.load(result, weights_only=False)


def _raise(errors: list[tuple[int, str, str]], procs: list, task: RankTask) -> None:
    classes = {c.__name__: c for c in EXIT_CODES}
    if not errors:
        codes = ", ".join(f"rank {r} exit {p.exitcode}" for r, p in enumerate(procs))
        raise RankLostError(f"{task.path}: the parity ranks stopped without a result ({codes})")
    real = [e for e in errors if e[1] != "RankLostError"] or errors
    cls = max((classes.get(c, ShardsmithError) for _, c, _ in real), key=lambda c: EXIT_CODES.get(c, 1))
    texts = list(dict.fromkeys(t for _, _, t in real))
    raise cls(texts[0] if len(texts) == 1 else "\n".join(texts))
