"""One rank's offloaded routed experts: host banks, slot cache, host executor, counters.

:func:`~.attach.attach_offload` puts it in the model (the expert banks are read into host memory,
:mod:`.host_bank`, instead of being assigned to the model). :meth:`OffloadRuntime.start`
runs after the dense weights and the KV cache are on the device: it sizes the slot pool from what
is left (or ``cache_bytes``), agreeing on the smallest slot count across ranks, probes, and logs.

One MoE layer, GPU backend (one host sync: the ``[T, K]`` expert ids)::

    ids -> host; hits/misses from the slot table (same on every rank); every expert's token
        rows back to the device in one pinned async copy (:mod:`~shardsmith.runtime.layers.staging`)
    copy stream: misses -> slots (one batch, after the compute stream's pending reads)
    compute stream: hits ... wait(copy) ... misses;  hybrid: the host computes its share meanwhile
    contributions summed in expert order (bitwise as the resident path on the same device)

A decode-sized step whose experts all fit in slots (and none on the host) is a *slot step*: the
slot of every (token, expert) pair goes to the device and the experts are applied from the pool
by pair (:meth:`OffloadRuntime.apply_slots`, device work only, so a graph captures it). With the
kernel (``SHARDSMITH_KERNELS=fused_experts``, set by :meth:`use_kernel_` as for resident banks) that is the
resident bank's own :func:`~shardsmith.runtime.layers.experts.fused_bank` call with slot ids for
expert ids, for any pool format (FP4, FP8, bf16) and up to ``FUSED_TOKENS_MAX`` tokens; without
it, FP4 pools of at most ``ExpertMath.batched_pairs`` pairs take the expanded pair maths.

**In place** (``SHARDSMITH_KERNELS=offload_inplace``: ``auto``, the default, for FP4 banks on CUDA;
``kernel`` also for plain banks, and on CPU under Triton's interpreter; ``off``: the host table above;
backend ``gpu`` with the kernel and pinned host banks): no host sync at all. At 4 x 256 V4-Flash
experts on an H200 (``v4_decode-20261203-h200x1aj*.json``) its copy mode decoded 261.7 and 158.2
tokens/s at 25% and 6.25% cache, 1.09x and 1.15x the link-plus-compute floor, against 257.4 and
154.2 for the host table and 217.4 and 120.3 for ``read``. A :class:`~.device_slots.DeviceSlots` table on the
device decides each pair's hit, miss and victim (``--expert-policy lru``: LRU; ``hot``, the default:
counted, a miss admitted only over a slot whose expert was used less; the same decisions on every
rank: a function of the ids alone), and a miss is served from the pinned host bank (mapped into the device's address
space) in one of two ways (``SHARDSMITH_TUNING=offload_miss``):

- ``copy`` (the default): :func:`~.miss_copy.copy_misses`, one launch, copies each missed expert into
  its new slot, or into one of ``top_k`` staging rows at the pool's end when the policy does not admit
  it, in 16 KiB runs; then :func:`~shardsmith.runtime.layers.kernels.fused_experts` reads every pair
  from the pool, the resident bank's call. A miss repeated within a step is copied once.
- ``read``: ``fused_experts`` reads a miss in place from the host bank and writes the bytes it reads
  through to the miss's new slot in the same launch (no separate copy, but its reads are 128 B runs
  that ran at 34-35 GB/s where the copy kernel's reach 48-50). A missed expert that several pairs of
  one chunk select is read over the link by each of them: batches pay for duplicates.

Every layer of a step is device work, so the whole step is one captured graph; the link carries each
missed expert once per step (a kernel read of pinned memory ran at 91-93% of the copy rate on an
H200, ``zero_copy-20261203-h200x1ah.json``). Steps of more than ``FUSED_TOKENS_MAX`` tokens run in
chunks of that many; a chunk's misses past the staging rows are read in place as in ``read``. The cache's host-side
table and copy stream are not used; counters live on the device (:meth:`stats` reads them).

A decode-sized ``hybrid`` step with some experts on the host and the rest in slots is a *split
step*: the layer's one sync reads the ids and brings ``x`` and the routing weights
along (:meth:`~.cpu_backend.CpuExperts.stage`); the host share goes to the worker thread first;
then the GPU experts are placed (misses copied) and applied by the slot path over every pair, the
host's pairs masked (a negative slot ``-1 - s``: weight 0 on slot ``s`` of a GPU expert of the
same step, so the kernel reads no extra expert); only then is the host's partial awaited, copied
up and added (:class:`~.cpu_backend.HostPartial`). Numerics: the GPU pairs are summed in float32 in
k order, the host's in ascending expert order, the two added in float32 and cast once (as many
roundings to the activation dtype as the resident step, one):
the resident step's value within float32 rounding, not its bits.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardsmith import settings
from shardsmith.errors import UsageError
from shardsmith.settings import Kernel
from shardsmith.runtime.layers.experts import (FUSED_TOKENS_MAX, ExpertMath, expert_output, fused_bank, grouped_experts,
                                              grouped_runs)
from shardsmith.runtime.layers.pairs import expand_pairs, routed_pairs
from shardsmith.runtime.layers.parallel import kernel_on
from shardsmith.runtime.layers.quant import bank_format
from shardsmith.runtime.layers.staging import rows_by_expert, to_device
from . import link_cap
from .config import GiB, OffloadConfig
from .cpu_backend import CpuExperts, HostPartial
from .device_slots import DeviceSlots
from .expert_cache import ExpertCache, slot_nbytes, slot_signature
from .host_bank import HostBanks
from .miss_copy import copy_misses
from .probe import ProbeResult, run_probe

log = logging.getLogger("shardsmith.runtime.offload")
STAGE_ROWS_DEFAULT = 8  # staging rows when the banks do not say their top-k (the largest of the families: Qwen3-MoE)


def miss_mode() -> str:
    """``SHARDSMITH_TUNING=offload_miss=...``: ``copy`` (the default) or ``read`` (module docstring).

    Raises:
        UsageError: another value (:mod:`shardsmith.settings`).
    """
    return settings.current().offload_miss.value


def inplace_blocks() -> tuple[int, int]:
    """``(block_r, block_g)`` of the in-place mode's expert launches: ``SHARDSMITH_TUNING=inplace_blocks=...``
    (``4x64``: 4 rows per program, 64 scale groups of a row per step) or the pair path's default
    ``(16, 8)``. A miss is read over the link, where fewer rows per program and longer steps along
    a row read longer contiguous runs of host memory.

    Raises:
        UsageError: not two positive ints (:mod:`shardsmith.settings`).
    """
    return settings.current().inplace_blocks


class OffloadRuntime:
    """Host banks, slot cache, host executor and counters of one rank.

    Attributes:
        config; host: :class:`HostBanks`; cache: :class:`ExpertCache` (None for ``cpu``);
        cpu: :class:`CpuExperts`; probe: :class:`ProbeResult`; backend, hybrid_fraction: as chosen;
        tokens: tokens through the first MoE layer (decode, and prefill chunks that do not stream their
        experts; those: prefill_tokens, with prefill_link_bytes copied for them).
    """

    def __init__(self, config: OffloadConfig, host: HostBanks, layers: list[str], *, device: torch.device,
                 dtype: torch.dtype, dim: int, block: tuple[int, int] | None, math: ExpertMath = ExpertMath(),
                 top_k: int | None = None) -> None:
        self.config, self.host, self.layers, self.device, self.dtype, self.dim = config, host, layers, device, dtype, dim
        self.block, self.math, self.top_k = block, math, top_k
        self.cpu = CpuExperts(host, layers, block, math, reserve_core=torch.device(device).type == "cuda")
        self.cache: ExpertCache | None = None
        self.probe: ProbeResult | None = None
        self.backend, self.hybrid_fraction = config.backend, config.hybrid_fraction or 0.0
        self.tokens, self.cpu_experts, self.step_s = 0, 0, 0.0
        self.kernel = False  # slot steps run fused_experts over the pool (use_kernel_)
        self.inplace = False  # misses read in place, decisions on the device (use_kernel_, start)
        self.slots: DeviceSlots | None = None  # the device-side table of the in-place mode (start)
        self.blocks = (16, 8)  # (block_r, block_g) of the in-place launches (start: inplace_blocks())
        self.miss = "copy"  # how the in-place mode serves a miss (start: miss_mode())
        self._tokens_dev: torch.Tensor | None = None  # tokens through layer 0, counted on the device
        self.steps = self.steps_all_hit = self.layer_steps = self.layer_steps_all_hit = 0  # _count
        self.split_steps = 0  # layer steps that ran split (GPU slots + host share)
        self.prefill_tokens = self.prefill_link_bytes = 0  # prefill chunks that streamed their experts (run_chunk)
        self.prefilling = False  # inside prefill(): long steps stream their experts
        self.stream_refused = ""  # why the first long prefill step that did not stream did not (logged once)
        self._step_open, self._step_hit = False, True

    # ------------------------------------------------------------ start-up

    def start(self, *, graphed: bool = True) -> None:
        """Probe, size and allocate the slot pool (collective: every rank agrees), log the numbers.

        ``graphed``: decode steps will run as CUDA graphs (``auto`` picks ``hybrid`` only then:
        :func:`~.probe.decide`)."""
        sig = slot_signature(self.host)
        slot_bytes = slot_nbytes(sig)
        c = self.config
        requested = c.backend
        cuda = self.device.type == "cuda"
        if not cuda and requested in ("gpu", "hybrid"):
            log.warning("--moe-backend %s on a CPU device: the expert 'cache' is more host memory and nothing is "
                        "copied over a link (useful for tests); on a host without a GPU use --moe-backend cpu",
                        requested)
        if c.probe and cuda:  # no host-to-device link to measure on a CPU device
            self.probe = run_probe(self.host, self.cpu, device=self.device, dim=self.dim, dtype=self.dtype,
                                   slot_bytes=slot_bytes, requested=requested, hybrid_fraction=c.hybrid_fraction,
                                   kernel=self.kernel, graphed=graphed)
            self.backend, self.hybrid_fraction = self.probe.backend, self.probe.hybrid_fraction  # agreed over ranks
        elif requested == "auto":
            self.backend = "gpu" if cuda else "cpu"
        if self.backend == "cpu":
            self.hybrid_fraction = 1.0
        else:
            n = self._slots(slot_bytes)
            self.cache = ExpertCache(self.host, self.layers, n, self.device, policy=c.policy,
                                     hot_fraction=c.hot_fraction, log=c.log_decisions)
        self.inplace = self.inplace and self.backend == "gpu" and self.cache is not None and \
            (self.host.pinned or self.device.type != "cuda") and link_cap.cap_gb_per_s() is None
        if self.inplace:
            self.blocks, self.miss = inplace_blocks(), miss_mode()
            experts = max(a["gate_up"].shape[0] for a in self.host.layers.values())
            # copy: the pool's last rows stage the misses no slot takes (one token's worth), out of the budget
            n_stage = min(self.top_k or STAGE_ROWS_DEFAULT, self.cache.n_slots // 2) if self.miss == "copy" else 0
            self.slots = DeviceSlots(self.cache.n_slots - n_stage, experts, self.device, n_layers=len(self.layers),
                                     policy="lru" if c.policy == "lru" else "lfu", n_stage=n_stage)  # ``hot``: counts
            self._tokens_dev = torch.zeros(1, dtype=torch.int64, device=self.device)
        log.info("%s", self.ready_line())

    def use_kernel_(self, device: torch.device) -> None:
        """Slot steps through the fused kernel when ``SHARDSMITH_KERNELS``'s ``fused_experts`` allows on ``device``
        (the resident banks' switch, read once at load), unless the banks are FP8 with scales
        other than float32 (the kernel's FP8 format)."""
        fp8 = [a for a in self.host.layers.values() if bank_format(a["gate_up"]) == "fp8"]
        self.kernel = kernel_on("fused_experts", device) and all(a["gate_up_scale"].dtype == torch.float32 for a in fp8)
        # in place (module docstring; on by default on CUDA): the pair path's formats; confirmed at start()
        # (backend, pinning). ``auto`` takes FP4 banks only, the format measured on a GPU (V4); a bf16 family
        # (Mixtral: top-2 of 8) batches many tokens onto one expert, where ``read`` re-reads a repeated miss
        fp4 = all(bank_format(a["gate_up"]) == "fp4" for a in self.host.layers.values())
        self.inplace = self.kernel and not fp8 and kernel_on("offload_inplace", device) \
            and (fp4 or settings.current().offload_inplace is Kernel.KERNEL)

    def decode_sync_free(self) -> bool:
        """Whether a decode step's experts run with no host sync: the in-place mode, once started."""
        return self.slots is not None

    def slot_path(self) -> bool:
        """Whether some steps are slot steps (module docstring): a cache, and the kernel or FP4 pairs."""
        if self.cache is None:
            return False
        return self.kernel or (bank_format(self.cache.pool["gate_up"]) == "fp4" and self.math.batched_pairs > 0)

    def _slots(self, slot_bytes: int) -> int:
        c, total = self.config, sum(a["gate_up"].shape[0] for a in self.host.layers.values())
        if c.cache_slots is not None:
            n = c.cache_slots
        elif c.cache_bytes is not None:
            n = c.cache_bytes // slot_bytes
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            n = max(0, free - c.reserve_bytes) // slot_bytes
        else:
            n = total
        n = int(_agree([float(min(n, total))], self.device, dist.ReduceOp.MIN)[0])
        if n < 1:
            raise UsageError(f"expert cache: room for {n} slots of {slot_bytes} bytes; give --expert-cache-gb "
                             f">= {slot_bytes / GiB:.3f} or use --moe-backend cpu")
        return n

    def ready_line(self) -> str:
        """One log line: host bytes, pinning, slots, backend and probe numbers."""
        hb = self.host
        parts = [f"expert offload: backend {self.backend}",
                 f"host banks {hb.nbytes / GiB:.2f} GiB/rank ({'pinned' if hb.pinned else 'pageable'}"
                 + (f", pinning refused: {hb.pin_error}" if hb.pin_error and not hb.pinned and self.device.type == 'cuda' else "")
                 + f", read {hb.read_s:.2f} s, pin {hb.pin_s:.2f} s, wall {hb.wall_s:.2f} s)"]
        if self.cache is not None:
            total = sum(a["gate_up"].shape[0] for a in hb.layers.values())
            parts.append(f"cache {self.cache.n_slots}/{total} experts x {self.cache.slot_bytes / 2**20:.2f} MiB = "
                         f"{self.cache.n_slots * self.cache.slot_bytes / GiB:.2f} GiB/GPU, policy {self.config.policy}")
        if self.backend in ("cpu", "hybrid"):
            parts.append(f"host experts: {self.cpu.path()}")
        if self.backend == "hybrid":
            parts.append(f"{self.hybrid_fraction:.2f} of misses on the host")
        if self.probe is not None:
            p = self.probe
            parts.append(f"probe: H2D {p.h2d_gb_per_s:.1f} GB/s, host {p.cpu_s_per_expert * 1e3:.2f} ms/expert/token "
                         f"({p.cpu_isa}); {p.reason}")
        return "; ".join(parts)

    # ------------------------------------------------------------ one layer

    def run_layer(self, layer: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The layer's routed partial ``[T, D]``, summed in ascending expert order as the resident path."""
        if self.streams_chunk(x):
            return self.run_chunk(layer, x, index, weight)
        if self.prefilling and x.shape[0] > FUSED_TOKENS_MAX and not self.stream_refused:
            self.stream_refused = self.stream_refusal(x) or "streams_chunk said no"
            log.info("a %d-token prefill chunk runs its experts through the expert cache, not streamed: %s",
                     x.shape[0], self.stream_refused)
        if self.slots is not None:
            return self.run_inplace(layer, x, index, weight)
        t0, m0 = time.perf_counter(), self._misses()
        index_h, experts, to_host, staged = self._prepare(layer, x, index, weight)
        if self._split(index_h, experts, to_host, staged):
            slots, pending = self._start_split(layer, x, index_h, experts, to_host, staged)
            out = pending.add_to(self.apply_slots(x, weight, slots, masked=True))
        elif self._pairs(index_h, experts, to_host) and self.kernel:
            out = self.apply_slots(x, weight, self._place(layer, x, index_h, experts))
        elif self._pairs(index_h, experts, to_host):
            out = self._run_pairs(layer, x, index_h, weight, experts)
        else:
            out = self._run_general(layer, x, index_h, weight, experts, to_host, staged)
        self._count(layer, x.shape[0], not to_host and self._misses() == m0)
        self.step_s += time.perf_counter() - t0
        return out

    @torch.compiler.disable  # inside a compiled piece: run as is (host addresses, a per-layer table), captured all the same
    def run_inplace(self, layer: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The in-place mode's layer (module docstring): device work only, so a graph captures it.

        Each chunk of up to ``FUSED_TOKENS_MAX`` tokens: the device table assigns every pair a slot
        (hit), or the host bank and a pool row (miss). ``copy``: :func:`~.miss_copy.copy_misses` copies
        the misses into their rows and one ``fused_experts`` call reads every pair from the pool (a
        miss past the staging rows from the host); ``read``: one call reads a miss from the host
        bank and writes it through to its slot. The same arithmetic per expert as the resident
        kernel bank: the same bits.
        """
        if layer == 0:
            self._tokens_dev.add_(x.shape[0])
        host = self.host.layers[self.layers[layer]]
        outs = []
        for t0 in range(0, x.shape[0], FUSED_TOKENS_MAX):
            rows = slice(t0, t0 + FUSED_TOKENS_MAX)
            ids = index[rows]
            if self.miss == "copy":
                src, dst, read = self.slots.assign_rows(layer, ids)
                copy_misses(self.cache.pool, host, src, dst)
                # every pair's expert in the pool once the staging rows cover the chunk: the resident call
                far = {} if ids.numel() <= self.slots.n_stage else {"host": host, "write_slots": torch.full_like(read, -1)}
                outs.append(fused_bank(x[rows], read.view(ids.shape), weight[rows], self.cache.pool, self.math,
                                       self.block, **far))
                continue
            src, dst = self.slots.assign(layer, ids)
            outs.append(fused_bank(x[rows], src.view(ids.shape), weight[rows], self.cache.pool, self.math,
                                   self.block, host=host, write_slots=dst, block_r=self.blocks[0],
                                   block_g=self.blocks[1]))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def streams_chunk(self, x: torch.Tensor) -> bool:
        """Whether a step of ``x`` ``[T, D]`` is a prefill chunk that streams its experts
        (:meth:`run_chunk`): inside :meth:`prefill` (decode steps, however many rows, keep the cache's
        path: they admit what they use, and a captured one stays device-only), more than
        ``FUSED_TOKENS_MAX`` tokens, backend ``gpu`` (a slot pool, no host share), and grouped matmuls
        for the bank's format and these activations (:func:`~shardsmith.runtime.layers.experts.grouped_runs`:
        FP4 everywhere, FP8 and dense banks on CUDA);
        :meth:`stream_refusal` says which is missing."""
        return not self.stream_refusal(x)

    def stream_refusal(self, x: torch.Tensor) -> str:
        """Why a step of ``x`` ``[T, D]`` does not stream its experts (:meth:`streams_chunk`), or ``""``."""
        if not self.prefilling:
            return "not a prefill (decode steps keep the cache's path)"
        if x.shape[0] <= FUSED_TOKENS_MAX:
            return f"{x.shape[0]} tokens, at most FUSED_TOKENS_MAX={FUSED_TOKENS_MAX}: the decode-sized path"
        if self.backend != "gpu" or self.cache is None:
            return f"moe backend {self.backend!r}" + ("" if self.cache is not None else " without a slot pool")
        fmt = bank_format(self.cache.pool["gate_up"])
        if not grouped_runs(x, fmt):
            return (f"grouped matmuls off, or none runs {fmt} experts for {x.dtype} activations on {x.device} (the tile "
                    "kernel: CUDA; torch._grouped_mm: FP4 expanded, or dense on CUDA)")
        return ""

    @contextlib.contextmanager
    def prefill(self) -> Iterator[None]:
        """Within: the layers run a prefill (or a chunk of one), whose long steps stream their experts
        (:meth:`streams_chunk`); the engine wraps every prefill forward in it."""
        before, self.prefilling = self.prefilling, True
        try:
            yield
        finally:
            self.prefilling = before

    def run_chunk(self, layer: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A prefill chunk's layer: the resident path's grouped matmuls (:func:`grouped_experts`: pairs sorted
        by expert, ``GROUP_EXPERTS`` present experts at a time), each expert's arrays read from its slot
        when the cache holds it and otherwise copied **once** from the host bank into a staging group,
        the next group's copies running on the copy stream while this group computes. A chunk routes to
        nearly every expert, so copying misses pair by pair, or admitting them, would move each many
        times and evict what decode keeps: the cache is left as it is (its counters too). The same
        expert bytes and maths as the resident path, so the same result.

        ``prefill_link_bytes`` counts what the chunks copied, ``prefill_tokens`` their tokens.
        """
        if layer == 0:
            self.prefill_tokens += x.shape[0]
        host = self.host.layers[self.layers[layer]]
        held = self._held(layer)
        return grouped_experts(x, index, weight, {}, self.math, block=self.block,
                               fetch=lambda ids, ids_h: self._stage(host, held, ids_h),
                               n_experts=host["gate_up"].shape[0], fmt=bank_format(self.cache.pool["gate_up"]))

    def _held(self, layer: int) -> dict[int, int]:
        """Expert -> pool row of layer ``layer``'s experts the cache holds now (one read of the device
        table in the in-place mode)."""
        if self.slots is not None:
            n, keys = self.slots.n_experts, self.slots.slot_key.tolist()
            return {k - layer * n: row for row, k in enumerate(keys) if k >= 0 and k // n == layer}
        return {e: slot for (lay, e), slot in self.cache.table.items() if lay == layer}

    def _stage(self, host: dict[str, torch.Tensor], held: dict[int, int], experts: list[int]):
        """Start bringing ``experts``' arrays into a fresh staging group ``[G, ...]`` on the device: held
        ones gathered from the pool, the others copied from the host bank (runs of consecutive experts
        in one copy each; on the copy stream on CUDA). Returns the call that waits and gives them."""
        pool, dev = self.cache.pool, self.device
        out = {name: torch.empty((len(experts), *p.shape[1:]), dtype=p.dtype, device=dev) for name, p in pool.items()}
        rows = [(i, held[e]) for i, e in enumerate(experts) if e in held]
        if rows:
            at, slot = to_device([torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])], dev)
            for name, p in pool.items():  # one-byte arrays as bytes (index_put has no float8 scale kernels)
                if p.element_size() == 1:
                    out[name].view(torch.uint8)[at] = p.view(torch.uint8)[slot]
                else:
                    out[name][at] = p[slot]
        runs, i = [], 0  # (group position, first expert, count) of the misses
        while i < len(experts):
            if experts[i] in held:
                i += 1
                continue
            j = i + 1
            while j < len(experts) and experts[j] == experts[j - 1] + 1 and experts[j] not in held:
                j += 1
            runs.append((i, experts[i], j - i))
            i = j
        n = sum(c for _, _, c in runs) * self.cache.slot_bytes
        self.prefill_link_bytes += n
        if not runs:
            return lambda: out
        if dev.type != "cuda":
            for i, e, c in runs:
                for name, t in out.items():
                    t[i:i + c].copy_(host[name][e:e + c])
            return lambda: out
        stream = self.cache.stream
        stream.wait_stream(torch.cuda.current_stream(dev))  # the staging memory is this stream's until here
        with torch.cuda.stream(stream):
            for i, e, c in runs:
                for name, t in out.items():
                    t[i:i + c].copy_(host[name][e:e + c], non_blocking=True)
            link_cap.pad(n, dev)  # emulated slower link, off unless SHARDSMITH_TUNING has emulate_h2d_gbps
            done = stream.record_event()
        for t in out.values():
            t.record_stream(stream)

        def ready() -> dict[str, torch.Tensor]:
            torch.cuda.current_stream(dev).wait_event(done)
            return out
        return ready

    def _misses(self) -> int:
        return self.cache.table.misses if self.cache is not None else 0

    def _count(self, layer: int, tokens: int, all_hit: bool) -> None:
        """Count decode-sized steps (at most ``FUSED_TOKENS_MAX`` tokens) and those whose every layer
        found all its experts in slots: the steps a device-side slot table would run with no host
        sync (hits applied in-graph; only misses need the host). Layer 0 opens a step."""
        if tokens > FUSED_TOKENS_MAX or self.cache is None:
            return
        if layer == 0:
            self.steps += self._step_open
            self.steps_all_hit += self._step_open and self._step_hit
            self._step_open, self._step_hit = True, True
        self.layer_steps += 1
        self.layer_steps_all_hit += all_hit
        self._step_hit &= all_hit

    def decode_slots(self, layer: int, x: torch.Tensor, index: torch.Tensor,
                     weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | HostPartial | None]:
        """For a graphed decode step: the slot of every pair, or the routed partial when there are none.

        When the step is a slot step (module docstring: no expert on the host, all fit, decode-sized),
        the step's experts are made resident, their misses copied, the current stream made to wait
        for the copies, and ``(slots [P = T*K] int64 on the device, None)`` returned: the caller
        applies the experts from ``cache.pool`` (a captured graph can, the pool never moves).
        A split step (module docstring) returns ``(slots, HostPartial)``: the host share is running,
        ``slots`` has the host's pairs masked (negative), the caller applies them with
        ``apply_slots(..., masked=True)`` and then passes that partial to ``HostPartial.add_to``.
        Otherwise ``(None, routed [T, D])`` from :meth:`run_layer`'s general path.
        """
        t0, m0 = time.perf_counter(), self._misses()
        index_h, experts, to_host, staged = self._prepare(layer, x, index, weight)
        if self._split(index_h, experts, to_host, staged):
            out = self._start_split(layer, x, index_h, experts, to_host, staged)
        elif not self._pairs(index_h, experts, to_host):
            out = (None, self._run_general(layer, x, index_h, weight, experts, to_host, staged))
        else:
            out = (self._place(layer, x, index_h, experts), None)
        self._count(layer, x.shape[0], not to_host and self._misses() == m0)
        self.step_s += time.perf_counter() - t0
        return out

    def _place(self, layer: int, x: torch.Tensor, index_h: torch.Tensor, experts: list[int],
               host: frozenset[int] = frozenset()) -> torch.Tensor:
        """Make ``experts`` resident (misses copied on the copy stream, which the current stream then
        waits for) and return each pair's slot ``[P] int64`` on ``x``'s device (one async copy).
        Pairs of a ``host`` expert get ``-1 - s``, ``s`` the slots of ``experts`` in turn (so no one
        expert's run in the kernel grows much: a run longer than 16 pairs re-reads the expert)."""
        slots, _ = self.cache.fetch(layer, experts)
        slot_of = dict(zip(experts, slots))
        pairs, turn = [], 0
        for e in index_h.flatten().tolist():
            if e in host:
                pairs.append(-1 - slots[turn % len(slots)])
                turn += 1
            else:
                pairs.append(slot_of[e])
        (pair_slots,) = to_device([torch.tensor(pairs, dtype=torch.int64)], x.device)
        self.cache.wait()
        return pair_slots

    def apply_slots(self, x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, *,
                    masked: bool = False) -> torch.Tensor:
        """The routed partial ``[T, D]`` of experts already in the pool's ``slots [P]`` (one per pair,
        token-major; from :meth:`decode_slots`), device work only, so a graph can capture it (the
        pool never moves). With the kernel: :func:`~shardsmith.runtime.layers.experts.fused_bank`
        over the pool, ``slots`` as ``[T, K]`` ids (the resident kernel bank's call, so the same
        arithmetic per expert); else the resident FP4 bank's expanded pair maths, on the same bits.
        ``masked``: a negative slot ``-1 - s`` is a host pair, run on slot ``s`` with weight 0 (an
        exact zero: the slot holds a real expert, so its output is finite); the partial is then
        returned in float32 (the sum before the cast).
        """
        out_dtype = None
        if masked:  # the float32 sum, uncast: HostPartial.add_to adds the host's and casts once
            keep = slots >= 0  # [P]
            slots = torch.where(keep, slots, -1 - slots)
            weight, out_dtype = weight * keep.view(weight.shape), torch.float32
        if self.kernel:
            return fused_bank(x, slots.view(weight.shape), weight, self.cache.pool, self.math, self.block, out_dtype)
        gate_up, down = expand_pairs({name: p[slots] for name, p in self.cache.pool.items()}, x.dtype)
        return routed_pairs(gate_up, down, x, weight, self.math.limit, out_dtype)

    def _prepare(self, layer: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int], list[int], tuple[torch.Tensor, ...] | None]:
        """Count tokens, read the routed ids (the one host sync of the layer): ``(index [T, K] on the
        host, the distinct experts ascending, those the host computes, staged)``; a decode-sized
        ``hybrid`` step brings ``x`` and ``weight`` in the same sync, ``staged = (index, x, weight)``
        on the host (:meth:`~.cpu_backend.CpuExperts.stage`), else ``staged`` is None."""
        if layer == 0:
            self.tokens += x.shape[0]
        staged = None
        if self.backend == "hybrid" and x.shape[0] <= FUSED_TOKENS_MAX:
            staged = self.cpu.stage(x, index, weight)
            index_h = staged[0]
        else:
            index_h = index.cpu()
        experts = index_h.unique().tolist()
        return index_h, experts, self._host_share(layer, experts), staged

    def _split(self, index_h: torch.Tensor, experts: list[int], to_host: list[int], staged) -> bool:
        """Whether this step is a split step (module docstring): staged, some experts on each side,
        the GPU's fit in the slots, and a slot step's size."""
        if not to_host or staged is None or len(to_host) == len(experts) or not self.slot_path():
            return False
        if len(experts) - len(to_host) > self.cache.n_slots:
            return False
        return self.kernel or index_h.numel() <= self.math.batched_pairs

    def _start_split(self, layer: int, x: torch.Tensor, index_h: torch.Tensor, experts: list[int],
                     to_host: list[int], staged) -> tuple[torch.Tensor, HostPartial]:
        """Submit the host share, then place the GPU experts: ``(masked slots [P], pending host partial)``."""
        _, x_h, w_h = staged
        pending = self.cpu.submit_partial(layer, x_h, index_h, w_h, to_host, x.device)  # first: it overlaps the rest
        host = frozenset(to_host)
        slots = self._place(layer, x, index_h, [e for e in experts if e not in host], host)
        self.cpu_experts += len(to_host)
        self.split_steps += 1
        return slots, pending

    def _pairs(self, index_h: torch.Tensor, experts: list[int], to_host: list[int]) -> bool:
        """Whether this step is a slot step (module docstring)."""
        if to_host or not self.slot_path() or len(experts) > self.cache.n_slots:
            return False
        return index_h.shape[0] <= FUSED_TOKENS_MAX if self.kernel else index_h.numel() <= self.math.batched_pairs

    def _run_general(self, layer: int, x: torch.Tensor, index_h: torch.Tensor, weight: torch.Tensor,
                     experts: list[int], to_host: list[int], staged=None) -> torch.Tensor:
        """Expert by expert on slots (in waves of at most ``n_slots``) and on the host (from
        ``staged`` host copies when the id read brought them, else with one more D2H)."""
        contrib: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        fut = None
        if to_host and staged is not None:
            fut = self.cpu.submit(layer, staged[1], index_h, staged[2], to_host)
        elif to_host:
            fut = self.cpu.submit_from(layer, x, index_h, weight, to_host)
        on_gpu = [e for e in experts if e not in set(to_host)]
        where = rows_by_expert(index_h, on_gpu, x.device)  # (tok [n], k [n]) per expert, one async copy
        n = self.cache.n_slots if self.cache is not None else 1
        for i in range(0, len(on_gpu), n):
            wave = on_gpu[i: i + n]
            slots, missed = self.cache.fetch(layer, wave)
            missed = set(missed)
            hits = [(e, s) for e, s in zip(wave, slots) if e not in missed]
            late = [(e, s) for e, s in zip(wave, slots) if e in missed]
            for group in (hits, late):
                if group is late:
                    self.cache.wait()
                for e, s in group:
                    contrib[e] = self._gpu_expert(x, weight, *where[e], s)
        if fut is not None:
            contrib |= self.cpu.collect(fut, x.device)
            self.cpu_experts += len(to_host)
        out = self.math.accumulator(x)
        for e in experts:
            tok, y = contrib[e]
            out.index_add_(0, tok, y)
        return out.to(x.dtype)

    def _run_pairs(self, layer: int, x: torch.Tensor, index_h: torch.Tensor, weight: torch.Tensor,
                   experts: list[int]) -> torch.Tensor:
        """A decode step's FP4 experts, batched per pair as the resident DeepSeek-V4 bank does.

        The hits' slots are expanded while the misses copy, then the misses', each into its pairs'
        rows; one pair of batched matmuls over all pairs in pair order follows, so the step is the
        resident one's maths on the same inputs (:func:`~shardsmith.runtime.layers.pairs.routed_pairs`).
        """
        T, K = index_h.shape
        pairs = index_h.flatten().tolist()  # [P]
        slots, missed = self.cache.fetch(layer, experts)
        slot_of, missed = dict(zip(experts, slots)), set(missed)
        groups = [[p for p, e in enumerate(pairs) if (e in missed) == late] for late in (False, True)]
        staged = to_device([torch.tensor(g, dtype=torch.int64) for g in groups]
                           + [torch.tensor([slot_of[pairs[p]] for p in g], dtype=torch.int64) for g in groups], x.device)
        gate_up = down = None
        for late, pos, slot in ((False, staged[0], staged[2]), (True, staged[1], staged[3])):
            if pos.numel() == 0:
                continue
            if late:
                self.cache.wait()
            gu, dn = expand_pairs({name: pool[slot] for name, pool in self.cache.pool.items()}, x.dtype)
            if gate_up is None:
                gate_up = gu.new_empty((T * K, *gu.shape[1:]))  # [P, 2*I_r, D]
                down = dn.new_empty((T * K, *dn.shape[1:]))  # [P, D, I_r]
            gate_up[pos], down[pos] = gu, dn
        return routed_pairs(gate_up, down, x, weight, self.math.limit)

    def _host_share(self, layer: int, experts: list[int]) -> list[int]:
        """Experts the host computes: all (``cpu``), or the last ``round(f * misses)`` misses (``hybrid``)."""
        if self.backend == "cpu":
            return list(experts)
        if self.backend != "hybrid" or self.hybrid_fraction <= 0:
            return []
        missing = [e for e in experts if (layer, e) not in self.cache.table]
        k = round(self.hybrid_fraction * len(missing))
        return missing[len(missing) - k:] if k else []

    def _gpu_expert(self, x, weight, tok_d, k_d, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = expert_output(self.cache.arrays(slot), x[tok_d], self.block, math=self.math)
        return tok_d, self.math.contribution(y, weight[tok_d, k_d], x.dtype)

    # ------------------------------------------------------------ counters

    def stats(self) -> dict[str, float]:
        """``slots``, ``hits``, ``misses``, ``hit_rate``, ``bytes_copied``, ``bytes_per_token``,
        ``h2d_gb_per_s`` (achieved during miss copies), ``host_bytes``, ``host_experts``, ``tokens``
        (the prefill chunks that stream their experts apart: ``prefill_tokens``, ``prefill_link_bytes``,
        ``prefill_link_bytes_per_token``);
        ``decode_steps``, ``steps_all_hit`` (decode-sized steps whose every layer hit: no host sync
        needed with a device-side slot table), ``layer_steps``, ``layer_steps_all_hit``."""
        out = {"backend": self.backend, "host_bytes": self.host.nbytes, "host_pinned": self.host.pinned,
               "tokens": self.tokens, "host_experts": self.cpu_experts, "moe_s": self.step_s,
               "decode_steps": self.steps + self._step_open, "split_steps": self.split_steps,
               "steps_all_hit": self.steps_all_hit + (self._step_open and self._step_hit),
               "layer_steps": self.layer_steps, "layer_steps_all_hit": self.layer_steps_all_hit}
        if self.cache is not None:
            out |= self.cache.stats()
            out["bytes_per_token"] = self.cache.bytes_copied / self.tokens if self.tokens else 0.0
        if self.slots is not None:  # device counters; bytes over the link = missed pairs' experts (at one token
            # a step's experts are distinct; in a batch ``copy`` reads a repeated miss once, so this is an upper bound)
            tokens = int(self._tokens_dev.item())
            st = self.slots.stats()
            missed = int(st["misses"]) * self.cache.slot_bytes
            out |= {"mode": "inplace", "miss": self.miss, "table_slots": self.slots.n_slots,
                    "staging_rows": self.slots.n_stage, "device_policy": self.slots.policy, "tokens": tokens,
                    "hits": int(st["hits"]),
                    "misses": int(st["misses"]), "hit_rate": st["hit_rate"], "bytes_copied": missed,
                    "bytes_per_token": missed / tokens if tokens else 0.0, "h2d_gb_per_s": None}
        out |= {"prefill_tokens": self.prefill_tokens, "prefill_link_bytes": self.prefill_link_bytes,
                "prefill_link_bytes_per_token": self.prefill_link_bytes / self.prefill_tokens
                if self.prefill_tokens else 0.0}
        if self.probe is not None:
            out["probe_h2d_gb_per_s"] = self.probe.h2d_gb_per_s
            out["probe_cpu_s_per_expert"] = self.probe.cpu_s_per_expert
        return out

    def reset_stats(self) -> None:
        """Zero the counters (e.g. after warm-up); the cache contents stay."""
        self.tokens = self.cpu_experts = self.prefill_tokens = self.prefill_link_bytes = 0
        self.steps = self.steps_all_hit = self.layer_steps = self.layer_steps_all_hit = self.split_steps = 0
        self._step_open, self._step_hit = False, True
        self.step_s = 0.0
        if self.cache is not None:
            t = self.cache.table
            t.hits = t.misses = t.evictions = 0
            self.cache._resolve()
            self.cache.bytes_copied, self.cache.copy_s, self.cache.copies = 0, 0.0, 0
        if self.slots is not None:
            self.slots.reset_counts()
            self._tokens_dev.zero_()

    def close(self) -> None:
        self.cpu.close()
        self.host.close()


def _agree(values: list[float], device: torch.device, op) -> list[float]:
    """Reduce ``values`` over every rank with ``op`` (start-up only); identity at world size 1."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=op)
    return t.tolist()
