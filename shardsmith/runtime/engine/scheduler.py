"""Continuous batching on rank 0: which sequences run in each engine step, in which slots.

One :meth:`Scheduler.step` advances the batch (the policy of vLLM's and Orca's
iteration-level scheduling, in its simplest form):

1. **prefill**: sequences whose prompt is not fully in their slot yet get up to ``prefill_chunk``
   prompt tokens in total, oldest first, one :meth:`Engine.prefill` call per sequence chunk (chunk
   k starts where chunk k-1 ended). A sequence whose last chunk ran samples its first token from
   that chunk's logits, so a long prompt delays the running streams by one chunk per step, never
   by its whole length.
2. **decode**: every other running sequence (its prompt done, a sampled token pending) feeds that
   token in one batched :meth:`Engine.decode` step, B rows in B slots, and samples its next token.

A prompt of at most ``decode_prompt_tokens`` tokens skips step 1: it is fed one token per step as
a row of the batched decode step (its row's logits are discarded until its last prompt token, which
samples the first generated token). On a GPU a captured decode step costs a small fraction of an
eager prefill forward (DeepSeek-V4-Flash-shaped, 2 layers, one H200: ~1.1 ms against 12 ms for 32
tokens alone and 40-110 ms while requests arrive; the default limit is measured at warm-up,
:func:`default_decode_prompt_tokens`), so requests
that arrive together start together instead of queueing behind one prefill each; the policy depends
only on the prompt's length, so a sequence's tokens do not depend on what else is running.

**Overlapped steps** (on CUDA at world size 1; :func:`default_overlap`): when no prompt is being
prefilled, a decode step is launched before the previous step's tokens are read: its rows take
their tokens from the previous step's choices on the device (a sampled row's uniform is drawn from
its generator at launch, :func:`~shardsmith.runtime.engine.sampling.draw`), its own choices are made
there and copied to pinned host memory without waiting, and only then
are the previous step's tokens read (by then the device has finished it), so the host's work for
a step (the scheduler, the text side, the event loop's) runs while the device computes the next.
Tokens therefore reach the caller one step later. A sequence whose next token surely ends it
(``max_tokens``, the last position) is left out of the step launched ahead; one that ends on a stop
token read after its next row was launched wastes that row, whose result is dropped (its slot is
released behind it in the device's stream order). A prefill makes the step plain (all tokens read
first): the tokens are the same either way.

**KV blocks and preemption** (every family whose KV sits in blocks,
:mod:`~shardsmith.runtime.models.kv_blocks`; vLLM's policy): a request is admitted when the pool
holds its prompt and its next step's rows, and one block of growth per running sequence, beside what
each running sequence needs for its own next step, never for ``max_tokens`` up front, so a request
that leaves ``max_tokens`` out does not reserve the whole context. Before each step every running sequence's blocks for that step are made room for:
kept prefixes are given up first (least recently used), then the sequence that arrived last is
preempted: its slot is released on every rank and it waits, ahead of every new request, until the
pool holds its prompt and the tokens it had generated, which are computed again as one prefill (its
pending token, random stream, grammar state and penalty counts are kept), so its tokens are the ones
it would have drawn without the preemption.

Each sequence samples with its own ``torch.Generator`` (seeded from its request), so a seeded
request draws the same tokens whatever else is in the batch. A sequence leaves (its slot is
released on every rank) when it finishes (a stop token, ``max_tokens``, the context is full) or
when :meth:`Scheduler.abort` is called (a stop string, a client that went away, the server
stopping). The scheduler knows nothing about text or HTTP: :mod:`shardsmith.runtime.serve.worker`
turns its :class:`~shardsmith.runtime.engine.sampling.StepOutput` items into text.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from shardsmith import settings
from shardsmith.errors import UsageError
from shardsmith.runtime.engine.constraints import TokenConstraint, allow_all, apply_bitmask
from shardsmith.runtime.engine.penalties import TokenCounts, adjusts, counts_tokens
from shardsmith.runtime.engine.penalties import apply as apply_penalties
from shardsmith.runtime.engine.prefix_cache import PrefixCache
from shardsmith.runtime.engine.speculative import SpeculativeConfig, SpecStats, accepted, ngram_draft, sample_verified
from shardsmith.runtime.engine.sampling import (Choice, SamplingParams, StepOutput, choose_on_device, choose_rows, draw,
                                                make_generator, unpack_choices)
from shardsmith.runtime.layers.staging import to_device

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per engine step on a CPU (all prefilling sequences together)
CUDA_PREFILL_CHUNK = 2048  # on a GPU: a chunk must be thousands of tokens to fill it
INTERLEAVED_PREFILL_CHUNK = 2048  # at most this many while other sequences decode: their next token waits for it


MAX_DECODE_PROMPT_TOKENS = 256  # the measured default never feeds longer prompts through decode rows


def feed_limit(prefill_seconds: float, step_seconds: float, max_seq_len: int) -> int:
    """The longest prompt worth feeding through decode rows: the largest power of two ``n`` with
    ``n * step_seconds <= prefill_seconds`` (a prompt of ``n`` tokens fed one per step costs at most
    what one eager prefill of a short prompt does, and concurrent arrivals share the steps), 0 when
    even 2 steps cost more; at most :data:`MAX_DECODE_PROMPT_TOKENS` and ``max_seq_len // 2`` (tokens).
    A power of two, so small differences between measurements do not move it."""
    if not (step_seconds > 0 and prefill_seconds > 0):
        return 0
    ratio = min(prefill_seconds / step_seconds, MAX_DECODE_PROMPT_TOKENS, max_seq_len // 2)
    return 0 if ratio < 2 else 1 << (int(ratio).bit_length() - 1)


def default_decode_prompt_tokens(engine: Any) -> int:
    """Prompts fed through decode rows by default (tokens): on CUDA, :func:`feed_limit` of what the
    engine's warm-up measured (``Engine.prompt_costs``: an eager prefill of a 32-token prompt against a
    one-row decode step; 16 when nothing was measured), with the prefill's time counted once per
    sequence slot (``max_num_seqs``): an eager prefill stalls every running sequence for its whole
    length, while a fed prompt's rows ride along in steps the others take anyway; 0 on CPU, where a
    prefill forward of a short prompt costs about one decode step.

    Measured on one H200 (2-layer DeepSeek-V4-Flash-shaped pack, 8 slots, 2026-12-02): an eager
    32-token prefill 12 ms alone (40-110 ms while 2-8 requests arrive and stream), a captured
    one-row step 1.1 ms, so prompts of up to 64 tokens are fed."""
    if not str(getattr(engine, "device", "cpu")).startswith("cuda"):
        return 0
    costs = getattr(engine, "prompt_costs", None)
    if costs is None:
        return 16
    prefill, step = costs
    slots = max(1, int(getattr(engine, "max_num_seqs", 1) or 1))
    return feed_limit(prefill * slots, step, int(getattr(engine, "max_seq_len", 2 * MAX_DECODE_PROMPT_TOKENS)))


@dataclass(eq=False)
class Sequence:
    """One request's generation state on rank 0.

    Attributes:
        prompt_ids: the prompt; params: its sampling; tag: the caller's handle (the worker's job).
        slot: its slot once admitted (-1 before); prefilled: prompt tokens already in the slot
        (from the start, those a previous request left there: ``reused``);
        pending: the last sampled token, to feed at position ``pos`` (None: none yet);
        generated: tokens sampled so far (``outputs``: those read on the host, in order);
        generator: its random stream; admitted: perf_counter time;
        constraint: the grammar its tokens must follow (:mod:`~shardsmith.runtime.engine.constraints`), or None;
        recompute: after a preemption, the generated tokens its prefill feeds again (:attr:`context_len`).
    """

    prompt_ids: list[int]
    params: SamplingParams
    tag: Any = None
    slot: int = -1
    prefilled: int = 0
    pending: int | None = None
    pos: int = 0
    generated: int = 0
    generator: torch.Generator | None = field(default=None, repr=False)
    admitted: float = 0.0
    inflight: int = -1  # its row in the step still in flight (its token on the device only), else -1
    counted: bool = False  # its slot's token counts were reset for it (penalties)
    reused: int = 0  # prompt tokens whose state a previous request left in its slot (not computed)
    constraint: TokenConstraint | None = None
    outputs: list[int] = field(default_factory=list, repr=False)
    recompute: int = 0  # after a preemption: generated tokens its prefill computes again after the prompt

    @property
    def context_len(self) -> int:
        """Tokens its prefill computes: the prompt, then after a preemption the ``recompute`` generated
        tokens it had fed (all but the pending one)."""
        return len(self.prompt_ids) + self.recompute

    def context(self, lo: int = 0, hi: int | None = None) -> list[int]:
        """Positions ``lo .. hi`` (default: all :attr:`context_len`) of its prefill's tokens."""
        n, hi = len(self.prompt_ids), self.context_len if hi is None else hi
        if hi <= n:
            return self.prompt_ids[lo:hi]
        return self.prompt_ids[lo:] + self.outputs[max(0, lo - n): min(hi, self.context_len) - n]

    def fed_tokens(self) -> list[int]:
        """The tokens whose state its slot holds, positions ``0 ..``: the prompt tokens prefilled or
        fed, then the generated tokens fed back (only those known on the host)."""
        written = max(self.pos, self.prefilled)
        return (self.prompt_ids[:written] + self.outputs[:max(0, written - len(self.prompt_ids))])[:written]


