"""Where a start's seconds go before the engine loads, as a rank sees them.

``serve`` answers ``/health`` once every rank has loaded and warmed up; the engine times its load and
warm-up itself. What comes before, from the command to the load, is timed here in rank 0 from the
processes' own start times (``/proc/<pid>/stat``, so nothing has to be passed between processes):

============== ===================================================================================
phase          from ... to ...
============== ===================================================================================
``launcher``   the launcher process's start (the command) to this rank's process start: the CLI's
               checks and the spawn (absent under ``torchrun``, where the command is the rank)
``rank_start`` this rank's process start to its body (:func:`~.launch.run_rank`): the interpreter,
               and the imports the job and spec bring when they are unpickled
``imports``    importing torch and the engine (the model families, kernels)
``group``      clamping this rank's threads and joining the process group
============== ===================================================================================

Source of the start times: ``proc(5)``, ``/proc/[pid]/stat`` field 22 (``starttime``, clock ticks
after boot) against ``/proc/uptime``; 10 ms resolution on Linux, None elsewhere.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

# bytes per posix_fadvise call: Linux reads at most max(read_ahead_kb, max_sectors_kb) of a WILLNEED
# range (mm/readahead.c, force_page_cache_ra), 128 KiB by default, so larger calls read only their start
READ_AHEAD_CHUNK = 128 << 10

PHASES = ("launcher", "rank_start", "imports", "group")


def process_started_at(pid: int | None = None) -> float | None:
    """When process ``pid`` (default: this one) started, in ``time.time()`` seconds; None where
    ``/proc`` does not say (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: count from the last ')'
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class StartClock:
    """This rank's start phases (:data:`PHASES`), in seconds, as they end.

    Attributes:
        command_at: ``time.time()`` of the command (the launcher's start; this process's own start
            under ``torchrun``), or None where unknown.
        phases: phase -> seconds, in the order they ended.
    """

    def __init__(self) -> None:
        self.command_at: float | None = None
        self.phases: dict[str, float] = {}
        self._last: float | None = None

    def begin(self, launcher_pid: int | None) -> None:
        """At the start of this rank's body: the ``launcher`` and ``rank_start`` phases, from the
        launcher's (``launcher_pid``; None: no launcher, this process is the command) and this
        process's start times."""
        now, own = time.time(), process_started_at()
        launcher = process_started_at(launcher_pid) if launcher_pid is not None else None
        self.phases.clear()
        if launcher is not None and own is not None:
            self.phases["launcher"] = max(0.0, own - launcher)
        if own is not None:
            self.phases["rank_start"] = max(0.0, now - own)
        self.command_at = launcher if launcher is not None else own
        self._last = now

    def lap(self, phase: str) -> None:
        """End ``phase`` now: the seconds since the last phase ended (nothing before :meth:`begin`)."""
        if self._last is None:
            return
        now = time.time()
        self.phases[phase] = now - self._last
        self._last = now

    def since_command(self) -> float | None:
        """Seconds from the command until now, or None where its start is unknown."""
        return None if self.command_at is None else time.time() - self.command_at


CLOCK = StartClock()  # this process's: one rank per process


def read_ahead(folder: Path, *, budget_bytes: int | None = None, ranks_here: int = 1) -> threading.Thread | None:
    """Ask the kernel to read this rank's pack files (``folder``, the rank directory) into the page
    cache in the background (``posix_fadvise(POSIX_FADV_WILLNEED)``, chunk by chunk on a daemon
    thread), so a start on a cold page cache reads the disk while the rank imports torch and joins
    its group instead of after; on a warm page cache it costs nothing. Files in name order (the
    dense weights, which the load reads first, then the expert banks); those past ``budget_bytes``
    (default: half of ``MemAvailable`` shared by the ``ranks_here`` ranks of this host, which start
    together) are left alone: reading more than fits would evict what was read first, and offloaded
    expert banks also need host memory of their own. Returns the thread, or None where there is nothing to do (no ``posix_fadvise``, no
    folder, nothing within the budget). Errors (a file gone, a filesystem that refuses) only end
    the read-ahead early: the load reads what it needs anyway.

    Source: ``posix_fadvise(2)``, ``POSIX_FADV_WILLNEED`` ("initiates a nonblocking read of the
    specified region into the page cache").
    """
    if not hasattr(os, "posix_fadvise"):
        return None
    try:
        files = sorted((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.name)
    except OSError:
        return None
    budget = _mem_available() // (2 * max(1, ranks_here)) if budget_bytes is None else budget_bytes
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if total + size > budget:
            break
        chosen.append((path, size))
        total += size
    if not chosen:
        return None

    def run() -> None:
        for path, size in chosen:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return
            try:
                for at in range(0, size, READ_AHEAD_CHUNK):
                    os.posix_fadvise(fd, at, min(READ_AHEAD_CHUNK, size - at), os.POSIX_FADV_WILLNEED)
            except OSError:
                return
            finally:
                os.close(fd)

    thread = threading.Thread(target=run, name="shardsmith-read-ahead", daemon=True)
    thread.start()
    log.debug("reading ahead %d file(s), %.2f GiB, of %s", len(chosen), total / 2**30, folder)
    return thread


def _mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 where it cannot be read: nothing is read ahead)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
