"""The DeepSeek-V3 causal LM, built on ``meta`` from the rank's plan and filled from its weights.

Module names mirror the Hugging Face checkpoint (``model.layers.N.self_attn.kv_b_proj.weight``),
so loading is a strict name-for-name assignment (:func:`assign_weights`); expert banks fill
``model.layers.N.mlp.experts.{gate_up,down}(_scale)``. The MTP layer (``model.layers.{L}`` with
``L = num_hidden_layers``: ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``
and a full decoder layer) is loaded as ``mtp.0`` when the model is built with ``mtp_layers=1``
(speculative decoding: :meth:`DeepseekV3.draft`); otherwise it stays in the pack.

``max_num_seqs`` sequences in slots of the latent KV cache (:mod:`~shardsmith.runtime.models.seq_slots`):
a prefill or step runs one sequence in its slot (``forward(..., slot=)``); a batched decode step
runs one token of each of B sequences through the layers' pieces (``decode_step`` and the piece
table of ``engine/cuda_graphs.py``). The cache is indexed by position, so a step may start anywhere
up to where the slot's sequence ended. Source of the maths: transformers
``modeling_deepseek_v3.py`` (``DeepseekV3ForCausalLM``), DeepSeek-V3 ``inference/model.py``.

Legend: B = sequences of a decode step, T = new tokens, D = hidden, V = vocabulary, c = kv_lora_rank, r = qk_rope_head_dim.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shardsmith.errors import UsageError
from shardsmith.runtime.layers.experts import RoutedExperts
from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.models.deepseek_v3.attention import ABSORB_MODES, MLAttention
from shardsmith.runtime.models.deepseek_v3.config import V3Args, rope_tables
from shardsmith.runtime.models.deepseek_v3.moe import MoE
from shardsmith.runtime.models.common import MLP, RMSNorm, install_buffers
from shardsmith.runtime.models.kv_blocks import KV_BLOCK_TOKENS, KVBlocks, kv_blocks_for
from shardsmith.runtime.models.seq_slots import Rows, SeqSlots, cache_bytes

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DecoderLayer(nn.Module):
    """Pre-norm MLA and MoE (or dense MLP for the first ``first_k_dense_replace`` layers) with residuals."""

    def __init__(self, args: V3Args, shards: Shards, i: int) -> None:
        super().__init__()
        prefix = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.self_attn = MLAttention(args, shards, prefix + ".self_attn")
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.mlp = MoE(args, shards, prefix) if args.is_moe(i) else MLP(shards, prefix + ".mlp", dim=args.dim,
                                                                          inter=args.inter)

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, slot: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), start, cos, sin, slot)
        return x + self.mlp(self.post_attention_layernorm(x))

    # The same layer as pieces around the attention core, for a batched decode step run piece by piece
    # (engine/cuda_graphs.py's table): the same kernels in the same order as forward, row by row.

    @property
    def experts(self) -> RoutedExperts | None:
        """The routed experts (None for a dense MLP layer)."""
        return self.mlp.experts if isinstance(self.mlp, MoE) else None

    def attn_in_args(self, step: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, r]``: each row's RoPE at its own position."""
        return step.cos, step.sin

    def attn_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Norm and projections ``[B, D]`` -> ``(q_nope, q_pe, latent, k_pe)`` for :meth:`attn_core`."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attn_core(self, a: tuple[torch.Tensor, ...], step: Rows) -> tuple[torch.Tensor]:
        """Latent cache write and attention, each row in its own slot: ``(o [B, H*v],)``."""
        return (self.self_attn.core_rows(*a, step),)

    def ffn_block(self, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor]:
        """``o_proj`` and its all-reduce, the residual, then the whole MoE (or MLP) block: ``([B, D],)``."""
        x = x + self.self_attn.o_proj(o)
        return (x + self.mlp(self.post_attention_layernorm(x)),)

    def ffn_in(self, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Up to the router: ``(x [B, D] after attention (the carry), h [B, D] normed (the experts'
        input), index [B, K], weight [B, K])``."""
        x = x + self.self_attn.o_proj(o)
        h = self.post_attention_layernorm(x)
        return (x, h, *self.mlp.gate(h))

    def ffn_out(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, routed: torch.Tensor) -> tuple[torch.Tensor]:
        """The routed partial ``[B, D]`` (computed between the pieces) plus the shared experts, all-reduce,
        residual (``weight`` is part of the common signature and not needed here)."""
        return (x + self.mlp.finish(h, routed),)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's multi-token prediction layer ``model.layers.{L}`` (``L >= num_hidden_layers``): a
    decoder layer whose input joins the next token's embedding and the main model's hidden,
    ``eh_proj([enorm(embed(t_j)); hnorm(h_{j-1})])``, and whose output goes through its own
    ``shared_head`` (norm and vocab-parallel head) to predict token ``j + 1``.

    Source: the DeepSeek-V3 technical report, section 2.2 (MTP modules); the inference wiring (the
    final-norm hidden of the main model, a masked embedding at position 0, one layer chained for
    more than one draft) as vLLM's ``deepseek_mtp.py``. Legend: T = tokens, D = hidden, V = vocabulary.
    """

    def __init__(self, args: V3Args, shards: Shards, i: int) -> None:
        super().__init__(args, shards, i)
        prefix, vocab = f"model.layers.{i}", (args.vocab_size, args.dim)
        self.embed_tokens = shards.embedding(prefix + ".embed_tokens.weight", vocab)
        self.enorm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.hnorm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.eh_proj = shards.linear(prefix + ".eh_proj", shape=(args.dim, 2 * args.dim))
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.shared_head.head = shards.lm_head(prefix + ".shared_head.head.weight", vocab)

    def hidden(self, ids: torch.Tensor, h_prev: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
               slot: int = 0, *, mask_first: bool = False) -> torch.Tensor:
        """Tokens ``ids [T]`` at ``[start, start + T)`` with the hidden before each, ``h_prev [T, D]``
        -> the layer's output ``[T, D]`` (its cache written at those positions). ``mask_first``
        zeroes the first token's embedding (position 0 has no hidden before it)."""
        e = self.embed_tokens(ids)
        if mask_first:
            e = torch.cat([torch.zeros_like(e[:1]), e[1:]])
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h_prev)], dim=-1))
        return super().forward(x, start, cos, sin, slot)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, D]`` -> float32 logits ``[T, V]`` of the next-but-one token."""
        return self.shared_head.head(self.shared_head.norm(x))


class DeepseekV3(nn.Module):
    """DeepSeek-V3 on one rank: vocab-parallel embedding, decoder layers, final norm, vocab-parallel head.

    Args:
        args: configuration; shards: the rank's plan and compute dtype.

    Raises:
        RuntimeLoadError: listing every tensor the config needs that the plan lacks or shapes differently.
    """

    SUPPORTS_BATCHING = True  # per-sequence slots and batched decode steps (models/seq_slots.py)
    VERIFY_RUNS = True  # a decode step may hold a slot's verify run: consecutive positions, in order

    def __init__(self, args: V3Args, shards: Shards, *, mtp_layers: int = 0) -> None:
        super().__init__()
        self.args = args
        vocab = (args.vocab_size, args.dim)
        if not 0 <= mtp_layers <= args.n_mtp:
            raise UsageError(f"DeepSeek-V3: {mtp_layers} MTP layer(s) asked for, the checkpoint has {args.n_mtp} "
                             "(num_nextn_predict_layers)")
        self.model = nn.Module()
        self.model.embed_tokens = shards.embedding("model.embed_tokens.weight", vocab)
        self.model.layers = nn.ModuleList(DecoderLayer(args, shards, i) for i in range(args.n_layers))
        self.model.norm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.lm_head = shards.lm_head("lm_head.weight", vocab)
        self.mtp = nn.ModuleList(MTPLayer(args, shards, args.n_layers + j) for j in range(mtp_layers))
        self._hidden: list[tuple[int, torch.Tensor] | None] = [None]  # per slot: (start, [T, D]) of its last forward
        self.cos = self.sin = None
        self.max_seq_len, self.max_num_seqs = 0, 0
        self.seqs = SeqSlots("DeepSeek-V3", 1, 1)  # replaced by setup_cache
        self.kv: KVBlocks | None = None  # the slots' block tables, set by setup_cache
        shards.raise_problems()

    def setup_cache(self, max_seq_len: int, device: torch.device, dtype: torch.dtype, max_num_seqs: int = 1,
                    kv_cache_tokens: int | None = None, block_size: int = KV_BLOCK_TOKENS) -> None:
        """Allocate the latent cache, forget every sequence, and build the RoPE tables: per layer (the MTP
        layers too) a pool ``[P * B, c]`` of latents and one ``[P * B, r]`` of rotated keys, ``P`` blocks of
        ``B = block_size`` positions that the ``max_num_seqs`` slots hold as their sequences grow
        (:mod:`~shardsmith.runtime.models.kv_blocks`).

        Args:
            kv_cache_tokens: positions of the pool across all slots, rounded up to whole blocks (None:
                ``max_num_seqs * max_seq_len``).

        Raises:
            UsageError: ``max_seq_len`` or ``max_num_seqs`` below 1, or a pool smaller than one
                ``max_seq_len`` sequence.
        """
        self.kv = KVBlocks.for_slots(max_seq_len, max_num_seqs, kv_cache_tokens, block_size)
        self.seqs = SeqSlots("DeepSeek-V3", max_num_seqs, max_seq_len, kv=self.kv)
        self.max_seq_len, self.max_num_seqs = max_seq_len, max_num_seqs
        self._hidden = [None] * max_num_seqs
        for layer in self._cached_layers():
            attn = layer.self_attn
            attn.cache_kv = torch.zeros(self.kv.tokens, attn.c, dtype=dtype, device=device)
            attn.cache_pe = torch.zeros(self.kv.tokens, attn.rope, dtype=dtype, device=device)
            attn.kv = self.kv
        cos, sin = rope_tables(self.args, max_seq_len)  # [S_max, r] float32
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    def state_bytes_for(self, max_seq_len: int, max_num_seqs: int, dtype: torch.dtype,
                        kv_cache_tokens: int | None = None) -> int:
        """What :meth:`state_bytes` would be after ``setup_cache(max_seq_len, ..., dtype, max_num_seqs,
        kv_cache_tokens)`` (every layer's latent and RoPE pools), allocating nothing."""
        positions = kv_blocks_for(max_seq_len, max_num_seqs, kv_cache_tokens) * KV_BLOCK_TOKENS
        return sum(positions * (layer.self_attn.c + layer.self_attn.rope) * dtype.itemsize
                   for layer in self._cached_layers())

    def state_bytes(self) -> int:
        """Bytes of per-sequence state this rank allocated (every layer's latent pools)."""
        return sum(cache_bytes(layer.self_attn.cache_kv, layer.self_attn.cache_pe) for layer in self._cached_layers())

    def _cached_layers(self) -> list[DecoderLayer]:
        """Every layer with a latent cache: the decoder layers, then the MTP layers."""
        return [*self.model.layers, *self.mtp]

    def release(self, slot: int) -> None:
        """Forget ``slot``'s sequence (its next step starts at 0).

        Raises:
            UsageError: ``slot`` outside ``0..max_num_seqs-1``.
        """
        self.seqs.release(slot)
        self._hidden[slot] = None

    def set_absorb(self, mode: str) -> None:
        """How attention uses the latent cache: ``decode`` (absorbed for one-token steps, the
        default), ``always`` or ``never`` (expanded keys and values: the reference path).

        Raises:
            UsageError: an unknown mode.
        """
        if mode not in ABSORB_MODES:
            raise UsageError(f"absorb mode must be one of {', '.join(ABSORB_MODES)}, got {mode!r}")
        for layer in self.model.layers:
            layer.self_attn.absorb = mode

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, *, last_only: bool = True, slot: int = 0) -> torch.Tensor:
        """Run ``ids`` ``[T]`` at positions ``[start, start + T)`` of sequence ``slot``; float32 logits
        ``[T or 1, V]``. ``start == 0`` begins a new sequence there; other slots are untouched.

        Raises:
            UsageError: a bad slot, a start past where the slot's sequence ended, or a step past
                ``max_seq_len`` (the cache's positions).
        """
        T = ids.shape[0]
        self.seqs.begin(slot, start, T)
        cos, sin = self.cos[start: start + T], self.sin[start: start + T]  # [T, r]
        (x,) = self.embed_ids(ids)  # [T, D]
        for layer in self.model.layers:
            x = layer(x, start, cos, sin, slot)
        if not self.mtp:
            return self.logits(x[-1:] if last_only else x)[0]  # [T or 1, V]
        h = self.model.norm(x)  # [T, D]: what the MTP layer reads, and the head's input
        self._mtp_pass(ids, h, start, cos, sin, slot)
        return self.lm_head(h[-1:] if last_only else h)  # [T or 1, V]

    # ------------------------------------------------------------------ MTP drafts

    def _previous_hidden(self, slot: int, pos: int) -> torch.Tensor | None:
        """The final-norm hidden ``[D]`` of ``slot`` at ``pos`` if its last forward computed it."""
        kept = self._hidden[slot]
        if kept is None or not kept[0] <= pos < kept[0] + kept[1].shape[0]:
            return None
        return kept[1][pos - kept[0]]

    def _mtp_pass(self, ids: torch.Tensor, h: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                  slot: int) -> None:
        """Run the MTP layer over a forward's positions, so its cache holds them: position ``j`` reads
        token ``j`` and the main model's hidden at ``j - 1`` (the previous forward's last row for the
        first position, zeros at position 0, whose embedding is masked as in training)."""
        prev = self._previous_hidden(slot, start - 1) if start > 0 else None
        first = torch.zeros_like(h[:1]) if prev is None else prev[None]
        h_prev = torch.cat([first, h[:-1]])  # [T, D]
        self.mtp[0].hidden(ids, h_prev, start, cos, sin, slot, mask_first=start == 0)
        self._hidden[slot] = (start, h)

    @torch.inference_mode()
    def draft(self, slot: int, token: int, pos: int, k: int) -> list[int]:
        """Up to ``k`` greedy draft tokens after ``token`` at ``pos`` in ``slot`` from the MTP layer:
        draft ``i`` is the MTP layer's choice at position ``pos + i`` (the main model's hidden at
        ``pos - 1`` and ``token`` for the first; the layer's own output and its last choice after
        that, as vLLM chains one MTP layer). Its cache entries at those positions are scratch: the
        next forward writes over them. ``[]`` when the slot's last forward did not end at ``pos``.

        Raises:
            UsageError: the model has no MTP layer, or ``pos + k`` passes ``max_seq_len``.
        """
        if not self.mtp:
            raise UsageError("DeepSeek-V3 was built without its MTP layer (mtp_layers=0)")
        if pos + k > self.max_seq_len:
            raise UsageError(f"slot {slot}: a {k}-token draft at {pos} passes max_seq_len={self.max_seq_len}")
        h = self._previous_hidden(slot, pos - 1)
        if h is None:
            return []
        self.kv.fit({slot: pos + k})  # the draft's scratch positions (the next forward gives them back)
        layer, device = self.mtp[0], h.device
        out: list[int] = []
        for i in range(k):
            p = pos + i
            x = layer.hidden(torch.tensor([token], device=device), h[None], p, self.cos[p: p + 1], self.sin[p: p + 1], slot)
            token = int(layer.logits(x)[0].argmax())  # lowest id on ties, as greedy decoding
            out.append(token)
            h = x[0]
        return out

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
            UsageError: as :meth:`SeqSlots.rows` (bad shapes, slot, position or padding rows).
        """
        return self.seqs.step_rows(ids, starts, slots, real, self.cos, self.sin)

    def bank_layer_key(self, key: str) -> str:
        """The pack's bank layer key of module layer ``key``: ``mtp.j`` is ``model.layers.{L + j}``
        (L = ``num_hidden_layers``), the decoder layers are their own (the expert offload asks)."""
        if key.startswith("mtp."):
            return f"model.layers.{self.args.n_layers + int(key.split('.')[1])}"
        return key

    def embed_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        """Token ids ``[T]`` -> ``([T, D],)`` (vocab-parallel, all-reduced)."""
        return (self.model.embed_tokens(ids),)

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        """Hidden ``[T, D]`` -> ``([T, V] float32,)``: final norm and the vocab-parallel head."""
        return (self.lm_head(self.model.norm(x)),)


def assign_weights(model: DeepseekV3, dense: dict[str, torch.Tensor], banks: dict[str, dict[str, torch.Tensor]],
                   *, device: torch.device) -> None:
    """Replace every ``meta`` buffer of ``model`` by the rank's tensor of the same name, strictly.

    Tensors and banks of the MTP layers (index >= ``num_hidden_layers``) go to ``mtp.j`` for the
    layers the model was built with, and are skipped otherwise. FP8 weights
    and their F32 ``weight_scale_inv`` keep their stored dtype (on CPU the buffer is the mmap view
    itself); other tensors are cast to the buffer's dtype (the router's BF16 weight to float32).

    Raises:
        RuntimeLoadError: listing every missing, unexpected, mis-shaped or wrongly typed tensor.
    """
    n, mtp = model.args.n_layers, len(model.mtp)

    def rename(name: str) -> str | None:  # decoder layers keep their names, the MTP layers loaded become mtp.j
        m = _LAYER.match(name + ".")
        if m is None or int(m.group(1)) < n:
            return name
        j = int(m.group(1)) - n
        return f"mtp.{j}." + name[m.end():] if j < mtp else None

    given = {r: t for k, t in dense.items() if (r := rename(k)) is not None}
    for layer, arrays in banks.items():
        if (r := rename(layer)) is not None:
            given.update({f"{r.rstrip('.')}.mlp.experts.{a}": t for a, t in arrays.items()})

    def convert(name: str, t: torch.Tensor, meta: torch.Tensor) -> torch.Tensor | str:
        if (meta.dtype == torch.float8_e4m3fn) != (t.dtype == torch.float8_e4m3fn):
            return f"dtype {t.dtype}, the model needs {meta.dtype}"
        return t.to(device=device, dtype=meta.dtype)

    install_buffers(model, dict(model.named_buffers()), given, convert, what="the rank's DeepSeek-V3 weights")
