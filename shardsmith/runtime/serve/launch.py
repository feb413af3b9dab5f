"""Start one process per rank, run a job on rank 0 while the other ranks follow, supervise them.

``launch(spec, job)`` spawns ``world_size`` processes (``multiprocessing``'s ``spawn`` context; the
launcher itself imports neither torch nor the HTTP stack, so the ranks start at once).
Each joins the default process group through one rendezvous port (``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT`` = ``--dist-port`` or a free port the parent picks; gloo on CPU, NCCL on CUDA),
clamps its CPU threads, and loads its pack with ``Engine.load``. Rank 0 runs ``job`` (the HTTP
server, or one-off generation); the others call ``Engine.follow()``, which executes rank 0's
commands until ``Engine.shutdown()``. Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
in the environment) the current process is that rank and joins through ``env://``.

Errors. A rank that raises sends a :class:`RankReport` to the launcher instead of logging it.
Once the ranks are down the launcher raises them as one error, each distinct message once (a load
error that every rank gathered appears once; the ``RankLostError`` of ranks that only saw another
one die is dropped when another report says why), so the CLI prints it once and exits with its
code. The code follows the cause chain: a ``RuntimeLoadError`` raised from an ``IntegrityError``
is raised as an ``IntegrityError`` (exit 2).

Supervision. The parent waits on every child's sentinel. A rank that exits non-zero or is
killed is reported in one line (rank, pid, exit code or signal) and the others are stopped:
SIGTERM to rank 0 (graceful: uvicorn drains, the engine shuts down), then SIGTERM, then SIGKILL
to whatever is left after a grace period, so a dead rank never leaves the server hanging.
SIGINT/SIGTERM to the parent stop rank 0 the same way; once rank 0 is gone the other ranks get
:data:`FOLLOWER_GRACE_S` to leave (they do at once after rank 0's engine shutdown; a rank still
loading never would) before SIGTERM. A second SIGINT kills every rank at once. The exit code
after SIGINT is 130 (128 + SIGINT, as shells report it); after SIGTERM, 0 unless a rank failed.
Each child watches its parent and stops itself if the parent disappears. Only rank 0 logs,
except errors, which every rank reports.

Processes. Ranks report errors over one ``multiprocessing`` pipe each: no semaphore, so a
SIGKILLed launcher leaks none. ``spawn`` starts ``multiprocessing``'s resource tracker and hands
its pipe to every child; the children close their copy at once and the launcher stops the tracker
when the ranks are down, so no process of ours outlives the launcher (the tracker also exits the
moment a SIGKILLed launcher's end of its pipe closes).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from shardsmith import settings
from shardsmith.errors import EXIT_CODES, RankLostError, ShardsmithError, UsageError, error_class, error_class_named, exit_code_for
from shardsmith.runtime.serve.placement import agree_on_local_ranks

log = logging.getLogger(__name__)

GRACE_S = 20.0        # rank 0's graceful stop (drain, engine shutdown) before SIGTERM to all
KILL_AFTER_S = 5.0    # SIGTERM to SIGKILL
FOLLOWER_GRACE_S = 3.0  # after a requested stop, how long the other ranks may outlive rank 0
SIGINT_EXIT = 128 + signal.SIGINT  # 130: the exit code after Ctrl-C, as a shell reports it
REPORT_CHARS = 20_000  # a rank's error message sent to the launcher, at most
COLLECTIVE_TIMEOUT_S = 600.0  # default group; idle followers wait in the engine's own command group


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What every rank loads and how the ranks meet.

    Attributes:
        path: the pack directory (``OUT``), or the checkpoint with ``from_checkpoint``.
        world_size: ranks to start (the pack's ``world_size``, or ``--tp``).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL, ``cuda:<local rank>``).
        dist_port: rendezvous port on 127.0.0.1; None: a free port chosen by the parent.
        from_checkpoint, verify_hashes, max_seq_len, dtype: passed to ``Engine.load``.
        offload: routed experts in host memory with a device expert cache
            (:class:`~shardsmith.runtime.offload.config.OffloadConfig`); None keeps every
            expert resident on the device.
        cuda_graphs: passed to ``Engine.load`` (False: ``--enforce-eager``).
        max_num_seqs: sequence slots (``Engine.load``; ``serve --max-num-seqs``, default 8 there;
            one-off generation needs 1).
        mtp_layers: MTP draft layers to load (``Engine.load``; ``serve --speculative mtp``: 1).
        compile_cache: where each rank keeps its compile caches (``Engine.load``; ``serve`` and
            ``warmup``: ``$SHARDSMITH_CACHE/compile``); None leaves the libraries' own folders.
        kv_cache_tokens: positions of the KV pool the slots share (``Engine.load``; ``serve
            --kv-cache-tokens``); None: ``max_num_seqs * max_seq_len``.
    """

    path: Path
    world_size: int
    device: str = "cpu"
    dist_port: int | None = None
    from_checkpoint: bool = False
    verify_hashes: bool = True
    max_seq_len: int = 2048
    dtype: str | None = None
    offload: Any = None  # OffloadConfig | None; typed loosely so --help stays free of torch
    cuda_graphs: bool = True
    max_num_seqs: int = 1
    mtp_layers: int = 0
    compile_cache: Path | None = None
    kv_cache_tokens: int | None = None


