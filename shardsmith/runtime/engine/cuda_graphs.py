"""Piecewise CUDA graphs for decode steps: the static-shape pieces of a step, captured once, replayed.

A decode step (one new token) is hundreds of small kernels; launched one by one from Python, the
host is the bottleneck (RESULTS.md, 2xH200: a 2-layer DeepSeek-V4 step took 9-14 ms eagerly and
3-4 ms captured, of which 2.3-3.5 ms is GPU work). The pieces of a step whose shapes do not depend on
the position (norms, projections, hyper-connection mixers, router, resident experts, shared expert,
their all-reduces, the embedding and the head) are captured as CUDA graphs and replayed with one
launch each; what grows with the sequence (the attention core over the KV cache or window and
compressed entries) and what needs the host (reading routed expert ids to place offloaded experts
in cache slots, or to run experts that are not gathered on the device) runs eagerly between them,
as in vLLM's piecewise graphs. Collectives inside a piece are captured too (NCCL supports stream
capture), so every rank must capture and replay the same pieces in the same order: they do,
because every rank runs the same step with the same (replicated) routing.

Semantics of :class:`GraphedPiece` (the contract the model relies on, identical on CPU where
nothing is captured):

* the first call copies its inputs into static buffers, runs the piece once eagerly (warm-up:
  ``torch.compile``, cuBLAS handles, NCCL communicators), captures it and replays it; an input that
  is another piece's static output is not copied but read where it is (piece B reads piece A's
  output in place: A rewrites it only at its next call, after B has run);
* later calls copy the inputs into the static buffers (none for adopted inputs) and replay;
* the returned tensors are the piece's static outputs: the **next call of the same piece
  overwrites them**, so a caller must be done with them (or copy them) by then. On CPU the piece
  runs eagerly and its results are copied into static outputs, so the same misuse shows up in CPU
  tests.

All pieces of one model share one memory pool; captures happen in execution order during the first
graphed step, and replays follow the same order (PyTorch's rule for sharing a pool between graphs:
``torch.cuda.graph`` documentation, "sharing memory across captures").

:class:`DecodeGraphs` drives any model that exposes its step as pieces (every family does; the model
files know nothing of graphs, only of the pieces). The model gives ``decode_layers``,
``decode_step(ids [B], starts, slots, real)`` (a model with ``SUPPORTS_BATCHING``: row b is slot
``slots[b]``'s token at ``starts[b]``, rows ``>= real`` padding; otherwise ``decode_step(ids [1],
start)``; it checks and advances the model's own state and returns an opaque per-step context its
layers read), ``embed_ids(ids) -> (h,)`` and ``logits(h) -> (logits,)``; each layer (B rows):

=================================  ======  ====================================================
layer member                       run     what
=================================  ======  ====================================================
``experts``                        -       its :class:`~shardsmith.runtime.layers.experts.RoutedExperts`, or None (dense)
``attn_in_args(step)``             eager   extra tensor inputs of ``attn_in`` (RoPE at each row's position)
``attn_in(h, *args) -> a``         graph   norms, projections (and mixers) before the attention core
``attn_core(a, step) -> mid``      eager   what grows with the sequence (each row's own slot's state)
``ffn_block(h, *mid) -> (h,)``     graph   everything after the core, experts included
``ffn_in(h, *mid)``                graph   up to the router: ``(*carry, x, index, weight)``
``ffn_out(*carry, x, weight, r)``  graph   the rest, given the routed partial ``r [T, D]``
=================================  ======  ====================================================

A model with a **static decode core** (``STATIC_DECODE``: DeepSeek-V4) computes its core with no
host sync and shapes fixed by the step's rows ``B`` and a length bucket ``step.key`` (its
``decode_step`` returns ``key`` and ``tensors``, the device inputs of the step; ``step_rows(*tensors,
key)`` builds the rows' derived tensors on the device and ``rows_from_tuple`` rebuilds them from
``rows.as_tuple()``; each layer has ``attn_static(h, ids, rows) -> mid``). Its step is then captured
per ``(B, key)``: as **one graph** when every layer's experts are sync-free (nothing runs eagerly
between embedding and head), else as per-layer ``attn`` pieces (mixer, projections and core) around
the experts that need the host (:class:`StaticBucketPieces`). The core writes its slots' state, so
those pieces are *stateful*: they run exactly once per call (:class:`GraphedPiece`).

Between ``ffn_in`` and ``ffn_out``, ``experts.decode_slots(x, index, weight)`` (eager) answers
``(slots, None)``: the ``ffn_slots`` piece applies them and runs ``ffn_out`` (one graph);
``(None, r)``: ``ffn_out`` over ``r``; or ``(slots, pending)``, a split step (offloaded ``hybrid``:
the host computes some pairs meanwhile): the ``ffn_gpu`` piece applies the GPU's pairs from their
slots (``apply_slots(..., masked=True)``, device only), then ``pending.add_to`` waits for the host
and adds its partial (copied up asynchronously), and ``ffn_out`` runs over the sum.

Source: PyTorch CUDA graphs notes (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from shardsmith import settings
from shardsmith.runtime.layers.fused import compiles

Tensors = tuple[torch.Tensor, ...]


class GraphPool:
    """The memory pool and capture stream shared by a model's pieces (one per model and device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capture = device.type == "cuda"
        self.handle = torch.cuda.graph_pool_handle() if self.capture else None
        self.stream = torch.cuda.Stream(device) if self.capture else None
        self.pieces = 0
        self.replays = 0
        self.static: set[int] = set()  # data_ptr of every piece's static outputs (stable across steps)


