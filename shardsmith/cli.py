"""The ``shardsmith`` command line: thin typer commands over the library.

Commands live in small modules (``cli_plan``: inspect, plan; ``cli_pack``: split, verify, export,
import, demo-checkpoint; ``cli_serve``: serve, generate, demo; ``cli_parity``: parity). Heavy imports (torch, the runtime)
happen inside commands so that ``--help`` is instant. Tables and progress go to stderr, ``--json``
results to stdout. Errors map to exit codes through :data:`shardsmith.errors.EXIT_CODES` (0 ok, 1
usage/plan/source error, 2 integrity failure); set ``SHARDSMITH_DEBUG=1`` for tracebacks.
"""

from __future__ import annotations

import sys

import typer

from . import settings
from .errors import ShardsmithError, exit_code_for

app = typer.Typer(
    name="shardsmith",
    help="Split Hugging Face MoE checkpoints into per-rank tensor-parallel packs, verify them, serve them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: flags read as flags (`--resume`); typer's rich help labels every one `<bool>`
    rich_markup_mode=None,
    context_settings={"max_content_width": 120},  # click wraps at 80 columns otherwise, even on a wide terminal
)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"shardsmith {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                       callback=_version)) -> None:
    """Split Hugging Face MoE checkpoints into per-rank tensor-parallel packs, verify them, serve them."""


def _register() -> None:
    from . import cli_pack, cli_parity, cli_plan, cli_serve

    for module in (cli_plan, cli_pack, cli_serve, cli_parity):
        module.register(app)


_register()


def main() -> None:
    """Console entry point: run the app, turning :class:`ShardsmithError` into its exit code.

    typer handles usage errors (exit 2 from click is mapped to 1, our usage code) and ``--help``.
    """
    try:
        app()
    except ShardsmithError as e:
        if settings.debug():
            raise
        from rich.markup import escape

        from .ui import err_console

        err_console().print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(exit_code_for(e))
    except SystemExit as e:
        if e.code == 2:  # click's usage-error code; ours is 1 (2 means an integrity failure)
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
