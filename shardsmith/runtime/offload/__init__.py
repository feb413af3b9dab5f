"""Offloaded routed experts: host banks, a GPU expert cache, a host executor, and a start-up probe.

With routed experts in host RAM, tensor parallelism divides each rank's expert bytes: every rank
holds and moves only its intermediate share of each expert (TP-within-expert), so at equal cache
bytes per GPU the cache holds world_size times more experts and each PCIe link moves
1/world_size of the bytes. CPU offload is a *placement* of an expert bank, not a split style.

================  ==============================================================
module            role
================  ==============================================================
``host_bank``     read the rank's bank files into host memory, pin after filling
``slots``         deterministic slot table (LRU / LRU + hot set), identical on all ranks
``expert_cache``  the slot pool on the GPU, batched miss copies on a copy stream
``cpu_backend``   routed experts computed on the host from the banks
``probe``         measured H2D bandwidth and host expert time; the backend choice
``config``        the options (:class:`OffloadConfig`)
``runtime``       one rank's host banks, cache, executor and counters (:class:`OffloadRuntime`)
``attach``        the drop-in expert module and :func:`attach_offload`
================  ==============================================================
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .attach import OffloadedExperts, attach_offload
    from .config import OffloadConfig
    from .runtime import OffloadRuntime
    from .slots import Policy, SlotTable

_EXPORTS = {"OffloadConfig": "config", "OffloadRuntime": "runtime", "OffloadedExperts": "attach", "Policy": "slots",
            "SlotTable": "slots", "attach_offload": "attach"}
__all__ = ["OffloadConfig", "OffloadRuntime", "OffloadedExperts", "Policy", "SlotTable", "attach_offload"]


def __getattr__(name: str):
    """The package's names, imported on first use (PEP 562): the CLI reads :mod:`.config` and
    :mod:`.cpu_flags` before any rank starts, without importing torch."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
