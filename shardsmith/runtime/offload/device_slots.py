"""An LRU slot table for the expert cache kept on the GPU: hits, misses and evictions without a host sync.

:class:`~.slots.SlotTable` decides on the host, so a decode step that routes on the GPU must read the
selected experts back first. :class:`DeviceSlots` keeps the table in four device tensors and decides
in one Triton launch (``_assign_kernel``, grid ``(1,)``) that a CUDA graph can capture: the decode
step's routed ids go in, the slot to read each pair from and the slot to fill come out.

=============  ==========  =====  ==================================================================
state          shape       dtype  meaning
=============  ==========  =====  ==================================================================
``slot_key``   ``[S]``     int64  ``layer * n_experts + expert`` held by the slot, -1: empty
``slot_used``  ``[S]``     int64  the tick of the last call that used the slot, -1: never
``tick``       ``[1]``     int64  calls so far
``counts``     ``[2]``     int64  (hit pairs, miss pairs) since start or :meth:`~DeviceSlots.reset_counts`
=============  ==========  =====  ==================================================================

One :meth:`~DeviceSlots.assign` call on ``ids [T, K]`` of one layer:

1. ``tick += 1`` (``t`` = the new tick); no slot is marked "filled in this call".
2. For each pair ``p = 0 .. P-1`` in token-major order, ``key = layer * n_experts + ids.flatten()[p]``:

   - the key sits in slot ``s``, filled earlier in this call: ``src = -1 - expert``, ``dst = -1``,
     a miss. The expert kernel writes the slot's bytes while it reads the host copy of the pair that
     filled it, so no pair of the same call can read the slot yet: this one reads the host copy too;
   - the key sits in slot ``s``, not filled in this call: ``src = s``, ``dst = -1``,
     ``slot_used[s] = t``, a hit;
   - the key is in no slot: a miss, ``src = -1 - expert``. The victim ``v`` is the slot with the
     smallest ``slot_used``, the lowest index among equals (empty slots first, then least recently
     used). If ``slot_used[v] == t`` every slot is already used by this call (hit or filled) and the
     expert is not admitted: ``dst = -1``. Else ``slot_key[v] = key``, ``slot_used[v] = t``, ``v``
     is marked filled and ``dst = v`` (the caller copies the expert's bytes into slot ``v``).

   ``read`` is where pair p's expert sits once the call's copies are done: the hit's or the filled
   slot (also for the later pairs of an expert filled in this call). The copy mode of the runtime
   (``n_stage`` > 0: that many staging rows ``S .. S + n_stage - 1`` after the slots, outside the
   table) also copies a miss that is not admitted: the first ``n_stage`` such experts of a call get
   ``dst = read = S + j`` in turn (later pairs of a staged expert read its row), the rest ``read =
   -1 - expert`` (host). A staged expert is not admitted later in the same call (one copy per call)
   and is forgotten at the next call.

   With ``policy="lfu"`` (what the runtime's default ``hot`` cache policy runs) every pair first adds 1
   to its key's count (``freq [n_layers * n_experts]``, all halved every ``decay`` calls) and a slot
   remembers its key's count (``slot_freq``); the victim is the slot not used by this call with the
   lowest count, then the least recently used, then the lowest index, and a miss is admitted only into
   an empty slot or over a lower count (so one-off experts read from the host and leave the frequent
   ones cached, as the host table's pinned hot set does).

3. The state is written back in place (never reallocated: a captured graph reads and writes these
   tensors); ``src`` and ``dst`` are fresh tensors.

So a slot hit or filled in a call is never evicted by a later pair of the same call.

Determinism: every rank of tensor parallelism runs the same calls on the same routed ids (the router
is replicated), and the decisions are a pure function of that call sequence: no timing, hash seed,
rank or thread order enters (the kernel is one program; ties break on the lowest slot index). The
Triton kernel and :func:`assign_reference` give the same bits.

Legend: S = slots, T = tokens, K = experts per token, P = T * K pairs.

Example:
    >>> slots = DeviceSlots(2, 16, torch.device("cpu"))
    >>> src, dst = slots.assign(0, torch.tensor([[3, 5]]), backend="reference")
    >>> src.tolist(), dst.tolist()  # two misses, read from host, copied into slots 0 and 1
    ([-4, -6], [0, 1])
    >>> slots.assign(0, torch.tensor([[5, 7]]), backend="reference")[0].tolist()  # 5 hits; 7 evicts 3
    [1, -8]
"""