class Job(Protocol):
    """What rank 0 runs: called with a zero-argument engine loader; returns an exit code."""

    def __call__(self, load: Any) -> int: ...


class RankFilter(logging.Filter):
    """Pass rank 0's records, and errors from any rank; tag each record with ``rank``."""

    def __init__(self, rank: int | None) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = "launcher" if self.rank is None else f"rank {self.rank}"
        return self.rank in (None, 0) or record.levelno >= logging.ERROR


def setup_logging(rank: int | None, level: int = logging.INFO) -> None:
    """One stderr handler on the root logger with :class:`RankFilter` (``rank=None``: the launcher)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(rank)s] %(name)s: %(message)s", "%H:%M:%S"))
    handler.addFilter(RankFilter(rank))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to ``bind(port=0)`` and outgoing connections (Linux reads
    ``ip_local_port_range``; elsewhere IANA's 49152..65535)."""
    try:
        lo, hi = map(int, EPHEMERAL_RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def free_ports(n: int, *, avoid: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago, none of them in ``avoid``.

    The ports are drawn at random from outside the kernel's ephemeral range (below it where it
    leaves room, 10000 up): a port the kernel chose could be handed to another socket of this host
    between the choice and the server's bind (gloo's connections between ranks take ephemeral
    ports while rank 0 loads, then the HTTP server's bind fails). Every candidate is bound and
    stays bound until all ``n`` are chosen, so none is in use or handed out twice. Where no room is
    left outside the range the kernel picks.
    """
    lo, hi = _ephemeral_range()
    pool = range(10000, lo) if lo - 10000 >= 1000 else range(hi + 1, 65536) if 65535 - hi >= 1000 else None
    pick = random.SystemRandom()
    held: list[socket.socket] = []
    try:
        ports: list[int] = []
        for _ in range(100 * n + 100):
            if len(ports) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            try:
                s.bind(("127.0.0.1", pick.choice(pool) if pool is not None else 0))
            except OSError:
                continue  # in use (or lingering): draw again
            if (p := s.getsockname()[1]) not in avoid and p not in ports:
                ports.append(p)
        if len(ports) < n:
            raise OSError(f"found {len(ports)} of {n} free TCP ports on 127.0.0.1 in {pool}")
        return ports
    finally:
        for s in held:
            s.close()


def free_port(*, avoid: frozenset[int] | set[int] = frozenset()) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and is not in ``avoid``."""
    return free_ports(1, avoid=avoid)[0]


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) and not settings.current().spawned


