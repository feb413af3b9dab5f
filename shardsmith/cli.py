"""The ``shardsmith`` command line: thin typer commands over the library.

Commands live in small modules (``cli_plan``: inspect, plan; ``cli_pack``: split, verify, export,
import, demo-checkpoint; ``cli_serve``: serve, generate, demo). Heavy imports (torch, the runtime)
happen inside commands so that ``--help`` is instant. Tables and progress go to stderr, ``--json``
results to stdout. Errors map to exit codes through :data:`shardsmith.errors.EXIT_CODES` (0 ok, 1
usage/plan/source error, 2 integrity failure); set ``SHARDSMITH_DEBUG=1`` for tracebacks.
"""

from __future__ import annotations

import os
import sys

import typer

from .errors import ShardsmithError, exit_code_for

app = typer.Typer(
    name="shardsmith",
    help="Split Hugging Face MoE checkpoints into per-rank tensor-parallel packs, verify them, serve them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from . import cli_pack, cli_plan, cli_serve

    for module in (cli_plan, cli_pack, cli_serve):
        module.register(app)


_register()


def main() -> None:
    """Console entry point: run the app, turning :class:`ShardsmithError` into an exit code."""
    try:
        app(standalone_mode=False)
    except ShardsmithError as e:
        if os.environ.get("SHARDSMITH_DEBUG"):
            raise
        from .ui import err_console

        err_console().print(f"[bold red]error:[/] {e}", highlight=False, markup=True, soft_wrap=True)
        sys.exit(exit_code_for(e))
    except SystemExit:
        raise
    except Exception as e:  # typer/click usage errors
        import click

        if isinstance(e, click.exceptions.Abort):
            sys.exit(130)
        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
