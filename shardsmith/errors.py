"""Error classes and their CLI exit codes.

Every error the project raises on bad input is a :class:`ShardsmithError` subclass whose message
names the file, tensor, value and rule involved. The CLI maps classes to exit codes through
:data:`EXIT_CODES` (0 ok, 1 usage or plan error, 2 integrity failure).
"""

from __future__ import annotations


class ShardsmithError(Exception):
    """Base class of every error shardsmith raises on bad input or a broken pack."""

    exit_code: int = 1


class UsageError(ShardsmithError):
    """A command-line argument or option is invalid (wrong world size, missing directory, ...)."""


class SourceError(ShardsmithError):
    """The source checkpoint is malformed: bad header, truncated shard, unknown dtype, ...

    Attributes:
        problems: every problem found, sorted, one line each (the message lists them too).
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


class PlanError(ShardsmithError):
    """No valid tensor-parallel plan: unmatched tensor, a cut inside a block, bad world size."""


class ManifestError(ShardsmithError):
    """A manifest is missing, unparsable, or of an unsupported format version."""

    exit_code = 2


class IntegrityError(ShardsmithError):
    """A pack does not match its manifest or its source (hash, size, coverage, missing file).

    Attributes:
        problems: every problem found (file, tensor, expected vs found), one line each.
    """

    exit_code = 2

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


class RuntimeLoadError(ShardsmithError):
    """The runtime cannot load a pack: wrong rank or world size, missing or mis-shaped tensor."""


class ChatTemplateError(ShardsmithError):
    """The checkpoint has no usable chat template, or rendering it failed (``raise_exception``).

    Here rather than in ``runtime/serve/chat.py`` so that ``chat`` and ``encoding`` (the
    DeepSeek-V4 message encoder, a subclass's home) do not import each other.
    """


class RankLostError(ShardsmithError):
    """Another rank died or left the process group mid-run; this rank cannot continue."""


EXIT_CODES: dict[type[ShardsmithError], int] = {
    UsageError: 1,
    SourceError: 1,
    PlanError: 1,
    RuntimeLoadError: 1,
    RankLostError: 1,
    ManifestError: 2,
    IntegrityError: 2,
}


def exit_code_for(err: BaseException) -> int:
    """Return the CLI exit code for ``err`` (the closest class in :data:`EXIT_CODES`, else 1)."""
    for cls in type(err).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1


def error_class(err: BaseException) -> type[ShardsmithError]:
    """The :data:`~shardsmith.errors.EXIT_CODES` class that sets ``err``'s exit code: the one with
    the highest code along its ``__cause__`` chain (``RuntimeLoadError`` raised from an
    ``IntegrityError``: ``IntegrityError``, 2); plain ``ShardsmithError`` (1) for anything else."""
    found, seen, e = [], set(), err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        found += [c for c in type(e).__mro__ if c in EXIT_CODES][:1]
        e = e.__cause__
    return max(found, key=EXIT_CODES.__getitem__, default=ShardsmithError)  # ties: the outermost


def error_class_named(name: str) -> type[ShardsmithError]:
    """The :data:`EXIT_CODES` class called ``name`` (as :func:`error_class`'s ``__name__`` travels
    between ranks); plain ``ShardsmithError`` for any other name."""
    return next((c for c in EXIT_CODES if c.__name__ == name), ShardsmithError)


def format_problems(header: str, problems: list[str], *, limit: int = 50) -> str:
    """Join ``problems`` under ``header``, sorted, listing at most ``limit`` of them."""
    items = sorted(set(problems))
    lines = [f"{header} ({len(items)} problem{'s' if len(items) != 1 else ''}):"]
    lines += [f"  - {p}" for p in items[:limit]]
    if len(items) > limit:
        lines.append(f"  ... and {len(items) - limit} more")
    return "\n".join(lines)
