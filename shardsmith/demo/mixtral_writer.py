"""Turn dense Llama weights into a sharded Mixtral checkpoint (bf16, or block FP8).

Every expert is the dense MLP with its intermediate neurons reordered by its own seeded
permutation ``p`` (``w1 = gate[p]``, ``w3 = up[p]``, ``w2 = down[:, p]``): a permutation of the
hidden units leaves ``down(silu(gate x) * up x)`` unchanged, and Mixtral's top-k weights are
renormalized to sum to 1, so the MoE layer computes the dense MLP exactly (up to float summation
order) for any router, while every expert has different bytes.

FP8 follows DeepSeek-V3's checkpoint format (``inference/kernel.py`` ``weight_dequant``): the weight
is ``float8_e4m3fn`` ``[R, C]`` with an F32 ``weight_scale_inv`` ``[ceil(R/128), ceil(C/128)]``, and
``w = fp8.float() * scale_inv`` on each 128x128 block (edge blocks cropped, 576 = 4.5 blocks).
Scales are plain ``scale_inv = amax / 448`` per block (as DeepSeek-V3's ``act_quant`` computes
them), so every block's largest |w| maps to 448. We tried power-of-two scales first: they are as
accurate on average, but on SmolLM2-135M (whose greedy first answer token wins by only 0.1 nat)
they happened to flip "The capital..." into a French ramble; amax/448 keeps the answer.

Legend: D = hidden, I = intermediate, E = experts, R/C = rows/columns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .gguf_source import LlamaShape

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SHARD_BYTES = 100_000_000
ROUTER_STD = 0.02


def quantize_fp8_blocks(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a weight to ``float8_e4m3fn`` with ``scale_inv = amax / 448`` per block.

    Args:
        w: ``[R, C]`` float weight.
        block: square block edge in elements (128).

    Returns:
        ``(q, scale_inv)``: ``q`` is ``[R, C]`` float8_e4m3fn, ``scale_inv`` is
        ``[ceil(R/block), ceil(C/block)]`` float32 with ``w ~= q.float() * scale_inv`` per block.
    """
    R, C = w.shape
    rb, cb = -(-R // block), -(-C // block)
    padded = torch.zeros(rb * block, cb * block, dtype=torch.float32)
    padded[:R, :C] = w.float()
    blocks = padded.reshape(rb, block, cb, block)  # [rb, 128, cb, 128]
    amax = blocks.abs().amax(dim=(1, 3))  # [rb, cb]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # all-zero block: any scale
    # amax / (amax / 448) can round to just above 448; clamp so it cannot become NaN in e4m3fn.
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rb * block, cb * block)[:R, :C].contiguous(), scale_inv


@dataclass(frozen=True, slots=True)
class TensorUnit:
    """Tensors produced together and kept in one shard (a weight and its ``weight_scale_inv``).

    Attributes:
        specs: ``(name, shape, dtype)`` of each tensor the unit makes, in write order.
        make: builds the tensors, ``name -> tensor``; called once, at write time.
    """

    specs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    make: Callable[[], dict[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """Bytes of all the unit's tensors."""
        total = 0
        for _, shape, dtype in self.specs:
            n = dtype.itemsize
            for d in shape:
                n *= d
            total += n
        return total


def _plain(name: str, fn: Callable[[], torch.Tensor], shape: tuple[int, ...]) -> TensorUnit:
    return TensorUnit(((name, shape, torch.bfloat16),), lambda: {name: fn().to(torch.bfloat16).contiguous()})


def _linear(name: str, fn: Callable[[], torch.Tensor], shape: tuple[int, ...], fp8: bool) -> TensorUnit:
    if not fp8:
        return _plain(name, fn, shape)
    sname = name[: -len("weight")] + "weight_scale_inv"
    sshape = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))

    def make() -> dict[str, torch.Tensor]:
        # FP8 is quantized from the bf16-rounded weight, the same values the bf16 checkpoint holds.
        q, s = quantize_fp8_blocks(fn().to(torch.bfloat16))
        return {name: q, sname: s}

    return TensorUnit(((name, shape, torch.float8_e4m3fn), (sname, sshape, torch.float32)), make)


