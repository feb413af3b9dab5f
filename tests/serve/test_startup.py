"""What a start does before the engine loads: the start clock (from the processes' own start times)
and the read-ahead of the rank's pack files into the page cache (checked with ``mincore(2)``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardsmith.runtime.serve.startup import READ_AHEAD_CHUNK, StartClock, process_started_at, read_ahead


def test_start_times_come_from_the_processes_own_clocks(tmp_path: Path) -> None:
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    after = time.time()
    try:
        started = process_started_at(child.pid)
        assert started is not None and before - 0.05 <= started <= after + 0.05, (before, started, after)
        time.sleep(0.3)
        assert process_started_at(child.pid) == pytest.approx(started, abs=0.02)  # a start, not a clock reading
    finally:
        child.kill()
        child.wait()
    assert process_started_at(child.pid) is None  # gone: /proc no longer says
    clock = StartClock()
    clock.begin(os.getppid())
    assert clock.command_at == pytest.approx(process_started_at(os.getppid()), abs=0.02)
    assert clock.phases["launcher"] == pytest.approx(process_started_at() - clock.command_at, abs=0.02)
    time.sleep(0.2)
    clock.lap("imports")
    assert 0.19 <= clock.phases["imports"] < 1.0 and list(clock.phases) == ["launcher", "rank_start", "imports"]
    assert clock.since_command() >= clock.phases["launcher"] + clock.phases["imports"]


def _resident(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore(2)`` over a read-only mapping)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        del view
    return sum(v & 1 for v in vec) / pages


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or ctypes.util.find_library("c") is None,
                    reason="posix_fadvise and mincore are Linux's")
def test_read_ahead_brings_the_rank_files_into_the_page_cache_within_the_budget(tmp_path: Path) -> None:
    rank = tmp_path / "rank-0-of-1"
    rank.mkdir()
    rng = np.random.default_rng(0)
    files = []
    for i, mib in enumerate((24, 8, 16)):  # several read-ahead chunks each, with a tail
        files.append(rank / f"part-{i}.safetensors")
        files[-1].write_bytes(rng.integers(0, 256, (mib << 20) + 12345, dtype=np.uint8).tobytes())
    os.sync()
    for f in files:
        _drop(f)
    if any(_resident(f) > 0.05 for f in files):
        pytest.skip("this filesystem keeps the pages (DONTNEED dropped nothing)")
    # a budget for the first two files: the third is left alone, the others are read whole
    thread = read_ahead(rank, budget_bytes=files[0].stat().st_size + files[1].stat().st_size)
    assert thread is not None
    thread.join(timeout=60)
    deadline = time.monotonic() + 20  # the reads were submitted; they complete in the background
    while time.monotonic() < deadline and min(_resident(files[0]), _resident(files[1])) < 0.99:
        time.sleep(0.1)
    assert _resident(files[0]) >= 0.99 and _resident(files[1]) >= 0.99, [_resident(f) for f in files]
    assert _resident(files[2]) < 0.5  # past the budget (the kernel's own read-around may touch a little)
    assert files[0].stat().st_size > 4 * READ_AHEAD_CHUNK
    assert read_ahead(tmp_path / "no-such-rank") is None and read_ahead(rank, budget_bytes=0) is None
    # the default budget, half of MemAvailable, is shared by the ranks of the host: a byte or so each here
    assert read_ahead(rank, ranks_here=1 << 40) is None
