"""Console helpers: Rich output on stderr, JSON on stdout, human-readable byte counts."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache

from rich.console import Console


@cache
def err_console() -> Console:
    """The Rich console on stderr (tables, progress, errors). Into a file or pipe, lines are not
    wrapped (a command printed to copy stays on one line); tables keep ``$COLUMNS`` (160)."""
    from shardsmith import settings

    tty = sys.stderr.isatty()
    width = None if tty else settings.terminal_columns()
    return Console(stderr=True, soft_wrap=not tty, width=width)


def emit_json(obj: object) -> None:
    """Write ``obj`` as one JSON document on stdout."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")
    sys.stdout.flush()


def human_bytes(n: float) -> str:
    """``n`` bytes as a short string in binary units (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@contextmanager
def step_lines(console: Console, indent: str = "    ") -> Iterator[Callable[[str], None]]:
    """A callback that shows each step line of a long job: one spinner line updated in place on a
    terminal, else each line printed as it comes (logs keep every step)."""
    from rich.markup import escape

    if not console.is_terminal:
        yield lambda line: console.print(f"{indent}{escape(line)}", highlight=False)
        return
    with console.status("", spinner="dots") as status:
        yield lambda line: status.update(f"{indent}{escape(line)}")