@dataclass(eq=False)
class _InFlight:
    """A decode step launched and not yet read back (overlapped steps): the rows that sample a token,
    their tokens on the device, and their packed choices on their way to the host
    (:func:`~shardsmith.runtime.engine.sampling.choose_on_device`)."""

    seqs: list[Sequence]  # the rows that sample a token, in order
    pos: list[int]  # where each one's token will be fed
    ids: torch.Tensor  # [R] int64 on the device: their chosen tokens
    host: torch.Tensor  # [R, 2 + 2n] float64 packed choices: pinned on CUDA, filled by a non-blocking copy
    n: int
    done: Any = None  # the CUDA event after the copy (None on CPU)




def overlap_setting() -> bool | None:
    """``SHARDSMITH_TUNING=overlap_steps=...``: ``0`` off, ``1`` on (a CPU too), unset None.

    Raises:
        UsageError: the variable is set to something other than 0 or 1 (:mod:`shardsmith.settings`).
    """
    return settings.current().overlap_steps


def verify_rows(engine: Any, speculative: SpeculativeConfig | None) -> int:
    """Rows a decode step needs when n-gram drafts ride in it as verify runs (``max_num_seqs`` plus the k draft
    rows; :meth:`Engine.reserve_rows`), or 0: no speculation, MTP drafts (a chunk of their own, where the MTP
    layer runs) or a model whose step takes one row per sequence."""
    if speculative is None or speculative.method != "ngram" or not getattr(engine, "verify_runs", False):
        return 0
    return engine.max_num_seqs + speculative.k