class GraphedPiece:
    """One static-shape piece ``fn(*inputs) -> tuple of tensors``, captured on first use.

    Args:
        fn: the piece; its inputs and outputs are tensors whose shapes are fixed for this piece
            (one piece per layer and role; a different shape needs a different piece).
        pool: the model's :class:`GraphPool`.
        name: for errors (``layers.3.ffn``).
        stateful: ``fn`` also writes state outside its outputs (a decode core appending to its slots'
            caches), so it must run exactly once per call: the first call's warm-up run is the step
            itself (its outputs are copied into the captured static outputs) and the new graph is
            first replayed at the next call. A pure piece (the default) replays at once.

    Raises:
        ValueError: a later call's input shapes or dtypes differ from the captured ones, or an input
            read in place from another piece comes from elsewhere.
    """

    def __init__(self, fn: Callable[..., Tensors], pool: GraphPool, name: str, *, stateful: bool = False) -> None:
        self.fn, self.pool, self.name, self.stateful = fn, pool, name, stateful
        self.inputs: list[torch.Tensor] | None = None
        self.adopted: list[bool] = []  # inputs read in place from another piece's static output
        self.outputs: Tensors = ()
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, *inputs: torch.Tensor) -> Tensors:
        if self.inputs is None:
            # another piece's static output is read in place (its address never changes); the rest is copied
            adopted = [x.data_ptr() in self.pool.static for x in inputs]
            static = [x if adopt else x.clone() for x, adopt in zip(inputs, adopted)]
            if self.pool.capture:
                self.outputs, self.graph, warm = self._capture(static)
            else:
                self.outputs = warm = tuple(y.clone() for y in self.fn(*static))
            self.inputs, self.adopted = static, adopted  # only once captured: a failed capture retries
            self.pool.static.update(y.data_ptr() for y in self.outputs)
            if self.graph is None:
                return self.outputs
            if self.stateful:  # the warm-up run was this call's step: keep its results, replay from the next call
                for out, y in zip(self.outputs, warm):
                    out.copy_(y)
                return self.outputs
        else:
            self._load(inputs)
        if self.graph is not None:
            self.graph.replay()
            self.pool.replays += 1
        else:  # CPU: eager into the static outputs, so outputs are overwritten as on the GPU
            for out, y in zip(self.outputs, self.fn(*self.inputs)):
                out.copy_(y)
        return self.outputs

    def _load(self, inputs: Sequence[torch.Tensor]) -> None:
        if len(inputs) != len(self.inputs):
            raise ValueError(f"graphed piece {self.name}: {len(inputs)} inputs, captured with {len(self.inputs)}")
        for i, (static, x) in enumerate(zip(self.inputs, inputs)):
            if x.shape != static.shape or x.dtype != static.dtype:
                raise ValueError(f"graphed piece {self.name}: input {i} is {tuple(x.shape)} {x.dtype}, "
                                 f"captured as {tuple(static.shape)} {static.dtype}")
            if x.data_ptr() == static.data_ptr():
                continue
            if self.adopted[i]:  # copying would overwrite the piece that owns the buffer
                raise ValueError(f"graphed piece {self.name}: input {i} was another piece's output when "
                                 "captured and is a different tensor now")
            static.copy_(x)

    def _capture(self, inputs: list[torch.Tensor]) -> tuple[Tensors, torch.cuda.CUDAGraph, Tensors]:
        """Warm up (one real run), capture; ``(static outputs, graph, the warm-up run's outputs)``."""
        side = self.pool.stream
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(side):
            warm = tuple(self.fn(*inputs))  # warm-up: compiles, allocates handles, initialises communicators
        torch.cuda.current_stream(self.pool.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's unrelated CUDA call (a /metrics scrape resolving copy events)
        # must not invalidate this capture; this thread's own unsafe calls still fail it
        with torch.cuda.graph(graph, pool=self.pool.handle, stream=side, capture_error_mode="thread_local"):
            outputs = tuple(self.fn(*inputs))
        self.pool.pieces += 1
        return outputs, graph, warm




def compiled(fn: Callable[..., Tensors]) -> Callable[..., Tensors]:
    """``fn`` (a layer's row-wise piece: norms, projections, mixers, router) fused by ``torch.compile``
    on CUDA (``SHARDSMITH_KERNELS=compile_pieces=reference`` turns it off; ``=kernel`` turns it on for the CPU
    too, as inductor's C++ code), else ``fn``: one compiled function per
    method, shared by every layer (dynamo lifts a module's tensors to inputs, so layers of one kind
    and batch bucket share a compiled graph; the Triton kernels inside are traced as user kernels;
    ``SHARDSMITH_TUNING=compile_rows=dynamic``: every bucket past one row shares one, the row count symbolic).
    The pieces' compile happens in their warm-up run, before capture (the server's warm-up: ~65 s
    more on a cold inductor cache for a V4-Flash-shaped model on an H200; the step ran 1.4x faster
    at one row and 1.5x at eight, ``benchmarks/RESULTS.md``)."""
    if not compiles():
        return fn
    from torch import _dynamo as dynamo  # (``import torch._dynamo`` here would make ``torch`` a local name)

    dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 512)
    dynamo.config.accumulated_cache_size_limit = max(dynamo.config.accumulated_cache_size_limit, 4096)
    owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "")
    cache = _COMPILED.setdefault(type(owner), {}) if owner is not None else {}
    static = settings.current().compile_rows is settings.CompileRows.STATIC
    if name not in cache:
        cache[name] = torch.compile(getattr(type(owner), name) if owner is not None else fn,
                                    dynamic=False if static else None)
    run = cache[name] if static else functools.partial(_rows_symbolic, cache[name])
    return functools.partial(run, owner) if owner is not None else run