def run_rank(spec: LaunchSpec, job: Job, *, rank: int, world_size: int, local_rank: int, init_method: str | None) -> int:
    """Body of one rank: join the group, load, then ``job`` (rank 0) or ``Engine.follow()``."""
    from shardsmith.pack.format import rank_dir
    from shardsmith.runtime.serve.startup import CLOCK, read_ahead

    CLOCK.begin(settings.current().spawned_by)
    if spec.device.startswith("cuda") and not spec.from_checkpoint:  # the disk reads the rank's files while it
        # imports and joins its group (on a CPU the weights are the files' mmap views, read as they are used)
        read_ahead(spec.path / rank_dir(rank, world_size), ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    import torch.distributed as dist

    from shardsmith.runtime.engine.dist import clamp_threads, init_distributed
    from shardsmith.runtime.engine.engine import Engine

    CLOCK.lap("imports")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    clamp_threads(local_ranks, local_rank=local_rank)  # and pin (dist.pin_cores)
    device = f"cuda:{local_rank}" if spec.device.startswith("cuda") else "cpu"
    if device != "cpu":  # the launcher counted the driver's GPUs without torch; torch must see them too
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have <= local_rank:
            why = "this torch build has no CUDA" if torch.version.cuda is None else f"torch sees {have} GPU(s)"
            raise UsageError(f"--device cuda needs one GPU per rank ({local_ranks}), but {why}; use --device cpu")
    if world_size > 1 and init_method == "env://":
        if spec.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(local_rank)
        from datetime import timedelta

        dist.init_process_group("nccl" if spec.device.startswith("cuda") else "gloo", init_method="env://",
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    elif world_size > 1:
        init_distributed(rank, world_size, master_addr=os.environ["MASTER_ADDR"],
                         master_port=int(os.environ["MASTER_PORT"]), device=spec.device, timeout_s=COLLECTIVE_TIMEOUT_S)
    if world_size > 1 and init_method == "env://" and not spec.from_checkpoint:
        agree_on_local_ranks(spec.path, rank, world_size)
    CLOCK.lap("group")

    load = partial(Engine.load, spec.path, rank=rank, world_size=world_size, device=device,
                   from_checkpoint=spec.from_checkpoint, verify_hashes=spec.verify_hashes,
                   max_seq_len=spec.max_seq_len, dtype=spec.dtype, offload=spec.offload,
                   cuda_graphs=spec.cuda_graphs, max_num_seqs=spec.max_num_seqs, mtp_layers=spec.mtp_layers,
                   compile_cache=spec.compile_cache, kv_cache_tokens=spec.kv_cache_tokens)
    if rank == 0:
        return job(load)
    engine = load()
    engine.follow()
    return 0


def _leave_group() -> None:
    """Destroy this rank's process group after a clean finish (every rank got here: rank 0's job
    returned after its shutdown broadcast, the others left ``Engine.follow()`` on it). Left to
    interpreter teardown, gloo's worker threads can be destroyed still joinable, which aborts the
    rank ("terminate called without an active exception", exit -6) after its answer was printed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _watch_parent(ppid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            log.error("the launcher (pid %d) is gone; stopping", ppid)
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _close_resource_tracker() -> None:
    """Drop this spawned child's copy of the resource tracker's pipe (ranks create no semaphores or
    shared memory), so the tracker lives only as long as the launcher."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker  # no public API; spawn sets _fd in every child
    fd, tracker._fd = getattr(tracker, "_fd", None), None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _stop_resource_tracker(timeout_s: float = 5.0) -> None:
    """Stop the launcher's resource tracker (after the ranks are down): close its pipe, the EOF it
    exits on, and reap it; killed after ``timeout_s`` if something still holds the pipe open
    (``ResourceTracker._stop`` would wait for it without a bound)."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker  # no public API for the tracker's pid and pipe
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if fd is None or pid is None:
        return
    tracker._fd = tracker._pid = None
    try:
        os.close(fd)
        deadline = time.monotonic() + timeout_s
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                log.warning("multiprocessing's resource tracker (pid %d) did not exit; killing it", pid)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.02)
    except OSError:  # already reaped or gone: nothing left to stop
        pass


def _name_process(title: str) -> None:
    """Show ``title`` as this process's command line in ``ps`` (``setproctitle``, the serve extra's;
    without it ``ps`` shows multiprocessing's ``spawn_main`` line)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(title)


def _child(rank: int, spec: LaunchSpec, job: Job, env: dict[str, str], log_level: int, reports) -> None:
    _close_resource_tracker()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    _name_process(f"shardsmith: rank {rank} of {spec.world_size} {spec.path}")
    setup_logging(rank, log_level)
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; rank 0 stops us
    threading.Thread(target=_watch_parent, args=(settings.current().spawned_by,), daemon=True).start()
    code = 1
    try:
        code = run_rank(spec, job, rank=rank, world_size=spec.world_size, local_rank=rank, init_method=None)
    except BaseException as e:  # noqa: BLE001 - reported once by the launcher, exit non-zero
        code = EXIT_CODES.get(error_class(e), 1)
        if not isinstance(e, KeyboardInterrupt):
            _report(reports, rank, e)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: a broken process group can hang in destructors


@dataclass(frozen=True, slots=True)
class RankReport:
    """A rank's error as sent to the launcher.

    Attributes:
        rank; error_class: name of the :data:`~shardsmith.errors.EXIT_CODES` class to raise it as;
        message: ``str(error)``, prefixed with its type when it is not a ``ShardsmithError``;
        lost: a ``RankLostError`` (this rank saw another one die).
    """

    rank: int
    error_class: str
    message: str
    lost: bool


def _report(reports, rank: int, e: BaseException) -> None:
    """Send the error to the launcher (a traceback in this rank's log with ``SHARDSMITH_DEBUG``)."""
    text = str(e) if isinstance(e, ShardsmithError) else f"{type(e).__name__}: {e}"
    if len(text) > REPORT_CHARS:
        text = text[:REPORT_CHARS] + " ... (truncated)"
    if settings.debug():
        log.error("rank %d failed", rank, exc_info=e)
    try:
        reports.send(RankReport(rank, error_class(e).__name__, text, isinstance(e, RankLostError)))
    except Exception:  # noqa: BLE001 - no launcher to tell: say it here
        log.error("rank %d failed: %s", rank, text)


def _describe(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(spec: LaunchSpec, job: Job, *, log_level: int = logging.INFO) -> int:
    """Run ``job`` on rank 0 of ``spec.world_size`` ranks; return the exit code for the CLI.

    Under ``torchrun`` this process is one rank (``--dist-port`` is ignored: torchrun owns the
    rendezvous). Otherwise the ranks are spawned and supervised here.

    Raises:
        ShardsmithError: what the ranks raised, each distinct error once, as the class of
            :data:`~shardsmith.errors.EXIT_CODES` that sets the exit code (:func:`error_class`).
    """
    if under_torchrun():
        ws, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if ws != spec.world_size:
            raise UsageError(f"torchrun started {ws} ranks but the pack needs world_size={spec.world_size}")
        setup_logging(rank, log_level)
        try:
            code = run_rank(spec, job, rank=rank, world_size=ws, local_rank=int(os.environ["LOCAL_RANK"]),
                            init_method="env://")
            _leave_group()
            return code
        except ShardsmithError as e:
            if EXIT_CODES.get(cls := error_class(e), 1) > exit_code_for(e):
                raise cls(str(e)) from e  # its cause sets the exit code
            raise
    return _spawn_and_supervise(spec, job, log_level)


def _spawn_and_supervise(spec: LaunchSpec, job: Job, log_level: int) -> int:
    import multiprocessing as mp  # not torch's: the ranks import torch, the launcher need not

    setup_logging(None, log_level)
    port = spec.dist_port or free_port()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = str(max(1, cores // spec.world_size))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(spec.world_size),
           "LOCAL_WORLD_SIZE": str(spec.world_size), settings.spelling("spawned_by"): str(os.getpid()),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
           "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", threads)}
    if not spec.device.startswith("cuda") and "GLOO_SOCKET_IFNAME" not in os.environ and Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo's pair connections on loopback, like the rendezvous
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(spec.world_size)]  # (reader, writer): no semaphore
    procs = [ctx.Process(target=_child, args=(r, spec, job, env, log_level, pipes[r][1]), name=f"shardsmith-rank-{r}")
             for r in range(spec.world_size)]
    log.info("starting %d rank(s) of %s on %s, rendezvous 127.0.0.1:%d", spec.world_size, spec.path, spec.device, port)
    try:
        for p in procs:
            p.start()
        for _, writer in pipes:
            writer.close()  # the children hold theirs: a reader sees EOF once its rank is gone
        log.info("rank pids: %s", ", ".join(f"rank {r}={p.pid}" for r, p in enumerate(procs)))
        return _supervise(procs, [reader for reader, _ in pipes])
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join()
        for reader, _ in pipes:
            reader.close()
        _stop_resource_tracker()


def _supervise(procs: list, reports: list | None = None) -> int:
    """Wait for the ranks; on the first exit or a signal, stop the rest in bounded time.

    Args:
        procs: the rank processes, rank order. reports: per rank, the read end of its report pipe.

    Returns:
        130 after SIGINT; else rank 0's exit code if it failed, else 1 if any rank failed
        unexpectedly, else 0.

    Raises:
        ShardsmithError: the errors the ranks reported (:func:`_raise_reports`), once they are down.
    """
    received: list[RankReport] = []

    def drain() -> None:
        for conn in reports or ():
            try:
                while not conn.closed and conn.poll():
                    received.append(conn.recv())
            except (EOFError, OSError):  # the rank is gone and said nothing more
                conn.close()

    # The handler only records the signal (a list append takes no lock): the loop below acts on it within
    # one poll. A handler that logged or set a threading.Event could be entered again by a second signal
    # while the first held the Event's (non-reentrant) lock, and the launcher then waited on itself forever.
    signals: list[int] = []  # non-empty: a requested stop

    def on_signal(signum, _frame) -> None:
        signals.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    failed, since, reported, escalated, noted, killed = False, None, set(), 0, 0, False
    try:
        while True:
            if len(signals) > noted:  # what the handler recorded since the last poll
                if noted == 0:
                    log.info("received %s; stopping", signal.Signals(signals[0]).name)
                if not killed and signals.count(signal.SIGINT) > 1:
                    log.info("received SIGINT again; killing every rank")
                    killed = True
                    for p in procs:
                        if p.is_alive():
                            p.kill()
                noted = len(signals)
            alive = [p.sentinel for p in procs if p.is_alive()]
            if not alive and len(reported) == len(procs):
                break
            multiprocessing.connection.wait(alive, timeout=0.2 if alive else 0)
            exited = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in reported]
            drain()  # after: an exited rank's report is in by now; and one blocked writing must not wait
            reported.update(exited)
            bad = sorted((r for r in exited if procs[r].exitcode != 0), key=lambda r: _blame(r, procs, received))
            if bad and since is None and not signals:  # after a requested stop, exits are the stop
                # Several ranks can go down within one poll: name the cause (a rank killed by a signal,
                # or one that reported its own error) before those that only saw a peer vanish.
                rest = "; stopping the other ranks" if any(q.is_alive() for q in procs) else ""
                for i, r in enumerate(bad):
                    what = "raised an error" if any(x.rank == r for x in received) else _describe(procs[r].exitcode)
                    log.error("rank %d (pid %d) %s%s", r, procs[r].pid, what, rest if i == 0 else "")
                failed = True
                _terminate(procs[0])
            if exited:
                since = since or time.monotonic()  # exit 0: rank 0 done, or a follower released by shutdown
            if signals and since is None:
                since = time.monotonic()
                _terminate(procs[0])
            if signals and escalated == 0 and procs[0].exitcode is not None:
                since = min(since, time.monotonic() - GRACE_S + FOLLOWER_GRACE_S)  # rank 0 gone: no drain to wait for
            waited = 0.0 if since is None else time.monotonic() - since
            if escalated == 0 and waited > GRACE_S:
                left = [r for r, p in enumerate(procs) if p.is_alive()]
                if left and not (signals and procs[0].exitcode is not None):
                    log.error("rank(s) %s still running %.0f s after the stop began; sending SIGTERM", left, GRACE_S)
                    failed = True
                escalated = 1
                for p in procs:
                    _terminate(p)
            elif escalated == 1 and waited > GRACE_S + KILL_AFTER_S:
                escalated = 2
                for p in procs:
                    if p.is_alive():
                        p.kill()
        drain()
        _raise_reports([r for r in received if not (signals and r.lost)], len(procs))  # Ctrl-C: no noise
        if signal.SIGINT in signals:
            return SIGINT_EXIT
        rank0 = procs[0].exitcode
        if signals:  # SIGTERM: a requested stop; ranks killed by it are not failures
            return int(failed)
        return rank0 if rank0 and rank0 > 0 else int(failed or bool(rank0))
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _blame(rank: int, procs: list, received: list[RankReport]) -> tuple[int, int]:
    """Sort key putting the likeliest root cause first: killed by a signal, then own error, then the rest."""
    code = procs[rank].exitcode
    own = [x for x in received if x.rank == rank]
    return (0 if code is not None and code < 0 else 1 if own and not all(x.lost for x in own) else 2, rank)


def _raise_reports(received: list[RankReport], world_size: int) -> None:
    """Raise the ranks' errors as one, each distinct message once (none: return).

    ``RankLostError`` reports (a rank saw another die) are left out when another error says why.
    The class is the one with the highest exit code among the reports.
    """
    shown = [r for r in received if not r.lost] or received
    if not shown:
        return
    by_text: dict[str, list[int]] = {}
    for r in shown:
        by_text.setdefault(r.message, []).append(r.rank)

    def who(ranks: list[int]) -> str:
        ids = sorted(set(ranks))
        return ("every rank" if len(ids) == world_size > 1 else
                f"rank {ids[0]}" if len(ids) == 1 else f"ranks {', '.join(map(str, ids))}")

    cls = max((error_class_named(r.error_class) for r in shown), key=lambda c: EXIT_CODES.get(c, 1))
    if len(by_text) == 1:
        (text, ranks), = by_text.items()
        raise cls(text if error_class_named(shown[0].error_class) in EXIT_CODES else f"{who(ranks)} failed: {text}")
    raise cls("\n".join(f"{who(ranks)} failed: {text}" for text, ranks in by_text.items()))


def _terminate(p) -> None:
    if p.is_alive():
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
