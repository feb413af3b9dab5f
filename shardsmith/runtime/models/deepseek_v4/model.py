"""The DeepSeek-V4 causal LM, built on ``meta`` from the rank's plan and filled from its weights.

Module paths mirror the release checkpoint (``layers.N.attn.wq_b.weight``), so loading is a strict
name-for-name assignment (:func:`assign_weights`) with three spelled-out renames:

=================================  =================================  ===========================
source tensor                      module buffer                      why
=================================  =================================  ===========================
``X.scale`` (UE8M0, FP8 weight)    ``X.weight_scale_inv`` (float32)   the parallel layers' name
``layers.N.hc_attn_fn`` (etc.)     ``layers.N.hc_attn.fn``            mixers are modules
``layers.N.ffn.experts.E.w1`` ...  ``layers.N.ffn.experts.gate_up``   expert banks
=================================  =================================  ===========================

``mtp.*`` draft layers stay in the pack and are not loaded. Every parallel layer comes from
:class:`~shardsmith.runtime.layers.parallel.Shards`; this file knows nothing about ranks. The state
(sliding windows, compressor buffers and entries) is kept per **slot**, ``max_num_seqs`` independent
sequences preallocated by :meth:`DeepseekV4.setup_cache`; it continues from the slot's last
position, so a step of a slot must start at 0 (a new sequence there) or where its previous one
ended, or at a **resume point**: a prefill chunk that ends at a multiple of ``snapshot_every``
tokens leaves a snapshot of the slot's state that cannot be recomputed from position-indexed
entries (the window ring, the CSA compressors' carried window), and :meth:`DeepseekV4.restore`
puts the slot back there, so a later prompt sharing that prefix resumes at it (prefix reuse).
:meth:`DeepseekV4.forward` runs one sequence (a prefill, a chunk of one, or one token);
:meth:`DeepseekV4.decode_step` and the blocks' pieces run one token for each of ``B`` slots
(continuous batching), or, after :meth:`DeepseekV4.reserve_runs`, a slot's speculative verify run
of consecutive tokens, whose rejected rows :meth:`DeepseekV4.restore` takes back.
Source of the maths: transformers ``modeling_deepseek_v4.py`` (``DeepseekV4Model``).

Legend: T = new tokens, B = rows of a batched decode step, m = hyper-connection streams, D = hidden,
V = vocabulary.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
from torch import nn

from shardsmith.errors import UsageError
from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.layers.quant import ue8m0_to_float
from shardsmith.runtime.models.deepseek_v4.block import Block, Step
from shardsmith.runtime.models.deepseek_v4.config import V4Args
from shardsmith.runtime.models.deepseek_v4.hyper import HyperHead
from shardsmith.runtime.models.common import RMSNormF32, install_buffers
from shardsmith.runtime.models.deepseek_v4.ops import inv_freq
from shardsmith.runtime.models.deepseek_v4.rows import (DecodeRows, RowsSpec, host_to_device, length_bucket,
                                                        length_buckets)
from shardsmith.runtime.models.seq_slots import verify_runs

_HC = re.compile(r"(^|\.)hc_(attn|ffn|head)_(fn|base|scale)$")


class DeepseekV4(nn.Module):
    """DeepSeek-V4 on one rank: vocab-parallel ``embed``, blocks, ``hc_head``, ``norm``, vocab-parallel ``head``.

    Args:
        args: configuration; shards: the rank's plan and compute dtype.

    Attributes:
        max_seq_len: positions per sequence (tokens), set by :meth:`setup_cache`.
        max_num_seqs: slots (independent sequences), set by :meth:`setup_cache`.
        scratch: the extra slot ``max_num_seqs`` that belongs to no sequence: a decode step's padding
            rows read and write it, so they never touch a real slot.
        rows_spec: what the layers ask of a step's rows (:class:`RowsSpec`), set by :meth:`setup_cache`.
        positions: per slot, the position its next token takes (tokens seen; 0: empty).

    Raises:
        RuntimeLoadError: the plan lacks a tensor the config needs (named).
    """

    SUPPORTS_BATCHING = True
    STATIC_DECODE = True  # decode_step's core is device-only with static shapes: Block.attn_static, step_rows
    VERIFY_RUNS = True  # a decode step may hold a slot's consecutive positions (reserve_runs first)

    def __init__(self, args: V4Args, shards: Shards) -> None:
        super().__init__()
        self.args = args
        freqs = {"main": inv_freq(args.rope_dim, args.rope_theta),
                 "compress": inv_freq(args.rope_dim, args.compress_theta, args.yarn)}
        self.embed = shards.embedding("embed.weight")
        self.layers = nn.ModuleList(Block(args, shards, i, freqs) for i in range(args.n_layers))
        self.hc_head = HyperHead(args.dim, args.hc_mult, args.hc_eps, args.norm_eps)
        self.norm = RMSNormF32(args.dim, args.norm_eps)
        self.head = shards.lm_head("head.weight")
        self.freqs = freqs
        self.max_seq_len = self.max_num_seqs = self.scratch = 0
        self.rows_spec: RowsSpec | None = None
        self.positions: list[int] = []
        self.runs = 1  # K: the most rows one slot may have in a decode step (reserve_runs)

    @classmethod
    def from_weights(cls, weights, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                     max_seq_len: int = 4096, max_num_seqs: int = 1) -> "DeepseekV4":
        """Build rank ``weights.rank``'s model from its weights (``config``, ``plan``, ``dense()``, ``banks()``).

        Raises:
            RuntimeLoadError: unsupported config, or missing/unexpected/mis-shaped tensors (all listed).
        """
        model = cls(V4Args.from_config(weights.config), Shards(weights.plan, weights.rank, dtype))
        assign_weights(model, weights.dense(), weights.banks(), device=torch.device(device))
        model.setup_cache(max_seq_len, torch.device(device), dtype, max_num_seqs)
        return model

    def setup_cache(self, max_seq_len: int, device: torch.device, dtype: torch.dtype, max_num_seqs: int = 1) -> None:
        """Preallocate the state of ``max_num_seqs`` sequences (slots ``0 .. max_num_seqs - 1``) of up
        to ``max_seq_len`` positions each, plus the scratch slot ``max_num_seqs`` (padding rows' state),
        on ``device`` in ``dtype``; move the RoPE tables there.

        Per slot and layer: the window ring ``[window, d]``; per compressor (attention's and the
        indexer's) the pending window and CSA carry ``[r, width]`` and the entries ``[max_seq_len // r, d]``
        (:meth:`state_bytes` sums them, the scratch slot included). Every slot starts empty.

        Raises:
            UsageError: ``max_seq_len`` or ``max_num_seqs`` below 1.
        """
        if max_seq_len < 1 or max_num_seqs < 1:
            raise UsageError(f"DeepSeek-V4 needs max_seq_len >= 1 and max_num_seqs >= 1; got "
                             f"max_seq_len={max_seq_len}, max_num_seqs={max_num_seqs}")
        self.max_seq_len, self.max_num_seqs, self.scratch = max_seq_len, max_num_seqs, max_num_seqs
        for mod in self.modules():
            if isinstance(getattr(mod, "freqs", None), torch.Tensor):
                mod.freqs = mod.freqs.to(device)
        self.freqs = {name: f.to(device) for name, f in self.freqs.items()}
        ratios = sorted({r for r in self.args.ratios if r and max_seq_len // r})
        self.rows_spec = RowsSpec(self.args.window, tuple(ratios), max_seq_len, self.freqs, self.runs)
        for layer in self.layers:
            layer.attn.allocate(max_num_seqs + 1, max_seq_len, torch.device(device), dtype, runs=self.runs)
            layer.attn.reset(self.scratch)
            layer.attn.fuse_projections_()  # wq_a | wkv, the compressors' (weights final by now)
            layer.ffn.fuse_projections_()  # the shared expert's w1 | w3
        self.positions = [0] * max_num_seqs
        self.snapshots: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(max_num_seqs)]
        self._speculating: list[tuple[int, int] | None] = [None] * max_num_seqs  # (start, T) saved by speculate
        self._run: list[tuple[int, int] | None] = [None] * max_num_seqs  # (first row, rows) of the last step's run
        for slot in range(max_num_seqs):
            self.release(slot)

    def reserve_runs(self, rows: int) -> bool:
        """Let a decode step of up to ``rows`` rows give a slot several consecutive positions (a
        speculative verify run of up to ``K = rows - max_num_seqs + 1`` rows): the window rings grow
        to ``W + K - 1`` rows and the compressors keep room for what a run's rollback needs. The state
        is allocated anew, so every slot's sequence is forgotten: call before serving (the engine's
        ``reserve_rows``, before its warm-up). Nothing changes when no step can hold a run.

        Returns:
            Whether the state was allocated anew (what held the old tensors must let go of them).

        Raises:
            UsageError: no slots yet (:meth:`setup_cache` first).
        """
        if not self.max_num_seqs:
            raise UsageError("DeepSeek-V4 has no slots yet: call setup_cache before reserve_runs")
        runs, anew = rows - self.max_num_seqs + 1, False
        if runs > self.runs:
            self.runs, anew = runs, True
            device, dtype = self.layers[0].attn.keys.device, self.layers[0].attn.keys.dtype
            self.setup_cache(self.max_seq_len, device, dtype, self.max_num_seqs)
        for layer in self.layers:
            layer.attn.reserve_runs(max(rows, self.max_num_seqs + 1))
        return anew

    def state_bytes_for(self, max_seq_len: int, max_num_seqs: int, dtype: torch.dtype) -> int:
        """What :meth:`state_bytes` would be after ``setup_cache(max_seq_len, ..., dtype, max_num_seqs)``,
        computed from the layers' shapes (nothing allocated; the scratch slot included)."""
        return sum(layer.attn.state_bytes_for(max_num_seqs + 1, max_seq_len, dtype, runs=self.runs)
                   for layer in self.layers)

    def state_bytes(self) -> int:
        """Bytes of per-sequence state this rank allocated: all ``max_num_seqs + 1`` slots (the scratch
        slot included), all layers."""
        return sum(t.nbytes for layer in self.layers for t in layer.attn.state())

    def release(self, slot: int) -> None:
        """Forget slot ``slot``'s sequence: it is empty (its next step must start at 0).

        Raises:
            UsageError: ``slot`` is not in ``[0, max_num_seqs)``.
        """
        self._check_slot(slot)
        self.positions[slot] = 0
        self.snapshots[slot].clear()
        self._speculating[slot] = None
        self._run[slot] = None
        for layer in self.layers:
            layer.attn.reset(slot)

    def reset(self) -> None:
        """Forget every slot's sequence."""
        for slot in range(self.max_num_seqs):
            self.release(slot)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, *, last_only: bool = True, slot: int = 0) -> torch.Tensor:
        """Run one sequence's ``ids`` ``[T]`` at positions ``[start, start + T)`` in slot ``slot``;
        float32 logits ``[T or 1, V]``. ``start == 0`` begins a new sequence there; other slots are
        untouched.

        Raises:
            UsageError: ``slot`` out of range, ``start`` neither 0 nor the slot's position (the
                compressor state cannot rewind), or the sequence would pass ``max_seq_len``.
        """
        T = ids.shape[0]
        self._check_row(slot, start, T)
        if start == 0:
            self.release(slot)
        (streams,) = self.embed_ids(ids)
        for layer in self.layers:
            streams = layer(streams, ids, start, slot)
        self.positions[slot] = start + T
        end = start + T
        if T > 1 and end % self.snapshot_every == 0 and not any(r and end % r for r in self.args.ratios):
            self._snapshot(slot, end)
        return self.logits(streams[-1:] if last_only else streams)[0]  # [T or 1, V]

    # ------------------------------------------------------------------ resume points (prefix reuse)

    snapshot_every = 2048  # tokens between resume points (every compression ratio divides it)
    prefill_chunk_cuda = 8192  # the scheduler's default chunk on a GPU (scheduler.default_prefill_chunk)
    max_snapshots = 16  # per slot; the earliest is dropped past it

    def _carried(self, slot: int) -> list[torch.Tensor]:
        """Views of ``slot``'s state that its position-indexed entries do not determine: each layer's
        window ring, each overlapping compressor's carried window (at a multiple of every ratio no
        window is pending, and the entries up to it stay where they are)."""
        out = []
        for layer in self.layers:
            out.append(layer.attn.win[slot])
            for comp in layer.attn._compressors():
                if comp.overlap:
                    out += [comp.prev_kv[slot], comp.prev_gate[slot]]
        return out

    def _snapshot(self, slot: int, pos: int) -> None:
        snaps = self.snapshots[slot]
        snaps[pos] = [t.clone() for t in self._carried(slot)]
        while len(snaps) > self.max_snapshots:
            del snaps[min(snaps)]

    def _drop_snapshots(self, slot: int, *, after: int) -> None:
        for pos in [p for p in self.snapshots[slot] if p > after]:
            del self.snapshots[slot][pos]

    def resume_points(self, slot: int) -> list[int]:
        """Positions ``slot`` can be put back to (:meth:`restore`), ascending."""
        self._check_slot(slot)
        return sorted(self.snapshots[slot])

    @property
    def max_speculative_step(self) -> int:
        """Tokens a :meth:`speculate` step may hold (the sliding window: the ring keeps that many rows)."""
        return self.args.window

    def speculate(self, slot: int, T: int) -> None:
        """Before a ``T``-token step of ``slot`` at its position (a speculative verify chunk): keep what
        the step writes over, so that :meth:`restore` can take back any of its rows but the first.

        Raises:
            UsageError: a bad slot, or ``T`` outside ``[1, sliding_window]`` (the rows the ring keeps).
        """
        self._check_slot(slot)
        if not 1 <= T <= self.max_speculative_step:
            raise UsageError(f"slot {slot}: a speculative step of {T} tokens; at most the sliding window "
                             f"({self.max_speculative_step}) can be taken back")
        start = self.positions[slot]
        for layer in self.layers:
            layer.attn.save(slot, start, T)
        self._speculating[slot], self._run[slot] = (start, T), None

    def speculating(self, slot: int) -> tuple[int, int] | None:
        """``(start, T)`` of the step :meth:`speculate` saved for ``slot``, or of the slot's verify run in
        the last decode step, if it is the slot's last step (positions ``(start, start + T)`` can be
        restored), else None."""
        self._check_slot(slot)
        spec = self._speculating[slot]
        return spec if spec is not None and self.positions[slot] == spec[0] + spec[1] else None

    def restore(self, slot: int, pos: int, *, program: Callable[..., tuple] | None = None) -> None:
        """Put ``slot`` back to ``pos``: a resume point, or a position inside the step :meth:`speculate`
        saved (its rows past ``pos`` taken back exactly); its next step starts there; later resume
        points are dropped (the positions past ``pos`` will be overwritten).

        A verify run's rollback (:meth:`rewind_program`, device work only) runs through ``program``
        when given, ``program(key, fn, *inputs)`` (the engine's
        :meth:`~shardsmith.runtime.engine.cuda_graphs.DecodeGraphs.program`: one captured graph per
        key on CUDA), else eagerly.

        Raises:
            UsageError: ``pos`` is neither one of :meth:`resume_points`, nor inside the saved step, nor
                the slot's position.
        """
        self._check_slot(slot)
        spec, self._speculating[slot] = self.speculating(slot), None
        if pos == self.positions[slot]:
            return
        if spec is not None and spec[0] < pos < spec[0] + spec[1]:
            run, self._run[slot] = self._run[slot], None
            if run is not None:  # a verify run of a decode step: its compressors retake the kept rows
                at = host_to_device([slot, run[0], spec[0]], self.freqs["main"].device)
                key, fn = self._rollback(run[1], pos - spec[0])
                (program or (lambda key, f, *inputs: f(*inputs)))(key, fn, at)
            else:
                for layer in self.layers:
                    layer.attn.rewind(slot, spec[0], pos - spec[0])
            self.positions[slot] = pos
            self._drop_snapshots(slot, after=pos)
            return
        if pos not in self.snapshots[slot]:
            raise UsageError(f"slot {slot}: no resume point at position {pos} (it has {self.resume_points(slot)} "
                             f"and is at {self.positions[slot]})")
        for view, saved in zip(self._carried(slot), self.snapshots[slot][pos]):
            view.copy_(saved)
        self.positions[slot] = pos
        self._drop_snapshots(slot, after=pos)

    def _rollback(self, rows: int, kept: int) -> tuple[tuple, Callable[[torch.Tensor], tuple]]:
        return ("rewind_run", rows, kept), functools.partial(self.rewind_program, rows, kept)

    def rollback_programs(self) -> list[tuple[tuple, Callable[[torch.Tensor], tuple], tuple[torch.Tensor]]]:
        """``(key, program, inputs)`` of every verify-run rollback this model may run (each run length
        ``2..runs`` to each kept length below it; none without :meth:`reserve_runs`), its inputs
        pointing at the scratch slot: running one there writes only that slot (state no sequence
        reads), so the engine builds them all before serving."""
        at = host_to_device([self.scratch, 0, 0], self.freqs["main"].device)
        return [(*self._rollback(rows, kept), (at,)) for rows in range(2, self.runs + 1) for kept in range(1, rows)]

    def rewind_program(self, rows: int, kept: int, at: torch.Tensor) -> tuple:
        """The rollback of a verify run of ``rows`` rows that keeps its first ``kept``: every layer's
        compressors put back and retake the kept rows (:meth:`Attention.rewind_run`). ``at`` ``[3]``
        int64 on the device: the slot, the run's first row in the step, its first position. Device
        work on static shapes for a given ``(rows, kept)``, and idempotent (it writes the same state
        however often it runs), so a graph of it captured once serves every slot and position.
        Returns ``()`` (the state is its result)."""
        slot, first, start = at[0:1], at[1:2], at[2:3]
        keep = [self.step_rows(start + j, slot, self.max_seq_len) for j in range(kept)]
        for layer in self.layers:
            layer.attn.rewind_run(slot, first, rows, start, keep)
        return ()

    def _check_slot(self, slot: int) -> None:
        if not self.max_num_seqs:
            raise UsageError("DeepSeek-V4 has no slots yet: call setup_cache(max_seq_len, device, dtype, max_num_seqs)")
        if not isinstance(slot, int) or not 0 <= slot < self.max_num_seqs:
            raise UsageError(f"slot {slot!r} is out of range: DeepSeek-V4 has slots 0..{self.max_num_seqs - 1} "
                             f"(max_num_seqs={self.max_num_seqs}, set by setup_cache)")

    def _check_row(self, slot: int, start: int, T: int) -> None:
        """Refuse a step of ``T`` tokens at ``start`` in ``slot`` that is out of range, does not continue
        the slot's sequence, or passes ``max_seq_len``."""
        self._check_slot(slot)
        if T < 1:
            raise UsageError(f"slot {slot}: a step needs at least one token, got {T}")
        if start != 0 and start != self.positions[slot]:
            raise UsageError(f"slot {slot}: DeepSeek-V4 continues a sequence where it ended (position "
                             f"{self.positions[slot]}); got start={start} (its compressor state cannot "
                             f"rewind: restart at 0)")
        if start + T > self.max_seq_len:
            raise UsageError(f"slot {slot}: {start + T} positions exceed max_seq_len={self.max_seq_len}")

    @property
    def decode_layers(self) -> nn.ModuleList:
        """The blocks, whose pieces a decode step runs in order."""
        return self.layers

    def decode_step(self, ids: torch.Tensor, starts: list[int] | int, slots: list[int] | None = None,
                    real: int | None = None) -> Step:
        """Begin a batched one-token step: row ``b`` is slot ``slots[b]``'s token ``ids[b]`` at
        ``starts[b]``; rows ``>= real`` (default: none) are padding, copies of row 0, that change no
        real slot (they run in the scratch slot). After :meth:`reserve_runs` a slot may have a run of
        up to ``runs`` rows at consecutive positions (a speculative verify run: each row attends to the
        ones before it, and :meth:`restore` can take back any but the first). Checks every real row
        as :meth:`forward` does, then resets the slots a row begins (``start == 0``) and advances each
        real slot's position. The old form ``decode_step(ids [1], start: int)`` is slot 0, one row.

        The step's device inputs are ``step.tensors = (positions [B], index [B])`` (one host-to-device
        copy; padding rows: row 0's position and the scratch slot) and its length bucket
        ``step.key`` (:func:`length_bucket` of the furthest real row); ``step.rows`` derives the
        rest from them (:meth:`step_rows`).

        Raises:
            UsageError: lengths disagree, ``real`` is not in ``[1, B]``, a padding row is not a copy
                of row 0, two real rows share a slot but not as a run (or a run is longer than
                ``runs``), or a row fails :meth:`forward`'s checks.
        """
        if isinstance(starts, int):  # the single-row form
            starts, slots = [starts], [0] if slots is None else slots
        starts, slots, B = list(starts), list(slots), ids.shape[0]
        real = B if real is None else real
        if len(starts) != B or len(slots) != B:
            raise UsageError(f"decode_step: {B} ids, {len(starts)} starts and {len(slots)} slots (one each per row)")
        if not 1 <= real <= B:
            raise UsageError(f"decode_step: real={real} must be in [1, {B}] (rows >= real are padding)")
        pad = [b for b in range(real, B) if (slots[b], starts[b]) != (slots[0], starts[0])]
        if pad:
            raise UsageError(f"decode_step: padding rows {pad} must copy row 0 (slot {slots[0]}, start {starts[0]})")
        if len(set(slots[:real])) != real and self.runs == 1:
            raise UsageError(f"decode_step: each real row must be a different slot; got slots {slots[:real]} "
                             f"(a slot's verify run needs reserve_runs)")
        runs = verify_runs(starts[:real], slots[:real], family="DeepSeek-V4 decode_step")
        long = {slot: T for slot, (_, T) in runs.items() if T > self.runs}
        if long:
            raise UsageError(f"decode_step: runs of {long} rows (slot: rows); at most {self.runs} per slot "
                             f"(reserve_runs)")
        for slot, (start, T) in runs.items():
            self._check_row(slot, start, T)
        firsts = {}
        for b, slot in enumerate(slots[:real]):
            firsts.setdefault(slot, b)
        apart = sorted(slot for slot, (_, T) in runs.items() if slots[firsts[slot]:firsts[slot] + T] != [slot] * T)
        if apart:  # what the step keeps for a rollback is indexed by the run's first row
            raise UsageError(f"decode_step: the rows of slots {apart} are not next to each other (a verify run's "
                             f"rows must follow one another in the step)")
        for slot, (start, T) in runs.items():
            if start == 0:
                self.release(slot)
            self.positions[slot] = start + T
            self._run[slot] = (firsts[slot], T) if T > 1 else None
            self._speculating[slot] = (start, T) if T > 1 else None
        key = length_bucket(max(starts[:real]), self.max_seq_len)
        # padding rows keep row 0's position (so their RoPE and projections are row 0's) in the scratch slot
        both = host_to_device(starts + slots[:real] + [self.scratch] * (B - real), ids.device)  # one copy: [2B]
        tensors = (both[:B], both[B:])
        return Step(ids, starts, slots, real, key, tensors, self.step_rows(*tensors, key))

    def length_buckets(self) -> list[int]:
        """Every length bucket a decode step can have (:func:`~.rows.length_buckets` of ``max_seq_len``), ascending."""
        return length_buckets(self.max_seq_len)

    def build_step(self, rows: int, key: int, device: torch.device) -> Step:
        """A step of ``rows`` padding rows alone (token 0 at position 0 in the scratch slot) with length bucket
        ``key``: run through the decode pieces, it builds the ``(rows, key)`` pieces (a capture on CUDA)
        before a sequence needs them, and changes no sequence's state (padding rows read and write the
        scratch slot only). ``ids`` are ``step.ids``.

        Raises:
            UsageError: ``key`` is not one of :meth:`length_buckets`, or ``rows < 1``.
        """
        if key not in self.length_buckets() or rows < 1:
            raise UsageError(f"build_step: {rows} rows at key={key}: rows >= 1 and a length bucket "
                             f"{self.length_buckets()} needed")
        ids = torch.zeros(rows, dtype=torch.int64, device=device)
        both = host_to_device([0] * rows + [self.scratch] * rows, device)
        tensors = (both[:rows], both[rows:])
        return Step(ids, [0] * rows, [self.scratch] * rows, 0, key, tensors, self.step_rows(*tensors, key))

    def step_rows(self, positions: torch.Tensor, index: torch.Tensor, key: int) -> DecodeRows:
        """The rows of a decode step (no torch op yet: each derived tensor is built on first use, or
        all by :meth:`DecodeRows.as_tuple`).

        Args:
            positions: ``[B]`` int64 on the model's device, each row's position (below ``key``);
            index: ``[B]`` int64, each row's slot (padding rows: :attr:`scratch`); key: the length bucket.

        Raises:
            UsageError: ``key`` is not in ``[1, max_seq_len]``.
        """
        if not 1 <= key <= self.max_seq_len:
            raise UsageError(f"step_rows: length bucket key={key} must be in [1, max_seq_len={self.max_seq_len}]")
        return DecodeRows(positions, index, key, self.scratch, self.rows_spec)

    def rows_from_tuple(self, tensors: tuple[torch.Tensor, ...], key: int) -> DecodeRows:
        """:meth:`step_rows`' rows rebuilt from their :meth:`DecodeRows.as_tuple` (no torch op): how a
        layer's captured piece reads the rows another piece computed."""
        return DecodeRows.from_tuple(tensors, key, self.scratch, self.rows_spec)

    def embed_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        """Token ids ``[T]`` -> ``([T, m, D],)``: the vocab-parallel embedding copied to every stream."""
        x = self.embed(ids)  # [T, D]
        return (x[:, None, :].expand(ids.shape[0], self.args.hc_mult, x.shape[-1]).contiguous(),)

    def logits(self, streams: torch.Tensor) -> tuple[torch.Tensor]:
        """Streams ``[T, m, D]`` -> ``([T, V] float32,)``: head mixer, final norm, vocab-parallel head."""
        return (self.head(self.norm(self.hc_head(streams))),)


