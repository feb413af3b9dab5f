"""Every ``SHARDSMITH_*`` environment setting, parsed, typed and checked in one place.

No other module reads ``os.environ`` for a ``SHARDSMITH_*`` name (``tests/test_settings.py``
enforces it): modules ask :func:`current` for the :class:`Settings`, and the CLI checks them before
any rank starts (:func:`check`), so a typo is refused at once with every bad variable named, not
at load, at a kernel's first call, or never. Rank processes inherit the environment, so every rank
sees the settings the launcher checked.

==============  =============================================================================
kind            what they are
==============  =============================================================================
``user``        settings a user sets (cache folder, tracebacks, core pinning)
``kernel``      each fused kernel's switch (``auto``, ``kernel``, ``off``), the in-place offload's
                modes, compiled pieces, merged projections: the PyTorch references stay reachable
                for tests, parity and measurements
``diagnostic``  step trace, thread switch interval, step overlap, the host kernel's switch, ISA and
                prefetch, link emulation, launch blocks, the gloo all-gather sum's bound
``internal``    the launcher's own markers and the split's test hook
==============  =============================================================================

The table of names, values and defaults is :data:`VARIABLES` (README's settings table is checked
against it).
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

__all__ = ["Kernel", "OffloadMiss", "Settings", "VARIABLES", "Variable", "check", "current"]


class Kernel(enum.Enum):
    """A fused kernel's switch: ``auto`` (on for CUDA with Triton), ``kernel`` (on; on CPU only
    under ``TRITON_INTERPRET=1``), ``off`` (the PyTorch reference path)."""

    AUTO = "auto"
    KERNEL = "kernel"
    OFF = "off"


class OffloadMiss(enum.Enum):
    """How the in-place offload serves a missed expert: ``copy`` it into its slot first (a kernel in
    the step's graph), or have the expert kernel ``read`` it from mapped host memory."""

    COPY = "copy"
    READ = "read"


@dataclass(frozen=True, slots=True)
class Variable:
    """One environment setting. Attributes: name (``SHARDSMITH_...``); field: the :class:`Settings`
    attribute; kind: ``user``, ``kernel``, ``diagnostic`` or ``internal``; values: what it takes
    (for messages and the README); default: what unset or empty means; doc: one line."""

    name: str
    field: str
    kind: str
    values: str
    default: str
    doc: str


def _bit(name: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return raw == "1"


def _flag(name: str, raw: str) -> bool:
    return raw != "0"


def _kernel(off_words: tuple[str, ...] = ("off",)) -> Callable[[str, str], Kernel]:
    def parse(name: str, raw: str) -> Kernel:
        if raw in off_words:
            return Kernel.OFF
        if raw not in ("auto", "kernel"):
            raise ValueError(f"expected auto, kernel or {off_words[0]}")
        return Kernel(raw)
    return parse


def _choice(kind: type[enum.Enum]) -> Callable[[str, str], enum.Enum]:
    def parse(name: str, raw: str) -> enum.Enum:
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"expected one of {', '.join(m.value for m in kind)}") from None
    return parse


def _number(*, zero: bool, rule: str) -> Callable[[str, str], float]:
    """A finite number above 0 (or at least 0 with ``zero``); ``rule`` is the message's wording."""
    def parse(name: str, raw: str) -> float:
        try:
            v = float(raw)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and (v >= 0 if zero else v > 0)):
            raise ValueError(f"expected {rule}")
        return v
    return parse


_positive = _number(zero=False, rule="a positive number")
_seconds = _number(zero=True, rule="seconds >= 0")


