"""The engine: load one rank, and let rank 0 drive every rank step by step.

Rank 0 owns the requests and decides every step; it broadcasts a small command over a gloo group
(``int64 [5]``), then the step's payload, then runs the step. Ranks != 0 sit in
:meth:`Engine.follow`, blocked in that broadcast, and run the same step. There is no queue: the
first command after start-up meets followers already waiting in the collective, so it cannot be
lost, and the sampled tokens reach them as the next step's payload. Commands:

==========  ============================================  =====================================
op          command ``[op, a, b, c, d]``                  payload (int64)
==========  ============================================  =====================================
FORWARD     ``n, start, flags, slot``                     ``ids [n]``: one sequence's prefill,
                                                          prefill chunk or step, in ``slot``
                                                          (flags: all logits, speculative)
DECODE      ``B, bucket, 0, 0``                           ``[3, B]``: ids, starts, slots (a
                                                          batched one-token step, B sequences;
                                                          bucket 0: the runner's choice)
RELEASE     ``slot, 0, 0, 0``                             none: the slot's sequence ended
RESTORE     ``slot, pos, 0, 0``                           none: the slot goes back to resume point
                                                          ``pos`` (a model that cannot rewind)
WARMUP      ``max_rows, 0, 0, 0``                         none: compile the Triton kernels'
                                                          variants (:mod:`.warmup`)
            ``0, 1, 0, 0``                                none: the warm-up ended; seal the
                                                          compile cache (:mod:`.compile_cache`)
            ``0, 2, 0, 0``                                none: defer the batch buckets not built
                                                          (``DecodeGraphs.defer``)
            ``rows, 3, 0, 0``                             none: buckets up to ``rows`` rows, the
                                                          model's room for verify runs
                                                          (:meth:`Engine.reserve_rows`)
            ``rows, 5, length, 0``                        none: build the ``(rows, length)`` decode
                                                          pieces (:meth:`Engine.build_length`)
DRAFT       ``slot, pos, k, token``                       none: the MTP layer drafts ``k`` tokens
                                                          after ``token`` at ``pos`` (:meth:`Engine.draft`)
SHUTDOWN    ``0, 0, 0, 0``                                none: followers return
==========  ============================================  =====================================

Slots: the model keeps ``max_num_seqs`` sequences' state (KV caches ...) in preallocated slots
(:meth:`Engine.load`, which builds the model with :mod:`.build`); rank 0's scheduler
(:mod:`shardsmith.runtime.serve.worker`) assigns them.
A model without ``SUPPORTS_BATCHING`` has one slot.

Failure: gloo notices a dead peer at once (its TCP connection closes), so a rank that dies makes
the others' next collective raise; the engine turns that into :class:`RankLostError`. The command
group's timeout is long (idle followers wait in it); the load ends with a ``monitored_barrier``
(``load_timeout_s``) that names ranks that never finished loading, then every rank's load error is
gathered and raised on all ranks. On NCCL, a peer dying mid-step is noticed only at the default
group's timeout (see :func:`~shardsmith.runtime.engine.dist.init_distributed`).

Example:
    >>> eng = Engine.load("out/", rank=0, world_size=1)  # doctest: +SKIP
    >>> [s.token_id for s in eng.generate([1, 2, 3], SamplingParams(max_tokens=4))]  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardsmith.errors import EXIT_CODES, RankLostError, RuntimeLoadError, UsageError, error_class, error_class_named, format_problems
from shardsmith.runtime.engine.build import build_model
from shardsmith.runtime.models.registry import ModelFamily, family_for
from shardsmith.runtime.models.seq_slots import verify_runs
from shardsmith.runtime.engine.dist import clamp_threads, install_rank_zero_logging
from shardsmith.runtime.engine.cuda_graphs import DecodeGraphs, compiles
from shardsmith.runtime.engine import penalties
from shardsmith.runtime.engine.penalties import TokenCounts
from shardsmith.runtime.engine.sampling import (SamplingParams, StepOutput, choose, choose_rows,  # noqa: F401 (re-exported)
                                                make_generator, param_problems)
from shardsmith.runtime.layers.staging import to_device
from shardsmith.runtime.engine.loader import load_rank_weights
from shardsmith.runtime.engine.rank_alone import is_rank_alone

if TYPE_CHECKING:
    from shardsmith.runtime.offload import OffloadConfig

log = logging.getLogger("shardsmith.runtime")
FORWARD, SHUTDOWN, DECODE, RELEASE, WARMUP, RESTORE, DRAFT = 1, 2, 3, 4, 5, 6, 7
CMD_LEN = 5
SPECULATIVE = 2  # FORWARD's flags (c): bit 0 all logits, bit 1 a verify chunk the model may take back
PROMPT_PROBE_TOKENS = 32  # the prompt length warm-up prefills to price a prefill against a decode step


def compile_seconds() -> dict[str, float]:
    """Seconds this process has spent in ``torch.compile`` so far (dynamo's own timers,
    ``torch._dynamo.utils.compilation_time_metrics``): ``dynamo`` (tracing the bytecode, building the
    guards: what no compile cache keeps) and ``backend`` (the backend compiler: Inductor, from its caches
    or not). Zeros where dynamo was never imported (nothing is imported here)."""
    utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(utils, "compilation_time_metrics", {}) if utils is not None else {}
    total, backend = sum(metrics.get("_compile.compile_inner", ())), sum(metrics.get("OutputGraph.call_user_compiler", ()))
    return {"dynamo": total - backend, "backend": backend}


class Engine:
    """One rank's model plus the rank-0-drives-all step protocol.

    Attributes:
        config: ``config.json``; root: directory with the tokenizer files; max_seq_len: positions
        of the KV cache per sequence (prompt + generated); max_num_seqs: sequences (slots) the
        model holds at once; state_bytes: per-sequence state this rank allocated, all slots (bytes;
        0 when the model does not say); load_seconds: time from :meth:`load` start to ready
        on this rank; eos_token_ids: from ``generation_config.json`` / ``config.json``;
        rank, world_size, device, dtype, vocab_size; family: the model's registry entry
        (:mod:`~shardsmith.runtime.models.registry`); graphs: the model's
        :class:`~shardsmith.runtime.engine.cuda_graphs.DecodeGraphs` once :meth:`use_decode_graphs`
        ran (None: every step eager); forward: what runs a step (``graphs`` or the model);
        runner: what runs batched decode steps (``graphs``, or the same pieces run eagerly);
        warmup_seconds, warmup_launches: what :meth:`warmup` took (seconds on rank 0) and how
        many kernel launches it made to compile the Triton variants; kv_blocks: the slots' block
        tables over the KV pool (:class:`~shardsmith.runtime.models.kv_blocks.KVBlocks`; rank 0's
        are every rank's) for a family whose KV sits in blocks, else None.
    """

    def __init__(self, model: torch.nn.Module, *, config: dict, root: Path, rank: int, world_size: int,
                 device: torch.device, dtype: torch.dtype, max_seq_len: int, group: object | None,
                 family: ModelFamily | None = None) -> None:
        self.model, self.config, self.root, self.family = model, config, root, family or family_for(config)
        self.rank, self.world_size, self.device, self.dtype = rank, world_size, device, dtype
        self.max_seq_len, self.vocab_size, self.load_seconds = max_seq_len, model.args.vocab_size, 0.0
        self.eos_token_ids = _eos_ids(root, config)
        self._group, self._lock, self._request, self._closed = group, threading.Lock(), 0, False
        self.offload = None  # OffloadRuntime when routed experts are offloaded (stats(): cache counters)
        self.graphs: DecodeGraphs | None = None
        self.forward = model
        self.max_num_seqs = int(getattr(model, "max_num_seqs", 1) or 1)
        self.state_bytes = int(model.state_bytes()) if hasattr(model, "state_bytes") else 0
        self.kv_blocks = model.kv if self.family.kv_blocks else None
        self._eager: DecodeGraphs | None = None
        self._kernels: bool | None = None  # whether some module runs a Triton kernel (warmup)
        self._pos = [0] * self.max_num_seqs  # per slot, where its last step ended (rank 0)
        self.warmup_seconds, self.warmup_launches = 0.0, 0
        self.compile_cache = None  # CompileCache of this rank (Engine.load(compile_cache=...)), sealed by warmup()
        self.warmup_phases: dict[str, float] = {}  # seconds per warm-up phase: kernels, prefill, step, bucket<rows>, probe
        self.warmup_compile: dict[str, float] = {}  # seconds of the warm-up inside torch.compile: dynamo, backend
        self.prompt_costs: tuple[float, float] | None = None  # (prefill, decode step) seconds, from warmup() on CUDA

    @classmethod
    def load(cls, path: str | Path, *, rank: int, world_size: int, device: str = "cpu", from_checkpoint: bool = False,
             verify_hashes: bool = True, max_seq_len: int = 2048, dtype: torch.dtype | None = None,
             load_timeout_s: float = 1800.0, offload: "OffloadConfig | None" = None, fp8: str = "load",
             cuda_graphs: bool = True, max_num_seqs: int = 8, mtp_layers: int = 0,
             compile_cache: Path | None = None, kv_cache_tokens: int | None = None) -> "Engine":
        """Load rank ``rank``'s weights and build its model; collective over all ranks.

        The model is the registry's for the config's architecture (:mod:`~shardsmith.runtime.models.registry`:
        the Mixtral family or DeepSeek-V4).

        ``torch.distributed`` must already be initialised when ``world_size > 1``
        (:func:`~shardsmith.runtime.engine.dist.init_distributed`).

        Args:
            path: a pack directory, or a checkpoint with ``from_checkpoint``.
            verify_hashes: hash each pack file (XXH3-128) as it is read and refuse a damaged one (default).
            device: ``cpu`` or ``cuda`` (``cuda:{LOCAL_RANK}``); dtype: compute dtype, a torch dtype
                or its name (default: the config's ``dtype``/``torch_dtype``, else bfloat16).
            max_seq_len: KV cache positions per sequence; load_timeout_s: how long rank 0 waits
                for the slowest rank to finish loading before naming it.
            max_num_seqs: sequences decoded together (slots of per-sequence state, >= 1); a model
                without ``SUPPORTS_BATCHING`` gets 1 (logged once).
            fp8: ``load`` dequantizes FP8 block weights once to ``dtype``; ``on-the-fly`` keeps
                them FP8 and dequantizes per matmul (see :mod:`~shardsmith.runtime.layers.parallel`).
                On CUDA, FP8 linears stay FP8 either way and run the ``fp8_linear`` kernel, and
                resident expert banks run ``fused_experts`` for decode steps, V4's decode attention
                ``sink_attention`` (:func:`~shardsmith.runtime.layers.parallel.use_kernels_`;
                ``SHARDSMITH_KERNELS=all=reference`` forces the PyTorch paths).
            offload: place routed experts in host memory with a device expert cache
                (:mod:`shardsmith.runtime.offload`); None keeps every expert resident.
            cuda_graphs: on CUDA, run one-token decode steps as piecewise CUDA graphs (both
                model families; :mod:`~shardsmith.runtime.engine.cuda_graphs`); False runs every kernel
                eagerly (``--enforce-eager``).
            mtp_layers: the checkpoint's MTP layers to load for :meth:`draft` (DeepSeek-V3: 0 or 1).
            compile_cache: keep this rank's TorchInductor and Triton caches in a checked folder under
                this one (``$SHARDSMITH_CACHE/compile``; :mod:`~shardsmith.runtime.engine.compile_cache`),
                sealed when :meth:`warmup` ends; None leaves the libraries' own folders.
            kv_cache_tokens: positions of the KV pool every slot takes blocks from as its sequence grows
                (every family but DeepSeek-V4; :mod:`~shardsmith.runtime.models.kv_blocks`), at least
                ``max_seq_len``; None: ``max_num_seqs * max_seq_len``. The scheduler admits a sequence
                when the pool can hold it to its end (:class:`~shardsmith.runtime.engine.scheduler.Scheduler`).

        Raises:
            RuntimeLoadError: on every rank, listing each rank's load problem (missing,
                unexpected or mis-shaped tensor, wrong world size, ...), or a process group that
                does not match ``rank``/``world_size``.
            UsageError: ``max_num_seqs`` below 1.
            RankLostError: a rank died during the load.
        """
        t0 = time.perf_counter()
        if max_num_seqs < 1:
            raise UsageError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        install_rank_zero_logging()
        clamp_threads()
        group = _command_group(rank, world_size)
        dev = torch.device(f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device)
        error, engine = None, None
        try:
            weights = load_rank_weights(path, rank=rank, world_size=world_size, from_checkpoint=from_checkpoint,
                                        verify=verify_hashes)  # hash each file as it is read (pack.loader)
            config = weights.config
            model, family, offloaded, dtype = build_model(weights, rank=rank, device=dev, dtype=dtype,
                                                          max_seq_len=max_seq_len, max_num_seqs=max_num_seqs,
                                                          offload=offload, fp8=fp8, mtp_layers=mtp_layers,
                                                          kv_cache_tokens=kv_cache_tokens)
            engine = cls(model, config=config, root=Path(weights.root), rank=rank, world_size=world_size,
                         device=dev, dtype=dtype, max_seq_len=max_seq_len, group=group, family=family)
            if compile_cache is not None:  # before anything compiles (warm-up), after the dtype is known
                from shardsmith.runtime.engine import compile_cache as cc

                key = cc.make_key(Path(path), from_checkpoint=from_checkpoint, rank=rank, world_size=world_size,
                                  dtype=dtype, device=dev)
                try:
                    engine.compile_cache = cc.open_cache(Path(compile_cache), Path(path), key)
                except OSError as e:  # a cache that cannot be written is a slower start, not a failed one
                    log.warning("compile cache under %s cannot be used (%s): the libraries' own folders are used",
                                compile_cache, e)
            if cuda_graphs and dev.type == "cuda":
                engine.use_decode_graphs()
            engine.offload = offloaded
        except Exception as e:  # gathered below so that every rank fails with every rank's reason
            error = e
        problems = _gather_errors(error, rank, world_size, group, load_timeout_s)
        if problems:
            message = format_problems(f"load of {path} at world_size={world_size} failed", [p for p, _ in problems])
            raise RuntimeLoadError(message) from _worst_cause(error, problems)
        if engine.offload is not None:  # collective (slot count and probe agreed by all ranks), after every rank loaded
            engine.offload.start(graphed=cuda_graphs and dev.type == "cuda")
        engine.load_seconds = time.perf_counter() - t0
        log.info("rank 0 of %d ready in %.2f s (%s, %s; %d sequence slot(s) of %d positions, %.1f MiB of "
                 "per-sequence state%s)", world_size, engine.load_seconds, dev, dtype, engine.max_num_seqs,
                 max_seq_len, engine.state_bytes / 2**20, "" if engine.kv_blocks is None else
                 f": a KV pool of {engine.kv_blocks.tokens} positions in blocks of {engine.kv_blocks.block_size}")
        return engine

    def use_decode_graphs(self) -> None:
        """Run one-token steps as piecewise CUDA graphs (:class:`~shardsmith.runtime.engine.cuda_graphs.DecodeGraphs`).

        On a CPU device nothing is captured: the pieces run eagerly through static buffers (what
        tests check against the plain forward). Call after the weights and offload are in place.
        """
        self.graphs = DecodeGraphs(self.model, self.device)
        self.forward = self.graphs

    @property
    def runner(self) -> DecodeGraphs:
        """What runs batched decode steps: the decode graphs, else the same pieces run eagerly."""
        if self.graphs is not None:
            return self.graphs
        if self._eager is None:
            self._eager = DecodeGraphs(self.model, self.device, capture=False)
        return self._eager

    # ---------------------------------------------------------------- rank 0

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Generate from ``prompt_ids`` in slot 0 (rank 0; drives the other ranks). One sequence at a
        time: the server batches through :meth:`prefill`, :meth:`decode` and :meth:`release` instead.

        The caller may stop iterating early; the next :meth:`generate` starts afresh, and an older
        iterator resumed after that raises :class:`~shardsmith.errors.UsageError`.

        Raises:
            UsageError: bad parameters, empty prompt, ids outside the vocabulary, a prompt longer
                than ``max_seq_len``, or called on a rank other than 0.
            RankLostError: another rank died.
        """
        self.check_request(prompt_ids, params)
        self._request += 1
        request = self._request
        gen = make_generator(params.seed)
        logits = self._step(prompt_ids, 0)[-1]  # [V]
        pos = len(prompt_ids)
        counts = TokenCounts(1, logits.shape[-1], logits.device) if penalties.counts_tokens(params) else None
        if counts is not None:
            counts.reset(0, prompt_ids)
        for i in range(params.max_tokens):
            scores = penalties.apply(logits[None], [params], [0], [i], counts) if penalties.adjusts(params) else None
            c = choose_rows(logits[None], [params], [gen], scores=scores)[0]
            if counts is not None:
                counts.add(*to_device([torch.tensor([0]), torch.tensor([c.token_id])], logits.device))
            reason = ("stop" if c.token_id in params.stop_token_ids
                      else "length" if i + 1 == params.max_tokens or pos >= self.max_seq_len else None)
            yield StepOutput(c.token_id, c.logprob, c.top_logprobs, reason is not None, reason)
            if reason is not None:
                return
            if request != self._request:
                raise UsageError("this generation was superseded by a newer generate() call")
            logits = self._step([c.token_id], pos)[-1]
            pos += 1

    def abort(self) -> None:
        """Forget the current generation (nothing to release: the next one overwrites the cache)."""
        self._request += 1

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Float32 logits ``[T, V]`` of a prefill of ``ids`` from position 0 (rank 0; for tests)."""
        self.check_request(ids, SamplingParams())
        self._request += 1
        return self._step(ids, 0, last_only=False)

    def prefill(self, slot: int, ids: list[int], start: int = 0, *, last_only: bool = True,
                on_device: bool = False, speculative: bool = False) -> torch.Tensor:
        """One sequence's tokens ``ids`` at ``[start, start + len(ids))`` in ``slot`` (a prompt, or one
        chunk of it: chunk k starts where chunk k-1 ended; ``start == 0`` begins a new sequence);
        float32 CPU logits ``[1, V]`` (``[T, V]`` without ``last_only``; left on the engine's device
        with ``on_device``, for :func:`~shardsmith.runtime.engine.sampling.choose_rows`). Rank 0;
        every rank runs it. ``speculative`` (a draft's verify chunk, in a model that cannot rewind):
        the model keeps what the step writes over, so :meth:`restore` can take back its later rows.

        Raises:
            UsageError: a slot outside ``[0, max_num_seqs)``, or a start the model cannot take.
            RankLostError: another rank died.
        """
        self._check_slots([slot])
        return self._step(ids, start, last_only=last_only, slot=slot, on_device=on_device,
                          speculative=speculative and not self.family.rewinds)

    def decode(self, ids: list[int], starts: list[int], slots: list[int], *, on_device: bool = False,
               bucket: int | None = None) -> torch.Tensor:
        """One batched step: B sequences, one token each (row b: ``ids[b]`` at ``starts[b]`` in
        ``slots[b]``); float32 CPU logits ``[B, V]`` (left on the engine's device with ``on_device``:
        the serving loop reduces them there, :func:`~shardsmith.runtime.engine.sampling.choose_rows`).
        Rank 0; every rank runs it.

        The step runs the model's decode pieces (:meth:`DecodeGraphs.decode`: padded to a bucket,
        graphed on CUDA, eager elsewhere); row b equals a one-token :meth:`prefill` of that sequence
        up to matmul rounding. ``bucket``: the batch bucket to run through (padded; built if it is not),
        default the runner's choice.

        Raises:
            UsageError: lists of different lengths, B outside ``[1, max_rows]``, a slot twice (but in
                a verify run, where the model takes one) or outside the slots, a start past the slot's
                sequence, a bucket that cannot hold B rows.
            RankLostError: another rank died.
        """
        B = len(ids)
        self._check_rows(B, starts, slots)
        if bucket is not None and (bucket not in self.runner.buckets or bucket < B):
            raise UsageError(f"decode: bucket {bucket} cannot run {B} rows (buckets {self.runner.buckets})")
        payload = torch.tensor([ids, starts, slots], dtype=torch.int64)  # [3, B]
        with self._lock:
            if self.world_size > 1:
                self._send(torch.tensor([DECODE, B, bucket or 0, 0, 0], dtype=torch.int64))
                self._collective(lambda: dist.broadcast(payload, src=0, group=self._group))
            for s, start in zip(slots, starts):
                self._pos[s] = start + 1
            logits = self._collective(lambda: self._run_decode(payload, bucket))
        return logits if on_device else logits.cpu()

    def decode_on_device(self, ids: torch.Tensor, starts: list[int], slots: list[int]) -> torch.Tensor:
        """:meth:`decode` with the tokens already on the engine's device: ``ids`` ``[B]`` int64 (the
        previous step's choices, :func:`~shardsmith.runtime.engine.sampling.choose_on_device`),
        logits ``[B, V]`` float32 left there; nothing waits for the device. The serving loop launches
        the next step this way before it reads the last one's tokens (one rank: the other ranks take
        their tokens from the command broadcast, which is on the host).

        Raises:
            UsageError: more than one rank, ``ids`` not ``[B]`` on the engine's device, or the checks
                of :meth:`decode`.
        """
        if self.world_size != 1:
            raise UsageError(f"decode_on_device runs one rank only (world_size {self.world_size})")
        if ids.dim() != 1 or ids.device.type != torch.device(self.device).type:
            raise UsageError(f"decode_on_device: ids must be [B] on {self.device}, got {list(ids.shape)} on {ids.device}")
        self._check_rows(ids.shape[0], starts, slots)
        with self._lock:
            for s, start in zip(slots, starts):
                self._pos[s] = start + 1
            return self.runner.decode(ids, list(starts), list(slots))

    def _check_rows(self, B: int, starts: list[int], slots: list[int]) -> None:
        most = self.max_rows
        if not 1 <= B <= most or len(starts) != B or len(slots) != B:
            raise UsageError(f"decode needs 1..{most} rows with one start and slot each; got "
                             f"{B} ids, {len(starts)} starts, {len(slots)} slots")
        firsts = dict(zip(slots, starts))
        if len(firsts) != B:  # several rows of one slot: a verify run, where the model takes them
            if not self.verify_runs:
                raise UsageError(f"decode: a slot appears twice in {slots} ({self.family.name} decodes one row "
                                 f"per sequence)")
            try:
                runs = verify_runs(starts, slots, family="decode")
            except UsageError:
                raise UsageError(f"decode: a slot appears twice in {slots} at positions that are not one verify "
                                 f"run (consecutive, in order)") from None
            firsts = {slot: first for slot, (first, _) in runs.items()}
        self._check_slots(slots)
        for s, start in firsts.items():
            self._check_start(s, start)

    @property
    def verify_runs(self) -> bool:
        """Whether a decode step may hold several rows of one sequence at consecutive positions (a
        speculative verify run, each row attending to the ones before it): the model's ``VERIFY_RUNS``."""
        return bool(getattr(self.model, "VERIFY_RUNS", False))

    @property
    def max_rows(self) -> int:
        """Most rows one decode step takes: ``max_num_seqs``, or more after :meth:`reserve_rows`."""
        return max(self.max_num_seqs, self.runner.buckets[-1])

    def reserve_rows(self, rows: int) -> None:
        """Let decode steps carry up to ``rows`` rows (rank 0; every rank): the batch buckets then reach
        ``rows`` (speculative verify runs add rows beyond one per sequence). Call before :meth:`warmup`:
        a model whose state is sized for runs (DeepSeek-V4's window rings) allocates it anew, and
        every slot's sequence is forgotten.

        Raises:
            UsageError: the model takes one row per sequence (no ``VERIFY_RUNS``) and ``rows`` exceeds
                ``max_num_seqs``.
        """
        if rows <= self.max_rows:
            return
        if not self.verify_runs:
            raise UsageError(f"{self.family.name} decodes one row per sequence: a step holds at most "
                             f"max_num_seqs={self.max_num_seqs} rows")
        with self._lock:
            if self.world_size > 1:
                self._send(torch.tensor([WARMUP, rows, 3, 0, 0], dtype=torch.int64))
            self._reserve(rows)
            self._pos = [0] * self.max_num_seqs

    def _reserve(self, rows: int) -> None:
        self.runner.reserve(rows)
        # state sized for runs (DeepSeek-V4's rings): slots forgotten, and pieces built on the old state rebuilt
        if hasattr(self.model, "reserve_runs") and self.model.reserve_runs(rows):
            self.runner.forget()

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` ended: every rank forgets it (rank 0)."""
        self._check_slots([slot])
        with self._lock:
            if self.world_size > 1:
                self._send(torch.tensor([RELEASE, slot, 0, 0, 0], dtype=torch.int64))
            self._pos[slot] = 0
            self._release(slot)

    def draft(self, slot: int, token: int, pos: int, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token`` at ``pos`` in ``slot``, from the model's MTP
        layer (``DeepseekV3.draft``; loaded with ``mtp_layers``); ``[]`` when the slot's last step did
        not end at ``pos``. Rank 0; every rank runs it (the layer is tensor-parallel).

        Raises:
            UsageError: a slot outside the slots, a model without an MTP layer, or ``pos + k`` past
                ``max_seq_len``.
            RankLostError: another rank died.
        """
        self._check_slots([slot])
        if not getattr(self.model, "mtp", None):
            raise UsageError(f"{self.family.name}: no MTP layer loaded (Engine.load(mtp_layers=1); DeepSeek-V3 only)")
        if pos + k > self.max_seq_len:
            raise UsageError(f"a {k}-token draft at {pos} passes max_seq_len={self.max_seq_len}")
        with self._lock:
            if self.world_size > 1:
                self._send(torch.tensor([DRAFT, slot, pos, k, token], dtype=torch.int64))
            return self._collective(lambda: self.model.draft(slot, token, pos, k))

    def resume_points(self, slot: int) -> list[int]:
        """Earlier positions ``slot`` can go back to with :meth:`restore` (rank 0): every position up
        to where its last step ended for a model that rewinds, else the resume points its prefills
        left (``DeepseekV4.resume_points``), ascending; the last step's end is always one."""
        self._check_slots([slot])
        points = getattr(self.model, "resume_points", None)
        return sorted({*(points(slot) if points is not None else ()), self._pos[slot]})

    def restore(self, slot: int, pos: int) -> None:
        """Every rank puts ``slot`` back to position ``pos`` (rank 0): a no-op for a model that
        rewinds (its next step may start anywhere up to where the last ended), else the model's
        ``restore`` to one of :meth:`resume_points` or into the last step when it was ``speculative``.

        Raises:
            UsageError: ``pos`` is past the slot's end, or (a model that cannot rewind) neither a resume
                point nor inside a speculative last step.
        """
        self._check_slots([slot])
        spec = self.model.speculating(slot) if hasattr(self.model, "speculating") else None
        inside = spec is not None and spec[0] < pos < spec[0] + spec[1] == self._pos[slot]  # a verify chunk's rows
        if pos > self._pos[slot] or (not self.family.rewinds and not inside and pos not in self.resume_points(slot)):
            raise UsageError(f"slot {slot} cannot go back to position {pos}: it ended at {self._pos[slot]}"
                             + ("" if self.family.rewinds else f"; its resume points are {self.resume_points(slot)}"))
        if self.family.rewinds or pos == self._pos[slot]:
            return
        with self._lock:
            if self.world_size > 1:
                self._send(torch.tensor([RESTORE, slot, pos, 0, 0], dtype=torch.int64))
            self._restore(slot, pos)
            self._pos[slot] = pos

    def warmup(self, *, defer_buckets: bool = False) -> None:
        """Prepare every rank for serving, so no request pays a compile or a capture (rank 0):

        1. every rank launches each Triton kernel variant its steps can use, for steps of up to
           ``max_seq_len`` tokens (:func:`~shardsmith.runtime.engine.warmup.warm_kernels`; the
           ``WARMUP`` command; nothing when no module runs a kernel, as on CPU);
        2. one tiny prefill and one decode step; on CUDA (or with kernels, or compiled pieces) also
           one batched step of every bucket, so no graph is captured and nothing compiled
           mid-serving (graphed or eager: the batched pieces' ``torch.compile`` and kernel shapes).
           With ``defer_buckets`` only the one-row bucket: the others are left in
           :attr:`pending_buckets` for :meth:`build_bucket`, and a step meanwhile runs through the
           smallest built bucket that holds it (or as several steps of the largest built one).

        3. on CUDA, times both ways a short prompt can take (best of 3, warm): an eager prefill of
           :data:`PROMPT_PROBE_TOKENS` tokens and a one-row decode step, into ``prompt_costs``
           (seconds); the scheduler feeds prompts through decode rows up to their ratio
           (:func:`~shardsmith.runtime.engine.scheduler.default_decode_prompt_tokens`).

        Every slot it used is released. Sets ``warmup_seconds``, ``warmup_launches`` and
        ``warmup_phases`` (seconds of each phase: ``kernels``, ``prefill``, ``step``, ``bucket<rows>``,
        ``rollbacks`` (:meth:`_warm_rollbacks`), ``probe``) and ``warmup_compile`` (:func:`compile_seconds`
        spent in it), and logs both.
        """
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        compiling = compile_seconds()

        def phase(name: str) -> None:
            phases[name] = time.perf_counter() - t0 - sum(phases.values())

        if self.has_kernels:  # every rank's modules are switched alike (same config, same device kind)
            with self._lock:
                if self.world_size > 1:
                    self._send(torch.tensor([WARMUP, self.max_seq_len, 0, 0, 0], dtype=torch.int64))
                self.warmup_launches = self._collective(lambda: self._warm_kernels(self.max_seq_len))
        phase("kernels")
        self._step([0, 0], 0)
        phase("prefill")
        self._step([0], 2)
        self.release(0)
        phase("step")
        if defer_buckets and (self.max_num_seqs > 1 or self.runner.static):
            with self._lock:  # batch buckets, and a static-core model's longer length buckets, wait
                if self.world_size > 1:
                    self._send(torch.tensor([WARMUP, 0, 2, 0, 0], dtype=torch.int64))
                self.runner.defer()
        if self.max_num_seqs > 1 and (self.bucket_builds_compile or defer_buckets):
            slots = list(range(self.max_num_seqs))  # eager too (--enforce-eager): torch.compile'd pieces
            buckets = self.runner.buckets[:1] if defer_buckets else self.runner.buckets
            for rows in buckets:
                for s in slots[:rows]:
                    self.prefill(s, [0, 0], 0)
                self.decode([0] * rows, [2] * rows, slots[:rows], bucket=rows)
                phase(f"bucket{rows}")
            for s in slots:
                self.release(s)
        if self._warm_rollbacks():
            phase("rollbacks")
        if self.device.type == "cuda" and self.max_seq_len >= 3:  # a prefill and a step after it must fit
            self.prompt_costs = self._time_prompt_paths()
            phase("probe")
        self._seal_all()
        phase("seal")
        self.warmup_seconds = time.perf_counter() - t0
        self.warmup_phases = phases
        self.warmup_compile = {k: v - compiling[k] for k, v in compile_seconds().items()}
        log.info("warm-up: %d kernel launches and the decode buckets in %.2f s%s", self.warmup_launches,
                 self.warmup_seconds, "" if self.prompt_costs is None else
                 "; a %d-token prefill takes %.1f ms, a one-row decode step %.2f ms" % (
                     min(PROMPT_PROBE_TOKENS, self.max_seq_len - 1), 1e3 * self.prompt_costs[0], 1e3 * self.prompt_costs[1]))
        log.info("warm-up phases (s): %s", " ".join(f"{k}={v:.2f}" for k, v in phases.items()))
        log.info("warm-up compiling (s): %s", " ".join(f"{k}={v:.2f}" for k, v in self.warmup_compile.items()))

    def _warm_rollbacks(self) -> bool:
        """With the decode graphs and room for verify runs (:meth:`reserve_rows`) in a model whose runs roll
        back through device programs (DeepSeek-V4's ``rollback_programs``), build (capture on CUDA) each
        of them on every rank before serving, on the model's scratch slot: no decode step, so no batch
        bucket is built for it. Whether it ran."""
        if self.graphs is None or not getattr(self.model, "rollback_programs", None) or getattr(self.model, "runs", 1) < 2:
            return False
        with self._lock:
            if self.world_size > 1:
                self._send(torch.tensor([WARMUP, 0, 4, 0, 0], dtype=torch.int64))
            self._build_rollbacks()
        return True

    def _build_rollbacks(self) -> None:
        for key, fn, inputs in self.model.rollback_programs():
            self.graphs.program(key, fn, *inputs)

    @property
    def bucket_builds_compile(self) -> bool:
        """Whether building a batch bucket compiles or captures (CUDA, a Triton kernel, compiled pieces), so
        the warm-up builds them all before serving (or defers them); elsewhere a bucket's eager pieces
        cost nothing to make."""
        return self.device.type == "cuda" or self.has_kernels or compiles()

    @property
    def has_kernels(self) -> bool:
        """Whether some module (or the offload runtime) runs a Triton kernel (asked once)."""
        if self._kernels is None:
            from shardsmith.runtime.engine.warmup import kernel_modules

            self._kernels = bool(kernel_modules(self.model, self.offload))
        return self._kernels

    @property
    def pending_buckets(self) -> list[int]:
        """Batch buckets the warm-up deferred and no :meth:`build_bucket` built yet, largest first (rank 0)."""
        return sorted(self.runner.pending(), reverse=True) if self.runner.deferring else []

    def built_buckets(self) -> list[int]:
        """Batch buckets whose pieces exist (a step ran through them), ascending."""
        return sorted(self.runner.built)

    def build_bucket(self, slot: int) -> int:
        """Build the largest of :attr:`pending_buckets` (rank 0; every rank runs it): a two-token prefill
        in the free ``slot``, one step through that bucket padded with copies of its row, and the slot
        released. Returns the bucket's rows.

        Raises:
            UsageError: nothing is pending.
        """
        if not self.pending_buckets:
            raise UsageError("no decode bucket is waiting to be built")
        rows, t0 = self.pending_buckets[0], time.perf_counter()
        self.prefill(slot, [0, 0], 0)
        self.decode([0], [2], [slot], bucket=rows)
        self.release(slot)
        self._seal_all()
        log.info("decode bucket of %d rows built in %.2f s%s", rows, time.perf_counter() - t0,
                 f" ({', '.join(map(str, self.pending_buckets))} to build)" if self.pending_buckets else
                 " (every bucket built)")
        return rows

    @property
    def pending_lengths(self) -> list[tuple[int, int]]:
        """A static-core model's (DeepSeek-V4) ``(rows, length bucket)`` decode pieces that the warm-up deferred
        and no step or :meth:`build_length` built yet, for the batch buckets built, shortest length first
        (rank 0). Unbuilt, the first step of a sequence past each power of two of its length builds them
        (captures a graph) in the middle of its stream."""
        return self.runner.pending_lengths() if self.runner.deferring else []

    def build_length(self) -> tuple[int, int]:
        """Build the first of :attr:`pending_lengths` (rank 0; every rank runs it) with a step of padding rows
        alone (the model's ``build_step``): no slot is taken and no sequence changes. Returns ``(rows,
        length)``.

        Raises:
            UsageError: nothing is pending.
        """
        pending = self.pending_lengths
        if not pending:
            raise UsageError("no decode length bucket is waiting to be built")
        (rows, length), t0 = pending[0], time.perf_counter()
        with self._lock:
            if self.world_size > 1:
                self._send(torch.tensor([WARMUP, rows, 5, length, 0], dtype=torch.int64))
            self._collective(lambda: self.runner.build_length(rows, length))
        self._seal_all()
        left = len(pending) - 1  # this one is built; nothing else changed
        log.info("decode pieces of %d rows at length bucket %d built in %.2f s%s", rows, length,
                 time.perf_counter() - t0, f" ({left} to build)" if left else " (every length built)")
        return rows, length

    def _seal_all(self) -> None:
        """Every rank records the compile cache its steps filled (the ``WARMUP`` command's seal)."""
        with self._lock:
            if self.world_size > 1:
                self._send(torch.tensor([WARMUP, 0, 1, 0, 0], dtype=torch.int64))
            self._seal_compile_cache()

    def _seal_compile_cache(self) -> None:
        if self.compile_cache is not None:
            try:
                self.compile_cache.seal()
            except OSError as e:  # unrecorded, the next start checks nothing and reuses the files as they are
                log.warning("compile cache %s: not sealed (%s)", self.compile_cache.folder, e)

    def _time_prompt_paths(self) -> tuple[float, float]:
        """(seconds of an eager prefill of :data:`PROMPT_PROBE_TOKENS` tokens, seconds of a one-row decode
        step after it), each the best of 3 in slot 0, synchronised on rank 0's device; slot 0 is released."""
        n = max(1, min(PROMPT_PROBE_TOKENS, self.max_seq_len - 1))
        prefill = step = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(self.device)
            t = time.perf_counter()
            self.prefill(0, [0] * n, 0, on_device=True)
            torch.cuda.synchronize(self.device)
            t1 = time.perf_counter()
            self.decode([0], [n], [0], on_device=True)
            torch.cuda.synchronize(self.device)
            prefill, step = min(prefill, t1 - t), min(step, time.perf_counter() - t1)
        self.release(0)
        return prefill, step

    def shutdown(self) -> None:
        """Release the followers from :meth:`follow` (rank 0; idempotent)."""
        if self.rank == 0 and not self._closed and self.world_size > 1:
            with self._lock:
                self._send(torch.tensor([SHUTDOWN, 0, 0, 0, 0], dtype=torch.int64))
        self._closed = True

    # ---------------------------------------------------------------- ranks != 0

    def follow(self) -> None:
        """Run rank 0's steps until it shuts down (ranks != 0).

        Raises:
            RankLostError: rank 0 or another rank died.
        """
        if self.rank == 0:
            raise UsageError("follow() is for ranks != 0; rank 0 drives with generate()")
        while True:
            cmd = torch.empty(CMD_LEN, dtype=torch.int64)
            self._collective(lambda: dist.broadcast(cmd, src=0, group=self._group))
            op, a, b, c, d = cmd.tolist()
            if op == SHUTDOWN:
                self._closed = True
                return
            if op == RELEASE:
                self._release(a)
            elif op == RESTORE:
                self._restore(a, b)
            elif op == WARMUP and b == 1:
                self._seal_compile_cache()
            elif op == WARMUP and b == 2:
                self.runner.defer()
            elif op == WARMUP and b == 3:
                self._reserve(a)
            elif op == WARMUP and b == 5:
                self._collective(lambda: self.runner.build_length(a, c))
            elif op == WARMUP and b == 4:
                if self.graphs is not None:
                    self._build_rollbacks()
            elif op == WARMUP:
                self._collective(lambda: self._warm_kernels(a))
            elif op == DRAFT:
                self._collective(lambda: self.model.draft(a, d, b, c))
            elif op == DECODE:
                payload = torch.empty(3, a, dtype=torch.int64)
                self._collective(lambda: dist.broadcast(payload, src=0, group=self._group))
                self._collective(lambda: self._run_decode(payload, bucket=b or None))
            else:
                ids = torch.empty(a, dtype=torch.int64)
                self._collective(lambda: dist.broadcast(ids, src=0, group=self._group))
                if c & SPECULATIVE:
                    self.model.speculate(d, a)
                self._collective(lambda: self._run_forward(ids, b, last_only=not c & 1, slot=d))

    # ---------------------------------------------------------------- internals

    def check_request(self, ids: list[int], p: SamplingParams) -> None:
        """Refuse bad sampling parameters or prompt ids before anything is broadcast (rank 0).

        Raises:
            UsageError: every problem found, in one message.
        """
        if self.rank != 0:
            raise UsageError(f"generate()/logits() run on rank 0 only (this is rank {self.rank})")
        if self._closed:
            raise UsageError("the engine was shut down")
        bad = [
            *param_problems(p, self.vocab_size),
            "the prompt is empty" if not ids else "",
            f"the prompt has {len(ids)} tokens; max_seq_len is {self.max_seq_len}" if len(ids) > self.max_seq_len else "",
            "token ids must be in [0, %d)" % self.vocab_size if any(not 0 <= t < self.vocab_size for t in ids) else "",
        ]
        if any(bad):
            raise UsageError("; ".join(b for b in bad if b))

    _check_request = check_request

    def _check_slots(self, slots: list[int]) -> None:
        bad = [s for s in slots if not 0 <= s < self.max_num_seqs]
        if bad:
            raise UsageError(f"slot(s) {bad} outside [0, {self.max_num_seqs}) (max_num_seqs={self.max_num_seqs})")

    def _check_start(self, slot: int, start: int) -> None:
        """Raises UsageError when ``start`` is past where slot's last step ended or, for a model that
        cannot rewind (``ModelFamily.rewinds``), neither 0 nor exactly there."""
        pos = self._pos[slot]
        if start not in (0, pos) and (not self.family.rewinds or start > pos):
            where = (f"at position {pos}, where the last step ended (its state cannot rewind)"
                     if not self.family.rewinds else f"at or before position {pos}, where the last step ended")
            raise UsageError(f"{self.family.name}: a step must start at 0 (a new sequence) or {where}; got start={start}")

    def _step(self, ids: list[int], start: int, *, last_only: bool = True, slot: int = 0,
              on_device: bool = False, speculative: bool = False) -> torch.Tensor:
        """Broadcast one sequence's step (command and tokens), run it here; returns float32 logits, on
        the CPU unless ``on_device``.

        Raises:
            UsageError: before anything is broadcast, when ``start`` is past where the slot's last step
                ended or, for a model that cannot rewind (``ModelFamily.rewinds``), neither 0 nor
                exactly there.
        """
        self._check_start(slot, start)
        tokens = torch.tensor(ids, dtype=torch.int64)
        with self._lock:
            if self.world_size > 1:
                flags = int(not last_only) | SPECULATIVE * speculative
                self._send(torch.tensor([FORWARD, len(ids), start, flags, slot], dtype=torch.int64))
                self._collective(lambda: dist.broadcast(tokens, src=0, group=self._group))
            if speculative:
                self.model.speculate(slot, len(ids))
            self._pos[slot] = start + len(ids)
            logits = self._collective(lambda: self._run_forward(tokens, start, last_only=last_only, slot=slot))
        return logits if on_device else logits.cpu()

    def _run_forward(self, tokens: torch.Tensor, start: int, *, last_only: bool, slot: int) -> torch.Tensor:
        with self.offload.prefill() if self.offload is not None else contextlib.nullcontext():
            if slot == 0:
                return self.forward(tokens.to(self.device), start, last_only=last_only)
            return self.forward(tokens.to(self.device), start, last_only=last_only, slot=slot)

    def _restore(self, slot: int, pos: int) -> None:
        """The model's ``restore``, its verify-run rollback through the decode graphs' programs (a
        captured graph on CUDA) when the model takes one (DeepSeek-V4)."""
        if self.graphs is not None and self.verify_runs:
            self.model.restore(slot, pos, program=self.graphs.program)
        else:
            self.model.restore(slot, pos)

    def _run_decode(self, payload: torch.Tensor, bucket: int | None = None) -> torch.Tensor:
        ids, starts, slots = payload[0].to(self.device), payload[1].tolist(), payload[2].tolist()
        return self.runner.decode(ids, starts, slots, bucket=bucket)

    def _warm_kernels(self, max_rows: int) -> int:
        from shardsmith.runtime.engine.warmup import warm_kernels

        top_k = int(self.config.get("num_experts_per_tok") or 1)
        return warm_kernels(self.model, max_rows=max_rows, top_k=top_k, dtype=self.dtype, device=self.device,
                            offload=self.offload)

    def _release(self, slot: int) -> None:
        release = getattr(self.model, "release", None)
        if release is not None:
            release(slot)

    def _send(self, cmd: torch.Tensor) -> None:
        self._collective(lambda: dist.broadcast(cmd, src=0, group=self._group))

    def _collective(self, fn):
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError) as e:
            if self.world_size == 1 or "gloo" not in str(e).lower() and "nccl" not in str(e).lower() \
                    and "connection" not in str(e).lower():
                raise
            raise RankLostError(f"rank {self.rank}: another rank died or left the process group; "
                                f"stopping ({str(e).splitlines()[0][:300]})") from e


def _command_group(rank: int, world_size: int) -> object | None:
    """A gloo group for step commands (CPU tensors on every backend), with a long idle timeout."""
    if world_size == 1:
        return None
    if not dist.is_initialized():
        raise RuntimeLoadError(f"world_size={world_size} but torch.distributed is not initialised "
                               "(call shardsmith.runtime.engine.dist.init_distributed first)")
    if is_rank_alone():
        raise UsageError("the process group is a rank-alone (fake) one: its collectives move no data, so the "
                         "model's values would be wrong; the engine (and serve) runs on gloo or NCCL only "
                         "(rank-alone runs are benchmarks/tp_sim.py's)")
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeLoadError(f"launched as rank {rank} of {world_size} but the process group is rank "
                               f"{dist.get_rank()} of {dist.get_world_size()}")
    return dist.new_group(backend="gloo", timeout=timedelta(days=30))


def _gather_errors(error: BaseException | None, rank: int, world_size: int, group: object | None,
                   timeout_s: float) -> list[tuple[str, str]]:
    """Every rank's load error as ``(line, error class name)`` (:func:`~shardsmith.errors.error_class`;
    empty when all loaded); collective."""
    mine = None if error is None else (f"rank {rank}: {type(error).__name__}: {error}", error_class(error).__name__)
    if world_size == 1:
        return [mine] if mine else []
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        everyone: list[tuple[str, str] | None] = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:
        raise RankLostError(f"rank {rank}: a rank did not finish loading ({str(e).splitlines()[0][:300]})"
                            + (f"; this rank's own error: {mine[0]}" if mine else "")) from error or e
    return [m for m in everyone if m]


def _worst_cause(error: BaseException | None, problems: list[tuple[str, str]]) -> BaseException | None:
    """The cause to chain the load error to: this rank's own error, unless another rank's has a
    higher exit code (a damaged rank pack: every rank then exits 2, as ``verify`` does)."""
    code = lambda cls: EXIT_CODES.get(cls, 1)  # noqa: E731
    line, worst = max(((line, error_class_named(name)) for line, name in problems), key=lambda p: code(p[1]))
    if error is not None and code(error_class(error)) >= code(worst):
        return error
    return worst(line)


def _eos_ids(root: Path, config: dict) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (else ``config.json``), as a tuple."""
    eos = config.get("eos_token_id")
    try:
        eos = json.loads((root / "generation_config.json").read_text()).get("eos_token_id", eos)
    except (OSError, ValueError):
        pass
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