from __future__ import annotations

import functools

import torch

from shardsmith.errors import UsageError
from shardsmith.runtime.layers.kernels._common import KernelError, use_triton

NUM_WARPS = 4
_FREE = 2**62  # ``slot_used`` of the padding lanes ``S..BLOCK_S``: above every tick, never a victim
POLICIES = ("lru", "lfu")
DECAY_CALLS = 1024  # ``lfu``: every count halves after this many calls (the hot set follows drift)


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (Triton is optional: the ``kernels`` extra)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _assign_kernel(ids_ptr, key_ptr, used_ptr, freq_ptr, sfreq_ptr, tick_ptr, counts_ptr, src_ptr, dst_ptr,
                       read_ptr, P, base, S, n_keys, decay, n_stage, BLOCK_S: tl.constexpr, FREE: tl.constexpr,
                       LFU: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
        # One program: the S-slot state lives in registers ([BLOCK_S] tensors) for the whole call, so
        # a pair sees the updates of the pairs before it with no global-memory round trip.
        offs = tl.arange(0, BLOCK_S)
        live = offs < S
        keys = tl.load(key_ptr + offs, mask=live, other=-1)
        used = tl.load(used_ptr + offs, mask=live, other=FREE)
        t = tl.load(tick_ptr) + 1
        if LFU:
            sfreq = tl.load(sfreq_ptr + offs, mask=live, other=0)
            if t % decay == 0:  # halve every count (the hot set adapts to drift)
                for k0 in range(0, n_keys, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    tl.store(freq_ptr + k, tl.load(freq_ptr + k, mask=k < n_keys, other=0) // 2, mask=k < n_keys)
                sfreq = sfreq // 2
                tl.debug_barrier()  # the halved counts before this program's atomics read them
        filled = offs < 0  # filled in this call: none yet
        stage = tl.arange(0, BLOCK_G)
        stage_keys = tl.full((BLOCK_G,), -1, tl.int64)  # the keys staged in this call, in staging-row order
        staged = t * 0
        hits = t * 0
        misses = t * 0
        for p in range(P):
            e = tl.load(ids_ptr + p).to(tl.int64)
            key = base + e
            match = (keys == key) & live
            found = tl.max(match.to(tl.int32), axis=0) > 0
            s = tl.min(tl.where(match, offs, BLOCK_S), axis=0)
            fresh = tl.max((match & filled).to(tl.int32), axis=0) > 0
            hit = found & (fresh == 0)
            sm = (stage_keys == key) & (stage < staged)  # staged earlier in this call (never also admitted)
            in_stage = tl.max(sm.to(tl.int32), axis=0) > 0
            if LFU:
                # victim among the slots not used by this call: the lowest count, then the least recently
                # used, then the lowest index; admitted into an empty slot or over a lower count
                f = tl.atomic_add(freq_ptr + key, 1) + 1
                cand = live & (used != t)
                lowf = tl.min(tl.where(cand, sfreq, FREE), axis=0)
                tie = cand & (sfreq == lowf)
                lowu = tl.min(tl.where(tie, used, FREE), axis=0)
                v = tl.min(tl.where(tie & (used == lowu), offs, BLOCK_S), axis=0)
                vkey = tl.max(tl.where(offs == v, keys, -1), axis=0)
                admit = (found == 0) & (in_stage == 0) & (lowf != FREE) & ((vkey < 0) | (f > lowf))
                sfreq = tl.where(((hit & (offs == s)) | (admit & (offs == v))), f, sfreq)
            else:
                # victim: the smallest slot_used, then the lowest index with it (explicit: no argmin ties)
                low = tl.min(tl.where(live, used, FREE), axis=0)
                v = tl.min(tl.where(live & (used == low), offs, BLOCK_S), axis=0)
                admit = (found == 0) & (in_stage == 0) & (low != t)
            # a miss neither admitted nor filled earlier in this call: a staging row (the first use of the
            # key in this call, while rows last), the row of that first use, else the host
            srow = S + tl.min(tl.where(sm, stage, BLOCK_G), axis=0).to(tl.int64)
            new_stage = (found == 0) & (admit == 0) & (in_stage == 0) & (staged < n_stage)
            stage_keys = tl.where(new_stage & (stage == staged), key, stage_keys)
            read = tl.where(found, s.to(tl.int64), tl.where(admit, v.to(tl.int64), -1 - e))
            read = tl.where(in_stage & (found == 0), srow, tl.where(new_stage, S + staged, read))
            tl.store(src_ptr + p, tl.where(hit, s.to(tl.int64), -1 - e))
            tl.store(dst_ptr + p, tl.where(admit, v.to(tl.int64), tl.where(new_stage, S + staged, -1)))
            tl.store(read_ptr + p, read)
            staged += new_stage.to(tl.int64)
            put = admit & (offs == v)
            used = tl.where((hit & (offs == s)) | put, t, used)
            keys = tl.where(put, key, keys)
            filled = filled | put
            hits += hit.to(tl.int64)
            misses += 1 - hit.to(tl.int64)
        tl.store(key_ptr + offs, keys, mask=live)
        tl.store(used_ptr + offs, used, mask=live)
        if LFU:
            tl.store(sfreq_ptr + offs, sfreq, mask=live)
        tl.store(tick_ptr, t)
        tl.store(counts_ptr, tl.load(counts_ptr) + hits)
        tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + misses)

    return _assign_kernel


def assign_reference(slot_key: torch.Tensor, slot_used: torch.Tensor, tick: torch.Tensor, counts: torch.Tensor,
                     base: int, ids: torch.Tensor, *, freq: torch.Tensor | None = None,
                     slot_freq: torch.Tensor | None = None, decay: int = 0,
                     n_stage: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PyTorch path the kernel replaces: one :meth:`DeviceSlots.assign_rows` (module docstring) as
    a Python loop over ``.tolist()`` copies (syncs on CUDA), the state written back into the same
    tensors. ``base = layer * n_experts``; ``ids [T, K]`` integer; ``freq`` (per key) and
    ``slot_freq`` (per slot) given: the ``lfu`` policy, counts halved every ``decay`` calls;
    ``n_stage`` staging rows after the ``S`` slots; returns ``(src [P], dst [P], read [P])`` int64 on
    the state's device."""
    keys, used = slot_key.tolist(), slot_used.tolist()
    lfu = freq is not None
    t = int(tick.item()) + 1
    if lfu:
        sfreq = slot_freq.tolist()
        if t % decay == 0:
            freq.copy_(freq // 2)
            sfreq = [c // 2 for c in sfreq]
        counts_of = freq.tolist()
    S = len(keys)
    filled = [False] * S
    where = {k: s for s, k in enumerate(keys) if k >= 0}
    staged: dict[int, int] = {}  # key -> staging row, this call
    src, dst, read, hits, misses = [], [], [], 0, 0

    def not_admitted(e: int, key: int) -> None:
        if key in staged:
            dst.append(-1), read.append(staged[key])
        elif len(staged) < n_stage:
            staged[key] = S + len(staged)
            dst.append(staged[key]), read.append(staged[key])
        else:
            dst.append(-1), read.append(-1 - e)

    for e in ids.flatten().tolist():
        key = base + e
        s = where.get(key)
        if lfu:
            counts_of[key] += 1
            f = counts_of[key]
        if s is not None and not filled[s]:
            src.append(s), dst.append(-1), read.append(s)
            used[s] = t
            if lfu:
                sfreq[s] = f
            hits += 1
            continue
        misses += 1
        src.append(-1 - e)
        if s is not None:  # filled earlier in this call: its bytes are not written yet
            dst.append(-1), read.append(s)
            continue
        if key in staged:  # staged earlier in this call: read there, never also admitted
            not_admitted(e, key)
            continue
        if lfu:
            cand = [i for i in range(S) if used[i] != t]
            v = min(cand, key=lambda i: (sfreq[i], used[i], i)) if cand else None
            if v is None or (keys[v] >= 0 and not f > sfreq[v]):  # no victim, or a count no higher: not admitted
                not_admitted(e, key)
                continue
            sfreq[v] = f
        else:
            low = min(used)
            v = used.index(low)  # the lowest index with the smallest slot_used
            if low == t:  # every slot used by this call: not admitted
                not_admitted(e, key)
                continue
        if keys[v] >= 0:
            del where[keys[v]]
        keys[v], used[v], filled[v], where[key] = key, t, True, v
        dst.append(v), read.append(v)
    slot_key.copy_(torch.tensor(keys, dtype=torch.int64))
    slot_used.copy_(torch.tensor(used, dtype=torch.int64))
    if lfu:
        slot_freq.copy_(torch.tensor(sfreq, dtype=torch.int64))
        freq.copy_(torch.tensor(counts_of, dtype=torch.int64))
    tick.fill_(t)
    counts.add_(torch.tensor([hits, misses], dtype=torch.int64).to(counts.device))
    dev = slot_key.device
    return tuple(torch.tensor(v, dtype=torch.int64, device=dev) for v in (src, dst, read))


class DeviceSlots:
    """An LRU table of ``n_slots`` expert-cache slots on a device, keyed ``layer * n_experts + expert``
    (module docstring: the state and one call's semantics).

    Attributes:
        n_slots: S, the slots of the cache's pool (all layers share them).
        n_experts: routed experts per layer (ids are ``0 .. n_experts-1``).
        n_stage: staging rows after the slots (pool rows ``S .. S + n_stage - 1``; module docstring).
        slot_key: ``[S]`` int64, the key held by each slot, -1 empty.
        slot_used: ``[S]`` int64, the tick of the last call that used each slot, -1 never.
        tick: ``[1]`` int64, :meth:`assign` calls so far.
        counts: ``[2]`` int64, (hit pairs, miss pairs) since start or :meth:`reset_counts`.

    The four tensors are allocated once and only ever written in place (a captured CUDA graph holds
    their addresses).

    Raises:
        UsageError: ``n_slots < 1``, ``n_experts < 1``, ``n_stage < 0`` or an unknown policy.
    """

    def __init__(self, n_slots: int, n_experts: int, device: torch.device, *, policy: str = "lru",
                 n_layers: int = 1, decay: int = DECAY_CALLS, n_stage: int = 0) -> None:
        problems = [f"{name}={value!r} must be an int >= 1" for name, value in
                    (("n_slots", n_slots), ("n_experts", n_experts), ("n_layers", n_layers), ("decay", decay))
                    if not isinstance(value, int) or value < 1]
        if not isinstance(n_stage, int) or n_stage < 0:
            problems.append(f"n_stage={n_stage!r} must be an int >= 0")
        if policy not in POLICIES:
            problems.append(f"policy={policy!r}: one of {', '.join(POLICIES)}")
        if problems:
            raise UsageError("DeviceSlots: " + "; ".join(problems))
        self.n_slots, self.n_experts, self.n_layers, self.policy, self.decay = n_slots, n_experts, n_layers, policy, decay
        self.n_stage = n_stage
        i64 = {"dtype": torch.int64, "device": device}
        self.slot_key = torch.full((n_slots,), -1, **i64)
        self.slot_used = torch.full((n_slots,), -1, **i64)
        self.tick = torch.zeros(1, **i64)
        self.counts = torch.zeros(2, **i64)
        self.freq = torch.zeros(n_layers * n_experts if policy == "lfu" else 1, **i64)  # per key (lfu)
        self.slot_freq = torch.zeros(n_slots, **i64)  # the count of each slot's key when last seen (lfu)
        self.device = self.slot_key.device  # normalised (``cuda`` -> ``cuda:0``)

    def assign(self, layer: int, ids: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)`` of :meth:`assign_rows`: the in-place read mode's call (a miss's pair reads
        the host copy; ``dst`` is where it writes through)."""
        return self.assign_rows(layer, ids, backend=backend)[:2]

    def assign_rows(self, layer: int, ids: torch.Tensor, *,
                    backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Look up, admit and evict the routed experts ``ids`` of ``layer`` for one decode step.

        Args:
            layer: the layer index (>= 0).
            ids: ``[T, K]`` int32 or int64 on this table's device, the experts each token routes to,
                each in ``[0, n_experts)`` (not checked: a check would sync; an id out of range
                aliases another layer's key).
            backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
                ``triton`` or ``reference``.

        Returns:
            ``(src [P], dst [P], read [P])`` int64, fresh tensors, P = T * K token-major: ``src`` the
            slot to read pair p from, or ``-1 - expert`` to read the host copy; ``dst`` the row to copy
            the expert into (a miss admitted to a slot, or staged: module docstring), else -1;
            ``read`` the row holding pair p's expert once every ``dst`` copy of the call is done, or
            ``-1 - expert`` (host). The state tensors are updated in place. The Triton path does not
            sync and its launch is fixed by (T, K, S): capturable in a CUDA graph.

        Raises:
            KernelError: ``ids`` is not 2-D int32 / int64, ``ids`` is on another device than the
                table, ``layer < 0``, or the backend cannot run (every problem listed).
        """
        problems = []
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            problems.append(f"ids {tuple(ids.shape)} {ids.dtype}: want [T, K] int32 or int64")
        if ids.device != self.device:
            problems.append(f"ids on {ids.device}, table on {self.device}: one device")
        if not isinstance(layer, int) or layer < 0 or (self.policy == "lfu" and layer >= self.n_layers):
            problems.append(f"layer={layer!r} must be an int >= 0" + (f" and < n_layers={self.n_layers}"
                                                                      if self.policy == "lfu" else ""))
        if problems:
            raise KernelError("DeviceSlots.assign: " + "; ".join(problems))
        base = layer * self.n_experts
        lfu = self.policy == "lfu"
        if not use_triton(ids, backend):
            return assign_reference(self.slot_key, self.slot_used, self.tick, self.counts, base, ids,
                                    freq=self.freq if lfu else None, slot_freq=self.slot_freq, decay=self.decay,
                                    n_stage=self.n_stage)
        import triton

        flat = ids.reshape(-1).contiguous()
        P = flat.numel()
        src, dst, read = (torch.empty(P, dtype=torch.int64, device=self.device) for _ in range(3))
        _kernel()[(1,)](flat, self.slot_key, self.slot_used, self.freq, self.slot_freq, self.tick, self.counts, src, dst,
                        read, P, base, self.n_slots, self.freq.numel(), self.decay, self.n_stage,
                        BLOCK_S=triton.next_power_of_2(self.n_slots), FREE=_FREE, LFU=lfu, BLOCK_K=1024,
                        BLOCK_G=triton.next_power_of_2(max(self.n_stage, 1)), num_warps=NUM_WARPS)
        return src, dst, read

    def reset_counts(self) -> None:
        """Set the hit and miss counts to 0 (in place; the slots are kept)."""
        self.counts.zero_()

    def stats(self) -> dict:
        """``{"hits": int, "misses": int, "hit_rate": float}`` in pairs since start or
        :meth:`reset_counts` (``hit_rate`` 0.0 before any pair). Reads the counts on the host: syncs."""
        hits, misses = self.counts.tolist()
        return {"hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0}