def _count(low: int, high: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            v = low - 1
        if not low <= v <= high:
            raise ValueError(f"expected a whole number in {low} .. {high}")
        return v
    return parse


def _pair(name: str, raw: str) -> tuple[int, int]:
    try:
        r, g = (int(v) for v in raw.split(","))
        if r < 1 or g < 1:
            raise ValueError
    except ValueError:
        raise ValueError("expected two positive ints 'block_r,block_g'") from None
    return r, g


def _isa(name: str, raw: str) -> str:
    if raw not in ("scalar", "avx2", "avx512"):
        raise ValueError("expected scalar, avx2 or avx512")
    return raw


def _pid(name: str, raw: str) -> int:
    return _count(1, 2**31)(name, raw)


MAX_PREFETCH_BYTES = 1 << 20

# switches whose default was settled and that were deleted: set, they are refused with what became of them
REMOVED = {
    "SHARDSMITH_MOE_PATH": "the expert kernel's path is chosen by batch and format (fused_moe.pick_path); "
                           "benchmarks/decode_kernels.py --moe-config path=... compares the paths",
    "SHARDSMITH_FP8_SPLIT_SUM": "fp8_linear always adds its split-K partials in its own launch; "
                                "benchmarks/decode_kernels.py times the separate sum",
    "SHARDSMITH_FP8_GEMV": "one-token FP8 linears always take the GEMV kernel; benchmarks/decode_kernels.py "
                           "times the dot kernel beside it",
}


def _var(name: str, kind: str, values: str, default: str, doc: str, parse: Callable | None, value: object) -> object:
    """A :class:`Settings` field read from ``SHARDSMITH_<name>``: ``parse(name, raw)`` (None: the raw
    string), ``value`` when unset or empty."""
    return field(default=value, metadata={"var": Variable(f"SHARDSMITH_{name}", "", kind, values, default, doc),
                                          "parse": parse})


@dataclass(frozen=True, slots=True)
class Settings:
    """The environment's settings, typed. Attributes: one per :data:`VARIABLES` entry (its doc)."""

    cache_dir: Path = _var("CACHE", "user", "a folder", "~/.cache/shardsmith",
                           "demo wheels and checkpoints, the compiled host expert kernel", lambda n, r: Path(r).expanduser(),
                           Path.home() / ".cache" / "shardsmith")
    debug: bool = _var("DEBUG", "user", "1 (any value but 0)", "off", "show tracebacks", _flag, False)
    pin_cores: bool = _var("PIN_CORES", "user", "0 or 1", "1",
                           "pin each rank to its share of the CPUs (0: a launcher pins)", _bit, True)
    fp8_dense: Kernel = _var("FP8_DENSE", "kernel", "auto, kernel, dequantize", "auto",
                             "FP8 block linears: the Triton kernel, or dequantized at load",
                             _kernel(("dequantize", "off")), Kernel.AUTO)
    fused_experts: Kernel = _var("FUSED_EXPERTS", "kernel", "auto, kernel, off", "auto",
                                 "routed experts in one fused launch", _kernel(), Kernel.AUTO)
    decode_attention: Kernel = _var("DECODE_ATTENTION", "kernel", "auto, kernel, off", "auto",
                                    "DeepSeek-V4's decode attention core", _kernel(), Kernel.AUTO)
    indexer_scores: Kernel = _var("INDEXER_SCORES", "kernel", "auto, kernel, off", "auto",
                                  "DeepSeek-V4's sparse indexer scores (with the decode attention kernel)",
                                  _kernel(), Kernel.AUTO)
    compressor_step: Kernel = _var("COMPRESSOR_STEP", "kernel", "auto, kernel, off", "auto",
                                   "DeepSeek-V4's KV compressor decode step", _kernel(), Kernel.AUTO)
    hc_pre: Kernel = _var("HC_PRE", "kernel", "auto, kernel, off", "auto",
                          "DeepSeek-V4's hyper-connection mixer before a block", _kernel(), Kernel.AUTO)
    hc_post: Kernel = _var("HC_POST", "kernel", "auto, kernel, off", "auto",
                           "DeepSeek-V4's hyper-connection mixer after a block", _kernel(), Kernel.AUTO)
    router_kernel: Kernel = _var("ROUTER_KERNEL", "kernel", "auto, kernel, off", "auto",
                                 "DeepSeek-V4's router top-k", _kernel(), Kernel.AUTO)
    offload_inplace: Kernel = _var("OFFLOAD_INPLACE", "kernel", "auto, kernel, off", "auto",
                                   "offloaded experts cached in place on the GPU (auto: FP4 banks; kernel: bf16 too)",
                                   _kernel(), Kernel.AUTO)
    offload_miss: OffloadMiss = _var("OFFLOAD_MISS", "kernel", "copy, read", "copy",
                                     "in place: copy a missed expert into its slot, or read it over the link",
                                     _choice(OffloadMiss), OffloadMiss.COPY)
    compile_pieces: bool = _var("COMPILE_PIECES", "kernel", "0 or 1", "1",
                                "torch.compile the row-wise pieces of a decode step on CUDA", _bit, True)
    merge_projections: bool = _var("MERGE_PROJECTIONS", "kernel", "0 or 1", "1",
                                   "merge same-input projections into one launch on the kernel path", _bit, True)
    step_trace: Path | None = _var("STEP_TRACE", "diagnostic", "a file", "none",
                                   "append one JSON line per engine step", lambda n, r: Path(r), None)
    switch_interval_ms: float | None = _var("SWITCH_INTERVAL_MS", "diagnostic", "milliseconds > 0", "python's",
                                            "the interpreter's thread switch interval", _positive, None)
    overlap_steps: bool | None = _var("OVERLAP_STEPS", "diagnostic", "0 or 1", "on for CUDA at world_size 1",
                                      "overlap a step's host work with the previous step", _bit, None)
    host_kernel: bool = _var("HOST_KERNEL", "diagnostic", "0 or 1", "1",
                             "the compiled host expert kernel (0: the PyTorch path)", _bit, True)
    host_isa: str | None = _var("HOST_ISA", "diagnostic", "scalar, avx2, avx512", "the best this CPU has",
                                "the host expert kernel's instruction set", _isa, None)
    host_prefetch: int | None = _var("HOST_PREFETCH", "diagnostic", f"bytes, 0 .. {MAX_PREFETCH_BYTES}",
                                     "the kernel's (2048)", "the host expert kernel's software prefetch distance",
                                     _count(0, MAX_PREFETCH_BYTES), None)
    emulate_h2d_gbps: float | None = _var("EMULATE_H2D_GBPS", "diagnostic", "GB/s > 0", "none",
                                          "emulate a slower host-to-device link (offload measurements)", _positive, None)
    inplace_blocks: tuple[int, int] = _var("INPLACE_BLOCKS", "diagnostic", "block_r,block_g", "16,8",
                                           "the in-place expert launches' rows per program and scale groups per step",
                                           _pair, (16, 8))
    gloo_gather_max: int = _var("GLOO_GATHER_MAX", "diagnostic", "elements >= 0", "65536",
                                "gloo all-reduces up to this size as one all-gather and a local sum (0: off)",
                                _count(0, 2**62), 1 << 16)
    spawned: bool = _var("SPAWNED", "internal", "1", "unset", "set by the launcher in the rank processes it starts",
                         _flag, False)
    parent_pid: int | None = _var("PARENT_PID", "internal", "a pid", "unset",
                                  "the launcher's pid, which a rank watches", _pid, None)
    test_slow_write: float = _var("TEST_SLOW_WRITE", "internal", "seconds >= 0", "0",
                                  "split sleeps this long per tensor written (the interrupt tests)", _seconds, 0.0)

    @classmethod
    def from_env(cls, env: "os._Environ[str] | dict[str, str]") -> "Settings":
        """Parse every variable of ``env`` (unset or empty: the default).

        Raises:
            UsageError: listing every variable that holds a value it does not take.
        """
        values, problems = {}, []
        for f in fields(cls):
            var, parse = f.metadata["var"], f.metadata["parse"]
            raw = (env.get(var.name) or "").strip()
            if not raw:
                continue
            try:
                values[f.name] = parse(var.name, raw)
            except ValueError as e:
                problems.append(f"{var.name}={raw!r}: {e}")
        problems += [f"{name} was removed: {why}" for name, why in REMOVED.items() if (env.get(name) or "").strip()]
        if problems:
            raise UsageError("; ".join(problems))
        return cls(**values)


VARIABLES: tuple[Variable, ...] = tuple(dataclasses.replace(f.metadata["var"], field=f.name) for f in fields(Settings))
_BY_FIELD = {v.field: v for v in VARIABLES}
_NAMES = tuple(v.name for v in VARIABLES) + tuple(REMOVED)  # what current() reads


@functools.lru_cache(maxsize=16)
def _parsed(values: tuple[str | None, ...]) -> Settings:
    return Settings.from_env(dict(zip(_NAMES, (v or "" for v in values))))


def variable(field: str) -> Variable:
    """The :data:`VARIABLES` entry of :class:`Settings` field ``field``.

    Raises:
        KeyError: not a field.
    """
    return _BY_FIELD[field]


def current() -> Settings:
    """The settings of this process's environment now (parsed once per distinct environment).

    Raises:
        UsageError: a variable holds a value it does not take (every one listed).
    """
    return _parsed(tuple(os.environ.get(n) for n in _NAMES))


def debug() -> bool:
    """``$SHARDSMITH_DEBUG`` alone (error handlers ask it even when another setting is malformed)."""
    return _flag("SHARDSMITH_DEBUG", (os.environ.get("SHARDSMITH_DEBUG") or "0").strip() or "0")


def check() -> Settings:
    """:func:`current`, for the CLI's checks before ranks start (the same errors)."""
    return current()


def words(s: Settings, *, kind: str | None = None) -> dict[str, str]:
    """``{variable name: its value as the word the environment takes}`` for every variable (of
    ``kind``), defaults included: what a benchmark records of the run's settings."""
    def word(v: object) -> str:
        if isinstance(v, enum.Enum):
            return str(v.value)
        if isinstance(v, bool):
            return "1" if v else "0"
        if isinstance(v, tuple):
            return ",".join(map(str, v))
        return "" if v is None else str(v)

    return {v.name: word(getattr(s, v.field)) for v in VARIABLES if kind is None or v.kind == kind}


def child_env(**values: str) -> dict[str, str]:
    """``SHARDSMITH_*`` entries for a child process's environment, by :class:`Settings` field name
    (``child_env(spawned="1")`` -> ``{"SHARDSMITH_SPAWNED": "1"}``).

    Raises:
        KeyError: a name that is not a field.
    """
    return {_BY_FIELD[k].name: v for k, v in values.items()}
