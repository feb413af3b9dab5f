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
:class:`~shardsmith.runtime.layers.parallel.Shards`; this file knows nothing about ranks. One sequence at a
time (batch 1); the state (sliding windows, compressor buffers and entries) continues from the
last position, so a step must start at 0 (a new sequence) or where the previous one ended.
Source of the maths: transformers ``modeling_deepseek_v4.py`` (``DeepseekV4Model``).

Legend: T = new tokens, m = hyper-connection streams, D = hidden, V = vocabulary.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

from shardsmith.errors import UsageError
from shardsmith.runtime.engine.cuda_graphs import GraphedPiece, GraphPool, layer_pieces
from shardsmith.runtime.models.mixtral.model import install_buffers
from shardsmith.runtime.layers.parallel import Shards, all_reduce
from shardsmith.runtime.models.deepseek_v4.attention import Attention
from shardsmith.runtime.models.deepseek_v4.config import V4Args
from shardsmith.runtime.models.deepseek_v4.hyper import HyperHead, HyperMixer, expand
from shardsmith.runtime.layers.experts import ExpertBank, expand_pairs, routed_pairs
from shardsmith.runtime.models.deepseek_v4.moe import MoE
from shardsmith.runtime.models.deepseek_v4.ops import RMSNorm, inv_freq, rope_cos_sin
from shardsmith.runtime.layers.quant import ue8m0_to_float

_HC = re.compile(r"(^|\.)hc_(attn|ffn|head)_(fn|base|scale)$")


