"""transformers' own implementation as a parity configuration (``--reference transformers``).

The checkpoint is loaded with ``AutoModelForCausalLM.from_pretrained`` twice, in the compute dtype
and in the reference precision, in this process (one rank: transformers' model is not split).
Decoding is greedy with its KV cache; the same forward hooks as the engine's
(:mod:`shardsmith.parity.collect`) record each step's logits and, with ``layers``, the decoder
layers' outputs (``model.layers``), so the trace is the same :class:`~shardsmith.parity.compare.Trace`.

One family-specific step comes first (:func:`loadable_checkpoint`): transformers (5.x, CPU) loads a
block-scaled FP8 checkpoint (``weight_scale_inv``, DeepSeek-V3's format) by expanding the scales
over whole blocks, and where a tensor's edge cuts a block (DeepSeek-V3's ``kv_a_proj_with_mqa``:
576 rows of 128-row blocks) it scales the wrong elements without an error (measured on the tiny
V3: 3% of the weight off, the model 6% off at layer 0, which parity would call a defect of ours).
Such a checkpoint is given to transformers as a float32 copy dequantized block by block, cropped at
the edges (``w * weight_scale_inv``, :func:`~shardsmith.runtime.layers.quant.dequantize_blocks`).
Legend: N = generated tokens, K = probed tokens, V = vocabulary.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from shardsmith.errors import UsageError
from shardsmith.parity.collect import Probe, recording, recording_layers
from shardsmith.parity.compare import Trace


def ragged_fp8(ckpt: Path) -> list[str]:
    """Names and shapes (``name [R, C] / block [b0, b1]``) of FP8 weights whose ``weight_scale_inv``
    blocks are cut by the tensor's edge, sorted; empty for any other checkpoint.

    Raises:
        UsageError: ``config.json`` or a shard's header cannot be read.
    """
    import json

    from safetensors import safe_open

    try:
        quant = json.loads((ckpt / "config.json").read_text(encoding="utf-8")).get("quantization_config") or {}
    except (OSError, ValueError) as e:
        raise UsageError(f"--reference transformers: cannot read {ckpt / 'config.json'} ({e})") from e
    block = quant.get("weight_block_size")
    if quant.get("quant_method") != "fp8" or not block:
        return []
    out = []
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names = set(h.keys())
            for name in sorted(n for n in names if n.endswith(".weight_scale_inv") and n[: -len("_scale_inv")] in names):
                shape = h.get_slice(name[: -len("_scale_inv")]).get_shape()
                if len(shape) == 2 and (shape[0] % block[0] or shape[1] % block[1]):
                    out.append(f"{name[: -len('_scale_inv')]} {list(shape)} / block {list(block)}")
    return out


def loadable_checkpoint(ckpt: Path, work: Path, progress: Callable[[str], None] = lambda _m: None) -> Path:
    """``ckpt``, or where it has FP8 blocks cut by a tensor edge (:func:`ragged_fp8`), a float32 copy
    under ``work`` with every FP8 weight dequantized and no ``quantization_config`` (one source
    shard in memory at a time; other files copied).

    Raises:
        UsageError: see :func:`ragged_fp8`.
    """
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardsmith.runtime.layers.quant import dequantize_blocks

    ragged = ragged_fp8(ckpt)
    if not ragged:
        return ckpt
    progress(f"transformers misreads FP8 blocks cut by a tensor edge ({ragged[0]}, {len(ragged)} such): "
             f"loading a float32 copy dequantized block by block")
    config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    work.mkdir(parents=True, exist_ok=True)
    files = sorted(ckpt.glob("*.safetensors"))
    handles = {f.name: safe_open(str(f), "pt") for f in files}
    where = {k: name for name, h in handles.items() for k in h.keys()}  # a scale may sit in another shard
    weight_map = {}
    for f in files:
        out = {}
        for name in handles[f.name].keys():
            if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in where:
                continue
            t = handles[f.name].get_tensor(name)
            if name + "_scale_inv" in where:
                t = dequantize_blocks(t, handles[where[name + "_scale_inv"]].get_tensor(name + "_scale_inv").float(),
                                      block, torch.float32)
            out[name] = t
        save_file(out, str(work / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, f.name))
    for f in ckpt.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, work / f.name)
    (work / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if (ckpt / "model.safetensors.index.json").is_file():
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (work / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    return work


def plain_pytorch_kwargs(ckpt: Path) -> dict:
    """``from_pretrained`` options that keep transformers on its PyTorch code: an MXFP4 checkpoint
    (gpt-oss) dequantized at load, not run by Hub kernels that transformers would download when the
    ``kernels`` package is installed (and that a reference must not depend on).
    """
    import json

    quant = json.loads((ckpt / "config.json").read_text(encoding="utf-8")).get("quantization_config") or {}
    if quant.get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    return {}


def load_transformers(ckpt: Path, dtype: torch.dtype, device: str):
    """``AutoModelForCausalLM`` from ``ckpt`` in ``dtype`` on ``device``, in eval mode.

    Raises:
        UsageError: transformers is not installed or cannot load the checkpoint (the reason).
    """
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise UsageError("--reference transformers needs the transformers package (pip install transformers)") from e
    transformers.utils.logging.set_verbosity_error()  # deprecation chatter would bury the tables
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kwargs: dict = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
    if dtype == torch.float64 and major >= 5:
        kwargs["experts_implementation"] = "eager"  # its grouped_mm has no float64
    kwargs |= plain_pytorch_kwargs(ckpt)
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt, **kwargs)
    except Exception as e:  # noqa: BLE001 - any loader failure is a usage problem of this option
        raise UsageError(f"--reference transformers: transformers cannot load {ckpt} in {dtype} "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
    return model.to("cuda" if device == "cuda" else "cpu").eval()


@torch.inference_mode()
def _greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens ``[N]`` and every step's log-softmax ``[N, V]`` (float64)."""
    dev = next(model.parameters()).device
    rows: list[torch.Tensor] = []
    ids, past, tokens = torch.tensor([prompt], device=dev), None, []
    with recording(model, rows, last_row=False), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values renamed in transformers 5.x
        for _ in range(max_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]], device=dev)
    lp = torch.stack([r[0, -1] for r in rows]).double().log_softmax(dim=-1)  # hook rows: logits [1, T, V]
    return tokens, lp


