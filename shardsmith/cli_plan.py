"""CLI commands ``inspect`` and ``plan``: read-only views of a checkpoint and its TP plan."""

from __future__ import annotations

from pathlib import Path

import typer


def inspect(
    checkpoint: Path = typer.Argument(..., metavar="CHECKPOINT", help="Checkpoint directory (config.json + safetensors or .safetensors.json headers)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
) -> None:
    """Show architecture, layers, experts, dtypes, quantization formats and bytes by category."""
    from .checkpoint import open_checkpoint
    from .report import inspect_checkpoint
    from .ui import emit_json, err_console, human_bytes

    info = inspect_checkpoint(open_checkpoint(checkpoint))
    if json_out:
        emit_json(info)
    else:
        from rich.table import Table

        con = err_console()
        con.print(f"[bold]{info['checkpoint']}[/]: {info['architecture']} (family {info['family']}), "
                  f"{info['layers']} layers, {info['moe_layers']} MoE layers"
                  + (f" (incl. {info['mtp_layers']} MTP draft layers)" if info["mtp_layers"] else "")
                  + f" x {info['experts_per_layer']} experts, "
                  f"top-{info['experts_per_token']}; {info['tensors']} tensors in {info['files']} files, "
                  f"{human_bytes(info['total_bytes'])}")
        con.print(f"dtypes: {info['dtypes']}   quantized weights: {info['quantization']}")
        t = Table("category", "tensors", "bytes")
        for cat, c in info["categories"].items():
            t.add_row(cat, str(c["tensors"]), human_bytes(c["bytes"]))
        con.print(t)
        for p in info["problems"]:
            con.print(f"[yellow]problem:[/] {p}", highlight=False)
    if not info["plannable"]:
        raise typer.Exit(1)


def plan(
    checkpoint: Path = typer.Argument(..., metavar="CHECKPOINT", help="Checkpoint directory."),
    tp: int = typer.Option(..., "--tp", help="Tensor-parallel world size."),
    align: int = typer.Option(1, "--align", help="Cut every splittable axis in whole units of N elements (e.g. 128)."),
    json_out: bool = typer.Option(False, "--json", help="Print the resolved plan summary as JSON on stdout."),
    tensors: bool = typer.Option(False, "--tensors", help="With --json: include every tensor's per-rank [start, length) ranges."),
) -> None:
    """Show the resolved TP plan: layout and per-rank shapes per rule, bytes and memory per rank."""
    from .checkpoint import open_checkpoint
    from .errors import UsageError
    from .families import serve_warning
    from .plans import plan_checkpoint
    from .report import summarize_plan
    from .ui import emit_json, err_console, human_bytes

    if tp < 1:
        raise UsageError(f"--tp must be at least 1, got {tp}")
    if align < 1:
        raise UsageError(f"--align must be at least 1, got {align}")
    if tensors and not json_out:
        raise UsageError("--tensors adds per-tensor ranges to the JSON output: use it with --json")
    ckpt = open_checkpoint(checkpoint)
    resolved = plan_checkpoint(ckpt, tp, align=align)
    summary = summarize_plan(resolved)
    unservable = serve_warning(ckpt.config)
    summary["servable"] = unservable is None
    if json_out:
        if unservable:  # the plan is fine; serving it is not
            err_console().print(f"[yellow]warning:[/] {unservable}", highlight=False)
        if tensors:
            summary["tensors"] = {n: {"layout": t.layout.value, "shard_dim": t.shard_dim, "unit": t.unit,
                                      "ranges": [[list(r) for r in rr] for rr in t.ranges]}
                                  for n, t in resolved.tensors.items()}
        emit_json(summary)
        return
    from rich.table import Table

    con = err_console()
    con.print(f"[bold]{resolved.family}[/] plan at world_size={tp}" + (f", align={align}" if align > 1 else ""))
    t = Table("example tensor", "layout", "dim", "unit", "n", "source shape", "rank shapes")
    for g in summary["groups"]:
        shapes = {tuple(s) for s in g["rank_shapes"]}
        t.add_row(g["example"], g["layout"], "-" if g["shard_dim"] is None else str(g["shard_dim"]),
                  str(g["unit"]), str(g["tensors"]), str(g["source_shape"]),
                  str(g["rank_shapes"][0]) if len(shapes) == 1 else " / ".join(map(str, g["rank_shapes"])))
    con.print(t)
    r = Table("rank", "dense (GPU)", "expert banks (host)")
    for row in summary["ranks"]:
        r.add_row(str(row["rank"]), human_bytes(row["gpu_dense_bytes"]), human_bytes(row["host_bytes"]))
    con.print(r)
    for note in summary["notes"]:
        con.print(f"[yellow]note:[/] {note}", highlight=False)
    if unservable:
        con.print(f"[yellow]warning:[/] {unservable}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``inspect`` and ``plan`` to ``app``."""
    app.command("inspect")(inspect)
    app.command("plan")(plan)
