"""A parity report as JSON (stdout, ``--json``) and Rich tables (stderr).

Log-probs and gaps are in nats; relative errors are ``||h - h_first|| / ||h_first||`` over every
prompt's positions. Token ids are shown, with their text when a tokenizer is at hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from shardsmith.parity.compare import first_departing
from shardsmith.parity.run import ParityReport


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def to_json(r: ParityReport) -> dict:
    """The report as plain data: configurations, prompts and tokens, divergences, layers, verdict."""
    first = r.configs[0].name
    return {
        "dtype": r.dtype, "reference_dtype": r.ref_dtype, "baseline": first,
        "configs": [{"name": c.name, "world_size": c.world_size, "kind": c.kind, "path": str(c.path)} for c in r.configs],
        "prompts": [{"index": i, "ids": p, "tokens": {n: t[i].tokens for n, t in r.traces.items()}}
                    for i, p in enumerate(r.prompts)],
        "divergences": [{
            "prompt": d.prompt, "config": d.config, "step": d.step, "verdict": d.verdict, "reason": d.reason,
            "baseline_token": d.first_token, "token": d.other_token,
            "top2_gap": {k: _num(v) for k, v in d.gaps.items()}, "flip_margin": _num(d.margin),
            "max_logprob_diff": d.max_diff, "noise": d.noise, "reference_diff": d.ref_diff,
            "reference_noise": d.ref_noise} for d in r.divergences],
        "layers": {n: {"first_departing": first_departing(rows),
                       "rows": [{"layer": x.layer, "rel_err": x.rel_err, "noise": x.noise, "reference_rel_err": x.ref_err,
                                 "departs": x.departs} for x in rows]} for n, rows in r.layers.items()} or None,
        "refused": [{"name": c.name, "world_size": c.world_size, "reason": why} for c, why in r.refused],
        "defects": r.defects,
        "verdict": "defect" if r.defects else "near-ties only",
        "exit_code": r.exit_code,
    }


def print_tables(r: ParityReport, *, decode: Callable[[int], str] | None = None) -> None:
    """Divergences (and layers) as Rich tables on stderr, then, when there is no defect, the verdict
    line (defects are raised by the command as an :class:`~shardsmith.errors.IntegrityError`)."""
    from rich.markup import escape
    from rich.table import Table

    from shardsmith.ui import err_console

    con = err_console()
    names = [c.name for c in r.configs]
    show = (lambda t: f"{t} {escape(repr(decode(t)))}") if decode else str
    table = Table(title=f"parity against {names[0]} ({r.dtype}; noise from {r.ref_dtype} reruns; nats)")
    for col in ("prompt", "config", "first diff", "tokens", *[f"gap {n}" for n in names], "max |dlp| top-k",
                "noise", "ref diff", "verdict"):
        table.add_column(col, justify="left" if col in ("config", "tokens", "verdict") else "right")
    for d in r.divergences:
        style = {"defect": "bold red", "near-tie": "yellow", "agree": "green"}[d.verdict]
        toks = "" if d.step is None else f"{show(d.first_token)} -> {show(d.other_token)}"
        gaps = [f"{d.gaps[n]:.3g}" if n in d.gaps and math.isfinite(d.gaps[n]) else "-" for n in names]
        table.add_row(str(d.prompt), d.config, "-" if d.step is None else str(d.step), toks, *gaps,
                      f"{d.max_diff:.3g}", f"{d.noise:.3g}", f"{d.ref_diff:.3g}", f"[{style}]{d.verdict}[/]")
    con.print(table)
    for c, why in r.refused:
        con.print(f"[yellow]not run:[/] {c.name}: {escape(why)}")
    for name, rows in r.layers.items():
        lt = Table(title=f"decoder layer outputs, {name} against {names[0]} (relative error)")
        for col in ("layer", f"rel err ({r.dtype})", "noise", f"rel err ({r.ref_dtype})", "departs"):
            lt.add_column(col, justify="right")
        for x in rows:
            lt.add_row(str(x.layer), f"{x.rel_err:.3g}", f"{x.noise:.3g}", f"{x.ref_err:.3g}",
                       "[bold red]yes[/]" if x.departs else "no")
        con.print(lt)
    if len(r.configs) == 1:
        con.print(f"[yellow]only {names[0]} ran:[/] nothing to compare it with")
    elif not r.defects:
        n = sum(d.verdict == "near-tie" for d in r.divergences)
        if n:
            con.print(f"[green]ok:[/] {n} divergence{'s' if n != 1 else ''}, all near-ties within the measured noise")
        else:
            con.print("[green]ok:[/] every configuration chose the same tokens, within the measured noise at every step")
