"""The DeepSeek-V3 causal LM, built on ``meta`` from the rank's plan and filled from its weights.

Module names mirror the Hugging Face checkpoint (``model.layers.N.self_attn.kv_b_proj.weight``),
so loading is a strict name-for-name assignment (:func:`assign_weights`); expert banks fill
``model.layers.N.mlp.experts.{gate_up,down}(_scale)``. The MTP layers (``model.layers.{L..}``
with ``L = num_hidden_layers``: ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head`` and a full decoder layer) stay in the pack and are not loaded or run.

One sequence at a time (batch 1); the latent KV cache is indexed by position, so a step may start
anywhere up to where the last one ended. Source of the maths: transformers
``modeling_deepseek_v3.py`` (``DeepseekV3ForCausalLM``), DeepSeek-V3 ``inference/model.py``.

Legend: T = new tokens, D = hidden, V = vocabulary, c = kv_lora_rank, r = qk_rope_head_dim.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shardsmith.errors import UsageError
from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.models.deepseek_v3.attention import ABSORB_MODES, MLAttention
from shardsmith.runtime.models.deepseek_v3.config import V3Args, rope_tables
from shardsmith.runtime.models.deepseek_v3.moe import MoE
from shardsmith.runtime.models.mixtral.model import RMSNorm, install_buffers
from shardsmith.runtime.models.mixtral.moe import MLP

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

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), start, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3(nn.Module):
    """DeepSeek-V3 on one rank: vocab-parallel embedding, decoder layers, final norm, vocab-parallel head.

    Args:
        args: configuration; shards: the rank's plan and compute dtype.

    Raises:
        RuntimeLoadError: listing every tensor the config needs that the plan lacks or shapes differently.
    """

    def __init__(self, args: V3Args, shards: Shards) -> None:
        super().__init__()
        self.args = args
        vocab = (args.vocab_size, args.dim)
        self.model = nn.Module()
        self.model.embed_tokens = shards.embedding("model.embed_tokens.weight", vocab)
        self.model.layers = nn.ModuleList(DecoderLayer(args, shards, i) for i in range(args.n_layers))
        self.model.norm = RMSNorm(args.dim, args.norm_eps, shards.dtype)
        self.lm_head = shards.lm_head("lm_head.weight", vocab)
        self.cos = self.sin = None
        self.max_seq_len = 0
        shards.raise_problems()

    def setup_cache(self, max_seq_len: int, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate the latent cache (``[max_seq_len, c]`` + ``[max_seq_len, r]`` per layer) and RoPE tables."""
        self.max_seq_len = max_seq_len
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.cache_kv = torch.zeros(max_seq_len, attn.c, dtype=dtype, device=device)
            attn.cache_pe = torch.zeros(max_seq_len, attn.rope, dtype=dtype, device=device)
        cos, sin = rope_tables(self.args, max_seq_len)  # [S_max, r] float32
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

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
    def forward(self, ids: torch.Tensor, start: int, *, last_only: bool = True) -> torch.Tensor:
        """Run ``ids`` ``[T]`` at positions ``[start, start + T)``; float32 logits ``[T or 1, V]``.

        Raises:
            UsageError: the step would pass ``max_seq_len`` (the cache's positions).
        """
        T = ids.shape[0]
        if start + T > self.max_seq_len:
            raise UsageError(f"{start + T} positions exceed max_seq_len={self.max_seq_len}")
        cos, sin = self.cos[start: start + T], self.sin[start: start + T]  # [T, r]
        x = self.model.embed_tokens(ids)  # [T, D]
        for layer in self.model.layers:
            x = layer(x, start, cos, sin)
        return self.lm_head(self.model.norm(x[-1:] if last_only else x))  # [T or 1, V]


def assign_weights(model: DeepseekV3, dense: dict[str, torch.Tensor], banks: dict[str, dict[str, torch.Tensor]],
                   *, device: torch.device) -> None:
    """Replace every ``meta`` buffer of ``model`` by the rank's tensor of the same name, strictly.

    Tensors and banks of the MTP layers (index >= ``num_hidden_layers``) are skipped. FP8 weights
    and their F32 ``weight_scale_inv`` keep their stored dtype (on CPU the buffer is the mmap view
    itself); other tensors are cast to the buffer's dtype (the router's BF16 weight to float32).

    Raises:
        RuntimeLoadError: listing every missing, unexpected, mis-shaped or wrongly typed tensor.
    """
    n = model.args.n_layers

    def decoder(name: str) -> bool:
        m = _LAYER.match(name + ".")
        return m is None or int(m.group(1)) < n

    given = {k: t for k, t in dense.items() if decoder(k)}
    for layer, arrays in banks.items():
        if decoder(layer):
            given.update({f"{layer}.mlp.experts.{a}": t for a, t in arrays.items()})

    def convert(name: str, t: torch.Tensor, meta: torch.Tensor) -> torch.Tensor | str:
        if (meta.dtype == torch.float8_e4m3fn) != (t.dtype == torch.float8_e4m3fn):
            return f"dtype {t.dtype}, the model needs {meta.dtype}"
        return t.to(device=device, dtype=meta.dtype)

    install_buffers(model, dict(model.named_buffers()), given, convert, what="the rank's DeepSeek-V3 weights")
