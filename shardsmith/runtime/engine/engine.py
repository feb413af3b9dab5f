"""The engine: load one rank, and let rank 0 drive every rank step by step.

Rank 0 owns the request; for every forward step it broadcasts a small command over a gloo group
(``int64 [4]``: op, tokens, start position, all-logits flag), then the token ids, then runs the
step. Ranks != 0 sit in :meth:`Engine.follow`, blocked in that broadcast, and run the same step.
There is no queue: the first command after start-up meets followers already waiting in the
collective, so it cannot be lost, and the sampled token reaches them as the next step's payload.

Failure: gloo notices a dead peer at once (its TCP connection closes), so a rank that dies makes
the others' next collective raise; the engine turns that into :class:`RankLostError`. The command
group's timeout is long (idle followers wait in it); the load ends with a ``monitored_barrier``
(``load_timeout_s``) that names ranks that never finished loading, then every rank's load error is
gathered and raised on all ranks. On NCCL, a peer dying mid-step is noticed only at the default
group's timeout (see :func:`~shardsmith.runtime.layers.parallel.init_distributed`).

Example:
    >>> eng = Engine.load("out/", rank=0, world_size=1)  # doctest: +SKIP
    >>> [s.token_id for s in eng.generate([1, 2, 3], SamplingParams(max_tokens=4))]  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardsmith.errors import RankLostError, RuntimeLoadError, UsageError, format_problems
from shardsmith.runtime.models.registry import ModelFamily, family_for
from shardsmith.runtime.layers.parallel import clamp_threads, install_rank_zero_logging, use_kernels_
from shardsmith.runtime.layers.quant import dequantize_fp8_
from shardsmith.runtime.engine.cuda_graphs import DecodeGraphs
from shardsmith.runtime.engine.sampling import choose, make_generator
from shardsmith.runtime.engine.loader import load_rank_weights

if TYPE_CHECKING:
    from shardsmith.runtime.offload import OffloadConfig

log = logging.getLogger("shardsmith.runtime")
FORWARD, SHUTDOWN = 1, 2
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to continue one prompt.

    Attributes:
        max_tokens: tokens to generate (>= 1); temperature: 0 greedy, else softmax temperature;
        top_k: 0 for all; top_p: nucleus mass in (0, 1]; seed: per-request seed (None: random);
        stop_token_ids: ids that end the generation (the stop token is yielded, finish "stop");
        logprobs: how many top logprobs per step (0: none).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One generated token.

    Attributes:
        token_id, logprob: the token and its model log-probability (nats);
        top_logprobs: ``(token_id, logprob)`` best first (``SamplingParams.logprobs`` of them);
        finished: last token of this generation; finish_reason: ``stop``, ``length`` or None.
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    finished: bool
    finish_reason: str | None


class Engine:
    """One rank's model plus the rank-0-drives-all step protocol.

    Attributes:
        config: ``config.json``; root: directory with the tokenizer files; max_seq_len: positions
        of the KV cache (prompt + generated); load_seconds: time from :meth:`load` start to ready
        on this rank; eos_token_ids: from ``generation_config.json`` / ``config.json``;
        rank, world_size, device, dtype, vocab_size; family: the model's registry entry
        (:mod:`~shardsmith.runtime.models.registry`); graphs: the model's
        :class:`~shardsmith.runtime.engine.cuda_graphs.DecodeGraphs` once :meth:`use_decode_graphs`
        ran (None: every step eager); forward: what runs a step (``graphs`` or the model).
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
        self._pos = 0  # where the last step ended (rank 0): models that cannot rewind continue only there

    @classmethod
    def load(cls, path: str | Path, *, rank: int, world_size: int, device: str = "cpu", from_checkpoint: bool = False,
             verify_hashes: bool = True, max_seq_len: int = 2048, dtype: torch.dtype | None = None,
             load_timeout_s: float = 1800.0, offload: "OffloadConfig | None" = None, fp8: str = "load",
             cuda_graphs: bool = True) -> "Engine":
        """Load rank ``rank``'s weights and build its model; collective over all ranks.

        The model is the registry's for the config's architecture (:mod:`~shardsmith.runtime.models.registry`:
        the Mixtral family or DeepSeek-V4).

        ``torch.distributed`` must already be initialised when ``world_size > 1``
        (:func:`~shardsmith.runtime.layers.parallel.init_distributed`).

        Args:
            path: a pack directory, or a checkpoint with ``from_checkpoint``.
            verify_hashes: hash each pack file (XXH3-128) as it is read and refuse a damaged one (default).
            device: ``cpu`` or ``cuda`` (``cuda:{LOCAL_RANK}``); dtype: compute dtype, a torch dtype
                or its name (default: the config's ``dtype``/``torch_dtype``, else bfloat16).
            max_seq_len: KV cache positions; load_timeout_s: how long rank 0 waits for the
                slowest rank to finish loading before naming it.
            fp8: ``load`` dequantizes FP8 block weights once to ``dtype``; ``on-the-fly`` keeps
                them FP8 and dequantizes per matmul (see :mod:`~shardsmith.runtime.layers.parallel`).
                On CUDA, FP8 linears stay FP8 either way and run the ``fp8_linear`` kernel, and
                resident expert banks run ``fused_experts`` for decode steps
                (:func:`~shardsmith.runtime.layers.parallel.use_kernels_`; ``SHARDSMITH_FP8_DENSE=dequantize``
                and ``SHARDSMITH_FUSED_EXPERTS=off`` force the PyTorch paths).
            offload: place routed experts in host memory with a device expert cache
                (:mod:`shardsmith.runtime.offload`); None keeps every expert resident.
            cuda_graphs: on CUDA, run one-token decode steps as piecewise CUDA graphs (both
                model families; :mod:`~shardsmith.runtime.engine.cuda_graphs`); False runs every kernel
                eagerly (``--enforce-eager``).

        Raises:
            RuntimeLoadError: on every rank, listing each rank's load problem (missing,
                unexpected or mis-shaped tensor, wrong world size, ...), or a process group that
                does not match ``rank``/``world_size``.
            RankLostError: a rank died during the load.
        """
        t0 = time.perf_counter()
        install_rank_zero_logging()
        clamp_threads()
        group = _command_group(rank, world_size)
        dev = torch.device(f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device)
        error, engine = None, None
        try:
            weights = load_rank_weights(path, rank=rank, world_size=world_size, from_checkpoint=from_checkpoint,
                                        verify=verify_hashes)  # hash each file as it is read (pack.loader)
            config = weights.config
            family = family_for(config)
            if isinstance(dtype, str):
                if dtype not in DTYPES:
                    raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
                dtype = DTYPES[dtype]
            dtype = dtype or DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")), torch.bfloat16)
            place = None
            if offload is not None:  # swaps the expert banks for host banks + a device cache
                from shardsmith.runtime.offload import attach_offload

                def place(meta_model):
                    return attach_offload(meta_model, weights, offload, device=dev, dtype=dtype)
            model, offloaded = family.build(weights, rank=rank, dtype=dtype, device=dev, place_experts=place)
            if fp8 not in ("load", "on-the-fly"):
                raise UsageError(f"fp8 must be 'load' or 'on-the-fly', got {fp8!r}")
            use_kernels_(model, dev)  # on CUDA: FP8 linears stay FP8 (fp8_linear), banks run fused_experts
            if fp8 == "load":
                dequantize_fp8_(model, dtype)  # what use_kernels_ did not keep FP8
            model.setup_cache(max_seq_len, dev, dtype)
            engine = cls(model, config=config, root=Path(weights.root), rank=rank, world_size=world_size,
                         device=dev, dtype=dtype, max_seq_len=max_seq_len, group=group, family=family)
            if cuda_graphs and dev.type == "cuda":
                engine.use_decode_graphs()
            engine.offload = offloaded
        except Exception as e:  # gathered below so that every rank fails with every rank's reason
            error = e
        problems = _gather_errors(error, rank, world_size, group, load_timeout_s)
        if problems:
            raise RuntimeLoadError(format_problems(f"load of {path} at world_size={world_size} failed", problems)) from error
        if engine.offload is not None:  # collective (slot count and probe agreed by all ranks), after every rank loaded
            engine.offload.start()
        engine.load_seconds = time.perf_counter() - t0
        log.info("rank 0 of %d ready in %.2f s (%s, %s)", world_size, engine.load_seconds, dev, dtype)
        return engine

    def use_decode_graphs(self) -> None:
        """Run one-token steps as piecewise CUDA graphs (:class:`~shardsmith.runtime.engine.cuda_graphs.DecodeGraphs`).

        On a CPU device nothing is captured: the pieces run eagerly through static buffers (what
        tests check against the plain forward). Call after the weights and offload are in place.
        """
        self.graphs = DecodeGraphs(self.model, self.device)
        self.forward = self.graphs

    # ---------------------------------------------------------------- rank 0

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Generate from ``prompt_ids`` (rank 0; drives the other ranks).

        The caller may stop iterating early; the next :meth:`generate` starts afresh, and an older
        iterator resumed after that raises :class:`~shardsmith.errors.UsageError`.

        Raises:
            UsageError: bad parameters, empty prompt, ids outside the vocabulary, a prompt longer
                than ``max_seq_len``, or called on a rank other than 0.
            RankLostError: another rank died.
        """
        self._check_request(prompt_ids, params)
        self._request += 1
        request = self._request
        gen = make_generator(params.seed)
        logits = self._step(prompt_ids, 0)[-1]  # [V]
        pos = len(prompt_ids)
        for i in range(params.max_tokens):
            c = choose(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                       generator=gen, logprobs=params.logprobs)
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
        self._check_request(ids, SamplingParams())
        self._request += 1
        return self._step(ids, 0, last_only=False)

    def warmup(self) -> None:
        """One tiny prefill and one decode step on every rank (rank 0)."""
        self._step([0, 0], 0)
        self._step([0], 2)

    def shutdown(self) -> None:
        """Release the followers from :meth:`follow` (rank 0; idempotent)."""
        if self.rank == 0 and not self._closed and self.world_size > 1:
            with self._lock:
                self._send(torch.tensor([SHUTDOWN, 0, 0, 0], dtype=torch.int64))
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
            cmd = torch.empty(4, dtype=torch.int64)
            self._collective(lambda: dist.broadcast(cmd, src=0, group=self._group))
            op, n, start, all_logits = cmd.tolist()
            if op == SHUTDOWN:
                self._closed = True
                return
            ids = torch.empty(n, dtype=torch.int64)
            self._collective(lambda: dist.broadcast(ids, src=0, group=self._group))
            self._collective(lambda: self.forward(ids.to(self.device), start, last_only=not all_logits))

    # ---------------------------------------------------------------- internals

    def _check_request(self, ids: list[int], p: SamplingParams) -> None:
        if self.rank != 0:
            raise UsageError(f"generate()/logits() run on rank 0 only (this is rank {self.rank})")
        if self._closed:
            raise UsageError("the engine was shut down")
        bad = [
            "max_tokens must be >= 1" if p.max_tokens < 1 else "",
            "temperature must be >= 0" if not p.temperature >= 0 else "",
            "top_k must be >= 0" if p.top_k < 0 else "",
            "top_p must be in (0, 1]" if not 0 < p.top_p <= 1 else "",
            "logprobs must be >= 0" if p.logprobs < 0 else "",
            "the prompt is empty" if not ids else "",
            f"the prompt has {len(ids)} tokens; max_seq_len is {self.max_seq_len}" if len(ids) > self.max_seq_len else "",
            "token ids must be in [0, %d)" % self.vocab_size if any(not 0 <= t < self.vocab_size for t in ids) else "",
        ]
        if any(bad):
            raise UsageError("; ".join(b for b in bad if b))

    def _step(self, ids: list[int], start: int, *, last_only: bool = True) -> torch.Tensor:
        """Broadcast one step's command and tokens, run it here; returns float32 CPU logits.

        Raises:
            UsageError: before anything is broadcast, when ``start`` is past where the last step
                ended or, for a model that cannot rewind (``ModelFamily.rewinds``), neither 0 nor
                exactly there.
        """
        if start not in (0, self._pos) and (not self.family.rewinds or start > self._pos):
            where = (f"at position {self._pos}, where the last step ended (its state cannot rewind)"
                     if not self.family.rewinds else f"at or before position {self._pos}, where the last step ended")
            raise UsageError(f"{self.family.name}: a step must start at 0 (a new sequence) or {where}; got start={start}")
        tokens = torch.tensor(ids, dtype=torch.int64)
        with self._lock:
            if self.world_size > 1:
                self._send(torch.tensor([FORWARD, len(ids), start, int(not last_only)], dtype=torch.int64))
                self._collective(lambda: dist.broadcast(tokens, src=0, group=self._group))
            self._pos = start + len(ids)
            return self._collective(lambda: self.forward(tokens.to(self.device), start, last_only=last_only)).cpu()

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
                               "(call shardsmith.runtime.layers.parallel.init_distributed first)")
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeLoadError(f"launched as rank {rank} of {world_size} but the process group is rank "
                               f"{dist.get_rank()} of {dist.get_world_size()}")
    return dist.new_group(backend="gloo", timeout=timedelta(days=30))


def _gather_errors(error: BaseException | None, rank: int, world_size: int, group: object | None,
                   timeout_s: float) -> list[str]:
    """Every rank's load error, one line each (empty when all loaded); collective."""
    mine = None if error is None else f"rank {rank}: {type(error).__name__}: {error}"
    if world_size == 1:
        return [mine] if mine else []
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        everyone: list[str | None] = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:
        raise RankLostError(f"rank {rank}: a rank did not finish loading ({str(e).splitlines()[0][:300]})"
                            + (f"; this rank's own error: {mine}" if mine else "")) from error or e
    return [m for m in everyone if m]


def _eos_ids(root: Path, config: dict) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (else ``config.json``), as a tuple."""
    eos = config.get("eos_token_id")
    try:
        eos = json.loads((root / "generation_config.json").read_text()).get("eos_token_id", eos)
    except (OSError, ValueError):
        pass
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
