"""``shardsmith parity``: the same prompts greedily under several configurations, compared.

A configuration is a pack at one world size (split from the checkpoint into a temporary directory
when given a checkpoint; a given pack runs as itself) or transformers' implementation loaded from
the checkpoint (:mod:`shardsmith.parity.reference`). The first configuration is the baseline;
each other one is compared with it by :func:`shardsmith.parity.compare.compare` (first divergent
token, top-2 gaps, noise, verdict) and, with ``layers``, per decoder layer.

Example:
    >>> report = run_parity(Path("ckpt"), tps=[1, 2], prompts=[[1, 2, 3]])  # doctest: +SKIP
    >>> report.exit_code  # doctest: +SKIP
    0
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardsmith.errors import UsageError
from shardsmith.pack.format import load_yaml
from shardsmith.parity.compare import Divergence, LayerError, Trace, compare, first_departing, layer_errors

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
REFERENCE = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}
TRANSFORMERS = "transformers"


@dataclass(frozen=True, slots=True)
class Config:
    """One configuration. Attributes: name (``tp2``, ``tp2-pack``, ``transformers``); world_size;
    path: the pack (or, for transformers, the checkpoint); kind: ``pack`` or ``transformers``."""

    name: str
    world_size: int
    path: Path
    kind: str = "pack"


@dataclass(slots=True)
class ParityReport:
    """Everything a parity run found.

    Attributes:
        configs: in order, the first is the baseline; dtype, ref_dtype: names of the compute dtype
        and reference precision; prompts: token ids; traces: per configuration name, one
        :class:`Trace` per prompt; divergences: one per (prompt, configuration after the first);
        layers: per configuration after the first, its :class:`LayerError` rows (``--layers``).
        refused: configurations the plan refuses at their world size, each with the plan's reason
            (its first problem); they are not run and the next one becomes the baseline.
    """

    configs: list[Config]
    dtype: str
    ref_dtype: str
    prompts: list[list[int]]
    traces: dict[str, list[Trace]]
    divergences: list[Divergence]
    layers: dict[str, list[LayerError]] = field(default_factory=dict)
    refused: list[tuple[Config, str]] = field(default_factory=list)

    @property
    def defects(self) -> list[str]:
        """One line per defect: a divergence called a defect, or a layer that departs."""
        out = [f"prompt {d.prompt}, {d.config}: {d.reason}" for d in self.divergences if d.verdict == "defect"]
        for name, rows in self.layers.items():
            if (layer := first_departing(rows)) is not None:
                out.append(f"{name}: decoder layer {layer} departs first")
        return out

    @property
    def exit_code(self) -> int:
        """0 when every divergence is a near-tie (or none), 2 when a defect is found."""
        return 2 if self.defects else 0


def is_pack(path: Path) -> bool:
    return (path / "pack.yaml").is_file()


def pack_world_size(path: Path) -> int:
    """``world_size`` from ``path/pack.yaml``.

    Raises:
        ManifestError: ``pack.yaml`` is unreadable, not a mapping, or holds a key twice.
        UsageError: ``world_size`` is missing or not a positive integer.
    """
    ws = load_yaml(path / "pack.yaml").get("world_size")
    if not isinstance(ws, int) or ws < 1:
        raise UsageError(f"{path / 'pack.yaml'}: world_size must be a positive integer, got {ws!r}")
    return ws


def plan_configs(source: Path, tps: list[int], *, checkpoint: Path | None, reference: str | None) -> list[tuple[Config, Path | None]]:
    """The configurations, each with the checkpoint to split it from (None: use ``path`` as is).

    A checkpoint ``source`` gives every ``tps`` entry (split on the fly). A pack gives only its
    own world size; the others need ``checkpoint``.

    Raises:
        UsageError: duplicate or non-positive ``tps``; a pack asked for world sizes it cannot
            run without ``checkpoint`` (the message names the possible ones); ``source`` neither
            pack nor checkpoint; transformers without a checkpoint.
    """
    if not tps or any(t < 1 for t in tps) or len(set(tps)) != len(tps):
        raise UsageError(f"--tp must list distinct world sizes >= 1 (e.g. 1,2), got {','.join(map(str, tps))}")
    out: list[tuple[Config, Path | None]] = []
    if is_pack(source):
        ws = pack_world_size(source)
        if checkpoint is None and (set(tps) - {ws} or reference == TRANSFORMERS):
            raise UsageError(
                f"{source} is a pack at world_size={ws}: from it parity can run only --tp {ws} (a pack cannot be "
                f"resliced); give the checkpoint instead, or add --checkpoint CKPT to compare this pack with "
                f"the checkpoint split at the other world sizes{' and transformers' if reference else ''}")
        for t in tps:
            out.append((Config(f"tp{t}-pack", t, source), None) if t == ws else (Config(f"tp{t}", t, Path()), checkpoint))
        if checkpoint is not None:
            _same_model(source, checkpoint)
        ckpt = checkpoint
    elif (source / "config.json").is_file():
        if checkpoint is not None:
            raise UsageError(f"{source} is a checkpoint; --checkpoint is for comparing a pack with its checkpoint")
        out = [(Config(f"tp{t}", t, Path()), source) for t in tps]
        ckpt = source
    else:
        raise UsageError(f"{source}: neither a pack (no pack.yaml) nor a checkpoint (no config.json)")
    if reference not in (None, TRANSFORMERS):
        raise UsageError(f"--reference must be {TRANSFORMERS!r}, got {reference!r}")
    if reference:
        out.append((Config(TRANSFORMERS, 1, ckpt, kind=TRANSFORMERS), None))
    return out


def _same_model(pack: Path, checkpoint: Path) -> None:
    """Refuse comparing a pack with a checkpoint of another model (their ``config.json`` differ).

    Raises:
        UsageError: naming the first differing key, or a missing ``config.json``.
    """
    import json

    try:
        a, b = (json.loads((p / "config.json").read_text(encoding="utf-8")) for p in (pack, checkpoint))
    except (OSError, ValueError) as e:
        raise UsageError(f"--checkpoint {checkpoint}: cannot read config.json of it or of {pack} ({e})") from e
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and not k.startswith("_"))
    if keys:
        raise UsageError(f"--checkpoint {checkpoint} is not the model of {pack}: config.json differs in "
                         f"{keys[0]!r} ({b.get(keys[0])!r} vs the pack's {a.get(keys[0])!r})")


def run_parity(source: Path, *, tps: list[int], prompts: list[list[int]], checkpoint: Path | None = None,
               reference: str | None = None, dtype: str = "bfloat16", max_tokens: int = 16, top_k: int = 8,
               layers: bool = False, device: str = "cpu", verify_hashes: bool = True,
               workdir: Path | None = None, progress: Callable[[str], None] = lambda _m: None) -> ParityReport:
    """Run ``prompts`` greedily under every configuration and compare each with the first.

    Args:
        source: checkpoint or pack; tps: world sizes, the first is the baseline (then transformers).
        prompts: token ids per prompt; max_tokens: greedy tokens per prompt (EOS does not stop them).
        dtype: compute dtype name; the reference precision is float32 (float64 for float32).
        top_k: tokens probed per step (K >= 2); layers: compare decoder-layer outputs too.
        workdir: where packs and traces go (default: a temporary directory, removed afterwards).

    A world size the model's plan refuses (a head count or an FP8 block that cannot be shared by
    that many ranks) is listed in the report's ``refused`` with the plan's reason; the rest run.

    Raises:
        UsageError: bad options (see :func:`plan_configs`), empty prompts, top_k < 2; or the plan
            refuses every configuration (each named with its reason).
        ShardsmithError: a rank's load or run error, as its class (IntegrityError: exit 2).
    """
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if top_k < 2 or max_tokens < 1 or not prompts or not all(prompts):
        raise UsageError(f"need --top-k >= 2 (got {top_k}), --max-tokens >= 1 (got {max_tokens}) and non-empty prompts")
    plan = plan_configs(Path(source), tps, checkpoint=checkpoint, reference=reference)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="shardsmith-parity-") as tmp:
            return _run(plan, Path(tmp), prompts, dtype, max_tokens, top_k, layers, device, verify_hashes, progress)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    return _run(plan, Path(workdir), prompts, dtype, max_tokens, top_k, layers, device, verify_hashes, progress)


def _run(plan, work: Path, prompts, dtype, max_tokens, top_k, layers, device, verify_hashes, progress) -> ParityReport:
    from shardsmith.parity.collect import Probe
    from shardsmith.parity.ranks import RankTask, run_task
    from shardsmith.writer.split import split_checkpoint

    from shardsmith.errors import PlanError

    dt, ref = DTYPES[dtype], REFERENCE[DTYPES[dtype]]
    configs, traces, probes, refused = [], {}, None, []
    seq = max(len(p) for p in prompts) + max_tokens + 1
    for config, ckpt in plan:
        if ckpt is not None:
            progress(f"splitting {ckpt} at world_size={config.world_size}")
            out = work / config.name
            try:
                split_checkpoint(ckpt, out, world_size=config.world_size)
            except PlanError as e:  # raised before a byte is written
                lines = [ln.strip().removeprefix("- ") for ln in str(e).splitlines() if ln.strip()]
                refused.append((config, ": ".join([lines[0].rstrip(":"), *lines[1:2]])))
                progress(f"skipping {config.name}: the plan refuses world_size={config.world_size}")
                continue
            config = Config(config.name, config.world_size, out, config.kind)
        progress(f"running {config.name} ({dtype}, then {str(ref).removeprefix('torch.')} for the noise)")
        if config.kind == TRANSFORMERS:
            from shardsmith.parity.reference import loadable_checkpoint, run_transformers

            got = run_transformers(loadable_checkpoint(config.path, work / "transformers-checkpoint", progress), prompts, dtype=dt, ref_dtype=ref, max_tokens=max_tokens,
                                   top_k=top_k, probes=probes, layers=layers, device=device)
        else:
            task = RankTask(config.path, config.world_size, device, dt, ref, prompts, max_tokens, top_k, probes,
                            layers, verify_hashes, seq, work / f"{config.name}.pt")
            got = run_task(task)
        configs.append(config)
        traces[config.name] = got
        if probes is None:
            probes = [Probe(t.tokens, t.top_ids) for t in got]
    if not configs:
        raise UsageError("parity has nothing to run; the plan refuses every configuration:\n" +
                         "\n".join(f"  - {c.name}: {why}" for c, why in refused))
    names = [c.name for c in configs]
    independent = frozenset(c.name for c in configs if c.kind == TRANSFORMERS)
    divergences = [d for i in range(len(prompts))
                   for d in compare(i, names, [traces[n][i] for n in names], independent=independent)]
    layer_rows = {n: layer_errors(traces[names[0]], traces[n], independent=n in independent)
                  for n in names[1:]} if layers else {}
    return ParityReport(configs, dtype, str(ref).removeprefix("torch."), prompts, traces, divergences, layer_rows,
                        refused)
