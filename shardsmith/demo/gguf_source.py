"""Read a Llama GGUF (SmolLM2-135M-Instruct, Q4_1) back as dense Hugging Face Llama weights.

Every tensor is dequantized to float32 with the ``gguf`` package (``GGUFReader`` +
``gguf.quants.dequantize``); tokenizer data and hyperparameters come from the GGUF metadata.

Formats and conventions:

- GGUF: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. Tensor shapes are listed
  fastest dim first (``ne0`` = columns); ``GGUFReader`` hands back rows first, i.e. Hugging Face's
  ``[out_features, in_features]``.
- llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders the rows of ``q_proj`` and
  ``k_proj`` inside every head from Hugging Face's rotate-half RoPE layout (first half / second
  half of the head) to GPT-J's interleaved pairs. :func:`unpermute_rope_rows` undoes it, as
  transformers' ``LlamaTensorProcessor._reverse_permute_weights`` does.

Name map (GGUF -> Hugging Face Llama), N = layer:

=======================  =============================================
``token_embd``           ``model.embed_tokens``
``output_norm``          ``model.norm``
``blk.N.attn_norm``      ``model.layers.N.input_layernorm``
``blk.N.ffn_norm``       ``model.layers.N.post_attention_layernorm``
``blk.N.attn_q|k|v``     ``model.layers.N.self_attn.q_proj|k_proj|v_proj``
``blk.N.attn_output``    ``model.layers.N.self_attn.o_proj``
``blk.N.ffn_gate|up``    ``model.layers.N.mlp.gate_proj|up_proj``
``blk.N.ffn_down``       ``model.layers.N.mlp.down_proj``
=======================  =============================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SourceError

_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head RoPE row permutation of a ``q_proj`` / ``k_proj`` weight.

    llama.cpp stores ``w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)`` (convert_hf_to_gguf
    ``LlamaModel.permute``); the inverse views rows as ``(n_head, head_dim // 2, 2)`` and swaps back.

    Args:
        w: ``[n_head * head_dim, in_features]`` as stored in the GGUF.
        n_head: heads in this projection (query heads for q, KV heads for k).

    Returns:
        ``[n_head * head_dim, in_features]`` in Hugging Face rotate-half order.
    """
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """Hyperparameters read from the GGUF's ``llama.*`` and ``tokenizer.ggml.*`` keys.

    Attributes:
        vocab_size: tokens (49152). hidden_size: model width D (576).
        intermediate_size: MLP width I (1536). num_layers: decoder layers (30).
        num_heads: query heads (9). num_kv_heads: KV heads (3). head_dim: per-head width (64).
        rope_theta: RoPE base (``llama.rope.freq_base``). rms_norm_eps: RMSNorm epsilon.
        context_length: trained context in tokens (8192).
        bos_id, eos_id, pad_id, unk_id: special token ids.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """The dequantized model and its tokenizer data.

    Attributes:
        shape: hyperparameters.
        weights: Hugging Face dense Llama names -> float32 tensors (``[out, in]`` for linears).
        tokens: vocabulary strings in id order (GPT-2 byte-level alphabet).
        token_types: llama.cpp token types per id (1 normal, 3 control).
        merges: BPE merges as ``"left right"`` strings, highest priority first.
        chat_template: Jinja chat template (``tokenizer.chat_template``).
    """

    shape: LlamaShape
    weights: dict[str, torch.Tensor]
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    chat_template: str


def _field(reader, key: str, problems: list[str]):
    field = reader.fields.get(key)
    if field is None:
        problems.append(f"missing metadata key {key}")
        return None
    return field.contents()


def _shortest_f32(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (9.9999997e-06 -> 1e-05)."""
    import numpy as np

    return float(str(np.float32(x)))


