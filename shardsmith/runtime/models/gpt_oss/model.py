"""The gpt-oss causal LM on one rank, built on ``meta`` from the rank's plan and filled from its weights.

Module names mirror the release checkpoint (``model.layers.N.self_attn.q_proj.weight``), so loading
is a strict name-for-name assignment (:func:`assign_weights`) with one spelled-out rename (the MXFP4
experts' ``<proj>_blocks`` and ``_scales`` are kept as they are, :mod:`~shardsmith.runtime.models.gpt_oss.moe`):

============================================  ===============================  ==========================
source tensors                                module buffer                    why
============================================  ===============================  ==========================
``...mlp.experts.down_proj_bias``             ``...mlp.down_proj_bias``        added once, by the MoE block
============================================  ===============================  ==========================

With offloaded experts the stacked ``...mlp.experts.*`` tensors live in host banks instead (read by
:func:`~shardsmith.runtime.offload.attach.attach_offload`) and are not assigned.

Attention with sinks over sliding and full layers lives in :mod:`~shardsmith.runtime.models.gpt_oss.attention`.
``max_num_seqs`` sequences in slots (:mod:`~shardsmith.runtime.models.seq_slots`) whose keys and values
(the rank's KV heads) sit in blocks of one pool per layer (:mod:`~shardsmith.runtime.models.kv_blocks`),
taken as a sequence grows: a prefill or step runs one sequence in its slot; a batched decode step runs one token of each of B sequences through the layers' pieces
(``engine/cuda_graphs.py``'s table). A step may start at any cached position of its slot.

Legend: B = sequences of a decode step, T = new tokens, D = hidden, V = vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from shardsmith.runtime.layers.parallel import Shards, all_reduce
from shardsmith.runtime.models.common import RMSNormF32  # transformers' GptOssRMSNorm: the same maths
from shardsmith.runtime.models.gpt_oss.attention import Attention
from shardsmith.runtime.models.gpt_oss.config import GptOssArgs, rope_tables
from shardsmith.runtime.models.gpt_oss.moe import Experts, MoE
from shardsmith.runtime.models.common import install_buffers
from shardsmith.runtime.models.kv_blocks import KV_BLOCK_TOKENS, KVBlocks, kv_blocks_for
from shardsmith.runtime.models.seq_slots import Rows, SeqSlots, cache_bytes


class DecoderLayer(nn.Module):
    """Pre-norm attention and MoE blocks with residuals."""

    def __init__(self, args: GptOssArgs, shards: Shards, i: int) -> None:
        super().__init__()
        prefix = f"model.layers.{i}"
        self.input_layernorm = RMSNormF32(args.dim, args.norm_eps)
        self.self_attn = Attention(args, shards, prefix + ".self_attn", args.windows[i])
        self.post_attention_layernorm = RMSNormF32(args.dim, args.norm_eps)
        self.mlp = MoE(args, shards, prefix + ".mlp")

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, slot: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), start, cos, sin, slot)
        return x + self.mlp(self.post_attention_layernorm(x))

    # The same layer as pieces around the attention core, for a batched decode step run piece by piece
    # (engine/cuda_graphs.py's table): the same kernels in the same order as forward, row by row.

    @property
    def experts(self) -> Experts:
        """The routed experts (every gpt-oss layer is MoE; they read routed ids on the host)."""
        return self.mlp.experts

    def attn_in_args(self, step: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, d/2]``: each row's RoPE at its own position."""
        return step.cos, step.sin

    def attn_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Norm and projections ``[B, D]`` -> ``(q, k, v)`` for :meth:`attn_core`."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attn_core(self, a: tuple[torch.Tensor, ...], step: Rows) -> tuple[torch.Tensor]:
        """KV cache write and attention, each row in its own slot: ``(o [B, H*d],)``."""
        return (self.self_attn.core_rows(*a, step),)

    def ffn_block(self, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor]:
        """``o_proj`` (all-reduce, bias once), the residual, then the whole MoE block: ``([B, D],)``."""
        x = x + self.self_attn.o_proj(o)
        return (x + self.mlp(self.post_attention_layernorm(x)),)

    def ffn_in(self, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Up to the router: ``(x [B, D] after attention, bias [B, D] (the routed down biases; both
        the carry), h [B, D] normed (the experts' input), index [B, K], weight [B, K])``."""
        x = x + self.self_attn.o_proj(o)
        h = self.post_attention_layernorm(x)
        index, weight = self.mlp.route(h)
        return x, self.mlp.bias(index, weight), h, index, weight

    def ffn_out(self, x: torch.Tensor, bias: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                routed: torch.Tensor) -> tuple[torch.Tensor]:
        """The routed partial ``[B, D]`` (computed between the pieces), all-reduced, plus the down
        biases, then the residual (``h`` and ``weight`` are part of the common signature)."""
        return (x + (all_reduce(routed) + bias),)


class GptOss(nn.Module):
    """gpt-oss on one rank: vocab-parallel embedding, decoder layers, final norm, vocab-parallel LM head.

    Args:
        args: configuration; shards: this rank's plan and compute dtype.

    Raises:
        RuntimeLoadError: listing every tensor the config needs that the source lacks or shapes
            differently.
    """

    SUPPORTS_BATCHING = True  # per-sequence slots and batched decode steps (models/seq_slots.py)

    def __init__(self, args: GptOssArgs, shards: Shards) -> None:
        super().__init__()
        self.args = args
        vocab = (args.vocab_size, args.dim)
        self.model = nn.Module()
        self.model.embed_tokens = shards.embedding("model.embed_tokens.weight", vocab)
        self.model.layers = nn.ModuleList(DecoderLayer(args, shards, i) for i in range(args.n_layers))
        self.model.norm = RMSNormF32(args.dim, args.norm_eps)
        self.lm_head = shards.lm_head("model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight", vocab)
        self.cos = self.sin = None
        self.max_seq_len, self.max_num_seqs = 0, 0
        self.seqs = SeqSlots("gpt-oss", 1, 1)  # replaced by setup_cache
        self.kv: KVBlocks | None = None  # the slots' block tables, set by setup_cache
        shards.raise_problems()

    def setup_cache(self, max_seq_len: int, device: torch.device, dtype: torch.dtype, max_num_seqs: int = 1,
                    kv_cache_tokens: int | None = None, block_size: int = KV_BLOCK_TOKENS) -> None:
        """Allocate the KV cache, forget every sequence, and build the RoPE tables: per layer (sliding layers
        included) a pool ``[K, P * B, d]`` of keys and one of values, ``P`` blocks of ``B = block_size``
        positions that the ``max_num_seqs`` slots hold as their sequences grow
        (:mod:`~shardsmith.runtime.models.kv_blocks`).

        Args:
            kv_cache_tokens: positions of the pool across all slots, rounded up to whole blocks (None:
                ``max_num_seqs * max_seq_len``).

        Raises:
            UsageError: ``max_seq_len`` or ``max_num_seqs`` below 1, or a pool smaller than one
                ``max_seq_len`` sequence.
        """
        self.kv = KVBlocks.for_slots(max_seq_len, max_num_seqs, kv_cache_tokens, block_size)
        self.seqs = SeqSlots("gpt-oss", max_num_seqs, max_seq_len, kv=self.kv)
        self.max_seq_len, self.max_num_seqs = max_seq_len, max_num_seqs
        for layer in self.model.layers:
            attn = layer.self_attn
            shape = (attn.n_kv, self.kv.tokens, self.args.head_dim)
            attn.cache_k = torch.zeros(shape, dtype=dtype, device=device)
            attn.cache_v = torch.zeros(shape, dtype=dtype, device=device)
            attn.kv = self.kv
        cos, sin = rope_tables(self.args, max_seq_len)  # [S_max, d/2] float32
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    def state_bytes_for(self, max_seq_len: int, max_num_seqs: int, dtype: torch.dtype,
                        kv_cache_tokens: int | None = None) -> int:
        """What :meth:`state_bytes` would be after ``setup_cache(max_seq_len, ..., dtype, max_num_seqs,
        kv_cache_tokens)`` (every layer's key and value pools, sliding layers included), allocating nothing."""
        positions = kv_blocks_for(max_seq_len, max_num_seqs, kv_cache_tokens) * KV_BLOCK_TOKENS
        return sum(2 * layer.self_attn.n_kv * positions * self.args.head_dim * dtype.itemsize
                   for layer in self.model.layers)

    def state_bytes(self) -> int:
        """Bytes of per-sequence state this rank allocated (every layer's key and value pools)."""
        return sum(cache_bytes(layer.self_attn.cache_k, layer.self_attn.cache_v) for layer in self.model.layers)

    def release(self, slot: int) -> None:
        """Forget ``slot``'s sequence (its next step starts at 0).

        Raises:
            UsageError: ``slot`` outside ``0..max_num_seqs-1``.
        """
        self.seqs.release(slot)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, *, last_only: bool = True, slot: int = 0) -> torch.Tensor:
        """Run ``ids`` ``[T]`` at positions ``[start, start + T)`` of sequence ``slot``; float32 logits
        ``[T or 1, V]``. ``start == 0`` begins a new sequence there; other slots are untouched.

        Raises:
            UsageError: a bad slot, a start past where the slot's sequence ended, or a step past
                ``max_seq_len``.
        """
        T = ids.shape[0]
        self.seqs.begin(slot, start, T)
        cos, sin = self.cos[start: start + T], self.sin[start: start + T]  # [T, d/2]
        (x,) = self.embed_ids(ids)  # [T, D]
        for layer in self.model.layers:
            x = layer(x, start, cos, sin, slot)
        return self.logits(x[-1:] if last_only else x)[0]

    @property
    def decode_layers(self) -> nn.ModuleList:
        """The decoder layers, whose pieces a decode step runs in order."""
        return self.model.layers

    def decode_step(self, ids: torch.Tensor, starts: int | list[int], slots: list[int] | None = None,
                    real: int | None = None) -> Rows:
        """The context of a batched one-token step: row ``b`` is slot ``slots[b]``'s token at
        ``starts[b]``; rows ``>= real`` are padding (copies of row 0, no state change). The old
        one-row form ``decode_step(ids, start)`` is slot 0.

        Raises:
            UsageError: as :meth:`~shardsmith.runtime.models.seq_slots.SeqSlots.rows`.
        """
        return self.seqs.step_rows(ids, starts, slots, real, self.cos, self.sin)

    def embed_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        """Token ids ``[T]`` -> ``([T, D],)`` (vocab-parallel, all-reduced)."""
        return (self.model.embed_tokens(ids),)

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        """Hidden ``[T, D]`` -> ``([T, V] float32,)``: final norm and the vocab-parallel head."""
        return (self.lm_head(self.model.norm(x)),)


def assign_weights(model: GptOss, dense: dict[str, torch.Tensor], *, device: torch.device,
                   offloaded: bool = False) -> None:
    """Replace every ``meta`` buffer of ``model`` by the rank's tensor of the same name, strictly.

    MXFP4 expert tensors (``<proj>_blocks``, ``<proj>_scales``) are taken as the bytes they are; every
    other tensor is cast to its buffer's dtype (no copy when it already matches, so on CPU the buffer is
    the mmap view itself). The rename of the module docstring applies. With ``offloaded`` (the model's
    experts were swapped for host banks), the stacked expert tensors (``...mlp.experts.*`` but the down
    bias) are left to the host banks.

    Raises:
        RuntimeLoadError: listing every missing, unexpected or mis-shaped tensor, and MXFP4 parts
            that are not bytes.
    """
    expected = dict(model.named_buffers())
    if model.args.tie_embeddings:
        expected.pop("lm_head.weight", None)
    given: dict[str, object] = {}
    for name, t in dense.items():
        if name.endswith(_DOWN_BIAS):
            given[name[: -len(_DOWN_BIAS)] + ".mlp.down_proj_bias"] = t
        elif offloaded and ".mlp.experts." in name:
            continue
        else:
            given[name] = t

    def convert(name: str, t: torch.Tensor, meta: torch.Tensor) -> torch.Tensor | str:
        if meta.dtype == torch.uint8 and t.dtype != torch.uint8:  # MXFP4 blocks and scales: bytes as they lie
            return f"MXFP4 {name.rpartition('_')[2]} must be U8 bytes, got {t.dtype}"
        return t.to(device=device, dtype=meta.dtype)

    install_buffers(model, expected, given, convert, what="the rank's gpt-oss weights")
    if model.args.tie_embeddings:
        model.lm_head._buffers["weight"] = model.model.embed_tokens.weight


_DOWN_BIAS = ".mlp.experts.down_proj_bias"
