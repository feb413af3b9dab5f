"""transformers' own DeepSeek-V4 at the same shapes: the per-token figure issue 12 compares against.

Builds ``DeepseekV4ForCausalLM`` from a DeepSeek-V4 ``config.json`` (the release's, or a
``gen_v4_checkpoint.py`` template's) with ``--layers`` layers (the config's own layer kinds, the
first N of ``compress_ratios``) and ``--experts`` routed experts per layer, directly on the device
in bf16 with transformers' random initialisation (speed does not depend on the weights' values;
random routing is the uniform worst case for both sides), and times greedy decode the way our rows
are timed: one prefill forward of ``--prompt`` tokens with a ``DynamicCache``, then one forward
per token on the argmax (a host sync per step, as our engine yields an int per step). Experts are
bf16 (transformers expands FP4/FP8 checkpoints at load), so its memory is about 3.5x ours.

Prints one JSON row: ``run``, ``layers``, ``experts_per_layer``, ``ms_per_token``, ``tokens_per_s``,
``ms_per_layer``, ``param_bytes``, ``transformers`` version. Used by ``benchmarks/gpu/*.sh`` next to
``v4_decode.py`` (same GPU, same call); on CPU with ``--tiny`` for a smoke run.

Source: transformers ``models/deepseek_v4/modeling_deepseek_v4.py`` (the model), ``generation/utils``
(the greedy loop written out).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def v4_config(config_json: Path, layers: int, experts: int):
    """A transformers ``DeepseekV4Config`` from ``config_json`` cut to ``layers`` layers and ``experts``
    routed experts, unquantized (``quantization_config`` dropped: the model is built in bf16), no MTP.

    Raises:
        ValueError: ``layers`` above the config's layer count, or ``experts`` below ``num_experts_per_tok``.
    """
    from transformers import DeepseekV4Config

    raw = json.loads(Path(config_json).read_text())
    if layers > raw["num_hidden_layers"]:
        raise ValueError(f"{config_json}: --layers {layers} > num_hidden_layers={raw['num_hidden_layers']}")
    if experts < raw["num_experts_per_tok"]:
        raise ValueError(f"--experts {experts} < num_experts_per_tok={raw['num_experts_per_tok']}")
    for key in ("quantization_config", "reap_pruning", "transformers_version", "torch_dtype"):
        raw.pop(key, None)
    raw.update(num_hidden_layers=layers, n_routed_experts=experts, num_nextn_predict_layers=0)
    if isinstance(raw.get("compress_ratios"), list):
        raw["compress_ratios"] = raw["compress_ratios"][:layers]
    raw["num_hash_layers"] = min(raw.get("num_hash_layers", 0), layers)
    return DeepseekV4Config(**raw)


@torch.inference_mode()
def time_decode(model, prompt: int, tokens: int, device: torch.device) -> dict:
    """Greedy decode of ``tokens`` steps after a ``prompt``-token prefill (random ids):
    ``{"ms_per_token": ...}``, milliseconds per step over the last ``tokens - 1`` steps (the first
    step's one-time costs left out)."""
    from transformers import DynamicCache

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device=device)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    sync()
    t0 = None
    for i in range(tokens):
        if i == 1:
            sync()
            t0 = time.perf_counter()
        out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        token.item()  # the host sync a server pays per token
    sync()
    return {"ms_per_token": (time.perf_counter() - t0) * 1e3 / (tokens - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path, nargs="?", help="a DeepSeek-V4 config.json")
    ap.add_argument("--tiny", action="store_true", help="the tiny test checkpoint's config instead (smoke run)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    if a.tiny:
        import tempfile

        from shardsmith.testing.tiny_v4 import tiny_deepseek_v4

        a.config = tiny_deepseek_v4(Path(tempfile.mkdtemp()) / "v4", layers=4) / "config.json"
    if a.config is None:
        ap.error("give a config.json or --tiny")
    import transformers
    from transformers import DeepseekV4ForCausalLM

    device = torch.device(a.device)
    config = v4_config(a.config, a.layers, a.experts)
    t0 = time.perf_counter()
    with torch.device(device):
        model = DeepseekV4ForCausalLM(config).to(torch.bfloat16).eval()
    build_s = time.perf_counter() - t0
    time_decode(model, a.prompt, 3, device)  # warm-up
    row = time_decode(model, a.prompt, a.tokens, device)
    row.update(run="transformers eager", layers=a.layers, experts_per_layer=a.experts, prompt_tokens=a.prompt,
               decode_tokens=a.tokens, tokens_per_s=1e3 / row["ms_per_token"],
               ms_per_layer=row["ms_per_token"] / a.layers,
               param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()), build_s=build_s,
               transformers=transformers.__version__, torch=torch.__version__, device=str(device))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