def default_prefill_chunk(engine: Any) -> int:
    """Prompt tokens per engine step by default: on a GPU the model's ``prefill_chunk_cuda`` where it
    has one (DeepSeek-V4: 8192, its prefill attention tiled) and its experts are resident, else
    :data:`CUDA_PREFILL_CHUNK`, where a chunk's fixed cost (thousands of launches a layer) and each
    expert's weight reads are spread over enough tokens only at that size; :data:`DEFAULT_PREFILL_CHUNK`
    on a CPU, where a running stream would wait seconds behind a larger one. While other sequences
    decode, a step prefills at most :data:`INTERLEAVED_PREFILL_CHUNK` tokens (:class:`Scheduler`).
    With offloaded experts the expert cache takes the GPU's free memory but a fixed reserve at load,
    which a larger chunk's activations have not been measured against: those keep 2048.

    Measured (DeepSeek-V4-Flash-shaped, one GPU, ``benchmarks/RESULTS.md``): 43 layers x 8 experts on
    an H100, an 8k prompt at 3,819 tokens/s in 2k chunks and 5,277 in one 8k chunk; 4 layers x 256
    experts on an H200, 8,895 and 26,859 tokens/s."""
    if str(getattr(engine, "device", "cpu")).startswith("cuda"):
        if getattr(engine, "offload", None) is not None:
            return CUDA_PREFILL_CHUNK
        return int(getattr(getattr(engine, "model", None), "prefill_chunk_cuda", CUDA_PREFILL_CHUNK))
    return DEFAULT_PREFILL_CHUNK


def default_overlap(engine: Any) -> bool:
    """Whether steps overlap by default: on CUDA at world size 1, unless :func:`overlap_setting` says
    otherwise (``1`` asks for them on a CPU too; never at world size > 1).

    Raises:
        UsageError: a bad ``overlap_steps`` item of ``$SHARDSMITH_TUNING``.
    """
    setting = overlap_setting()
    if setting and engine.world_size != 1:
        log.warning("%s is ignored: overlapped steps run one rank only (world size %d); steps are plain",
                    settings.spelling("overlap_steps", "1"), engine.world_size)
    if engine.world_size != 1 or setting is False:
        return False
    return bool(setting) or str(getattr(engine, "device", "cpu")).startswith("cuda")


