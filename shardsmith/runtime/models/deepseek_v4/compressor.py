"""KV compressors and the Lightning Indexer of DeepSeek-V4's compressed attention layers.

A compressor turns every ``ratio`` source tokens into one compressed KV entry (paper §2.3,
transformers ``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` / ``DeepseekV4Indexer``):

=============  =====  ===============================  ============================================
layer kind     ratio  projections ``wkv``/``wgate``    entry ``w``
=============  =====  ===============================  ============================================
HCA            128    ``[d, D]``                       ``norm(sum_j softmax_j(Z_j + ape_j) C_j)``
                                                       over the 128 tokens of window ``w``
CSA            4      ``[2d, D]``: series Ca | Cb      the same over 8 rows: Ca of window ``w-1``
(overlap)                                              and Cb of window ``w``
=============  =====  ===============================  ============================================

Entry ``w`` gets RoPE (the compressed-layer RoPE) at position ``w * ratio`` and is visible to a
query at position ``t`` iff ``w < (t + 1) // ratio`` (its window is complete). Tokens of an
incomplete window wait in a buffer, and a CSA compressor keeps the last complete window's Ca
rows: both carried across decode steps. That state is kept per **slot** (one independent sequence
each, preallocated; :class:`Compressor`): a prefill or prefill chunk extends one slot
(:meth:`Compressor.extend`), a batched decode step takes one token for each of ``R`` slots
(:meth:`Compressor.step`, device-only with static shapes), or with speculation a run of a slot's
consecutive tokens, taken in order and taken back exactly (:meth:`Compressor.rewind_run`). All
projections here are replicated.

Legend: T = new tokens, B = rows of a batched decode step (one slot each), N = slots, D = hidden,
d = entry dim, C = compressed entries so far, r = ratio, h = indexer heads, k = top-k, L = max_seq_len.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.errors import UsageError
from shardsmith.runtime.layers.fused import for_chunks
from shardsmith.runtime.layers.kernels._common import use_triton
from shardsmith.runtime.layers.kernels.deepseek_v4.compressor_step import compressor_step
from shardsmith.runtime.layers.kernels.deepseek_v4.indexer_scores import indexer_prefill_scores, indexer_scores
from shardsmith.runtime.layers.parallel import Shards, kernel_on
from shardsmith.runtime.models.common import RMSNormF32
from shardsmith.runtime.models.deepseek_v4.ops import apply_rope, rope_cos_sin
from shardsmith.runtime.models.deepseek_v4.rows import NEG_INF, DecodeRows


class Compressor(nn.Module):
    """One compressor and the running state of every slot (one independent sequence per slot).

    Per-slot state, preallocated by :meth:`allocate` (N = slots, d = entry dim, width = ``2d`` with
    overlap else ``d``); how much of it is live follows from the slot's position ``p`` (tokens seen),
    so the model's position per slot is the only length kept:

    ==============================  ======================  ==========================================
    tensor                          shape                   live part
    ==============================  ======================  ==========================================
    ``buf_kv`` / ``buf_gate``       ``[N, r, width]``       rows ``[0, p % r)``: the incomplete window
                                    (views of ``buf``       (one buffer, so a decode step writes a
                                    ``[N, r, 2, width]``)   row's kv and gate with one index_put)
    ``prev_kv`` / ``prev_gate``     ``[N, r, d]`` (CSA)     Ca of the last complete window (reset:
                                                            ``0`` / ``-inf``, so it weighs 0)
    ``entries``                     ``[N, L // r, d]``      rows ``[0, p // r)``
    ==============================  ======================  ==========================================

    Args:
        shards: the rank's plan; prefix: ``layers.N.attn.compressor`` or
            ``layers.N.attn.indexer.compressor``; ratio: r; dim: d; overlap: CSA's two series.
        freqs: compressed-layer RoPE inverse frequencies ``[rope_dim/2]``; eps: norm epsilon.
    """

    def __init__(self, shards: Shards, prefix: str, *, ratio: int, dim: int, overlap: bool,
                 freqs: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.ratio, self.dim, self.overlap, self.freqs = ratio, dim, overlap, freqs
        self.width = (2 if overlap else 1) * dim
        self.wkv = shards.linear(prefix + ".wkv")
        self.wgate = shards.linear(prefix + ".wgate")
        self.register_buffer("ape", torch.empty(ratio, self.width, dtype=torch.float32, device="meta"))
        self.norm = RMSNormF32(dim, eps)
        self.buf = self.buf_kv = self.buf_gate = self.prev_kv = self.prev_gate = self.entries = None
        self.kernel = False  # step through the Triton kernel (use_kernel_)
        self._saved: tuple | None = None  # (slot, buf, carry, the step's rows): save() for rewind()
        self.run_col = self.run_prev_kv = self.run_prev_gate = self.run_rows = None  # reserve_runs

    def allocate(self, num_slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype, *,
                 entries: torch.Tensor | None = None) -> None:
        """Preallocate the state of ``num_slots`` sequences of up to ``max_seq_len`` tokens (zeros; every
        slot reset). ``dtype`` is the compute dtype (kv rows, entries); gates with ``ape`` are float32.
        ``entries`` (optional): a zeroed ``[N, L // r, d]`` view to keep the entries in (the attention's
        key buffer, so that its keys are one gather)."""
        r, d, n = self.ratio, self.dim, num_slots
        self.buf = torch.zeros(n, r, 2, self.width, device=device, dtype=dtype)
        self.buf_kv, self.buf_gate = self.buf[:, :, 0], self.buf[:, :, 1]
        if self.overlap:
            self.prev_kv = torch.zeros(n, r, d, device=device, dtype=dtype)
            self.prev_gate = torch.full((n, r, d), float("-inf"), device=device, dtype=torch.float32)
        self.entries = torch.zeros(n, max_seq_len // r, d, device=device, dtype=dtype) if entries is None else entries

    def state_bytes_for(self, num_slots: int, max_seq_len: int, dtype: torch.dtype) -> int:
        """Bytes :meth:`allocate` would make for ``num_slots`` slots of ``max_seq_len`` positions (what
        :meth:`state` then holds: the pending window, the CSA carry, the entries), allocating nothing."""
        b = dtype.itemsize
        r, d = self.ratio, self.dim
        per_slot = 2 * r * self.width * b + (r * d * (b + 4) if self.overlap else 0) + max_seq_len // r * d * b
        return num_slots * per_slot

    def state(self) -> list[torch.Tensor]:
        """The preallocated per-slot state tensors (for :meth:`DeepseekV4.state_bytes`)."""
        return [t for t in (self.buf_kv, self.buf_gate, self.prev_kv, self.prev_gate, self.entries) if t is not None]

    def reset(self, slot: int) -> None:
        """Forget slot ``slot``'s tokens (a new sequence starts there at position 0)."""
        if self._saved is not None and self._saved[0] == slot:
            self._saved = None
        if self.overlap:
            self.prev_kv[slot] = 0
            self.prev_gate[slot] = float("-inf")

    def extend(self, x: torch.Tensor, slot: int, start: int) -> torch.Tensor:
        """Take one sequence's new tokens ``x`` ``[T, D]`` at positions ``[start, start + T)`` into
        slot ``slot``; return the slot's entries so far ``[(start + T) // r, d]`` (a view).

        ``start`` must be the slot's position (the caller checks it).
        """
        kv, gate = self.wkv(x), self.wgate(x)  # [T, width]
        if self._saved is not None and self._saved[0] == slot and self._saved[-1] is None:
            self._saved = (*self._saved[:-1], (kv, gate))  # a verify chunk's rows, for rewind
        self._absorb(kv, gate, slot, start)
        return self.entries[slot, :(start + x.shape[0]) // self.ratio]

    def _absorb(self, kv: torch.Tensor, gate: torch.Tensor, slot: int, start: int) -> None:
        """Take one sequence's projected rows ``kv``, ``gate`` ``[T, width]`` at ``[start, start + T)``
        into slot ``slot``: complete windows pool into entries (and the CSA carry), the rest waits."""
        r, d = self.ratio, self.dim
        pending = start % r
        if pending:
            kv = torch.cat((self.buf_kv[slot, :pending], kv))
            gate = torch.cat((self.buf_gate[slot, :pending], gate))
        usable = kv.shape[0] // r * r
        if usable:
            n, w0 = usable // r, start // r  # complete windows, index of the first
            kv_w = kv[:usable].view(n, r, -1)  # [n, r, width]
            gate_w = gate[:usable].view(n, r, -1) + self.ape  # float32
            prev = (None, None)
            if self.overlap:  # Ca of the window before each: the slot's last one, then the previous row
                prev = (torch.cat((self.prev_kv[slot, None], kv_w[:-1, :, :d])),
                        torch.cat((self.prev_gate[slot, None], gate_w[:-1, :, :d])))
                self.prev_kv[slot], self.prev_gate[slot] = kv_w[-1, :, :d], gate_w[-1, :, :d]
            cos, sin = rope_cos_sin(torch.arange(w0, w0 + n, device=kv.device) * r, self.freqs)
            self.entries[slot, w0:w0 + n] = apply_rope(self._pool(kv_w, gate_w, *prev), cos, sin)
        rest = kv.shape[0] - usable
        self.buf_kv[slot, :rest], self.buf_gate[slot, :rest] = kv[usable:], gate[usable:]

    def save(self, slot: int) -> None:
        """Keep slot ``slot``'s pending window and carry, and the rows the next :meth:`extend` of the
        slot takes, so that :meth:`rewind` can take back that step's later rows (speculative decoding's
        rejected draft). Entries need no copy: they are indexed by position, and a window the draft
        completed is written again when its real tokens complete it."""
        carry = (self.prev_kv[slot].clone(), self.prev_gate[slot].clone()) if self.overlap else None
        self._saved = (slot, self.buf[slot].clone(), carry, None)

    def rewind(self, slot: int, start: int, keep: int) -> None:
        """Put slot ``slot`` back to its state before the saved step (at ``start``), then take that
        step's first ``keep`` rows again: the state the step would have left with only those rows.

        Raises:
            UsageError: no step of ``slot`` was saved.
        """
        if self._saved is None or self._saved[0] != slot or self._saved[-1] is None:
            raise UsageError(f"slot {slot}: no saved step to rewind (save() before the step's extend)")
        _, buf, carry, (kv, gate) = self._saved
        self._saved = None
        self.buf[slot] = buf
        if carry is not None:
            self.prev_kv[slot], self.prev_gate[slot] = carry
        if keep:
            self._absorb(kv[:keep], gate[:keep], slot, start)

    def reserve_runs(self, rows: int) -> None:
        """Room for what :meth:`step` keeps of a step of up to ``rows`` rows when a slot may have a run
        of them (``spec.runs > 1``), for :meth:`rewind_run`: each row's column of its slot's pending
        window before the step ``run_col [rows, 2, width]``, its slot's CSA carry before the step
        ``run_prev_kv / run_prev_gate [rows, r, d]``, its projections ``run_rows [rows, 2, width]``.
        Static buffers, so a captured step writes the same memory at every replay."""
        if self.run_rows is not None and self.run_rows.shape[0] >= rows:
            return
        dev, dt, r = self.buf.device, self.buf.dtype, self.ratio
        self.run_col = torch.zeros(rows, 2, self.width, device=dev, dtype=dt)
        self.run_rows = torch.zeros_like(self.run_col)
        if self.overlap:
            self.run_prev_kv = torch.zeros(rows, r, self.dim, device=dev, dtype=dt)
            self.run_prev_gate = torch.zeros(rows, r, self.dim, device=dev, dtype=torch.float32)

    def rewind_run(self, slot: torch.Tensor, first: torch.Tensor, rows: int, start: torch.Tensor,
                   keep: list[DecodeRows]) -> None:
        """After a step in which slot ``slot`` had a run of ``rows`` rows from row ``first`` on, at
        positions from ``start`` (kept by :meth:`step`): put the slot back as it was before the step,
        then take the run's first ``len(keep)`` rows again, one :func:`compressor_step` each
        (``keep[j]``: row ``j``'s one-row rows, at ``start + j``), as the step's phases took them: the state the step
        would have left with those rows only. Entries a taken-back row completed stay written but
        unseen (an entry is visible only past its window's last position) until the real token
        completes the window again.

        ``slot``, ``first``, ``start``: ``[1]`` int64 on the state's device, so the whole rollback is
        device work on static shapes (the engine captures it as a graph per ``(rows, len(keep))``).

        Raises:
            UsageError: :meth:`reserve_runs` was not called, or ``keep`` is empty (a run's first row,
                the sequence's pending token, is always kept).
        """
        if self.run_rows is None or not keep:
            raise UsageError(f"slot {slot.tolist()}: no run kept to rewind, or none of its rows kept")
        if self.entries.shape[1] == 0:  # E = 0: the step never ran (no window ever completes)
            return
        r = self.ratio
        at = torch.arange(min(rows, r), device=self.buf.device)  # each column's first writer in the run
        self.buf[slot, (start + at) % r] = self.run_col.index_select(0, first + at)  # kept its pre-step value
        if self.overlap:
            self.prev_kv[slot], self.prev_gate[slot] = self.run_prev_kv[first], self.run_prev_gate[first]
        for j, one in enumerate(keep):
            done, entry, cs, sn = one.completion(r)
            compressor_step(self.run_rows.index_select(0, first + j), self.buf, self.ape, self.norm.weight,
                            self.entries, one.index, one.column(r), done, entry, cs, sn, self.prev_kv,
                            self.prev_gate, eps=self.norm.eps, backend="auto" if self.kernel else "reference")

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The per-token projections ``kv``, ``gate`` of ``x`` ``[T, D]`` stacked: ``[T, 2, width]``.
        Row-wise, so a decode step computes them in its captured ``attn_in`` piece and hands them to
        :meth:`step`."""
        return torch.stack((self.wkv(x), self.wgate(x)), dim=1)

    def step(self, kv_gate: torch.Tensor, rows: DecodeRows) -> None:
        """Take one token per row: row ``i`` of ``kv_gate`` ``[B, 2, width]`` (:meth:`project`) is slot
        ``rows.index[i]``'s token at ``rows.positions[i]`` (padding rows: the scratch slot's).

        Device-only, static shapes, no host value: the rows that complete their window (``position %
        r == r - 1``, real; :meth:`DecodeRows.completion`) write its pooled entry and (CSA) the carry
        ``prev_kv/prev_gate``: :func:`compressor_step`, one Triton launch on CUDA (its reference on
        CPU, or with ``SHARDSMITH_KERNELS=compressor_step=reference``: every row pools as if complete and keeps the
        result where done). Needs ``E > 0`` (the caller skips a compressor without entries).

        Where a slot may have a run of rows (``rows.spec.runs = K > 1``; :meth:`reserve_runs` called),
        the step first keeps what :meth:`rewind_run` needs, then takes the rows in ``K`` launches, the
        ``j``-th row of every run in launch ``j`` (the others sent to the scratch slot,
        :meth:`DecodeRows.phase`), so that a window a run's row completes pools the run's earlier rows.
        """
        r, backend = self.ratio, "auto" if self.kernel else "reference"
        done, entry, cs, sn = rows.completion(r)
        if rows.spec.runs == 1:
            compressor_step(kv_gate, self.buf, self.ape, self.norm.weight, self.entries, rows.index,
                            rows.column(r), done, entry, cs, sn, self.prev_kv, self.prev_gate,
                            eps=self.norm.eps, backend=backend)
            return
        # runs: keep what rewind_run needs, then take the rows in phases (each run's j-th rows in phase j)
        B = kv_gate.shape[0]
        if B > self.run_col.shape[0]:
            raise UsageError(f"a decode step of {B} rows; reserve_runs kept room for {self.run_col.shape[0]}")
        self.run_col[:B] = self.buf[rows.index, rows.column(r)]
        self.run_rows[:B] = kv_gate
        if self.overlap:
            self.run_prev_kv[:B], self.run_prev_gate[:B] = self.prev_kv[rows.index], self.prev_gate[rows.index]
        if self.kernel and use_triton(kv_gate, "auto"):  # one launch: each run's first row's program takes its rows
            compressor_step(kv_gate, self.buf, self.ape, self.norm.weight, self.entries, rows.index,
                            rows.column(r), done, entry, cs, sn, self.prev_kv, self.prev_gate,
                            eps=self.norm.eps, backend="triton", run=rows.run_lengths())
            return
        for j in range(rows.spec.runs):
            index, done_j = rows.phase(r, j)
            compressor_step(kv_gate, self.buf, self.ape, self.norm.weight, self.entries, index,
                            rows.column(r), done_j, entry, cs, sn, self.prev_kv, self.prev_gate,
                            eps=self.norm.eps, backend=backend)

    def use_kernel_(self, device: torch.device) -> None:
        """Run :meth:`step` through :func:`compressor_step`'s Triton kernel when
        ``SHARDSMITH_KERNELS=compressor_step`` allows on ``device`` (``auto``: on CUDA; ``reference``: its PyTorch
        reference, the same maths in about 22-30 launches)."""
        self.kernel = kernel_on("compressor_step", device)

    def warm_kernel(self, seen: set, *, dtype: torch.dtype | None = None) -> int:
        """Launch :func:`compressor_step` once on a one-slot scratch copy of this compressor's state
        (no sequence slot touched), so its kernel compiles before serving (``engine/warmup.py``),
        unless a compressor of the same variant did (``seen``); returns the launches (0 or 1).
        ``dtype``: unused (the state's decides)."""
        key = ("compressor_step", self.ratio, self.dim, self.overlap, self.buf.dtype, self.freqs.shape[0])
        if key in seen:
            return 0
        seen.add(key)
        dev, dt, r, d = self.buf.device, self.buf.dtype, self.ratio, self.dim
        one = torch.zeros(1, dtype=torch.int64, device=dev)
        cs = torch.zeros(1, 2 * self.freqs.shape[0], device=dev)
        prev = (torch.zeros(1, r, d, dtype=dt, device=dev), torch.zeros(1, r, d, device=dev)) if self.overlap \
            else (None, None)
        compressor_step(torch.zeros(1, 2, self.width, dtype=dt, device=dev), torch.zeros_like(self.buf[:1]),
                        self.ape, self.norm.weight, torch.zeros(1, 1, d, dtype=dt, device=dev), one, one,
                        torch.ones(1, dtype=torch.bool, device=dev), one, cs, cs, *prev, eps=self.norm.eps)
        return 1

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None,
              prev_gate: torch.Tensor | None) -> torch.Tensor:
        """Entries ``[n, d]`` of ``n`` complete windows, before their RoPE (at position ``w * r`` for
        entry ``w``: the caller's).

        Args:
            kv: ``[n, r, width]``; gate: ``[n, r, width]`` float32, ``ape`` added; prev_kv /
            prev_gate: ``[n, r, d]`` Ca of the window before each (CSA; ``-inf`` gates weigh 0),
            laid before Cb of the window itself: ``[n, 2r, d]``.
        """
        if self.overlap:
            d = self.dim
            kv, gate = torch.cat((prev_kv, kv[..., d:]), dim=1), torch.cat((prev_gate, gate[..., d:]), dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.norm((kv * weights).sum(dim=1))  # [n, d]


def visible(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """``[T, C]`` bool: entry ``w`` is complete for the query at ``positions[t]``."""
    return torch.arange(n_entries, device=positions.device)[None, :] < ((positions + 1) // ratio)[:, None]


class Indexer(nn.Module):
    """Lightning Indexer: picks the top-``k`` compressed entries per query for CSA layers.

    ``score[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s]) / sqrt(c)`` with ``w = weights_proj(x) /
    sqrt(h)``, ``q = wq_b(q_lora)`` (compressed-layer RoPE at the query position) and ``K`` its own
    overlap compressor at ``index_head_dim`` (paper §2.3.1 eqs. 13-17).
    """

    def __init__(self, shards: Shards, prefix: str, *, ratio: int, heads: int, head_dim: int, topk: int,
                 freqs: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.ratio, self.heads, self.head_dim, self.topk, self.freqs = ratio, heads, head_dim, topk, freqs
        self.compressor = Compressor(shards, prefix + ".compressor", ratio=ratio, dim=head_dim, overlap=True,
                                     freqs=freqs, eps=eps)
        self.wq_b = shards.linear(prefix + ".wq_b")
        self.weights_proj = shards.linear(prefix + ".weights_proj")

    def forward(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, slot: int,
                start: int, *, kernel: bool = False) -> torch.Tensor:
        """One sequence's picks ``[T, K]`` int64 over slot ``slot``'s entries: each query's top
        ``K = min(topk, C)`` complete entries by index score, ``-1`` where it has fewer than ``K``.

        Args:
            x: ``[T, D]`` attention input; q_lora: ``[T, q_lora_rank]`` normed query latent;
            positions: ``[T]`` absolute positions ``[start, start + T)``; slot: the slot; start: the
                slot's position (checked by the caller); kernel: score through
                :func:`indexer_prefill_scores`'s Triton kernel (else the reference einsum).
        """
        keys = self.compressor.extend(x, slot, start)  # [C, c]
        T, C = x.shape[0], keys.shape[0]
        if C == 0:
            return torch.zeros(T, 0, dtype=torch.int64, device=x.device)
        q, w = self.query(x, q_lora, *rope_cos_sin(positions, self.freqs))
        if kernel:  # -inf on entries not complete for the query already
            score = indexer_prefill_scores(q, w, keys, q0=start, ratio=self.ratio, backend="triton")
        else:
            score = self._score(q, w, keys)  # [T, C]
        return self._top(score, visible(positions, C, self.ratio))

    def project(self, x: torch.Tensor, q_lora: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Everything per token the indexer takes in a decode step, row-wise (so captured in the step's
        ``attn_in`` piece): its compressor's ``kv_gate`` ``[T, 2, 2c]`` and :meth:`query`'s ``(q, w)``."""
        return (self.compressor.project(x), *self.query(x, q_lora, cos, sin))

    def step(self, kv_gate: torch.Tensor, q: torch.Tensor, w: torch.Tensor, rows: DecodeRows, *,
             kernel: bool = False) -> torch.Tensor:
        """One token per row (row ``i``: slot ``rows.index[i]`` at ``rows.positions[i]``): the selection
        as an additive bias ``[B, C]`` float32 over entries ``[0, C)`` of each row's own slot (``0``:
        picked, ``-inf``: not), ``C`` the bucket's columns (:meth:`DecodeRows.count`); the top
        ``k = min(topk, C)`` is static. Device-only (no host value).

        Args:
            kv_gate, q, w: the rows' :meth:`project` ``[B, ...]``; rows: the step's rows (the
                ratio's visibility and completed windows); kernel: score through
                :func:`indexer_scores`'s Triton kernel (else its reference, the same maths as prefill's).
        """
        B, C = q.shape[0], rows.count(self.ratio)
        if self.compressor.entries.shape[1] == 0:  # E = 0 (max_seq_len < ratio): no entry ever
            return torch.zeros(B, 0, device=q.device)
        self.compressor.step(kv_gate, rows)
        if C == 0:
            return torch.zeros(B, 0, device=q.device)
        hidden = rows.visible(self.ratio)  # [B, C]: 0 visible, -inf not
        score = indexer_scores(q, w, self.compressor.entries, rows.index, C,
                               backend="auto" if kernel else "reference") + hidden  # non-causal entries: -inf
        top = score.topk(min(self.topk, C), dim=-1).indices
        # picked entries weigh 0, the rest -inf; a row with fewer than k causal entries picks some -inf
        # ones, which the visibility bias hides again
        return torch.full_like(score, NEG_INF).scatter_(1, top, 0.0) + hidden

    def query(self, x: torch.Tensor, q_lora: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
              weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries ``q`` ``[T, h, c]`` (compressed-layer RoPE, ``cos``/``sin`` ``[T, rope_dim/2]``
        at the query positions) and head weights ``w`` ``[T, h]`` float32 (``weights_proj(x) / sqrt(h)``;
        ``weights``: ``weights_proj(x)`` already computed, e.g. in the attention's merged projection)."""
        T = x.shape[0]
        q = index_query(self.wq_b(q_lora).view(T, self.heads, self.head_dim), cos, sin)
        return q, (self.weights_proj(x) if weights is None else weights).float() * self.heads ** -0.5

    def _score(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Index scores ``[T, C]`` float32 of :meth:`query`'s ``q``, ``w`` over keys ``[C, c]`` (one
        sequence) or ``[T, C, c]`` (a row each)."""
        spec = "thc,sc->ths" if keys.dim() == 2 else "thc,tsc->ths"
        scores = F.relu(torch.einsum(spec, q.float(), keys.float())) * self.head_dim ** -0.5
        return (scores * w[..., None]).sum(dim=1)  # [T, C]

    def _top(self, score: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """The top-``k`` of ``score`` ``[T, C]`` among the ``causal`` entries, as indices ``[T, k]``
        (``-1`` where a query has fewer than ``k`` causal entries)."""
        top = score.masked_fill(~causal, float("-inf")).topk(min(self.topk, score.shape[1]), dim=-1).indices
        return torch.where(causal.gather(1, top), top, -1)


@for_chunks
def index_query(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The index queries' RoPE: ``q [T, h, c]`` rotated at ``cos``/``sin`` ``[T, rope_dim/2]`` (fused for a
    chunk's rows)."""
    return apply_rope(q, cos, sin)