def read_gguf(path: Path) -> GGUFModel:
    """Dequantize a Llama GGUF into dense Hugging Face float32 tensors plus tokenizer data.

    Args:
        path: a GGUF v3 file with ``general.architecture = llama``.

    Returns:
        The model: ``q_proj`` / ``k_proj`` rows back in Hugging Face order, ``rope_theta`` and
        ``rms_norm_eps`` as the shortest decimals of their float32 values (1e-05, not 9.99e-06).

    Raises:
        SourceError: ``gguf`` is not installed, the file is not a Llama GGUF, or keys, tensors or
            shapes are missing or wrong (all problems listed at once).
    """
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError as e:
        raise SourceError("the demo checkpoint needs the 'gguf' package (pip install gguf)") from e
    reader = GGUFReader(str(path))
    p: list[str] = []
    arch = _field(reader, "general.architecture", p)
    if arch != "llama":
        raise SourceError(f"{path}: general.architecture is {arch!r}, expected 'llama'")
    g = {k: _field(reader, f"llama.{k}", p) for k in (
        "embedding_length", "feed_forward_length", "block_count", "attention.head_count",
        "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon",
        "context_length")}
    t = {k: _field(reader, f"tokenizer.{k}", p) for k in (
        "ggml.tokens", "ggml.token_type", "ggml.merges", "ggml.bos_token_id", "ggml.eos_token_id",
        "ggml.unknown_token_id", "ggml.padding_token_id", "chat_template")}
    if p:
        raise SourceError(f"{path}: bad GGUF metadata: " + "; ".join(sorted(p)), sorted(p))
    heads, kv = int(g["attention.head_count"]), int(g["attention.head_count_kv"])
    hidden = int(g["embedding_length"])
    shape = LlamaShape(
        vocab_size=len(t["ggml.tokens"]), hidden_size=hidden, intermediate_size=int(g["feed_forward_length"]),
        num_layers=int(g["block_count"]), num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads,
        rope_theta=_shortest_f32(g["rope.freq_base"]),
        rms_norm_eps=_shortest_f32(g["attention.layer_norm_rms_epsilon"]),
        context_length=int(g["context_length"]), bos_id=int(t["ggml.bos_token_id"]),
        eos_id=int(t["ggml.eos_token_id"]), pad_id=int(t["ggml.padding_token_id"]),
        unk_id=int(t["ggml.unknown_token_id"]))
    weights = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            p.append(f"unexpected tensor {tensor.name}")
            continue
        rows_first = tuple(int(d) for d in reversed(tensor.shape))
        w = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(rows_first).copy())
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, kv)
        weights[name] = w.float()
    p += _check_shapes(weights, shape)
    if p:
        raise SourceError(f"{path}: unexpected tensors: " + "; ".join(sorted(p)[:5]), sorted(p))
    return GGUFModel(shape, weights, list(t["ggml.tokens"]), [int(x) for x in t["ggml.token_type"]],
                     list(t["ggml.merges"]), str(t["chat_template"]))


def _hf_name(gguf_name: str) -> str | None:
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _NAMES:
        return f"model.layers.{m.group(1)}.{_NAMES[m.group(2)]}.weight"
    return None


def expected_shapes(s: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every dense Hugging Face Llama tensor name -> shape (tied embeddings: no ``lm_head``)."""
    D, I = s.hidden_size, s.intermediate_size
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab_size, D),
                                       "model.norm.weight": (D,)}
    per_layer = {"input_layernorm": (D,), "post_attention_layernorm": (D,), "self_attn.q_proj": (q, D),
                 "self_attn.k_proj": (kv, D), "self_attn.v_proj": (kv, D), "self_attn.o_proj": (D, q),
                 "mlp.gate_proj": (I, D), "mlp.up_proj": (I, D), "mlp.down_proj": (D, I)}
    for n in range(s.num_layers):
        out.update({f"model.layers.{n}.{k}.weight": v for k, v in per_layer.items()})
    return out


def _check_shapes(weights: dict[str, torch.Tensor], s: LlamaShape) -> list[str]:
    want = expected_shapes(s)
    problems = [f"missing tensor {k}" for k in want if k not in weights]
    problems += [f"{k}: shape {tuple(v.shape)} != expected {want[k]}"
                 for k, v in weights.items() if k in want and tuple(v.shape) != want[k]]
    return problems
