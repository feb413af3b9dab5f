"""transformers as the test oracle: greedy continuations from a model loaded from the same files."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def hf_greedy(model, prompts: list[list[int]], *, max_tokens: int, eos: tuple[int, ...]) -> list[list[int]]:
    """Each prompt's greedy continuation by a transformers causal LM, with its own KV cache.

    Args:
        model: a loaded transformers ``*ForCausalLM`` in eval mode (float32 for exact comparisons);
        prompts: token ids per prompt; max_tokens: tokens per continuation at most; eos: ids that
            end a continuation (the EOS itself included).

    Returns:
        the generated token ids per prompt (``<= max_tokens`` each).
    """
    from transformers import DynamicCache

    out = []
    with torch.no_grad():
        for ids in prompts:
            cache, tokens = DynamicCache(config=model.config), []
            logits = model(torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
            while len(tokens) < max_tokens:
                tokens.append(int(logits.argmax()))
                if tokens[-1] in eos:
                    break
                logits = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0, -1]
            out.append(tokens)
    return out


def dequantized_copy(src: Path, dst: Path) -> Path:
    """``src`` (a DeepSeek-V4 checkpoint) with every FP8/FP4 weight expanded to float32 by transformers'
    ``Fp8Dequantize``: the reference copy for transformers paths that refuse the quantized one.

    Returns:
        ``dst``, a float32 checkpoint without ``quantization_config``.
    """
    from safetensors import safe_open
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from shardsmith.testing.tiny import write_checkpoint

    expand = Fp8Dequantize(None)._dequantize_one
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            raw.update({k: h.get_tensor(k) for k in h.keys()})
    out = {}
    for name, t in raw.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in raw:
            continue
        scale = raw.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        out[name] = t if scale is None else expand(t, scale, output_dtype=torch.float32)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    config.pop("expert_dtype", None)
    return write_checkpoint(dst, out, config, max_shard_bytes=8 << 20)
