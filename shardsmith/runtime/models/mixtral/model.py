"""The Mixtral / Qwen3-MoE / Qwen2-MoE decoder, built on ``meta`` and filled from a rank's weights.

Module names mirror the Hugging Face checkpoints (``model.layers.N.self_attn.q_proj.weight``), so
a buffer's name is its source tensor's name and loading is a strict name-for-name assignment
(:func:`assign_weights`). Every layer comes from :class:`~shardsmith.runtime.layers.parallel.Shards`, so
this file knows nothing about ranks beyond its local head counts.

One sequence at a time (batch 1), a static KV cache of ``max_seq_len`` positions per layer and
rank (local KV heads only). Sources: transformers ``modeling_mixtral.py`` / ``modeling_qwen3_moe.py``
/ ``modeling_qwen2_moe.py`` for the maths (RMSNorm in float32, rotate-half RoPE, SDPA attention).

Legend: T = new tokens, S = cached positions, D = hidden, H = local query heads, K = local KV
heads, d = head dim, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.errors import RuntimeLoadError, format_problems
from shardsmith.runtime.layers.experts import RoutedExperts
from shardsmith.runtime.layers.parallel import HeadShard, Shards
from shardsmith.runtime.models.mixtral.config import ModelArgs, rope_tables
from shardsmith.runtime.models.mixtral.moe import MLP, SparseMoe


class RMSNorm(nn.Module):
    """``w * x / rms(x)`` computed in float32, cast back before the weight (as transformers)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(dim, dtype=dtype, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x * cos + rotate_half(x) * sin``; x ``[T, n, d]``, cos/sin ``[T, d]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


class Attention(nn.Module):
    """GQA attention over this rank's heads; o_proj's all-reduce is the layer's one collective."""

    def __init__(self, args: ModelArgs, shards: Shards, prefix: str, window: int | None) -> None:
        super().__init__()
        self.head_dim, self.window = args.head_dim, window
        q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        before = len(shards.problems)
        self.q_proj = shards.linear(prefix + ".q_proj", bias=args.qkv_bias, shape=(q_rows, args.dim))
        self.k_proj = shards.linear(prefix + ".k_proj", bias=args.qkv_bias, shape=(kv_rows, args.dim))
        self.v_proj = shards.linear(prefix + ".v_proj", bias=args.qkv_bias, shape=(kv_rows, args.dim))
        self.o_proj = shards.linear(prefix + ".o_proj", bias=args.o_bias, shape=(args.dim, q_rows))
        if len(shards.problems) > before:  # the load fails; shapes here do not matter
            heads = HeadShard(args.n_heads, args.n_kv_heads, tuple(range(args.n_heads)))
        else:
            heads = shards.heads(prefix, args.head_dim, args.n_heads // args.n_kv_heads)
        self.n_heads, self.n_kv = heads.n_heads, heads.n_kv_heads
        group = self.n_heads // self.n_kv if self.n_heads % self.n_kv == 0 else 0
        self.gqa = group > 0 and heads.kv_index == tuple(j // group for j in range(self.n_heads))
        self.kv_index = torch.tensor(heads.kv_index)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, shards.dtype) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, shards.dtype) if args.qk_norm else None
        self.cache_k = self.cache_v = None  # [K, S_max, d], set by Transformer.setup_cache

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.core(*self.project(x, cos, sin), start))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``q [T, H, d]``, ``k [T, K, d]`` (normed if Qwen3, RoPE applied) and ``v [T, K, d]``."""
        T, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(T, self.n_heads, d)  # [T, H, d]
        k = self.k_proj(x).view(T, self.n_kv, d)  # [T, K, d]
        v = self.v_proj(x).view(T, self.n_kv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Write ``k``/``v`` at ``[start, start + T)`` of the cache, attend: ``[T, H*d]`` (before ``o_proj``).

        Its shapes grow with the position, so a piecewise decode step runs it eagerly between pieces.
        """
        T, d = q.shape[0], self.head_dim
        end = start + T
        self.cache_k[:, start:end] = k.transpose(0, 1)
        self.cache_v[:, start:end] = v.transpose(0, 1)
        keys, values = self.cache_k[:, :end], self.cache_v[:, :end]  # [K, S, d]
        if not self.gqa:  # kv-copies shares: map each query head to its local KV head
            idx = self.kv_index.to(keys.device)
            keys, values = keys.index_select(0, idx), values.index_select(0, idx)  # [H, S, d]
        mask = None
        if T > 1 or self.window:
            qpos = torch.arange(start, end, device=q.device)[:, None]  # [T, 1]
            kpos = torch.arange(end, device=q.device)[None, :]  # [1, S]
            mask = kpos <= qpos
            if self.window:
                mask &= qpos - kpos < self.window
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                           enable_gqa=self.gqa and self.n_kv != self.n_heads)  # [H, T, d]
        return o.transpose(0, 1).reshape(T, self.n_heads * d)


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

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), start, cos, sin)
        return x + getattr(self, self.ffn_name)(self.post_attention_layernorm(x))

    # The same layer as pieces around the attention core, for a decode step run piece by piece
    # (engine/cuda_graphs.py's table): the same kernels in the same order as forward, so the same bits.

    @property
    def experts(self) -> RoutedExperts | None:
        """The routed experts (None for a dense MLP layer)."""
        ffn = getattr(self, self.ffn_name)
        return ffn.experts if isinstance(ffn, SparseMoe) else None

    def attn_in_args(self, step: "Step") -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[1, d]`` at the step's position."""
        return step.cos, step.sin

    def attn_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Norm and projections: ``(q, k, v)`` for :meth:`Attention.core`."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attn_core(self, qkv: tuple[torch.Tensor, ...], step: "Step") -> tuple[torch.Tensor]:
        """:meth:`Attention.core` at the step's position: ``(o [T, H*d],)``."""
        return (self.self_attn.core(*qkv, step.start),)

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
    """A one-token step's context for the layers' pieces: its position and RoPE ``[1, d]`` there."""

    start: int
    cos: torch.Tensor
    sin: torch.Tensor


