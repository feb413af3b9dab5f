"""The CPU's instruction sets, as the host expert kernel needs them, read without importing torch
(the CLI checks ``SHARDSMITH_TUNING=host_isa`` before any rank starts).

Source: ``/proc/cpuinfo``'s ``flags`` line (Linux); elsewhere no flags, so only ``scalar``.
"""

from __future__ import annotations

from shardsmith import settings
from shardsmith.errors import UsageError

ISA_FLAGS = (("avx2", frozenset({"avx2", "fma", "f16c"})), ("avx512", frozenset({"avx512f", "avx512bw"})))
"""Each instruction set of the host kernel past ``scalar`` and the CPU flags it needs (``avx512``
builds on ``avx2``)."""


def cpu_flags() -> str:
    """The first ``flags`` line of ``/proc/cpuinfo`` (space-separated), or ``""`` where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def allowed_isas() -> list[str]:
    """The host kernel's instruction sets this CPU's flags allow, weakest first (``scalar`` always)."""
    flags = set(cpu_flags().split())
    return ["scalar"] + [isa for isa, need in ISA_FLAGS if need <= flags]


def check_settings() -> None:
    """``SHARDSMITH_TUNING=host_isa``, when set, names an instruction set this CPU's flags allow; checked
    without building the kernel: for the CLI, before ranks start.

    Raises:
        UsageError: a malformed host setting (:mod:`shardsmith.settings`), or an ISA this CPU lacks.
    """
    allowed = allowed_isas()
    want = settings.current().host_isa
    if want and want not in allowed:
        raise UsageError(f"{settings.spelling('host_isa', repr(want))}: this CPU supports {', '.join(allowed)}")