def mixtral_units(dense: dict[str, torch.Tensor], s: LlamaShape, *, fp8: bool, num_experts: int,
                  seed: int) -> list[TensorUnit]:
    """Plan every tensor of the Mixtral checkpoint, in write order (embeddings, layers, norm).

    Per layer N the router ``block_sparse_moe.gate.weight`` ``[E, D]`` is N(0, 0.02^2) noise and
    expert e gets permutation ``p = randperm(I)``, both drawn from one ``torch.Generator`` seeded
    with ``seed``, layer by layer (router first, then experts 0..E-1).

    Args:
        dense: dense Llama weights (names as :func:`gguf_source.expected_shapes`), float32.
        s: model hyperparameters.
        fp8: quantize attention and expert linears to block FP8 (embeddings, norms, router stay bf16).
        num_experts: E.
        seed: generator seed.

    Returns:
        The tensor units, each producing its tensors lazily.
    """
    gen = torch.Generator().manual_seed(seed)
    D, I = s.hidden_size, s.intermediate_size
    emb = dense["model.embed_tokens.weight"]
    units = [_plain("model.embed_tokens.weight", lambda: emb, (s.vocab_size, D))]
    for n in range(s.num_layers):
        pre = f"model.layers.{n}."
        for k in ("input_layernorm", "post_attention_layernorm"):
            w = dense[f"{pre}{k}.weight"]
            units.append(_plain(f"{pre}{k}.weight", lambda w=w: w, (D,)))
        for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = dense[f"{pre}self_attn.{k}.weight"]
            units.append(_linear(f"{pre}self_attn.{k}.weight", lambda w=w: w, tuple(w.shape), fp8))
        router = torch.randn(num_experts, D, generator=gen) * ROUTER_STD
        units.append(_plain(f"{pre}block_sparse_moe.gate.weight", lambda r=router: r, (num_experts, D)))
        gate, up, down = (dense[f"{pre}mlp.{k}_proj.weight"] for k in ("gate", "up", "down"))
        for e in range(num_experts):
            p = torch.randperm(I, generator=gen)
            ex = f"{pre}block_sparse_moe.experts.{e}."
            units += [
                _linear(ex + "w1.weight", lambda g=gate, p=p: g[p], (I, D), fp8),  # [I, D] rows permuted
                _linear(ex + "w2.weight", lambda d=down, p=p: d[:, p], (D, I), fp8),  # [D, I] cols permuted
                _linear(ex + "w3.weight", lambda u=up, p=p: u[p], (I, D), fp8),  # [I, D] rows permuted
            ]
    norm = dense["model.norm.weight"]
    units.append(_plain("model.norm.weight", lambda: norm, (D,)))
    return units


def _pack(units: list[TensorUnit], limit: int) -> list[list[TensorUnit]]:
    shards: list[list[TensorUnit]] = [[]]
    size = 0
    for u in units:
        if shards[-1] and size + u.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(u)
        size += u.nbytes
    return shards


def write_shards(out_dir: Path, units: list[TensorUnit], *,
                 shard_bytes: int = SHARD_BYTES) -> Iterator[str]:
    """Write ``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json``.

    Units are packed greedily in order into shards of at most ``shard_bytes`` bytes of tensor
    data (a unit larger than that gets a shard of its own); one shard is in memory at a time.
    The index's ``metadata.total_size`` is the sum of tensor bytes, as transformers writes it.

    Yields:
        Each file name written, relative to ``out_dir`` (index last).
    """
    from safetensors.torch import save_file

    shards = _pack(units, shard_bytes)
    umask = os.umask(0)
    os.umask(umask)
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for u in shard:
            tensors.update(u.make())
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        (out_dir / fname).chmod(0o666 & ~umask)  # safetensors writes through a 0600 temporary file
        weight_map.update(dict.fromkeys(tensors, fname))
        yield fname
    index = {"metadata": {"total_size": sum(u.nbytes for u in units)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    yield "model.safetensors.index.json"


def mixtral_config(s: LlamaShape, *, fp8: bool, num_experts: int, top_k: int) -> dict:
    """The ``config.json`` of the Mixtral checkpoint (tied embeddings, no sliding window)."""
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.context_length,
        "initializer_range": 0.02,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_local_experts": num_experts,
        "num_experts_per_tok": top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": s.bos_id,
        "eos_token_id": s.eos_id,
        "pad_token_id": s.pad_id,
        "torch_dtype": "bfloat16",
    }
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    return config