def _rows_symbolic(fn: Callable[..., Tensors], *args: Any) -> Tensors:
    """``fn(*args)`` with the leading (row) dim of every tensor argument of more than one row marked
    dynamic, so the first bucket past one row compiles ``fn`` with the row count symbolic and every
    larger bucket reuses that graph (a one-row bucket keeps its own: dynamo specialises size 1)."""
    from torch import _dynamo as dynamo

    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] > 1:
            dynamo.maybe_mark_dynamic(a, 0)
    return fn(*args)


_COMPILED: dict[type, dict[str, Callable[..., Tensors]]] = {}


def layer_pieces(layer: Any, pool: GraphPool, index: int, *, whole: bool, tag: str = "") -> dict[str, GraphedPiece]:
    """A decoder layer's pieces around its attention core: ``attn_in`` and either ``ffn`` (everything
    after the core in one graph, ``whole``) or ``ffn_in`` and ``ffn_out`` (experts run eagerly between).

    ``layer`` has the methods of those names (the module table); ``tag`` marks a bucket's pieces in errors.
    """
    pieces = {"attn_in": GraphedPiece(compiled(layer.attn_in), pool, f"layers.{index}.attn_in{tag}")}
    names = ("ffn_block",) if whole else ("ffn_in", "ffn_out")
    for name in names:
        key = "ffn" if name == "ffn_block" else name
        pieces[key] = GraphedPiece(compiled(getattr(layer, name)), pool, f"layers.{index}.{key}{tag}")
    return pieces