class Transformer(nn.Module):
    """The causal LM: vocab-parallel embedding, decoder layers, final norm, vocab-parallel LM head.

    Args:
        args: model configuration; shards: this rank's plan and compute dtype.

    Raises:
        RuntimeLoadError: listing every tensor the config needs that the source lacks or shapes
            differently.
    """

    def __init__(self, args: ModelArgs, shards: Shards) -> None:
        super().__init__()
        self.args = args
        self.model = nn.Module()
        vocab = (args.vocab_size, args.dim)
        self.model.embed_tokens = shards.embedding("model.embed_tokens.weight", vocab)
        self.model.layers = nn.ModuleList(DecoderLayer(args, shards, i) for i in range(args.n_layers))
        self.model.norm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.lm_head = shards.lm_head("model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight", vocab)
        self.cos = self.sin = None
        shards.raise_problems()

    def setup_cache(self, max_seq_len: int, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate the static KV cache (``[K, max_seq_len, d]`` per layer) and RoPE tables."""
        for layer in self.model.layers:
            attn = layer.self_attn
            shape = (attn.n_kv, max_seq_len, self.args.head_dim)
            attn.cache_k = torch.zeros(shape, dtype=dtype, device=device)
            attn.cache_v = torch.zeros(shape, dtype=dtype, device=device)
        cos, sin = rope_tables(self.args, max_seq_len)  # [S_max, d] float32
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, *, last_only: bool = True) -> torch.Tensor:
        """Run ``ids`` ``[T]`` at positions ``[start, start + T)``; returns float32 logits ``[T or 1, V]``."""
        cos, sin = self.cos[start: start + ids.shape[0]], self.sin[start: start + ids.shape[0]]  # [T, d]
        (x,) = self.embed_ids(ids)  # [T, D]
        for layer in self.model.layers:
            x = layer(x, start, cos, sin)
        return self.logits(x[-1:] if last_only else x)[0]  # [T or 1, V]

    @property
    def decode_layers(self) -> nn.ModuleList:
        """The decoder layers, whose pieces a decode step runs in order."""
        return self.model.layers

    def decode_step(self, ids: torch.Tensor, start: int) -> Step:
        """The context of a one-token step at ``start`` (the KV cache is indexed by position: no state)."""
        return Step(start, self.cos[start: start + 1], self.sin[start: start + 1])

    def embed_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        """Token ids ``[T]`` -> ``([T, D],)`` (vocab-parallel, all-reduced)."""
        return (self.model.embed_tokens(ids),)

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        """Hidden ``[T, D]`` -> ``([T, V] float32,)``: final norm and the vocab-parallel head."""
        return (self.lm_head(self.model.norm(x)),)


def install_buffers(model: nn.Module, expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor],
                    convert: Callable[[str, torch.Tensor, torch.Tensor], "torch.Tensor | str"], *, what: str) -> None:
    """Strictly replace ``model``'s ``meta`` buffers (``expected``, by name) with ``given`` tensors.

    Every problem is collected first and raised once: a given tensor with no buffer, a buffer with
    no tensor, a shape mismatch, or a ``convert(name, tensor, meta)`` that returns a message
    instead of the tensor to install (dtype rules are the caller's).

    Raises:
        RuntimeLoadError: listing every problem, naming ``what`` was loaded.
    """
    problems = [f"unexpected tensor {n!r} {list(given[n].shape)}: the model has no place for it"
                for n in sorted(set(given) - set(expected))]
    out = {}
    for name, meta in expected.items():
        t = given.get(name)
        if t is None:
            problems.append(f"missing tensor {name!r}: the model needs {list(meta.shape)}")
        elif tuple(t.shape) != tuple(meta.shape):
            problems.append(f"tensor {name!r}: shape {list(t.shape)}, the model needs {list(meta.shape)}")
        elif isinstance(got := convert(name, t, meta), str):
            problems.append(f"tensor {name!r}: {got}")
        else:
            out[name] = got
    if problems:
        raise RuntimeLoadError(format_problems(f"cannot load {what}", problems))
    for name, t in out.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = t


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
