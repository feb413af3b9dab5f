"""CLI command ``parity``: is a TP difference numerics or a bug? (:mod:`shardsmith.parity`).

Thin: parse options, tokenize the prompts, call :func:`shardsmith.parity.run.run_parity`, print
the tables on stderr (``--json``: the report on stdout) and exit 0 (no divergence, or near-ties
only), 2 (a defect: an integrity failure in the exit-code table) or 1 (usage error).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .errors import UsageError

DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at a temperature of")
ID_PROMPTS = 3  # prompts made of token ids when the source has no tokenizer


def parse_tp(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``.

    Raises:
        UsageError: a part that is not a positive integer.
    """
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(t < 1 for t in out):
        raise UsageError(f"--tp must be comma-separated world sizes >= 1 such as 1,2; got {text!r}")
    return out


def read_prompts(path: Path | None, root: Path) -> tuple[list[list[int]], object | None]:
    """Token ids of each prompt, and the tokenizer (None when the source has none).

    ``path`` holds one prompt per line (blank lines skipped); a line ``ids: 5 17 42`` gives token
    ids directly. Without ``path``: :data:`DEFAULT_PROMPTS`, or fixed id prompts when ``root``
    has no ``tokenizer.json``.

    Raises:
        UsageError: the file is unreadable or empty, a bad ``ids:`` line, or text without a tokenizer.
    """
    codec = None
    if (root / "tokenizer.json").is_file():
        from shardsmith.runtime.serve.tokenizer import Codec

        codec = Codec(root)
    if path is None:
        if codec is None:
            vocab = int(json.loads((root / "config.json").read_text(encoding="utf-8")).get("vocab_size", 2))
            return [[(7 + 31 * i + 13 * j * (i + 1)) % vocab for j in range(8)] for i in range(ID_PROMPTS)], None
        return [codec.encode_prompt(p) for p in DEFAULT_PROMPTS], codec
    try:
        lines = [(n, ln) for n, ln in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if ln.strip()]
    except OSError as e:
        raise UsageError(f"--prompts {path}: cannot read it ({e.strerror})") from e
    if not lines:
        raise UsageError(f"--prompts {path}: no prompts (one per line; 'ids: 1 2 3' for token ids)")
    out = []
    for n, line in lines:
        if line.startswith("ids:"):
            try:
                out.append([int(x) for x in line[4:].split()])
            except ValueError:
                raise UsageError(f"--prompts {path}:{n}: 'ids:' must be followed by integers, got {line!r}") from None
        elif codec is None:
            raise UsageError(f"--prompts {path}:{n}: a text prompt needs {root / 'tokenizer.json'}; "
                             "give token ids as 'ids: 1 2 3'")
        else:
            out.append(codec.encode_prompt(line))
        if not out[-1]:
            raise UsageError(f"--prompts {path}:{n}: the prompt is empty")
    return out, codec


def parity(
    path: Path = typer.Argument(..., metavar="PATH", help="Checkpoint (split on the fly per --tp) or pack (runs at its own world size)."),
    tp: str = typer.Option("1,2", "--tp", help="World sizes to compare, the first is the baseline (e.g. 1,2,4)."),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="With a pack: its checkpoint, for the other --tp."),
    reference: str | None = typer.Option(None, "--reference", help="'transformers': add transformers' model as a configuration."),
    prompts: Path | None = typer.Option(None, "--prompts", help="One prompt per line ('ids: 1 2 3' for token ids)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Compute dtype: bfloat16, float16 or float32."),
    max_tokens: int = typer.Option(16, "--max-tokens", help="Greedy tokens per prompt."),
    top_k: int = typer.Option(8, "--top-k", help="Tokens whose log-probs are compared per step (>= 2)."),
    layers: bool = typer.Option(False, "--layers", help="Per decoder layer: relative error of its output."),
    device: str = typer.Option("cpu", "--device", help="cpu (gloo) or cuda (NCCL, rank r on cuda:r)."),
    verify_hashes: bool = typer.Option(True, "--verify-hashes/--no-verify", help="Hash pack files as they load."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    """Run the same prompts greedily at each --tp and say whether differences are near-ties or a defect."""
    from shardsmith.parity.report import print_tables, to_json
    from shardsmith.parity.run import run_parity
    from shardsmith.ui import emit_json, err_console

    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory (give a checkpoint or a pack)")
    tps = parse_tp(tp)
    ids, codec = read_prompts(prompts, path if checkpoint is None else checkpoint)
    con = err_console()
    report = run_parity(path, tps=tps, prompts=ids, checkpoint=checkpoint, reference=reference, dtype=dtype,
                        max_tokens=max_tokens, top_k=top_k, layers=layers, device=device,
                        verify_hashes=verify_hashes, progress=lambda m: con.print(f"[dim]{m}[/]"))
    print_tables(report, decode=(lambda t: codec.decode([t], skip_special_tokens=False)) if codec else None)
    if as_json:
        emit_json(to_json(report))
    if report.defects:  # raised, not typer.Exit(2): the entry point maps IntegrityError to exit 2
        from .errors import IntegrityError, format_problems

        raise IntegrityError(format_problems(f"parity of {path}: a defect, not rounding noise", report.defects),
                             report.defects)


def register(app: typer.Typer) -> None:
    """Add ``parity`` to ``app``."""
    app.command("parity")(parity)
