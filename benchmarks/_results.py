"""Save a benchmark run as ``benchmarks/results/<benchmark>-<YYYYMMDD>-<host>.json``.

Schema: ``{"benchmark", "date", "host", "commit", "rows": [...]}``; row fields carry their unit
in the name (``seconds``, ``tokens_per_s``, ``bytes_per_rank``, ...).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import socket
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def host_name() -> str:
    """Short host label: the hostname, or ``$SHARDSMITH_HOST`` when set (e.g. ``h200x2``)."""
    import os

    return os.environ.get("SHARDSMITH_HOST") or socket.gethostname().split(".")[0]


def commit_id() -> str | None:
    """``$SHARDSMITH_COMMIT`` when set (a copied tree, e.g. on the GPU host, whose ``.git`` may not be
    the tree's), else ``git rev-parse --short HEAD`` of this checkout (None outside one)."""
    import os

    commit = os.environ.get("SHARDSMITH_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip() or None
        except OSError:
            commit = None
    return commit


def save_results(benchmark: str, rows: list[dict], *, extra: dict | None = None, path: Path | None = None,
                 append: bool = False) -> Path:
    """Write the run and return its path: ``path`` when given (with ``append``, after the rows a run
    already wrote there: one file for several configurations of one GPU call), else
    ``results/<benchmark>-<YYYYMMDD>-<host>.json`` (overwriting a run of the same day and host).

    The commit is :func:`commit_id`'s.
    """
    old = json.loads(path.read_text())["rows"] if path is not None and append and path.exists() else []
    doc = {"benchmark": benchmark, "date": dt.date.today().isoformat(), "host": host_name(), "commit": commit_id(),
           "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
           **(extra or {}), "rows": old + rows}
    if path is None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{benchmark}-{dt.date.today():%Y%m%d}-{host_name()}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"saved {path}")
    return path


@contextlib.contextmanager
def environment(entries: dict[str, str]):
    """``os.environ`` with ``entries`` set for the ``with`` block (child processes started in it
    inherit them), restored after."""
    saved = {k: os.environ.get(k) for k in entries}
    os.environ.update(entries)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