def buckets_for(max_num_seqs: int) -> tuple[int, ...]:
    """Batch buckets for decode steps of up to ``max_num_seqs`` rows: 1, 2, 4, 8, ... and ``max_num_seqs``.

    >>> buckets_for(6)
    (1, 2, 4, 6)
    """
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return tuple(out + [max(1, max_num_seqs)])


def _sync_free(experts: Any, rows: int) -> bool:
    """Whether ``rows`` tokens run ``experts`` with no host sync (so the whole ffn can be one piece)."""
    if experts is None:
        return True
    if rows == 1:
        return experts.decode_sync_free()
    check = getattr(experts, "sync_free", None)  # the resident ExpertBank (and in-place offload) know per row count
    return bool(check and check(rows, getattr(experts, "top_k", None)))


class BucketPieces:
    """One batch bucket's pieces: ``embed``, ``head`` and per layer :func:`layer_pieces`, for ``rows`` rows."""

    def __init__(self, model: Any, pool: GraphPool, rows: int) -> None:
        tag = "" if rows == 1 else f"[B={rows}]"
        self.rows, self.whole = rows, None
        self.embed = GraphedPiece(model.embed_ids, pool, "embed" + tag)
        self.head = GraphedPiece(model.logits, pool, "head" + tag)
        self.layers = [layer_pieces(layer, pool, i, whole=_sync_free(layer.experts, rows), tag=tag)
                       for i, layer in enumerate(model.decode_layers)]
        self.outputs: dict[int, torch.Tensor] = {}  # split layer -> its output's one buffer


