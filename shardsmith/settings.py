"""Every ``SHARDSMITH_*`` environment setting, parsed, typed and checked in one place.

No other module reads ``os.environ`` for a ``SHARDSMITH_*`` name (``tests/test_settings.py``
enforces it): modules ask :func:`current` for the :class:`Settings`, and the CLI checks them before
any rank starts (:func:`check`), so a typo is refused at once with every bad entry named, not at
load, at a kernel's first call, or never. Rank processes inherit the environment, so every rank
sees the settings the launcher checked.

Seven variables (:data:`VARIABLES`):

=================  ==========================================================================
kind               variables
=================  ==========================================================================
``user``           ``CACHE`` (the cache folder), ``DEBUG`` (tracebacks), ``PIN_CORES``
``diagnostic``     ``STEP_TRACE`` (one JSON line per engine step)
``debug``          ``KERNELS``: which fused kernels run and which take their PyTorch reference
                   (``all=reference``; ``fused_experts=kernel,hc_pre=reference``; ...)
``measurement``    ``TUNING``: the knobs benchmarks turn (link emulation, launch blocks, the host
                   kernel's instruction set and prefetch, step overlap, ...)
``internal``       ``SPAWNED_BY``: the launcher's pid, set in the rank processes it starts
=================  ==========================================================================

``KERNELS`` and ``TUNING`` hold comma-separated ``key=word`` items (:data:`ITEMS`); later items
override earlier ones, and ``KERNELS``'s key ``all`` sets every kernel at once. Each item is a
typed :class:`Settings` field like the plain variables. The variables that the items replaced are
refused with their new spelling (:data:`REMOVED`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from shardsmith.errors import UsageError

__all__ = ["ITEMS", "CompileRows", "Item", "Kernel", "OffloadMiss", "REMOVED", "Settings", "VARIABLES", "Variable", "check",
           "current", "env", "items", "overrides", "spelling", "with_words"]

KERNELS = "SHARDSMITH_KERNELS"
TUNING = "SHARDSMITH_TUNING"


class Kernel(enum.Enum):
    """A fused kernel's mode: ``auto`` (on for CUDA with Triton), ``kernel`` (on; on CPU only
    under ``TRITON_INTERPRET=1``), ``reference`` (its PyTorch reference path)."""

    AUTO = "auto"
    KERNEL = "kernel"
    OFF = "reference"


class CompileRows(enum.Enum):
    """How the compiled decode pieces take the batch buckets: ``static``, one graph per bucket (each
    bucket's build traces and compiles every piece again), or ``dynamic``, the row count symbolic past
    one row (the two-row bucket compiles, larger buckets reuse its graphs)."""

    STATIC = "static"
    DYNAMIC = "dynamic"


class OffloadMiss(enum.Enum):
    """How the in-place offload serves a missed expert: ``copy`` it into its slot first (a kernel in
    the step's graph), or have the expert kernel ``read`` it from mapped host memory."""

    COPY = "copy"
    READ = "read"


@dataclass(frozen=True, slots=True)
class Variable:
    """One environment variable. Attributes: name (``SHARDSMITH_...``); field: the :class:`Settings`
    attribute ("" for a list variable, whose fields are its :data:`ITEMS`); kind: ``user``,
    ``diagnostic``, ``debug``, ``measurement`` or ``internal``; values: what it takes (for messages
    and the README); default: what unset or empty means; doc: one line."""

    name: str
    field: str
    kind: str
    values: str
    default: str
    doc: str


@dataclass(frozen=True, slots=True)
class Item:
    """One ``key=word`` item of a list variable (``SHARDSMITH_KERNELS`` or ``SHARDSMITH_TUNING``).
    Attributes: variable: the list variable's name; key; field: the :class:`Settings` attribute;
    values, default, doc: as :class:`Variable`'s; old: the variable it replaced ("" for none)."""

    variable: str
    key: str
    field: str
    values: str
    default: str
    doc: str
    old: str


# ------------------------------------------------------------------ word parsers: (raw) -> value, ValueError


def _bit(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return raw == "1"


def _flag(raw: str) -> bool:
    return raw != "0"


def _kernel(raw: str) -> Kernel:
    try:
        return Kernel(raw)
    except ValueError:
        raise ValueError("expected auto, kernel or reference") from None


def _on(raw: str) -> bool:
    """A switch with no kernel of its own: ``on`` (``auto`` and ``kernel`` mean the same) or ``reference``."""
    if raw not in ("on", "auto", "kernel", "reference"):
        raise ValueError("expected on or reference")
    return raw != "reference"


def _choice(kind: type[enum.Enum]) -> Callable[[str], enum.Enum]:
    def parse(raw: str) -> enum.Enum:
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"expected one of {', '.join(m.value for m in kind)}") from None
    return parse


def _positive(raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise ValueError("expected a positive number")
    return v


def _count(low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            v = low - 1
        if not low <= v <= high:
            raise ValueError(f"expected a whole number in {low} .. {high}")
        return v
    return parse


def _blocks(raw: str) -> tuple[int, int]:
    try:
        r, g = (int(v) for v in raw.split("x"))
        if r < 1 or g < 1:
            raise ValueError
    except ValueError:
        raise ValueError("expected two positive ints 'ROWSxGROUPS'") from None
    return r, g


def _isa(raw: str) -> str:
    if raw not in ("scalar", "avx2", "avx512"):
        raise ValueError("expected scalar, avx2 or avx512")
    return raw


MAX_PREFETCH_BYTES = 1 << 20


def _var(name: str, kind: str, values: str, default: str, doc: str, parse: Callable[[str], object] | None,
         value: object) -> object:
    """A :class:`Settings` field read from ``SHARDSMITH_<name>``: ``parse(raw)`` (None: the raw
    string), ``value`` when unset or empty."""
    return field(default=value, metadata={"var": Variable(f"SHARDSMITH_{name}", "", kind, values, default, doc),
                                          "parse": parse})


def _item(variable: str, key: str, values: str, default: str, doc: str, parse: Callable[[str], object],
          value: object, old: str) -> object:
    """A :class:`Settings` field read from item ``key`` of list variable ``variable``."""
    return field(default=value, metadata={"item": Item(variable, key, "", values, default, doc,
                                                       f"SHARDSMITH_{old}" if old else ""),
                                          "parse": parse})


def _kernel_item(key: str, doc: str, old: str = "") -> object:
    return _item(KERNELS, key, "auto, kernel, reference", "auto", doc, _kernel, Kernel.AUTO, old)


@dataclass(frozen=True, slots=True)
class Settings:
    """The environment's settings, typed. Attributes: one per :data:`VARIABLES` field and
    :data:`ITEMS` entry (its doc)."""

    cache_dir: Path = _var("CACHE", "user", "a folder", "~/.cache/shardsmith",
                           "demo wheels and checkpoints, the compiled host expert kernel, compile caches per pack", lambda r: Path(r).expanduser(),
                           Path.home() / ".cache" / "shardsmith")
    debug: bool = _var("DEBUG", "user", "1 (any value but 0)", "off", "show tracebacks", _flag, False)
    pin_cores: bool = _var("PIN_CORES", "user", "0 or 1", "1",
                           "pin each rank to its share of the CPUs (0: a launcher pins)", _bit, True)
    step_trace: Path | None = _var("STEP_TRACE", "diagnostic", "a file", "none",
                                   "append one JSON line per engine step", Path, None)
    spawned_by: int | None = _var("SPAWNED_BY", "internal", "a pid", "unset",
                                  "the launcher's pid, set in the rank processes it starts (a rank watches it)",
                                  _count(1, 2**31), None)
    # SHARDSMITH_KERNELS: each fused kernel, or its PyTorch reference
    fp8_dense: Kernel = _kernel_item("fp8_dense", "FP8 block linears: the Triton kernel, or dequantized at load",
                                     "FP8_DENSE")
    fused_experts: Kernel = _kernel_item("fused_experts", "routed experts in one fused launch", "FUSED_EXPERTS")
    decode_attention: Kernel = _kernel_item("decode_attention", "DeepSeek-V4's decode attention core",
                                            "DECODE_ATTENTION")
    indexer_scores: Kernel = _kernel_item("indexer_scores", "DeepSeek-V4's sparse indexer scores (with the decode "
                                          "attention kernel)", "INDEXER_SCORES")
    prefill_attention: Kernel = _kernel_item("prefill_attention", "DeepSeek-V4's prefill attention and indexer "
                                             "scores over a chunk")
    compressor_step: Kernel = _kernel_item("compressor_step", "DeepSeek-V4's KV compressor decode step",
                                           "COMPRESSOR_STEP")
    hc_pre: Kernel = _kernel_item("hc_pre", "DeepSeek-V4's hyper-connection mixer before a block", "HC_PRE")
    hc_post: Kernel = _kernel_item("hc_post", "DeepSeek-V4's hyper-connection mixer after a block", "HC_POST")
    router_kernel: Kernel = _kernel_item("router", "DeepSeek-V4's router top-k", "ROUTER_KERNEL")
    offload_inplace: Kernel = _kernel_item("offload_inplace", "offloaded experts cached in place on the GPU "
                                           "(auto: FP4 banks; kernel: bf16 too)", "OFFLOAD_INPLACE")
    host_kernel: bool = _item(KERNELS, "host_experts", "on, reference", "on",
                              "the compiled host expert kernel (reference: the PyTorch path)", _on, True, "HOST_KERNEL")
    compile_pieces: Kernel = _kernel_item("compile_pieces", "torch.compile the row-wise pieces of a decode step "
                                          "and a prefill chunk's row-wise maths (auto: on CUDA; kernel: on the "
                                          "CPU too, inductor's C++ code)",
                                          "COMPILE_PIECES")
    merge_projections: bool = _item(KERNELS, "merge_projections", "on, reference", "on",
                                    "merge same-input projections into one launch on the kernel path", _on, True,
                                    "MERGE_PROJECTIONS")
    # SHARDSMITH_TUNING: what benchmarks turn
    overlap_steps: bool | None = _item(TUNING, "overlap_steps", "0 or 1", "on for CUDA at world_size 1",
                                       "overlap a step's host work with the previous step", _bit, None, "OVERLAP_STEPS")
    offload_miss: OffloadMiss = _item(TUNING, "offload_miss", "copy, read", "copy",
                                      "in place: copy a missed expert into its slot, or read it over the link",
                                      _choice(OffloadMiss), OffloadMiss.COPY, "OFFLOAD_MISS")
    emulate_h2d_gbps: float | None = _item(TUNING, "emulate_h2d_gbps", "GB/s > 0", "none",
                                           "emulate a slower host-to-device link", _positive, None, "EMULATE_H2D_GBPS")
    inplace_blocks: tuple[int, int] = _item(TUNING, "inplace_blocks", "ROWSxGROUPS", "16x8",
                                            "the in-place expert launches' rows per program and scale groups per step",
                                            _blocks, (16, 8), "INPLACE_BLOCKS")
    gloo_gather_max: int = _item(TUNING, "gloo_gather_max", "elements >= 0", "65536",
                                 "gloo all-reduces up to this size as one all-gather and a local sum (0: off)",
                                 _count(0, 2**62), 1 << 16, "GLOO_GATHER_MAX")
    host_isa: str | None = _item(TUNING, "host_isa", "scalar, avx2, avx512", "the best this CPU has",
                                 "the host expert kernel's instruction set", _isa, None, "HOST_ISA")
    host_prefetch: int | None = _item(TUNING, "host_prefetch", f"bytes, 0 .. {MAX_PREFETCH_BYTES}", "the kernel's (2048)",
                                      "the host expert kernel's software prefetch distance",
                                      _count(0, MAX_PREFETCH_BYTES), None, "HOST_PREFETCH")
    compile_rows: CompileRows = _item(TUNING, "compile_rows", "static, dynamic", "static",
                                      "the compiled decode pieces: one graph per batch bucket, or one for every "
                                      "bucket past one row (fewer compiles at start)", _choice(CompileRows),
                                      CompileRows.STATIC, "")
    switch_interval_ms: float | None = _item(TUNING, "switch_interval_ms", "milliseconds > 0", "python's",
                                             "the interpreter's thread switch interval", _positive, None,
                                             "SWITCH_INTERVAL_MS")

    @classmethod
    def from_env(cls, env: "os._Environ[str] | dict[str, str]") -> "Settings":
        """Parse every variable of ``env`` (unset or empty: the default).

        Raises:
            UsageError: listing every variable or item that holds a value it does not take, every
                unknown item key, and every removed variable that is set.
        """
        values, problems = {}, []
        for f in fields(cls):
            if "var" in f.metadata:
                var = f.metadata["var"]
                raw = (env.get(var.name) or "").strip()
                if raw:
                    try:
                        values[f.name] = f.metadata["parse"](raw)
                    except ValueError as e:
                        problems.append(f"{var.name}={raw!r}: {e}")
        for name in (KERNELS, TUNING):
            raw = (env.get(name) or "").strip()
            if raw:
                items = _parse_items(name, raw, problems)
                values.update(items)
        problems += [f"{name} was removed: {why}" for name, why in REMOVED.items() if (env.get(name) or "").strip()]
        if problems:
            raise UsageError("; ".join(problems))
        return cls(**values)

    @property
    def spawned(self) -> bool:
        """Whether this process is a rank the launcher started (not one torchrun started)."""
        return self.spawned_by is not None


def _parse_items(name: str, raw: str, problems: list[str]) -> dict[str, object]:
    """``{field: value}`` of list variable ``name``'s ``key=word`` items; bad ones appended to ``problems``."""
    by_key = {i.key: i for i in ITEMS if i.variable == name}
    out: dict[str, object] = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        key, eq, word = (s.strip() for s in part.partition("="))
        if not eq or not word:
            problems.append(f"{name}: {part!r} is not key=word")
            continue
        keys = [k for k in by_key if by_key[k].variable == KERNELS] if (key == "all" and name == KERNELS) else [key]
        if keys[0] not in by_key:
            problems.append(f"{name}: unknown key {key!r} (known: {', '.join(sorted(by_key))}"
                            f"{', all' if name == KERNELS else ''})")
            continue
        for k in keys:
            item = by_key[k]
            try:
                out[item.field] = _PARSE[item.field](word)
            except ValueError as e:
                problems.append(f"{name}: {k}={word!r}: {e}")
                break
    return out


VARIABLES: tuple[Variable, ...] = tuple(
    [dataclasses.replace(f.metadata["var"], field=f.name) for f in fields(Settings) if "var" in f.metadata]
    + [Variable(KERNELS, "", "debug", "key=word, ...", "auto for each",
                "which fused kernels run, or their PyTorch references: all=reference, fused_experts=kernel, ..."),
       Variable(TUNING, "", "measurement", "key=word, ...", "none",
                "benchmark knobs: link emulation, launch blocks, host kernel ISA and prefetch, step overlap, ...")])
ITEMS: tuple[Item, ...] = tuple(dataclasses.replace(f.metadata["item"], field=f.name)
                                for f in fields(Settings) if "item" in f.metadata)
_PARSE = {f.name: f.metadata["parse"] for f in fields(Settings)}
_DEFAULT = {f.name: f.default for f in fields(Settings)}
_BY_FIELD: dict[str, Variable | Item] = {v.field: v for v in VARIABLES if v.field} | {i.field: i for i in ITEMS}

# variables that were deleted or folded into a list variable: set, they are refused with what became of them
REMOVED = {
    "SHARDSMITH_MOE_PATH": "the expert kernel's path is chosen by batch and format (fused_moe.pick_path); "
                           "benchmarks/decode_kernels.py --moe-config path=... compares the paths",
    "SHARDSMITH_FP8_SPLIT_SUM": "fp8_linear always adds its split-K partials in its own launch; "
                                "benchmarks/decode_kernels.py times the separate sum",
    "SHARDSMITH_FP8_GEMV": "one-token FP8 linears always take the GEMV kernel; benchmarks/decode_kernels.py "
                           "times the dot kernel beside it",
    "SHARDSMITH_TEST_SLOW_WRITE": "the interrupt tests slow the split from their own side",
    "SHARDSMITH_SPAWNED": "the launcher sets SHARDSMITH_SPAWNED_BY",
    "SHARDSMITH_PARENT_PID": "the launcher sets SHARDSMITH_SPAWNED_BY",
    **{i.old: f"write {i.variable}={i.key}=<{i.values.replace(', ', '|')}>" for i in ITEMS if i.old},
}
_NAMES = tuple(v.name for v in VARIABLES) + tuple(REMOVED)  # what current() reads


@functools.lru_cache(maxsize=16)
def _parsed(values: tuple[str | None, ...]) -> Settings:
    return Settings.from_env(dict(zip(_NAMES, (v or "" for v in values))))


def spelling(field: str, word: str | None = None) -> str:
    """How :class:`Settings` field ``field`` is written in the environment: ``SHARDSMITH_PIN_CORES``,
    or ``SHARDSMITH_KERNELS=fused_experts`` for an item; ``=word`` appended when given (for messages).

    Raises:
        KeyError: not a field.
    """
    v = _BY_FIELD[field]
    base = f"{v.variable}={v.key}" if isinstance(v, Item) else v.name
    return base if word is None else f"{base}={word}"


def current() -> Settings:
    """The settings of this process's environment now (parsed once per distinct environment).

    Raises:
        UsageError: a variable holds a value it does not take (every one listed).
    """
    return _parsed(tuple(os.environ.get(n) for n in _NAMES))


def debug() -> bool:
    """``$SHARDSMITH_DEBUG`` alone (error handlers ask it even when another setting is malformed)."""
    return _flag((os.environ.get("SHARDSMITH_DEBUG") or "0").strip() or "0")


# the libraries' cache folders as this process found them: inductor writes its default into os.environ the first
# time it asks (torch._dynamo's import does), so a later look cannot tell the user's choice from torch's
_LIBRARY_CACHES = {v: os.environ.get(v) or "" for v in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}


def library_cache_folders() -> dict[str, str]:
    """``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` that the user set (name -> folder), as they
    were when this module was first imported (the CLI imports it before torch)."""
    return {k: v for k, v in _LIBRARY_CACHES.items() if v}


def triton_interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (Triton's own ``TRITON_INTERPRET``, not ours: read here so
    that no other module reads the environment)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def terminal_columns(default: int = 160) -> int:
    """The width ``COLUMNS`` asks for (the shell's), else ``default`` characters."""
    raw = os.environ.get("COLUMNS", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else default


def check() -> Settings:
    """:func:`current`, for the CLI's checks before ranks start (the same errors)."""
    return current()


def word(value: object) -> str:
    """``value`` (a :class:`Settings` field's) as the word the environment takes."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return "" if value is None else str(value)


def _item_word(item: Item, value: object) -> str:
    if isinstance(value, bool) and item.values == "on, reference":
        return "on" if value else "reference"
    return word(value)


def items(s: Settings, variable: str) -> dict[str, str]:
    """``{key: word}`` of every item of list variable ``variable`` (defaults included; unset ones
    left out): what a benchmark records of the run's kernels or knobs."""
    return {i.key: _item_word(i, v) for i in ITEMS if i.variable == variable and (v := getattr(s, i.field)) is not None}


def env(s: Settings) -> dict[str, str]:
    """``{variable name: value}`` that :meth:`Settings.from_env` reads back as ``s`` (every variable
    named; an empty value where ``s`` holds the default or None): for a child process's environment."""
    out = {v.name: word(getattr(s, v.field)) for v in VARIABLES if v.field}
    for name in (KERNELS, TUNING):
        out[name] = ",".join(f"{k}={w}" for k, w in items(s, name).items())
    return out


def with_words(s: Settings | None = None, **words: str) -> Settings:
    """``s`` (default :func:`current`) with fields set from environment words
    (``with_words(fused_experts="kernel", inplace_blocks="4x64")``; an empty word: the default).

    Raises:
        KeyError: a name that is not a field.
        UsageError: a word the field does not take (named with its spelling).
    """
    base = current() if s is None else s
    values = {}
    for name, raw in words.items():
        if not raw:
            values[name] = _DEFAULT[name]
            continue
        try:
            values[name] = _PARSE[name](raw)
        except ValueError as e:
            raise UsageError(f"{spelling(name, repr(raw))}: {e}") from None
    return dataclasses.replace(base, **values)


def overrides(**words: str) -> dict[str, str]:
    """Environment entries that set the given fields (as :func:`with_words`) and keep every other
    setting of :func:`current`: only the variables holding those fields, e.g.
    ``overrides(fused_experts="reference")`` -> ``{"SHARDSMITH_KERNELS": "...,fused_experts=reference,..."}``
    (for ``monkeypatch.setenv``, ``os.environ.update`` or a child process's environment).

    Raises:
        KeyError, UsageError: as :func:`with_words`.
    """
    new = env(with_words(**words))
    names = {v.variable if isinstance(v, Item) else v.name for v in (_BY_FIELD[k] for k in words)}
    return {n: new[n] for n in sorted(names)}