class Block(nn.Module):
    """Decoder layer N: ``hc_attn`` -> attention -> ``hc_ffn`` -> MoE, on ``m`` residual streams."""

    def __init__(self, args: V4Args, shards: Shards, i: int, freqs: dict[str, torch.Tensor]) -> None:
        super().__init__()
        prefix = f"layers.{i}"
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, shards, prefix + ".attn", i, freqs_main=freqs["main"],
                              freqs_compress=freqs["compress"])
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn = MoE(args, shards, prefix, i)
        self.hc_attn = HyperMixer(args.dim, args.hc_mult, args.hc_iters, args.hc_eps, args.norm_eps)
        self.hc_ffn = HyperMixer(args.dim, args.hc_mult, args.hc_iters, args.hc_eps, args.norm_eps)

    def forward(self, streams: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:  # [T, m, D]
        x, post, comb = self.hc_attn(streams)
        streams = expand(streams, self.attn(self.attn_norm(x), start), post, comb)
        x, post, comb = self.hc_ffn(streams)
        return expand(streams, self.ffn(self.ffn_norm(x), ids), post, comb)

    # The same layer as pieces around its attention, for the graphed decode (each piece a CUDA graph):
    # the same kernels in the same order as forward, so the same bits.

    def attn_in(self, streams: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Mixer, norm and attention projections: ``(x [T, D], q [T, n, d], kv [T, d], q_lora, post, comb)``.

        ``cos``/``sin`` ``[T, r/2]``: this layer's RoPE at the new positions.
        """
        x, post, comb = self.hc_attn(streams)
        x = self.attn_norm(x)
        return (x, *self.attn.project(x, cos, sin), post, comb)

    def ffn_in(self, streams: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               post: torch.Tensor, comb: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Attention output projection onto the streams, then the MoE's input, routing and shared partial.

        Args:
            attn: the attention core's ``[T, n, d]``. Returns ``(streams [T, m, D], x [T, D],
            index [T, K], weight [T, K], shared [T, D], post, comb)``.
        """
        streams = expand(streams, self.attn.output(attn, cos, sin), post, comb)
        x, post, comb = self.hc_ffn(streams)
        x = self.ffn_norm(x)
        index, weight = self.ffn.route(x, ids)
        return streams, x, index, weight, self.ffn.shared(x), post, comb

    def ffn_out(self, streams: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> tuple[torch.Tensor]:
        """The layer's one all-reduce (routed + shared partials) spread onto the streams: ``([T, m, D],)``."""
        return (expand(streams, all_reduce(routed + shared), post, comb),)

    def ffn_slots(self, streams: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                  shared: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
                  pool: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """:meth:`ffn_out` after applying offloaded experts already in the expert cache's slots.

        Args:
            slots: ``[P = T*K]`` the slot of each (token, expert) pair, token-major; pool: the
                cache's arrays ``[S, ...]`` (packed FP4, as the resident bank's). The resident
                bank's pair maths (:func:`expand_pairs`, :func:`apply_pairs`, :func:`combine_pairs`):
                the same bits.
        """
        gate_up, down = expand_pairs({name: p[slots] for name, p in pool.items()}, x.dtype)
        return self.ffn_out(streams, routed_pairs(gate_up, down, x, weight, self.ffn.limit), shared, post, comb)

    def ffn_block(self, streams: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  post: torch.Tensor, comb: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor]:
        """:meth:`ffn_in`, the routed experts, :meth:`ffn_out`: everything after the attention core."""
        streams, x, index, weight, shared, post, comb = self.ffn_in(streams, attn, cos, sin, post, comb, ids)
        return self.ffn_out(streams, self.ffn.experts(x, index, weight), shared, post, comb)


class DeepseekV4(nn.Module):
    """DeepSeek-V4 on one rank: vocab-parallel ``embed``, blocks, ``hc_head``, ``norm``, vocab-parallel ``head``.

    Args:
        args: configuration; shards: the rank's plan and compute dtype.

    Raises:
        RuntimeLoadError: the plan lacks a tensor the config needs (named).
    """

    def __init__(self, args: V4Args, shards: Shards) -> None:
        super().__init__()
        self.args = args
        freqs = {"main": inv_freq(args.rope_dim, args.rope_theta),
                 "compress": inv_freq(args.rope_dim, args.compress_theta, args.yarn)}
        self.embed = shards.embedding("embed.weight")
        self.layers = nn.ModuleList(Block(args, shards, i, freqs) for i in range(args.n_layers))
        self.hc_head = HyperHead(args.dim, args.hc_mult, args.hc_eps, args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = shards.lm_head("head.weight")
        self.pos, self.max_seq_len = 0, 0
        self.graphs: DecodeGraphs | None = None  # one-token steps as piecewise CUDA graphs (use_decode_graphs)

    @classmethod
    def from_weights(cls, weights, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                     max_seq_len: int = 4096) -> "DeepseekV4":
        """Build rank ``weights.rank``'s model from its weights (``config``, ``plan``, ``dense()``, ``banks()``).

        Raises:
            RuntimeLoadError: unsupported config, or missing/unexpected/mis-shaped tensors (all listed).
        """
        config = weights.config
        block = tuple((config.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
        model = cls(V4Args.from_config(config), Shards(weights.plan, weights.rank, dtype, block))
        assign_weights(model, weights.dense(), weights.banks(), device=torch.device(device))
        model.setup_cache(max_seq_len, torch.device(device), dtype)
        return model

    def setup_cache(self, max_seq_len: int, device: torch.device, dtype: torch.dtype) -> None:
        """Bound sequences to ``max_seq_len`` positions, move RoPE tables to ``device``, reset state."""
        self.max_seq_len = max_seq_len
        for mod in self.modules():
            if isinstance(getattr(mod, "freqs", None), torch.Tensor):
                mod.freqs = mod.freqs.to(device)
        self.reset()

    def reset(self) -> None:
        """Start a new sequence (position 0)."""
        self.pos = 0
        for layer in self.layers:
            layer.attn.reset()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, *, last_only: bool = True) -> torch.Tensor:
        """Run ``ids`` ``[T]`` at positions ``[start, start + T)``; float32 logits ``[T or 1, V]``.

        Raises:
            UsageError: ``start`` is neither 0 nor the end of the previous step (the compressor
                state cannot rewind), or the sequence would pass ``max_seq_len``.
        """
        T = ids.shape[0]
        if start == 0:
            self.reset()
        elif start != self.pos:
            raise UsageError(f"DeepSeek-V4 continues a sequence where it ended (position {self.pos}); "
                             f"got start={start} (its compressor state cannot rewind: restart at 0)")
        if self.max_seq_len and start + T > self.max_seq_len:
            raise UsageError(f"{start + T} positions exceed max_seq_len={self.max_seq_len}")
        if T == 1 and self.graphs is not None:
            logits = self.graphs.step(ids, start)
            self.pos = start + T
            return logits
        (streams,) = self.embed_streams(ids)
        for layer in self.layers:
            streams = layer(streams, ids, start)
        self.pos = start + T
        return self.logits(streams[-1:] if last_only else streams)[0]  # [T or 1, V]

    def embed_streams(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        """Token ids ``[T]`` -> ``([T, m, D],)``: the vocab-parallel embedding copied to every stream."""
        x = self.embed(ids)  # [T, D]
        return (x[:, None, :].expand(ids.shape[0], self.args.hc_mult, x.shape[-1]).contiguous(),)

    def logits(self, streams: torch.Tensor) -> tuple[torch.Tensor]:
        """Streams ``[T, m, D]`` -> ``([T, V] float32,)``: head mixer, final norm, vocab-parallel head."""
        return (self.head(self.norm(self.hc_head(streams))),)

    def use_decode_graphs(self, device: torch.device | str) -> None:
        """Run one-token steps as piecewise CUDA graphs (:mod:`~shardsmith.runtime.engine.cuda_graphs`).

        On a CPU device nothing is captured: the same pieces run eagerly through static buffers
        (what tests check against the plain forward). Call after the weights and offload are in place.
        """
        self.graphs = DecodeGraphs(self, torch.device(device))


class DecodeGraphs:
    """A DeepSeek-V4 one-token step as graphed pieces with the attention (and offloaded experts) between.

    Per step: ``embed`` -> per layer [``attn_in`` graph (mixer, norm, attention projections),
    attention core eager (window, compressor, indexer, softmax), ``ffn`` graph (output projection
    and its all-reduce, mixer, MoE)] -> ``head`` graph. A layer whose routed experts are resident
    and sync-free for one token (the bank's batched pair path, ``ExpertBank.decode_sync_free``) captures
    routing, experts, shared expert and the all-reduce in its ``ffn`` graph. An offloaded layer
    captures ``ffn_in`` (through routing), then the host reads the routed ids, updates the slot table
    and copies the misses (:meth:`OffloadRuntime.decode_slots`), and ``ffn_slots`` (the experts on
    their slots, the all-reduce) replays; a step the pair path cannot take (experts on the host,
    more experts than slots) runs its experts eagerly and replays ``ffn_out``.
    """

    def __init__(self, model: DeepseekV4, device: torch.device) -> None:
        self.model, self.pool = model, GraphPool(device)
        self.outputs: dict[int, torch.Tensor] = {}  # offloaded layer -> its output streams' one buffer
        self.embed = GraphedPiece(model.embed_streams, self.pool, "embed")
        self.head = GraphedPiece(model.logits, self.pool, "head")
        self.layers = []
        for i, layer in enumerate(model.layers):
            resident = layer.ffn.experts.decode_sync_free()
            self.layers.append(layer_pieces(layer, self.pool, i, whole=resident))

    def step(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """One token ``ids [1]`` at position ``start``: float32 logits ``[1, V]`` (a fresh tensor)."""
        positions = torch.arange(start, start + 1, device=ids.device)
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # cos, sin per RoPE table (equal per kind)
        (streams,) = self.embed(ids)
        for i, (layer, pieces) in enumerate(zip(self.model.layers, self.layers)):
            attn = layer.attn
            table = "main" if attn.kind == "sliding" else "compress"
            if table not in rope:
                rope[table] = rope_cos_sin(positions, attn.freqs)
            cos, sin = rope[table]
            x, q, kv, q_lora, post, comb = pieces["attn_in"](streams, cos, sin)
            out = attn.core(x, q, kv, q_lora, positions, start)  # eager: window and compressor state
            if "ffn" in pieces:
                (streams,) = pieces["ffn"](streams, out, cos, sin, post, comb, ids)
            else:
                streams = self._ffn_split(i, layer, pieces, streams, out, cos, sin, post, comb, ids)
        return self.head(streams)[0].clone()  # the static output is overwritten by the next step

    def _ffn_split(self, i: int, layer: Block, pieces: dict, streams, out, cos, sin, post, comb, ids) -> torch.Tensor:
        """Everything after the attention core of a layer whose experts run between two pieces."""
        mid, x, index, weight, shared, post, comb = pieces["ffn_in"](streams, out, cos, sin, post, comb, ids)
        runtime = getattr(layer.ffn.experts, "runtime", None)
        slots = routed = None
        if runtime is not None:  # offloaded: host reads the ids, updates the slot table, copies misses
            slots, routed = runtime.decode_slots(layer.ffn.experts.layer, x, index, weight)
            if runtime.cache is not None and "ffn_slots" not in pieces:
                pieces["ffn_slots"] = GraphedPiece(partial(layer.ffn_slots, pool=runtime.cache.pool),
                                                   self.pool, f"layers.{i}.ffn_slots")
        else:  # a resident bank without the sync-free pair path (top_k > BATCHED_PAIRS)
            routed = layer.ffn.experts(x, index, weight)
        if slots is not None:  # every expert in a slot: the experts are captured too
            (streams,) = pieces["ffn_slots"](mid, x, slots, weight, shared, post, comb)
        else:
            (streams,) = pieces["ffn_out"](mid, routed, shared, post, comb)
        # capture the other piece now too, on dummy experts (slot 0, zeros; its result is discarded), so
        # that no capture happens later in the middle of serving; every rank takes the same path here
        if "ffn_slots" in pieces and pieces["ffn_slots"].inputs is None:
            pieces["ffn_slots"](mid, x, torch.zeros(weight.numel(), dtype=torch.int64, device=x.device), weight,
                                shared, post, comb)
        if pieces["ffn_out"].inputs is None:
            pieces["ffn_out"](mid, torch.zeros_like(x), shared, post, comb)
        # one address for the layer's output whichever piece made it: the next pieces read it in place
        out_buf = self.outputs.setdefault(i, streams)
        if streams is not out_buf:
            streams = out_buf.copy_(streams)
        return streams


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