class StaticBucketPieces:
    """The pieces of a model with a static decode core (``STATIC_DECODE``) for ``rows`` rows and length
    bucket ``key`` (the step's shapes depend on both).

    When every layer's experts run with no host sync for ``rows`` rows, the whole step (embedding,
    every layer's attention and core and ffn, the head) is **one** stateful piece, ``whole``:
    ``(ids [B], *step.tensors) -> (logits [B, V],)``. Otherwise ``step_in`` (embedding and the step's
    rows: ``(h, ids, *rows)``) and per layer a stateful ``attn`` piece (mixer, norm, projections and
    the core: :meth:`attn_static`) followed by ``ffn`` or ``ffn_in``/``ffn_out`` as in :class:`BucketPieces`.
    """

    def __init__(self, model: Any, pool: GraphPool, rows: int, key: int) -> None:
        tag = f"[B={rows},L={key}]"
        self.rows, self.key, self.model = rows, key, model
        layers = list(model.decode_layers)
        self.whole = None
        self.layers: list[dict[str, GraphedPiece]] = []
        if all(_sync_free(layer.experts, rows) for layer in layers):
            self.whole = GraphedPiece(self._whole, pool, "step" + tag, stateful=True)
        else:
            self.step_in = GraphedPiece(self._step_in, pool, "step_in" + tag)
            self.head = GraphedPiece(model.logits, pool, "head" + tag)
            for i, layer in enumerate(layers):
                pieces = {"attn": GraphedPiece(self._attn(layer), pool, f"layers.{i}.attn{tag}", stateful=True)}
                pieces.update({k: v for k, v in layer_pieces(layer, pool, i, whole=_sync_free(layer.experts, rows),
                                                            tag=tag).items() if k != "attn_in"})
                self.layers.append(pieces)
        self.outputs: dict[int, torch.Tensor] = {}

    def _whole(self, ids: torch.Tensor, *tensors: torch.Tensor) -> Tensors:
        model = self.model
        rows = model.step_rows(*tensors, self.key)
        (h,) = model.embed_ids(ids)
        for layer in model.decode_layers:
            a = compiled(layer.attn_in)(h, *rows.rope(layer.attn.table))
            (h,) = compiled(layer.ffn_block)(h, *layer.attn_core_rows(a, ids, rows))
        return model.logits(h)

    def _step_in(self, ids: torch.Tensor, *tensors: torch.Tensor) -> Tensors:
        (h,) = self.model.embed_ids(ids)
        return (h, ids.clone(), *self.model.step_rows(*tensors, self.key).as_tuple())

    def _attn(self, layer: Any) -> Callable[..., Tensors]:
        model, key = self.model, self.key

        def attn(h: torch.Tensor, ids: torch.Tensor, *tensors: torch.Tensor) -> Tensors:
            rows = model.rows_from_tuple(tensors, key)
            return layer.attn_core_rows(compiled(layer.attn_in)(h, *rows.rope(layer.attn.table)), ids, rows)

        return attn


