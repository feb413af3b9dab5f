"""The Mixtral / Qwen3-MoE / Qwen2-MoE decoder, built on ``meta`` and filled from a rank's weights.

Module names mirror the Hugging Face checkpoints (``model.layers.N.self_attn.q_proj.weight``), so
a buffer's name is its source tensor's name and loading is a strict name-for-name assignment
(:func:`assign_weights`). Every layer comes from :class:`~shardsmith.runtime.layers.parallel.Shards`, so
this file knows nothing about ranks beyond its local head counts.

Per-sequence state lives in **slots** (model-side contract): each slot's keys and values sit in
blocks of one KV pool per layer and rank (local KV heads only), taken as its sequence grows and
given back when it is released (:mod:`~shardsmith.runtime.models.kv_blocks`). ``forward`` runs one sequence (a prefill, a prefill chunk or one step) in one slot; the
decode pieces run B sequences, one new token each, every row in its own slot. Sources: transformers ``modeling_mixtral.py`` / ``modeling_qwen3_moe.py``
/ ``modeling_qwen2_moe.py`` for the maths (RMSNorm in float32, rotate-half RoPE, SDPA attention).

Legend: T = new tokens, S = cached positions, D = hidden, H = local query heads, K = local KV
heads, d = head dim, V = vocabulary, N = slots (max_num_seqs), B = rows of a batched decode step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from shardsmith.errors import UsageError
from shardsmith.runtime.layers.experts import RoutedExperts
from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.models.common import MLP, RMSNorm, install_buffers
from shardsmith.runtime.models.kv_blocks import KV_BLOCK_TOKENS, KVBlocks, kv_blocks_for
from shardsmith.runtime.models.mixtral.attention import Attention
from shardsmith.runtime.models.mixtral.config import ModelArgs, rope_tables
from shardsmith.runtime.models.mixtral.moe import SparseMoe
from shardsmith.runtime.models.seq_slots import verify_runs


class DecoderLayer(nn.Module):
    """Pre-norm attention and MoE (or dense MLP) blocks with residuals."""

    def __init__(self, args: ModelArgs, shards: Shards, i: int) -> None:
        super().__init__()
        prefix = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.self_attn = Attention(args, shards, prefix + ".self_attn", args.windows[i])
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.ffn_name = args.moe_prefix if i in args.moe_layers else "mlp"
        ffn_prefix = f"{prefix}.{self.ffn_name}"
        if i in args.moe_layers:
            ffn = SparseMoe(shards, ffn_prefix, prefix, args)
        else:
            ffn = MLP(shards, ffn_prefix, dim=args.dim, inter=args.dense_dim)
        self.add_module(self.ffn_name, ffn)

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, slot: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), start, cos, sin, slot)
        return x + getattr(self, self.ffn_name)(self.post_attention_layernorm(x))

    # The same layer as pieces around the attention core, for a decode step run piece by piece
    # (engine/cuda_graphs.py's table): the same kernels in the same order as forward, so the same bits.

    @property
    def experts(self) -> RoutedExperts | None:
        """The routed experts (None for a dense MLP layer)."""
        ffn = getattr(self, self.ffn_name)
        return ffn.experts if isinstance(ffn, SparseMoe) else None

    def attn_in_args(self, step: "Step") -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, d]``: each row's RoPE at its own position."""
        return step.cos, step.sin

    def attn_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Norm and projections: ``(q, k, v)`` for :meth:`Attention.core`."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attn_core(self, qkv: tuple[torch.Tensor, ...], step: "Step") -> tuple[torch.Tensor]:
        """:meth:`Attention.core` of each real row over its own slot's cache: ``(o [B, H*d],)``.

        Row by row, the kernels of a one-token :meth:`Transformer.forward`, so a row's attention
        output has the bits it has alone. Padding rows (``>= step.real``) write nothing: they get
        copies of row 0's output.
        """
        q, k, v = qkv  # [B, H, d], [B, K, d], [B, K, d]
        rows = [self.self_attn.core(q[b: b + 1], k[b: b + 1], v[b: b + 1], step.starts[b], step.slots[b])
                for b in range(step.real)]  # [1, H*d] each
        rows += rows[:1] * (q.shape[0] - step.real)
        return (rows[0] if len(rows) == 1 else torch.cat(rows),)

    def ffn_block(self, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor]:
        """``o_proj`` and its all-reduce, the residual, then the whole MoE (or MLP) block: ``([T, D],)``."""
        x = x + self.self_attn.o_proj(o)
        return (x + getattr(self, self.ffn_name)(self.post_attention_layernorm(x)),)

    def ffn_in(self, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Up to the router: ``(x [T, D] after attention (the carry), h [T, D] normed (the experts'
        input), index [T, K], weight [T, K])``."""
        x = x + self.self_attn.o_proj(o)
        h = self.post_attention_layernorm(x)
        return (x, h, *getattr(self, self.ffn_name).route(h))

    def ffn_out(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, routed: torch.Tensor) -> tuple[torch.Tensor]:
        """The routed partial (computed between the pieces) plus shared expert, all-reduce, residual
        (``weight``, the routing weights, is part of the common signature and not needed here)."""
        return (x + getattr(self, self.ffn_name).finish(h, routed),)


class Step(NamedTuple):
    """A batched one-token step's context for the layers' pieces.

    Attributes:
        starts, slots: per row (B of them), the position of its token and its sequence's slot;
        real: rows ``[0, real)`` are sequences, the rest padding (copies of row 0);
        cos, sin: ``[B, d]``, each row's RoPE at its position.
    """

    starts: list[int]
    slots: list[int]
    real: int
    cos: torch.Tensor
    sin: torch.Tensor


class Transformer(nn.Module):
    """The causal LM: vocab-parallel embedding, decoder layers, final norm, vocab-parallel LM head.

    Implements the continuous-batching contract (``SUPPORTS_BATCHING``): per-sequence KV caches in
    slots (their blocks in :attr:`kv`), :meth:`forward` in one slot, :meth:`decode_step` and the layers' pieces over B slots.

    Args:
        args: model configuration; shards: this rank's plan and compute dtype.

    Raises:
        RuntimeLoadError: listing every tensor the config needs that the source lacks or shapes
            differently.
    """

    SUPPORTS_BATCHING = True
    VERIFY_RUNS = True  # a decode step may hold a slot's verify run: consecutive positions, in order

    def __init__(self, args: ModelArgs, shards: Shards) -> None:
        super().__init__()
        self.args = args
        self.max_seq_len = self.max_num_seqs = 0
        self.lengths: list[int] = []
        self.kv: KVBlocks | None = None  # the slots' block tables, set by setup_cache
        self.model = nn.Module()
        vocab = (args.vocab_size, args.dim)
        self.model.embed_tokens = shards.embedding("model.embed_tokens.weight", vocab)
        self.model.layers = nn.ModuleList(DecoderLayer(args, shards, i) for i in range(args.n_layers))
        self.model.norm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.lm_head = shards.lm_head("model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight", vocab)
        self.cos = self.sin = None
        shards.raise_problems()

    def setup_cache(self, max_seq_len: int, device: torch.device, dtype: torch.dtype, max_num_seqs: int = 1,
                    kv_cache_tokens: int | None = None, block_size: int = KV_BLOCK_TOKENS) -> None:
        """Allocate the KV cache and the RoPE tables: per layer a pool ``[K, P * B, d]`` of keys and one
        of values, ``P`` blocks of ``B = block_size`` positions, which the ``max_num_seqs`` slots hold
        as their sequences grow (:mod:`~shardsmith.runtime.models.kv_blocks`).

        Args:
            max_seq_len: positions one slot may hold; max_num_seqs: N slots.
            kv_cache_tokens: positions of the pool across all slots, rounded up to whole blocks
                (None: ``max_num_seqs * max_seq_len``, every slot at its longest at once).

        Raises:
            UsageError: ``max_seq_len`` or ``max_num_seqs`` below 1, or a pool smaller than one
                ``max_seq_len`` sequence.
        """
        self.kv = KVBlocks.for_slots(max_seq_len, max_num_seqs, kv_cache_tokens, block_size)
        for layer in self.model.layers:
            attn = layer.self_attn
            shape = (attn.n_kv, self.kv.tokens, self.args.head_dim)
            attn.cache_k = torch.zeros(shape, dtype=dtype, device=device)
            attn.cache_v = torch.zeros(shape, dtype=dtype, device=device)
            attn.kv = self.kv
        cos, sin = rope_tables(self.args, max_seq_len)  # [S_max, d] float32
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
        self.max_seq_len, self.max_num_seqs = max_seq_len, max_num_seqs
        self.lengths = [0] * max_num_seqs  # positions held per slot

    def state_bytes_for(self, max_seq_len: int, max_num_seqs: int, dtype: torch.dtype,
                        kv_cache_tokens: int | None = None) -> int:
        """What :meth:`state_bytes` would be after ``setup_cache(max_seq_len, ..., dtype, max_num_seqs,
        kv_cache_tokens)`` (every layer's key and value pools), allocating nothing."""
        positions = kv_blocks_for(max_seq_len, max_num_seqs, kv_cache_tokens) * KV_BLOCK_TOKENS
        return sum(2 * layer.self_attn.n_kv * positions * self.args.head_dim * dtype.itemsize
                   for layer in self.model.layers)

    def state_bytes(self) -> int:
        """Bytes of per-sequence state this rank allocated in :meth:`setup_cache` (every layer's KV pools)."""
        return sum(layer.self_attn.cache_k.nbytes + layer.self_attn.cache_v.nbytes for layer in self.model.layers)

    def release(self, slot: int) -> None:
        """Forget slot ``slot``'s sequence: it gives its blocks back."""
        self._check(slot, 0, 0)
        self.lengths[slot] = 0
        self.kv.release(slot)

    def _check(self, slot: int, start: int, n: int) -> None:
        """Refuse a slot outside ``[0, N)`` or positions past ``max_seq_len``.

        Raises:
            UsageError: naming the value and the limit.
        """
        if not 0 <= slot < self.max_num_seqs:
            raise UsageError(f"slot {slot} is outside [0, {self.max_num_seqs}) (max_num_seqs={self.max_num_seqs})")
        if start < 0 or start + n > self.max_seq_len:
            raise UsageError(f"positions [{start}, {start + n}) of slot {slot} do not fit max_seq_len={self.max_seq_len}")

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, *, last_only: bool = True, slot: int = 0) -> torch.Tensor:
        """Run ``ids`` ``[T]`` at positions ``[start, start + T)`` of slot ``slot``'s sequence (a prefill,
        a prefill chunk or one step); returns float32 logits ``[T or 1, V]``. Other slots are untouched.

        The slot is left the blocks of positions ``[0, start + T)``: growing, or giving back those past
        the end after a rewind.

        Raises:
            UsageError: a slot outside ``[0, max_num_seqs)`` or positions past ``max_seq_len``.
            KVCacheFull: the pool has too few free blocks (nothing is run).
        """
        T = ids.shape[0]
        self._check(slot, start, T)
        self.kv.fit({slot: start + T})
        cos, sin = self.cos[start: start + T], self.sin[start: start + T]  # [T, d]
        (x,) = self.embed_ids(ids)  # [T, D]
        for layer in self.model.layers:
            x = layer(x, start, cos, sin, slot)
        self.lengths[slot] = start + T
        return self.logits(x[-1:] if last_only else x)[0]  # [T or 1, V]

    @property
    def decode_layers(self) -> nn.ModuleList:
        """The decoder layers, whose pieces a decode step runs in order."""
        return self.model.layers

    def decode_step(self, ids: torch.Tensor, starts: list[int], slots: list[int], real: int | None = None) -> Step:
        """The context of a batched one-token step: row b is slot ``slots[b]``'s token at ``starts[b]``.

        Rows ``>= real`` (default: none) are padding, copies of row 0, and change no state. Each
        real row is checked as :meth:`forward` checks it and advances its slot's length.

        Args:
            ids: ``[B]`` token ids (unused: the KV cache is indexed by position, so the step needs no
                id); starts, slots: B ints each; real: rows that are sequences.

        Raises:
            UsageError: lists of the wrong length, rows of one slot that are not one verify run
                (consecutive positions in order: :func:`~shardsmith.runtime.models.seq_slots.verify_runs`;
                the rows run in order, so each attends to the ones before it), a slot outside
                ``[0, N)`` or a position past ``max_seq_len``.
            KVCacheFull: the pool has too few free blocks for the rows' slots (no slot changes).
        """
        B = ids.shape[0]
        real = B if real is None else real
        if len(starts) != B or len(slots) != B or not 1 <= real <= B:
            raise UsageError(f"decode_step: {B} ids, {len(starts)} starts, {len(slots)} slots, real={real}")
        runs = verify_runs(starts[:real], slots[:real], family="decode_step")
        for slot, (first, n) in runs.items():
            self._check(slot, first, n)
        self.kv.fit({slot: first + n for slot, (first, n) in runs.items()})
        index = torch.tensor(starts, device=self.cos.device)
        for slot, (first, n) in runs.items():
            self.lengths[slot] = first + n
        return Step(list(starts), list(slots), real, self.cos.index_select(0, index), self.sin.index_select(0, index))

    def embed_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        """Token ids ``[T]`` -> ``([T, D],)`` (vocab-parallel, all-reduced)."""
        return (self.model.embed_tokens(ids),)

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        """Hidden ``[T, D]`` -> ``([T, V] float32,)``: final norm and the vocab-parallel head."""
        return (self.lm_head(self.model.norm(x)),)


def assign_weights(model: Transformer, dense: dict[str, torch.Tensor], banks: dict[str, dict[str, torch.Tensor]],
                   *, device: torch.device, tied: bool) -> None:
    """Replace every ``meta`` buffer of ``model`` by the rank's tensor of the same name, strictly.

    Unquantized tensors are cast to the buffer's dtype (no copy when it already matches, so on CPU
    the buffer is the mmap view itself); FP8 weights and F32 scales are kept as stored. Bank arrays
    ``banks[layer][array]`` fill ``{layer}.<moe>.experts.{array}``.

    Raises:
        RuntimeLoadError: listing every missing, unexpected, mis-shaped or wrongly typed tensor.
    """
    expected = dict(model.named_buffers())
    moe = model.args.moe_prefix
    given = dict(dense)
    for layer, arrays in banks.items():
        for array, t in arrays.items():
            given[f"{layer}.{moe}.experts.{array}"] = t
    if tied:
        expected.pop("lm_head.weight", None)

    def convert(name: str, t: torch.Tensor, meta: torch.Tensor) -> torch.Tensor | str:
        if (meta.dtype == torch.float8_e4m3fn) != (t.dtype == torch.float8_e4m3fn):
            return f"dtype {t.dtype}, the model needs {meta.dtype}"
        return t.to(device=device, dtype=meta.dtype)

    install_buffers(model, expected, given, convert, what="the rank's weights")
    if tied:
        model.lm_head._buffers["weight"] = model.model.embed_tokens.weight