class Scheduler:
    """The running batch over an engine's ``max_num_seqs`` slots (rank 0, one thread).

    Args:
        engine: a loaded :class:`~shardsmith.runtime.engine.engine.Engine` (rank 0).
        prefill_chunk: prompt tokens per step across the prefilling sequences (>= 1), at most
            :data:`INTERLEAVED_PREFILL_CHUNK` while other sequences decode (``interleaved_chunk``);
            None: :func:`default_prefill_chunk`. A model that cannot rewind ends its chunks on its
            resume points (:meth:`_resume_cut`).
        decode_prompt_tokens: prompts of at most this many tokens are fed through decode rows
            (0: never); None: :func:`default_decode_prompt_tokens` (measured at warm-up on CUDA).
        overlap: launch each decode step before reading the previous one's tokens
            (module docstring); None: :func:`default_overlap` (on CUDA at world size 1).
        prefix_caching: a finished sequence's slot keeps its state and a later prompt resumes its
            longest reusable prefix (:mod:`~shardsmith.runtime.engine.prefix_cache`); False: every
            prompt is computed from position 0.
        speculative: n-gram or MTP drafts, checked in one chunk per sequence or as rows of the step
            (:mod:`~shardsmith.runtime.engine.speculative`; MTP needs an engine loaded with its
            MTP layer), or None.
        verify_runs: where the model's decode step takes a slot's consecutive positions, check n-gram
            drafts as rows of the batched step (default) rather than in a chunk per sequence (False:
            ``benchmarks/spec_decode.py --verify`` compares them).

    Raises:
        UsageError: ``prefill_chunk`` below 1, ``decode_prompt_tokens`` below 0, ``overlap`` with
            more than one rank.
    """

    def __init__(self, engine: Any, *, prefill_chunk: int | None = None,
                 decode_prompt_tokens: int | None = None, overlap: bool | None = None,
                 prefix_caching: bool = True, speculative: SpeculativeConfig | None = None,
                 verify_runs: bool = True) -> None:
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(engine)
        if prefill_chunk < 1:
            raise UsageError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        if decode_prompt_tokens is None:
            decode_prompt_tokens = default_decode_prompt_tokens(engine)
        if decode_prompt_tokens < 0:
            raise UsageError(f"decode_prompt_tokens must be >= 0, got {decode_prompt_tokens}")
        self.engine, self.prefill_chunk, self.decode_prompt_tokens = engine, prefill_chunk, decode_prompt_tokens
        self.interleaved_chunk = min(prefill_chunk, INTERLEAVED_PREFILL_CHUNK)
        self.running: list[Sequence] = []
        self._free = list(range(engine.max_num_seqs))
        self.prefix = PrefixCache(engine.max_num_seqs, rewinds=engine.family.rewinds, enabled=prefix_caching,
                                  resume_points=getattr(engine, "resume_points", None))
        if speculative is not None and (bad := speculative.problems()):
            raise UsageError("; ".join(bad))
        # drafts need a state that takes back rejected positions: written over where it rewinds, else
        # saved before the verify chunk and restored after it (DeepseekV4.speculate)
        takes_back = engine.family.rewinds or hasattr(engine.model, "speculate")
        self.speculative = speculative if takes_back else None
        # a verify chunk holds the pending token and the draft: at most what the model can take back
        self.max_draft = getattr(engine.model, "max_speculative_step", 17) - 1
        # n-gram drafts of a model whose decode step takes verify runs ride in the batched step (MTP drafts
        # need the MTP layer's pass over the chunk: a chunk of their own); the step gets k rows more
        self.runs = verify_runs and verify_rows(engine, self.speculative) > 0
        if self.runs:
            engine.reserve_rows(verify_rows(engine, self.speculative))
        self.spec = SpecStats()
        # a model that cannot rewind leaves resume points where a prefill chunk ends at their multiple
        self.resume_every = 0 if engine.family.rewinds else int(getattr(engine.model, "snapshot_every", 0) or 0)
        self.counts: TokenCounts | None = None  # per-slot token counts, made when a penalty first needs them
        self.last_batch = 0  # rows of the last decode step
        self.last_feeding = 0  # of them, rows that fed a prompt token (decode_prompt_tokens)
        self.last_prefill_tokens = 0  # prompt tokens the last step prefilled (eager prefill chunks)
        if overlap is None:
            overlap = default_overlap(engine)
        if overlap and engine.world_size != 1:
            raise UsageError(f"overlapped steps run one rank only (world_size {engine.world_size})")
        self.overlap = overlap
        self.overlapped_steps = 0  # decode steps launched before the previous step's tokens were read
        self._inflight: _InFlight | None = None
        self.preempted: list[Sequence] = []  # preempted for KV blocks, in arrival order: they resume first
        self.preemptions = 0  # sequences preempted so far

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def _blocks_at(self, fed: int) -> int:
        """KV blocks a sequence needs for the step after ``fed`` positions: one row more and a verify run's
        draft rows, at most ``max_seq_len`` positions."""
        k = self.speculative.k if self.speculative is not None else 0
        return self.engine.kv_blocks.blocks_for(min(fed + 1 + k, self.engine.max_seq_len))

    def blocks_needed(self, seq: Sequence) -> int:
        """KV blocks running ``seq`` needs for its next step: its whole prompt (and, resumed after a
        preemption, the tokens computed again), one row more than it has fed and a verify run's draft rows
        (:meth:`_blocks_at`), never fewer than its slot holds; 0 when the engine's KV is not in blocks."""
        kv = self.engine.kv_blocks
        if kv is None:
            return 0
        return max(self._blocks_at(max(seq.context_len, seq.pos)), kv.held(seq.slot))

    def can_admit(self, prompt_ids: list[int]) -> bool:
        """Whether :meth:`admit` has room for a request with this prompt now: a free slot, no preempted
        sequence waiting (they resume first), and for a family whose KV sits in blocks, the blocks of its
        prompt and first generated row, and one block of growth per running sequence, beside what every
        running sequence needs for its next step (:meth:`blocks_needed`) and what free slots keep for
        prefix reuse. Kept prefixes are given up for it, least recently used first (their slots released
        on every rank), only when that makes room; the one the request would resume is kept. False: it
        waits."""
        return not self.preempted and self._room_for(prompt_ids)

    def _room_for(self, ids: list[int]) -> bool:
        """:meth:`can_admit` for a sequence whose prefill computes ``ids`` (a new prompt, or a preempted
        sequence's prompt and the tokens it had fed), preempted ones waiting or not."""
        if not self._free:
            return False
        kv = self.engine.kv_blocks
        if kv is None:
            return True
        slot, _ = self.prefix.pick(self._free, ids)
        # and one block of growth for each running sequence: none is preempted for it before some sequence
        # has crossed two block edges (without it a resumed sequence could be preempted again at once)
        need = max(self._blocks_at(len(ids)), kv.held(slot)) + len(self.running)
        taken = sum(map(self.blocks_needed, self.running))
        kept = [f for f in self._free if f != slot and kv.held(f)]
        kept_blocks = sum(map(kv.held, kept))
        room = kv.n_blocks - taken - kept_blocks
        if room + kept_blocks < need:  # it waits whatever is given up: keep every prefix
            return False
        while room < need and kept:
            victim = self.prefix.evictable(kept)
            kept.remove(victim)
            room += kv.held(victim)
            self.engine.release(victim)
        return room >= need

    def can_build(self) -> bool:
        """Whether :meth:`build_bucket` would build something now (no step in flight; a free slot for a batch
        bucket; a length bucket needs none)."""
        if self._inflight is not None:
            return False
        return bool(self.engine.pending_buckets and self._free or self.engine.pending_lengths)

    def build_bucket(self) -> int | None:
        """Build the engine's next deferred decode pieces between steps: a batch bucket in a free slot
        (:meth:`Engine.build_bucket`; a slot that keeps no prefix first, else the least recently used one, its
        kept prefix dropped), else a length bucket (:meth:`Engine.build_length`: no slot, no prefix
        dropped). Returns the rows built; None when nothing is built (:meth:`can_build`)."""
        if not self.can_build():
            return None
        if self.engine.pending_buckets and self._free:
            return self.engine.build_bucket(self.prefix.evictable(self._free))
        return self.engine.build_length()[0]

    def admit(self, seq: Sequence) -> None:
        """Give ``seq`` a free slot; its prefill starts at the next :meth:`step`. A caller that runs
        several sequences asks :meth:`can_admit` first.

        Raises:
            UsageError: no free slot, the request is bad (:meth:`Engine.check_request`), or (KV in
                blocks) the pool has no room for it beside the running sequences, or a preempted
                sequence waits (:meth:`can_admit`).
        """
        if not self._free:
            raise UsageError(f"no free slot: all {self.engine.max_num_seqs} are running (max_num_seqs)")
        self.engine.check_request(seq.prompt_ids, seq.params)
        if not self.can_admit(seq.prompt_ids):
            kv = self.engine.kv_blocks
            raise UsageError(f"no room in the KV cache: this prompt needs {self._blocks_at(len(seq.prompt_ids))} "
                             f"blocks of {kv.block_size} positions, the {len(self.running)} running sequence(s) need "
                             f"{sum(map(self.blocks_needed, self.running))} of {kv.n_blocks} (--kv-cache-tokens "
                             f"{kv.tokens}) and {len(self.preempted)} preempted one(s) wait")
        seq.generated, seq.outputs, seq.pending, seq.recompute = 0, [], None, 0
        seq.generator, seq.admitted = make_generator(seq.params.seed), time.perf_counter()
        seq.reused = self._place(seq)

    def _place(self, seq: Sequence, *, preempted: bool = False) -> int:
        """Put ``seq`` in the free slot that holds the longest prefix of its prefill's tokens (resumed from
        there) and run it; returns the tokens resumed (``preempted``: it resumes after a preemption,
        counted apart in the prefix cache's stats)."""
        slot, reused = self.prefix.choose(self._free, seq.context(), preempted=preempted)
        self._free.remove(slot)
        if reused:
            self.engine.restore(slot, reused)  # back to a resume point (a no-op where the state rewinds)
        seq.slot, seq.prefilled, seq.pos, seq.counted = slot, reused, reused, False
        self.running.append(seq)
        return reused

    def abort(self, seq: Sequence) -> None:
        """End ``seq`` now and free its slot (no-op when it already left). With prefix caching the
        slot keeps its state for a later prompt that shares its tokens; otherwise it is released on
        every rank. A preempted sequence just stops waiting."""
        if seq in self.preempted:
            self.preempted.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self._free.append(seq.slot)
            tokens = seq.fed_tokens()
            if self.prefix.enabled and (self.engine.family.rewinds or len(tokens) == max(seq.pos, seq.prefilled)):
                self.prefix.keep(seq.slot, tokens)
            else:  # nothing reusable (or a state that cannot rewind past tokens unknown here)
                self.prefix.keep(seq.slot, ())
                self.engine.release(seq.slot)

    def _preempt(self, seq: Sequence) -> None:
        """Take running ``seq``'s slot back (released on every rank, nothing kept) and make it wait, ahead
        of new requests, to compute its prompt and the tokens it had fed again (:meth:`_resume`)."""
        if seq.pending is not None and seq.prefilled >= seq.context_len:
            seq.recompute = seq.pos - len(seq.prompt_ids)  # fed after the prompt: all but the pending token
        # else its prefill had not ended: the same tokens are computed again from the start
        self.running.remove(seq)
        self._free.append(seq.slot)
        self.prefix.keep(seq.slot, ())
        self.engine.release(seq.slot)
        seq.slot, seq.prefilled, seq.pos, seq.inflight = -1, 0, 0, -1
        self.preempted.append(seq)
        self.preempted.sort(key=lambda s: s.admitted)
        self.preemptions += 1
        kv = self.engine.kv_blocks
        (log.warning if self.preemptions == 1 else log.debug)(
            "preempted a sequence of %d tokens: the KV pool (%d blocks of %d) holds no more; it is computed again "
            "when it resumes (%d waiting; raise --kv-cache-tokens or lower --max-num-seqs to preempt less; "
            "/metrics counts them)", seq.context_len, kv.n_blocks, kv.block_size, len(self.preempted))

    def _resume(self) -> None:
        """Preempted sequences back into free slots, oldest first, while the pool has room for each one's
        prefill (:meth:`_room_for`)."""
        while self.preempted and self._room_for(self.preempted[0].context()):
            self._place(self.preempted.pop(0), preempted=True)

    def _make_room(self) -> list[tuple[Sequence, StepOutput]]:
        """Before a step, blocks for every running sequence's next step (:meth:`blocks_needed`): kept
        prefixes given up first, least recently used, then the sequence that arrived last preempted
        (:meth:`_preempt`) until the rest fit. A step in flight is read first (its tokens returned, the
        sequences it finished gone)."""
        kv = self.engine.kv_blocks
        out: list[tuple[Sequence, StepOutput]] = []
        if kv is None:
            return out
        while True:
            kept = [f for f in self._free if kv.held(f)]
            short = sum(map(self.blocks_needed, self.running)) + sum(map(kv.held, kept)) - kv.n_blocks
            if short <= 0 or not self.running:
                return out
            if kept:
                self.engine.release(self.prefix.evictable(kept))
            elif self._inflight is not None:  # its sequences' tokens to the host before any leaves
                landed = self._land()
                out += landed
                for seq, step in landed:
                    if step.finished:
                        self.abort(seq)
            elif len(self.running) > 1:
                self._preempt(max(self.running, key=lambda s: s.admitted))
            else:  # one sequence always fits (the pool holds max_seq_len): the model's own check says more
                return out

    def _resume_cut(self, seq: Sequence, n: int) -> int:
        """The tokens of ``seq``'s next chunk, at most ``n``, for a model that cannot rewind
        (``resume_every``: its resume points, multiples of that many tokens, where a chunk ends): the
        chunk ends at the prompt's last resume point when it would pass it (where the next turn of a
        conversation resumes), and before it on a multiple when it holds one, so every chunk of
        thousands of tokens still leaves its resume point; otherwise ``n``."""
        every = self.resume_every
        if not every:
            return n
        start, total = seq.prefilled, seq.context_len
        end, last = start + n, total - total % every
        if start < last < end:
            return last - start
        if end < last and end % every and end - end % every > start:
            return end - end % every - start
        return n

    def step(self) -> list[tuple[Sequence, StepOutput]]:
        """One engine step: a prefill budget, then one batched decode; each sampled token, in order.

        With ``overlap``, a decode step is launched before the previous step's tokens are
        read, and this returns the previous step's tokens (module docstring). Sequences that finish
        leave (slots released) before this returns.

        Raises:
            RankLostError: another rank died (the caller fails every sequence).
        """
        self.last_prefill_tokens = self.last_feeding = 0
        self._resume()
        out = self._make_room()
        prefilling = [s for s in self.running if s.prefilled < s.context_len and not self._fed(s)]
        decoding = len(prefilling) < len(self.running)  # their next tokens wait for this step's chunks
        budget, fresh = self.interleaved_chunk if decoding else self.prefill_chunk, set()
        # a constrained sequence's next mask needs its last token on the host: plain steps while one runs
        overlap = self.overlap and not prefilling and not any(s.constraint is not None for s in self.running)
        if self._inflight is not None and not overlap:
            out += self._land()  # every token on the host before a step that needs them there
            for seq, step in out:
                if step.finished:  # it leaves before this step's batch is chosen
                    self.abort(seq)
        for seq in prefilling:
            if budget == 0:
                break
            n = self._resume_cut(seq, min(budget, seq.context_len - seq.prefilled))
            logits = self.engine.prefill(seq.slot, seq.context(seq.prefilled, seq.prefilled + n), seq.prefilled,
                                         on_device=True)
            seq.prefilled += n
            budget -= n
            self.last_prefill_tokens += n
            if seq.prefilled == seq.context_len:
                seq.pos = seq.prefilled
                if seq.pending is None:  # else resumed after a preemption: its pending token is fed next
                    out.append((seq, self._sample([seq], logits[-1:])[0]))
                fresh.add(id(seq))
        batch = [s for s in self.running if id(s) not in fresh and self._in_batch(s)]
        runs: dict[int, list[int]] = {}  # verify runs in the decode step: id(seq) -> its draft
        if self.speculative is not None and not overlap:
            drafts = {id(s): d for s in batch if (d := self._draft(s))}
            if self.runs:
                room = self.engine.max_rows - len(batch)  # the step's rows beyond one per sequence
                for s in batch:
                    if id(s) in drafts and room > 0:
                        runs[id(s)] = drafts[id(s)][:room]
                        room -= len(runs[id(s)])
            else:
                for seq in [s for s in batch if id(s) in drafts]:
                    out += self._verify(seq, drafts[id(seq)])
                batch = [s for s in batch if id(s) not in drafts]
        self.last_batch = len(batch) + sum(map(len, runs.values()))
        if batch:
            feeding = [s.prefilled < s.context_len for s in batch]  # a prompt token, not a sampled one
            self.last_feeding = sum(feeding)
            if overlap:
                out += self._launch(batch, feeding)
            else:
                ids, starts, slots, first = [], [], [], []  # first: each sequence's first row
                for s, f in zip(batch, feeding):
                    row = [s.prompt_ids[s.prefilled] if f else s.pending, *runs.get(id(s), ())]
                    first.append(len(ids))
                    ids += row
                    starts += range(s.pos, s.pos + len(row))
                    slots += [s.slot] * len(row)
                logits = self.engine.decode(ids, starts, slots, on_device=True)
                for b, s in enumerate(batch):
                    if id(s) in runs:
                        draft = runs[id(s)]
                        out += self._accept(s, draft, logits[first[b]: first[b] + len(draft) + 1], s.pos)
                plain = [b for b, s in enumerate(batch) if id(s) not in runs]
                rest, fed = [batch[b] for b in plain], [feeding[b] for b in plain]
                ready = self._advance(rest, fed)
                if ready:
                    at = [first[plain[i]] for i in ready]
                    rows = logits if at == list(range(logits.shape[0])) else logits[torch.tensor(at, device=logits.device)]
                    out += zip([rest[i] for i in ready], self._sample([rest[i] for i in ready], rows))
        elif self._inflight is not None:
            out += self._land()
        for seq, step in out:
            if step.finished:
                self.abort(seq)
        return out

    def _draft(self, s: Sequence) -> list[int]:
        """``s``'s draft (n-gram, or the MTP layer's), or ``[]`` when it does not speculate (penalised, logprobs,
        constrained, still feeding its prompt) or nothing repeats."""
        p = s.params
        if (s.prefilled < s.context_len or s.pending is None or p.logprobs or adjusts(p)
                or s.constraint is not None or s.inflight >= 0):
            return []
        left = min(p.max_tokens - s.generated, self.engine.max_seq_len - s.pos) - 1  # room for the draft's tokens
        left = min(left, self.max_draft)
        if left < 1:
            return []
        cfg = self.speculative
        if cfg.method == "mtp":
            # the MTP layer's draft; after a step that did not run it (a one-token step through the decode
            # pieces) a one-token guess makes this verify a chunk, whose forward runs it again
            return (self.engine.draft(s.slot, s.pending, s.pos, min(cfg.k, left))
                    or ngram_draft(s.prompt_ids + s.outputs, cfg)[:1] or [s.pending])
        return ngram_draft(s.prompt_ids + s.outputs, cfg)[:left]

    def _verify(self, seq: Sequence, draft: list[int]) -> list[tuple[Sequence, StepOutput]]:
        """One chunk of ``seq``'s pending token and ``draft``; the tokens it gives (1 to
        ``len(draft) + 1``, fewer when one ends the sequence): greedy choices, or for a sampled
        sequence speculative sampling's (:func:`~shardsmith.runtime.engine.speculative.sample_verified`)."""
        start = seq.pos
        logits = self.engine.prefill(seq.slot, [seq.pending, *draft], start, last_only=False, on_device=True,
                                     speculative=True)
        return self._accept(seq, draft, logits, start)

    def _accept(self, seq: Sequence, draft: list[int], logits: torch.Tensor, start: int) -> list[tuple[Sequence, StepOutput]]:
        """The tokens ``seq``'s verify gives from its ``logits`` ``[len(draft) + 1, V]`` (the rows after its
        pending token at ``start`` and after each draft token), greedy or by speculative sampling; the
        rejected positions are taken back."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        if seq.params.temperature > 0:
            tokens = sample_verified(logits, draft, seq.params, seq.generator)
            choices = torch.tensor(tokens, device=logits.device)
            n = len(tokens)
        else:
            choices = torch.argmax(logits, dim=-1)  # lowest id on ties, as choose_rows
        picked = lp[torch.arange(choices.shape[0], device=lp.device), choices]
        choices, picked = choices.tolist(), picked.tolist()
        if seq.params.temperature <= 0:
            n = accepted(draft, choices)
        self.spec.steps += 1
        self.spec.drafted += len(draft)
        self.spec.accepted += n - 1
        out = []
        for i in range(n):
            seq.pos += 1  # the token fed at this position (the pending one, then each accepted draft token)
            step = self._step_output(seq, Choice(choices[i], picked[i], ()), seq.pos)
            out.append((seq, step))
            if step.finished:
                break
        if n <= len(draft) and not out[-1][1].finished:
            self.engine.restore(seq.slot, start + n)  # the rejected rows back (a no-op where the state rewinds)
        self.spec.emitted += len(out)
        return out

    def _in_batch(self, s: Sequence) -> bool:
        """Whether ``s`` has a token to feed in the next decode step: a prompt token (fed prompts), a
        sampled token on the host, or one still on the device from the step in flight (unless that
        token surely ends it: its ``max_tokens`` or the last position)."""
        if s.prefilled < s.context_len:
            return self._fed(s)
        if s.inflight >= 0:  # set only while its step is in flight
            return s.generated + 1 < s.params.max_tokens and s.pos < self.engine.max_seq_len
        return s.pending is not None

    def _advance(self, batch: list[Sequence], feeding: list[bool]) -> list[int]:
        """After a decode step is launched: every row's position moves on (a fed prompt token counts as
        prefilled); returns the rows that sample a token (not feeding, or their last prompt token)."""
        for seq, f in zip(batch, feeding):
            seq.pos += 1
            seq.prefilled += f
        return [b for b, (s, f) in enumerate(zip(batch, feeding)) if not f or s.prefilled == len(s.prompt_ids)]

    def _launch(self, batch: list[Sequence], feeding: list[bool]) -> list[tuple[Sequence, StepOutput]]:
        """An overlapped step: the rows' tokens assembled on the device (a prompt token or a host token,
        or the step in flight's choice), the step and its choices launched, their copy to
        the host started; then the step in flight before it is read (its tokens returned)."""
        prev = self._inflight
        self.overlapped_steps += prev is not None
        device = torch.device(self.engine.device)
        host = [s.prompt_ids[s.prefilled] if f else (s.pending if s.inflight < 0 else 0) for s, f in zip(batch, feeding)]
        src = [-1 if f else s.inflight for s, f in zip(batch, feeding)]  # a row of the step in flight, or -1
        if max(src) >= 0:
            ids, idx = to_device([torch.tensor(host), torch.tensor(src)], device)
            ids = torch.where(idx >= 0, prev.ids[idx.clamp(min=0)], ids)
        else:
            ids = to_device([torch.tensor(host)], device)[0]
        logits = self.engine.decode_on_device(ids, [s.pos for s in batch], [s.slot for s in batch])
        ready = self._advance(batch, feeding)
        self._inflight = None
        for seq in prev.seqs if prev is not None else ():
            seq.inflight = -1
        if ready:
            rows = logits if len(ready) == len(batch) else logits[to_device([torch.tensor(ready)], device)[0]]
            seqs = [batch[b] for b in ready]
            draws = [draw(s.generator) if s.params.temperature > 0.0 else 0.0 for s in seqs]
            scores = self._scores(rows, seqs, prev)
            chosen, packed, n = choose_on_device(rows, [s.params for s in seqs], draws, scores=scores)
            self._count(seqs, chosen)
            fl = _InFlight(seqs, [s.pos for s in seqs], chosen, packed, n)
            if device.type == "cuda":
                fl.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                fl.host.copy_(packed, non_blocking=True)
                fl.done = torch.cuda.Event()
                fl.done.record()
            for j, seq in enumerate(seqs):
                seq.inflight = j
            self._inflight = fl
        return self._read(prev) if prev is not None else []

    def _land(self) -> list[tuple[Sequence, StepOutput]]:
        """Read the step in flight (waits for its copy); no step is in flight after."""
        fl, self._inflight = self._inflight, None
        for seq in fl.seqs:
            seq.inflight = -1
        return self._read(fl)

    def _read(self, fl: _InFlight) -> list[tuple[Sequence, StepOutput]]:
        """The step outputs of ``fl``'s rows whose sequences still run (one that left meanwhile, a stop
        token read after its next row was launched or an abort, is skipped)."""
        if fl.done is not None:
            fl.done.synchronize()
        choices = unpack_choices(fl.host.tolist(), [s.params for s in fl.seqs], fl.n)
        running = set(map(id, self.running))
        return [(seq, self._step_output(seq, c, pos)) for seq, c, pos in zip(fl.seqs, choices, fl.pos)
                if id(seq) in running]

    def _fed(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt goes through decode rows, one token per step (``decode_prompt_tokens``;
        not a sequence resumed after a preemption, whose rows sample nothing)."""
        return seq.pending is None and len(seq.prompt_ids) <= self.decode_prompt_tokens

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """Choose each sequence's next token from its row of ``logits`` ``[B, V]`` (on the engine's
        device: :func:`choose_rows`); a sequence is finished when its token is a stop token, the last
        of ``max_tokens``, or has no position left to be fed at (``max_seq_len``)."""
        scores = self._scores(logits, seqs, None)
        choices = choose_rows(logits, [s.params for s in seqs], [s.generator for s in seqs], scores=scores)
        if any(counts_tokens(s.params) for s in seqs):
            self._count(seqs, to_device([torch.tensor([c.token_id for c in choices])], logits.device)[0])
        return [self._step_output(seq, c, seq.pos) for seq, c in zip(seqs, choices)]

    def _scores(self, logits: torch.Tensor, seqs: list[Sequence], prev: _InFlight | None) -> torch.Tensor | None:
        """The logits ``[R, V]`` the rows choose from, adjusted by their penalties and biases
        (:func:`~shardsmith.runtime.engine.penalties.apply`) and their constraints' masks, or None
        when no row adjusts them. ``prev``: the step in flight whose tokens are not counted in
        ``generated`` yet."""
        scores = self._penalised(logits, seqs, prev)
        constrained = [r for r, s in enumerate(seqs) if s.constraint is not None]
        if not constrained:
            return scores
        mask = allow_all(len(seqs), logits.shape[-1])
        for r in constrained:
            seqs[r].constraint.fill_bitmask(mask, r)
        return apply_bitmask(logits.float().clone() if scores is None else scores.float(), mask)

    def _penalised(self, logits: torch.Tensor, seqs: list[Sequence], prev: _InFlight | None) -> torch.Tensor | None:
        """:meth:`_scores` before the constraints: the penalties and biases alone (None: none)."""
        params = [s.params for s in seqs]
        if not any(adjusts(p) for p in params):
            return None
        if any(counts_tokens(p) for p in params):
            if self.counts is None:
                self.counts = TokenCounts(self.engine.max_num_seqs, logits.shape[-1], logits.device)
            for s in seqs:
                if counts_tokens(s.params) and not s.counted:
                    self.counts.reset(s.slot, s.prompt_ids, s.outputs)
                    s.counted = True
        unread = set(map(id, prev.seqs)) if prev is not None else set()
        produced = [s.generated + (id(s) in unread) for s in seqs]
        return apply_penalties(logits, params, [s.slot for s in seqs], produced, self.counts)

    def _count(self, seqs: list[Sequence], chosen: torch.Tensor) -> None:
        """Add each penalised row's chosen token ``chosen[r]`` (on the device) to its slot's counts."""
        rows = [r for r, s in enumerate(seqs) if counts_tokens(s.params)]
        if not rows:
            return
        slots, idx = to_device([torch.tensor([seqs[r].slot for r in rows]), torch.tensor(rows)], chosen.device)
        self.counts.add(slots, chosen[idx])

    def _step_output(self, seq: Sequence, c: Choice, pos: int) -> StepOutput:
        """``seq``'s output for token ``c``, to be fed at ``pos``: finished on a stop token, its
        ``max_tokens``-th token, or no position left (``max_seq_len``)."""
        p = seq.params
        seq.generated += 1
        seq.outputs.append(c.token_id)
        if seq.constraint is not None:
            seq.constraint.advance(c.token_id)
        reason = ("stop" if c.token_id in p.stop_token_ids
                  else "length" if seq.generated == p.max_tokens or pos >= self.engine.max_seq_len else None)
        seq.pending = c.token_id
        return StepOutput(c.token_id, c.logprob, c.top_logprobs, reason is not None, reason)
