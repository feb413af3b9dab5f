"""Expert offload options: ``--moe-backend``, ``--expert-cache-gb``, ``--expert-policy`` as one record."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import UsageError
from .slots import Policy

BACKENDS = ("auto", "gpu", "cpu", "hybrid")
POLICIES = tuple(p.value for p in Policy)
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """How routed experts are placed (``--moe-backend``, ``--expert-cache-gb``, ...).

    Attributes:
        backend: ``auto`` (the probe decides, never a slower one), ``gpu`` (slot cache), ``cpu``
            (host computes every routed expert) or ``hybrid`` (a share of misses on the host).
        cache_bytes: slot pool bytes per GPU; None: free device memory after weights and KV cache
            minus ``reserve_bytes`` (on a CPU device: every expert).
        cache_slots: exact slot count (tests); overrides ``cache_bytes``.
        policy: ``hot`` (LRU with a frequency-pinned hot set) or ``lru``; hot_fraction: its share.
        pin: ``auto``, ``require`` or ``off`` (:func:`~.host_bank.load_host_banks`).
        hybrid_fraction: share of misses for the host in ``hybrid`` (None: the probe's balance).
        probe: run the start-up probe on a CUDA device (off, or on a CPU device: no measurements, ``auto``
            means ``gpu`` on CUDA and ``cpu`` otherwise).
        log_decisions: keep the slot table's decision log (tests).
    """

    backend: str = "auto"
    cache_bytes: int | None = None
    cache_slots: int | None = None
    policy: str = "hot"
    hot_fraction: float = 0.75  # measured best of 0.25/0.5/0.75 on SmolLM2 and Zipf traces (RESULTS.md)
    pin: str = "auto"
    reserve_bytes: int = 2 * GiB
    hybrid_fraction: float | None = None
    probe: bool = True
    log_decisions: bool = False

    @classmethod
    def from_cli(cls, *, moe_backend: str = "auto", expert_cache_gb: float | None = None,
                 expert_policy: str = "hot") -> "OffloadConfig":
        """From the ``serve``/``generate`` options.

        Raises:
            UsageError: an unknown backend or policy, or a cache size that is negative or not finite.
        """
        if moe_backend not in BACKENDS:
            raise UsageError(f"--moe-backend must be one of {', '.join(BACKENDS)}, got {moe_backend!r}")
        if expert_cache_gb is not None and not (math.isfinite(expert_cache_gb) and expert_cache_gb >= 0):
            raise UsageError(f"--expert-cache-gb must be a number >= 0, got {expert_cache_gb}")
        if expert_policy not in POLICIES:
            raise UsageError(f"--expert-policy must be one of {', '.join(POLICIES)}, got {expert_policy!r}")
        return cls(backend=moe_backend, policy=expert_policy,
                   cache_bytes=None if expert_cache_gb is None else int(expert_cache_gb * GiB))
