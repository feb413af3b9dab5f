"""The GPU expert cache: a pool of expert slots filled from the host banks on a copy stream.

A slot holds one expert's rank shard of every bank array, in stored format (FP8 stays FP8, FP4
stays packed), so a slot is the same size as the expert's bytes in the host bank:

=================  ===========================  =======================================
pool array         shape                        filled from
=================  ===========================  =======================================
``gate_up``        ``[S, 2*I_r, D]``            ``host[layer]["gate_up"][e]``
``down``           ``[S, D, I_r]``              ``host[layer]["down"][e]``
``*_scale``        ``[S, rows, cols]``          the matching scale rows
=================  ===========================  =======================================

Which expert goes where is decided by a :class:`~shardsmith.runtime.offload.slots.SlotTable`
(deterministic, identical on every rank). The misses of one request are copied in one batch on a
dedicated CUDA stream that first waits for the compute stream (a victim slot may still be read by
queued kernels); the caller computes the hits meanwhile and waits on :meth:`ExpertCache.wait`
before touching the misses. On a CPU "device" the pool is just more host memory and copies are
synchronous (the same logic, for tests and CPU benchmarks).

Legend: S = slots, E = experts, D = hidden, I_r = this rank's intermediate share.
"""

from __future__ import annotations

import time

import torch

from ...errors import RuntimeLoadError
from . import link_cap
from .host_bank import HostBanks
from .slots import Policy, SlotTable

REFRESH_STEPS = 4  # decode steps between hot-set recomputations


def slot_signature(host: HostBanks) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Array name -> (dtype, one expert's shape), checked equal across every MoE layer.

    Raises:
        RuntimeLoadError: two layers whose experts differ (one pool cannot hold both).
    """
    sig, first = None, None
    for layer, arrays in host.layers.items():
        s = {name: (a.dtype, tuple(a.shape[1:])) for name, a in sorted(arrays.items())}
        if sig is None:
            sig, first = s, layer
        elif s != sig:
            raise RuntimeLoadError(f"expert cache: {layer} experts {s} differ from {first} experts {sig}; "
                                   "one slot pool needs one expert shape")
    if sig is None:
        raise RuntimeLoadError("expert cache: the model has no expert banks")
    return sig


def slot_nbytes(sig: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """Bytes of one slot (one expert's rank shard, every array)."""
    total = 0
    for dtype, shape in sig.values():
        n = 1
        for d in shape:
            n *= d
        total += n * torch.empty(0, dtype=dtype).element_size()
    return total


class ExpertCache:
    """``n_slots`` expert slots on ``device`` over the host banks ``host``.

    Args:
        host: the rank's host banks; layers: bank layer keys in model order (index = layer number
            used in keys); n_slots: S; device: pool device; policy, hot_fraction: see
            :class:`SlotTable`; log: keep the decision log.

    Attributes:
        table: the slot table; pool: array name -> ``[S, ...]`` device tensor; slot_bytes: bytes per slot.
        bytes_copied: host-to-device bytes moved so far; copy_s: seconds those copies took (GPU
            events on the copy stream, resolved lazily; wall time on CPU).
    """

    def __init__(self, host: HostBanks, layers: list[str], n_slots: int, device: torch.device, *,
                 policy: Policy | str = Policy.HOT, hot_fraction: float = 0.75, log: bool = False) -> None:
        self.host, self.layers, self.device = host, layers, torch.device(device)
        self.sig = slot_signature(host)
        self.slot_bytes = slot_nbytes(self.sig)
        # hot set recomputed every 4 decode steps (4 requests per MoE layer): hit rates within 0.2% of
        # every 64 requests at DeepSeek-V4-Flash scale, at half the host time (RESULTS.md, slot_table)
        self.table = SlotTable(n_slots, policy=policy, hot_fraction=hot_fraction, log=log,
                               refresh=max(64, REFRESH_STEPS * len(layers)))
        self.pool = {name: torch.empty((n_slots, *shape), dtype=dtype, device=self.device)
                     for name, (dtype, shape) in self.sig.items()}
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._done: torch.cuda.Event | None = None
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.bytes_copied, self.copy_s, self.copies = 0, 0.0, 0

    @property
    def n_slots(self) -> int:
        return self.table.n_slots

    def arrays(self, slot: int) -> dict[str, torch.Tensor]:
        """One slot's arrays (views of the pool)."""
        return {name: p[slot] for name, p in self.pool.items()}

    def fetch(self, layer: int, experts: list[int]) -> tuple[list[int], list[int]]:
        """Make ``experts`` of layer ``layer`` resident; start copying the misses (one batch).

        Returns:
            ``(slots, missed)``: the slot of each expert in order, and the experts that were copied
            (usable after :meth:`wait`).
        """
        slots, misses = self.table.admit([(layer, e) for e in experts])
        if misses:
            self._copy(self.host.layers[self.layers[layer]], misses)
        return slots, [key[1] for key, _ in misses]

    def _copy(self, bank: dict[str, torch.Tensor], misses: list) -> None:
        n = len(misses) * self.slot_bytes
        if not self.cuda:
            t0 = time.perf_counter()
            for (_, e), slot in misses:
                for name, p in self.pool.items():
                    p[slot].copy_(bank[name][e])
            self.copy_s += time.perf_counter() - t0
        else:
            ready = torch.cuda.current_stream(self.device).record_event()  # victims no longer read after this
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                start.record(self.stream)
                for (_, e), slot in misses:
                    for name, p in self.pool.items():
                        p[slot].copy_(bank[name][e], non_blocking=True)
                link_cap.pad(n, self.device)  # emulated slower link, off unless SHARDSMITH_TUNING has emulate_h2d_gbps
                end.record(self.stream)
            self._done = end
            self._timings.append((start, end))
            if len(self._timings) > 4096:
                self._resolve(len(self._timings) // 2)
        self.bytes_copied += n
        self.copies += 1

    def wait(self) -> None:
        """Make the current stream wait for the last batch of copies (no host sync)."""
        if self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)
            self._done = None

    def _resolve(self, n: int | None = None) -> None:
        done, self._timings = self._timings[:n] if n else self._timings, self._timings[n:] if n else []
        for start, end in done:
            end.synchronize()
            self.copy_s += start.elapsed_time(end) / 1e3

    def stats(self) -> dict[str, float]:
        """Slot table counters plus ``slot_bytes``, ``pool_bytes``, ``bytes_copied``, ``copy_s``, ``h2d_gb_per_s``."""
        self._resolve()
        out = dict(self.table.stats())
        out.update(slot_bytes=self.slot_bytes, pool_bytes=self.slot_bytes * self.n_slots,
                   bytes_copied=self.bytes_copied, copy_s=self.copy_s, copy_batches=self.copies,
                   h2d_gb_per_s=self.bytes_copied / self.copy_s / 1e9 if self.copy_s else 0.0)
        return out