def buffer_name(source: str, fp8_weights: set[str]) -> str:
    """The module buffer a source tensor fills (see the module docstring's table)."""
    if source.endswith(".scale") and source[: -len(".scale")] + ".weight" in fp8_weights:
        return source[: -len(".scale")] + ".weight_scale_inv"
    return _HC.sub(lambda m: f"{m.group(1)}hc_{m.group(2)}.{m.group(3)}", source)


def assign_weights(model: DeepseekV4, dense: dict[str, torch.Tensor], banks: dict[str, dict[str, torch.Tensor]],
                   *, device: torch.device) -> None:
    """Replace every ``meta`` buffer of ``model`` by the rank's tensor of the same name, strictly.

    FP8 weights and FP4/UE8M0 bank arrays keep their stored dtype (on CPU the buffer is the mmap
    view itself); FP8 block scales become float32; other tensors are cast to the buffer's dtype.

    Raises:
        RuntimeLoadError: listing every missing, unexpected, mis-shaped or wrongly typed tensor.
    """
    expected = dict(model.named_buffers())
    fp8 = {n for n, t in dense.items() if t.dtype == torch.float8_e4m3fn}
    given = {buffer_name(n, fp8): t for n, t in dense.items() if not n.startswith("mtp.")}
    for layer, arrays in banks.items():
        if not layer.startswith("mtp."):
            given.update({f"{layer}.ffn.experts.{a}": t for a, t in arrays.items()})

    def convert(name: str, t: torch.Tensor, meta: torch.Tensor) -> torch.Tensor | str:
        if meta.dtype in (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu, torch.int64) and t.dtype != meta.dtype:
            return f"dtype {t.dtype}, the model needs {meta.dtype}"
        if name.endswith(".weight_scale_inv"):
            return ue8m0_to_float(t).to(device)
        return t.to(device=device, dtype=meta.dtype)

    install_buffers(model, expected, given, convert, what="the rank's DeepSeek-V4 weights")