class DecodeGraphs:
    """Batched one-token steps of ``model`` as graphed pieces, the attention core (and experts that
    need the host) run eagerly between them; calling it runs longer steps through ``model`` itself.

    Per step: ``embed`` -> per layer [``attn_in`` graph, attention core eager, ``ffn`` graph] ->
    ``head`` graph. A layer whose experts are not sync-free for the bucket's rows (offloaded, FP8
    banks, dense experts past the gather budget or more than one row, more pairs than the FP4 batch)
    captures ``ffn_in`` and ``ffn_out`` and runs its experts between them
    (:meth:`RoutedExperts.decode_slots`; a batch's experts are the union over its rows); when those
    experts sit in cache slots (:meth:`RoutedExperts.slot_path`), an ``ffn_slots`` piece applies them
    in the graph (``ffn_out`` over :meth:`RoutedExperts.apply_slots`).

    Batches: a model with ``SUPPORTS_BATCHING`` decodes B sequences at once
    (:meth:`decode`); B is padded to the next bucket of :func:`buckets_for` (``model.max_num_seqs``)
    with copies of row 0, and each bucket has its own :class:`BucketPieces` (captured on its first
    use, all sharing one pool). Other models decode one sequence (B = 1, ``decode_step(ids, start)``).

    Args:
        model: a model with the pieces of the module table; device: where it runs (CPU: nothing is
            captured, every piece runs eagerly through its static buffers, as tests check).
        capture: False runs the pieces eagerly on CUDA too (the engine's batched path under
            ``--enforce-eager``).
    """

    def __init__(self, model: Any, device: torch.device, *, capture: bool = True) -> None:
        self.model, self.pool = model, GraphPool(torch.device(device))
        self.pool.capture = self.pool.capture and capture
        self.batching = bool(getattr(model, "SUPPORTS_BATCHING", False))
        self.static = bool(getattr(model, "STATIC_DECODE", False))
        self.buckets = buckets_for(getattr(model, "max_num_seqs", 1) if self.batching else 1)
        # rows -> BucketPieces; a static-core model: (rows, length bucket) -> StaticBucketPieces
        self.sets: dict[Any, BucketPieces | StaticBucketPieces] = {}
        self.built: set[int] = set()  # buckets (rows) a step has run through: their pieces exist
        self.deferring = False  # choose among built buckets only (defer()): the rest are built on purpose
        self.last_rows = 0  # the bucket the last step ran through
        self.last: BucketPieces | StaticBucketPieces | None = None
        self.programs: dict[Hashable, GraphedPiece] = {}  # program(): a model's other device programs, by key
        if not self.static:
            self.last = self.sets[1] = BucketPieces(model, self.pool, 1)

    @property
    def layers(self) -> list[dict[str, GraphedPiece]]:
        """The per-layer pieces of the last step's bucket (empty when that step was one whole graph)."""
        return self.last.layers if self.last is not None else []

    def __call__(self, ids: torch.Tensor, start: int, *, last_only: bool = True, slot: int = 0) -> torch.Tensor:
        """The model's forward (``ids [T]`` at ``start`` in ``slot`` -> float32 logits), one-token steps graphed."""
        if ids.shape[0] == 1:
            return self.decode(ids, [start], [slot])
        if self.batching:
            return self.model(ids, start, last_only=last_only, slot=slot)
        return self.model(ids, start, last_only=last_only)

    def step(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """One token ``ids [1]`` at position ``start`` (slot 0): float32 logits ``[1, V]`` (a fresh tensor)."""
        return self.decode(ids, [start], [0])

    def bucket(self, rows: int) -> int:
        """The smallest bucket holding ``rows`` rows.

        Raises:
            ValueError: more rows than the largest bucket (``max_num_seqs``).
        """
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"a decode step of {rows} rows exceeds max_num_seqs={self.buckets[-1]}")

    def defer(self) -> None:
        """From now on a step takes the smallest *built* bucket that holds its rows, else runs as steps of the
        largest built one; an unbuilt bucket is built only by a step that names it (``decode(bucket=...)``).
        Every rank must defer alike (the engine's ``WARMUP`` command), so that all choose the same buckets."""
        self.deferring = True

    def reserve(self, rows: int) -> None:
        """Batch buckets up to ``rows`` rows (more than ``max_num_seqs``: speculative verify runs), the
        new ones built like the others (deferred ones pending)."""
        if rows > self.buckets[-1]:
            self.buckets = buckets_for(rows)

    def program(self, key: Hashable, fn: Callable[..., Tensors], *inputs: torch.Tensor) -> Tensors:
        """Run ``fn(*inputs)``, a model's stateful device-only program of static shapes for ``key``
        (DeepSeek-V4's verify-run rollback), as one :class:`GraphedPiece` per key: on CUDA its first
        call runs it and captures it, later calls copy ``inputs`` into the captured ones and replay
        (one launch instead of hundreds); elsewhere it runs eagerly through the same static inputs.
        ``fn`` is the first call's for its key: a later call's must do the same work."""
        piece = self.programs.get(key)
        if piece is None:
            piece = self.programs[key] = GraphedPiece(fn, self.pool, f"program {key}", stateful=True)
        return piece(*inputs)

    def forget(self) -> None:
        """Drop every built bucket's pieces (the model's state was allocated anew: captured graphs point
        at the old tensors); each bucket is built again by its next step, as at start."""
        self.sets.clear()
        self.built.clear()
        self.programs.clear()
        self.last = None
        if not self.static:
            self.last = self.sets[1] = BucketPieces(self.model, self.pool, 1)

    def pending(self) -> list[int]:
        """Buckets not built yet."""
        return [b for b in self.buckets if b not in self.built]

    def pending_lengths(self) -> list[tuple[int, int]]:
        """A static-core model's ``(rows, length bucket)`` pieces not built yet for the batch buckets built,
        shortest length first, then fewest rows (empty for other models)."""
        if not self.static:
            return []
        return [(rows, key) for key in self.model.length_buckets() for rows in self.buckets
                if rows in self.built and (rows, key) not in self.sets]

    @torch.inference_mode()
    def build_length(self, rows: int, key: int) -> None:
        """Build a static-core model's ``(rows, key)`` pieces with a step of padding rows alone
        (:meth:`build_step`: no sequence's state changes; its logits are dropped).

        Raises:
            ValueError: a model without a static core, or ``rows`` not a bucket.
        """
        if not self.static or rows not in self.buckets:
            raise ValueError(f"build_length: {type(self.model).__name__} (STATIC_DECODE={self.static}) and rows={rows} "
                             f"(buckets {self.buckets})")
        step = self.model.build_step(rows, key, self.pool.device)
        self._decode_static(step.ids, step, rows)

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, starts: list[int], slots: list[int], *, bucket: int | None = None) -> torch.Tensor:
        """B sequences one token each: row b is slot ``slots[b]``'s token ``ids[b]`` at ``starts[b]``.

        Args:
            ids: ``[B]`` int64 on the model's device; starts, slots: B ints each.
            bucket: run through this bucket (padded to it), building it if needed; default: the
                smallest bucket that holds B rows (while deferring, the smallest built one, else
                ``ceil(B / largest built)`` steps of the largest built one; a step with a verify run,
                a slot in several rows, builds its bucket instead).

        Returns:
            float32 logits ``[B, V]`` (a fresh tensor).

        Raises:
            ValueError: B above the largest bucket or above ``bucket``, ``bucket`` not a bucket, or B > 1
                for a model without ``SUPPORTS_BATCHING``.
        """
        n = ids.shape[0]
        if n > 1 and not self.batching:
            raise ValueError(f"{type(self.model).__name__} decodes one sequence per step (no SUPPORTS_BATCHING); got {n}")
        if bucket is not None:
            if bucket not in self.buckets or bucket < n:
                raise ValueError(f"bucket {bucket} cannot run {n} rows (buckets {self.buckets})")
            rows = bucket
        else:
            rows = self.bucket(n)
            if self.deferring and rows not in self.built and self.built:
                usable = [b for b in sorted(self.built) if b >= n]
                if not usable and len(set(slots)) < n:  # a verify run cannot be split: build its bucket now
                    usable = [rows]
                if not usable:  # split over the largest built bucket: each part is an ordinary step
                    part = max(self.built)
                    return torch.cat([self.decode(ids[i:i + part], starts[i:i + part], slots[i:i + part])
                                      for i in range(0, n, part)])
                rows = usable[0]
        self.built.add(rows)
        self.last_rows = rows
        if rows > n:  # padding rows: copies of row 0 (the model leaves their state alone)
            ids = torch.cat([ids, ids[:1].expand(rows - n)])
            starts, slots = list(starts) + [starts[0]] * (rows - n), list(slots) + [slots[0]] * (rows - n)
        if self.batching:
            step = self.model.decode_step(ids, list(starts), list(slots), real=n)
        else:
            step = self.model.decode_step(ids, starts[0])
        if self.static:
            return self._decode_static(ids, step, rows)[:n].clone()
        pieces = self.sets.get(rows) or self.sets.setdefault(rows, BucketPieces(self.model, self.pool, rows))
        self.last = pieces
        (h,) = pieces.embed(ids)
        for i, (layer, lp) in enumerate(zip(self.model.decode_layers, pieces.layers)):
            a = lp["attn_in"](h, *layer.attn_in_args(step))
            mid = layer.attn_core(a, step)  # eager: the KV cache / window / compressor state grows
            if "ffn" in lp:
                (h,) = lp["ffn"](h, *mid)
            else:
                h = self._ffn_split(i, layer, lp, h, mid, pieces)
        return pieces.head(h)[0][:n].clone()  # the static output is overwritten by the next step

    def _decode_static(self, ids: torch.Tensor, step: Any, rows: int) -> torch.Tensor:
        """A static-core model's step (:class:`StaticBucketPieces`): the whole step as one graph, or
        the core captured per layer with the experts that need the host run between pieces."""
        key = (rows, step.key)
        pieces = self.sets.get(key) or self.sets.setdefault(key, StaticBucketPieces(self.model, self.pool, *key))
        self.last = pieces
        if pieces.whole is not None:
            return pieces.whole(ids, *step.tensors)[0]
        h, ids_s, *rows_t = pieces.step_in(ids, *step.tensors)
        for i, (layer, lp) in enumerate(zip(self.model.decode_layers, pieces.layers)):
            mid = lp["attn"](h, ids_s, *rows_t)
            if "ffn" in lp:
                (h,) = lp["ffn"](h, *mid)
            else:
                h = self._ffn_split(i, layer, lp, h, mid, pieces)
        return pieces.head(h)[0]

    def _ffn_split(self, i: int, layer: Any, pieces: dict[str, GraphedPiece], h: torch.Tensor,
                   mid: tuple[torch.Tensor, ...], bucket: BucketPieces) -> torch.Tensor:
        """Everything after the attention core of a layer whose experts run between two pieces."""
        *carry, x, index, weight = pieces["ffn_in"](h, *mid)
        experts = layer.experts
        slots, routed = experts.decode_slots(x, index, weight)  # host: ids, slot table, miss copies
        tag = "" if bucket.rows == 1 else f"[B={bucket.rows}]"
        if experts.slot_path() and "ffn_slots" not in pieces:
            pieces["ffn_slots"] = GraphedPiece(_slots_piece(layer), self.pool, f"layers.{i}.ffn_slots{tag}")
        if experts.may_split() and "ffn_gpu" not in pieces:
            pieces["ffn_gpu"] = GraphedPiece(_slots_piece(layer, masked=True), self.pool, f"layers.{i}.ffn_gpu{tag}")
        if slots is not None and routed is not None:  # split: GPU pairs captured, the host's share added after
            (gpu,) = pieces["ffn_gpu"](x, weight, slots)
            (h,) = pieces["ffn_out"](*carry, x, weight, routed.add_to(gpu))
        elif slots is not None:  # every expert in a slot: the experts are captured too
            (h,) = pieces["ffn_slots"](*carry, x, weight, slots)
        else:
            (h,) = pieces["ffn_out"](*carry, x, weight, routed)
        # capture the other pieces now too, on dummy experts (slot 0, zeros; its result is discarded), so
        # that no capture happens later in the middle of serving; every rank takes the same path here
        for name in ("ffn_slots", "ffn_gpu"):
            if name in pieces and pieces[name].inputs is None:
                dummy = torch.zeros(weight.numel(), dtype=torch.int64, device=x.device)
                pieces[name](*(() if name == "ffn_gpu" else carry), x, weight, dummy)
        if pieces["ffn_out"].inputs is None:
            pieces["ffn_out"](*carry, x, weight, torch.zeros_like(x))
        # one address for the layer's output whichever piece made it: the next pieces read it in place
        out = bucket.outputs.setdefault(i, h)
        return h if h is out else out.copy_(h)


def _slots_piece(layer: Any, *, masked: bool = False) -> Callable[..., Tensors]:
    """``ffn_slots(*carry, x, weight, slots)``: the layer's ``ffn_out`` over its experts applied from
    their cache slots (device work only, so it is captured); ``masked``: ``ffn_gpu(x, weight, slots)``,
    a split step's GPU partial alone (``ffn_out`` follows once the host's share is added)."""

    def ffn_slots(*inputs: torch.Tensor) -> Tensors:
        *carry, x, weight, slots = inputs
        return layer.ffn_out(*carry, x, weight, layer.experts.apply_slots(x, weight, slots))

    def ffn_gpu(x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor) -> Tensors:
        return (layer.experts.apply_slots(x, weight, slots, masked=True),)

    return ffn_gpu if masked else ffn_slots
