"""Pieces several model families share: norms, rotate-half RoPE, the dense gated MLP, a prefill chunk's
causal attention without a mask, and the strict buffer installer. Families import these from here, never from one another.

Sources: transformers ``modeling_mixtral.py`` (``RMSNorm`` in float32 cast back before the weight,
rotate-half RoPE, the gated MLP), DeepSeek-V4 ``inference/model.py`` (``RMSNormF32``: the weight
kept in float32, as gpt-oss's ``GptOssRMSNorm`` computes too). Legend: T = tokens, D = hidden,
n = heads, d = head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from shardsmith.errors import RuntimeLoadError, format_problems
from shardsmith.runtime.layers.parallel import Shards

__all__ = ["MLP", "RMSNorm", "RMSNormF32", "apply_rope", "causal_chunk_attention", "install_buffers"]


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


class RMSNormF32(nn.Module):
    """``(w * x / rms(x))`` in float32, cast back to the input dtype; ``weight`` kept in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(dim, dtype=torch.float32, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight, self.eps)

    @staticmethod
    def normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The norm as a function of its ``weight [D]`` float32 and ``eps`` (for fused callers)."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (weight * h).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x * cos + rotate_half(x) * sin``; x ``[T, n, d]``, cos/sin ``[T, d]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with column-parallel gate/up and row-parallel down.

    Args:
        shards: the rank's plan; prefix: ``model.layers.N.mlp`` or ``....mlp.shared_expert``.
        dim, inter: D and the global intermediate size (checked against the source).
        reduce: all-reduce the output (False: return this rank's partial sum).
    """

    def __init__(self, shards: Shards, prefix: str, *, dim: int, inter: int, reduce: bool = True) -> None:
        super().__init__()
        self.gate_proj = shards.linear(prefix + ".gate_proj", shape=(inter, dim))
        self.up_proj = shards.linear(prefix + ".up_proj", shape=(inter, dim))
        self.down_proj = shards.linear(prefix + ".down_proj", reduce=reduce, shape=(dim, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def causal_chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, *,
                           gqa: bool, scale: float | None = None) -> torch.Tensor:
    """Causal attention of queries ``q`` ``[H, T, d]`` at positions ``[start, start + T)`` over
    ``keys`` ``[K, S, d]`` and ``values`` ``[K, S, d_v]`` at ``[0, S)``, ``S = start + T`` (``gqa``: ``K``
    divides ``H``, query head ``h`` reading KV head ``h // (H / K)``; else ``K = H``; ``scale``: SDPA's,
    default ``1/sqrt(d)``): ``[H, T, d_v]``.

    No ``[T, S]`` mask is built: from position 0 SDPA's own causal flag, else its lower-right causal bias
    (:func:`torch.nn.attention.bias.causal_lower_right`), both of which its fused CUDA kernels take (in
    ``[N, H, L, d]`` form); a materialised mask, or three-dimensional inputs, send the call to the math
    kernel, whose ``[H, T, S]`` scores do not fit at long contexts (~34 GB for an 8k chunk at 32k with 32
    heads). The Mixtral family and DeepSeek-V3 (its expanded MLA heads) use it on CUDA.
    """
    H, T = q.shape[0], q.shape[1]
    q, keys, values = q[None], keys[None], values[None]  # the fused kernels take [N, H, L, d] only
    if start == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa, scale=scale)[0]
    if gqa:  # the bias's fused kernels take equal head counts
        keys = keys.repeat_interleave(H // keys.shape[1], 1)
        values = values.repeat_interleave(H // values.shape[1], 1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(T, start + T), scale=scale)[0]


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