@torch.inference_mode()
def _forced(model, prompt: list[int], tokens: list[int], probe_ids: torch.Tensor,
            layers: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Teacher-forced log-probs of ``probe_ids`` ``[N, K]`` and the layers' outputs ``[T, D]`` each."""
    dev = next(model.parameters()).device
    sink: list[list[torch.Tensor]] = []
    ids = torch.tensor([list(prompt) + list(tokens)], device=dev)
    if layers:
        with recording_layers(model, sink):
            logits = model(input_ids=ids, use_cache=False).logits[0]
    else:
        logits = model(input_ids=ids, use_cache=False).logits[0]  # [T, V]
    lp = logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].double().log_softmax(dim=-1).cpu()
    hidden = [s[0].reshape(-1, *s[0].shape[2:]) if s[0].dim() > 2 else s[0] for s in sink] if layers else None
    return lp.gather(1, probe_ids[: len(tokens)]), hidden


def run_transformers(ckpt: Path, prompts: list[list[int]], *, dtype: torch.dtype, ref_dtype: torch.dtype,
                     max_tokens: int, top_k: int, probes: list[Probe] | None, layers: bool,
                     device: str = "cpu") -> list[Trace]:
    """transformers' traces of ``prompts``, as :func:`shardsmith.parity.collect.dtype_phase` and
    :func:`~shardsmith.parity.collect.reference_phase` record them for the engine.

    Raises:
        UsageError: see :func:`load_transformers`.
    """
    model = load_transformers(ckpt, dtype, device)
    runs = []
    for i, prompt in enumerate(prompts):
        tokens, lp = _greedy(model, prompt, max_tokens)
        top_lp, top_ids = torch.topk(lp, min(top_k, lp.shape[-1]), dim=-1)
        probe_ids = top_ids if probes is None else probes[i].top_ids
        forced = tokens if probes is None else probes[i].tokens
        hidden = _forced(model, prompt, forced, probe_ids, layers)[1] if layers else None
        runs.append((tokens, top_ids, top_lp, probe_ids, lp.gather(1, probe_ids), forced, hidden))
    del model
    gc.collect()
    ref = load_transformers(ckpt, ref_dtype, device)
    traces = []
    for prompt, (tokens, top_ids, top_lp, probe_ids, probe_lp, forced, hidden) in zip(prompts, runs):
        ref_lp, hidden_ref = _forced(ref, prompt, forced, probe_ids, layers)
        traces.append(Trace(tokens, top_ids, top_lp, probe_ids, probe_lp, ref_lp, hidden, hidden_ref))
    return traces
