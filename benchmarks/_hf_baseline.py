"""The baseline a user would reach for: transformers + accelerate with the routed experts in host RAM.

Loads the synthetic Mixtral checkpoint (``<pack-root>/src``, made by ``decode_offload.make_checkpoint``)
with ``AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16, device_map=..., max_memory=...)``
and times greedy decode. Rows (CUDA):

=============================  =================================================================
``hf_accelerate_experts_cpu``  explicit ``device_map``: every routed-experts module (transformers
                               5.x fuses a layer's experts into one ``MixtralExperts`` module with
                               ``gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``) on ``"cpu"``,
                               everything else on GPU 0. accelerate's hooks copy the module's
                               weights to the GPU at every forward, from pageable memory (it does
                               not pin): all E experts of the layer, not only the routed ones.
``hf_accelerate_auto``         ``device_map="auto"`` with ``max_memory={0: gpu_bytes, "cpu": RAM}``:
                               accelerate places whole ``MixtralDecoderLayer`` s (its no-split unit)
                               on the GPU until the budget is spent; the rest run from host RAM the
                               same way.
=============================  =================================================================

On ``--device cpu`` one row, ``hf_cpu``: everything on the CPU, no hooks (for tests and smoke runs).

Timing: the loop ``generate()`` runs for greedy search, written out so that prefill and decode
are timed apart the way our rows are: one prefill forward with a ``DynamicCache``, then one
forward per token on the argmax (a host sync each step, as our engine yields an int per step).
EOS does not stop it. ``decode_s`` spans the ``tokens - 1`` steps after the first token;
a warm-up generation runs first. ``tests/runtime/models/test_hf_baseline.py`` checks the loop's tokens against
``model.generate(do_sample=False)`` and against our engine at TP=1.

Row fields besides ours (``tokens_per_s``, ``decode_tokens``, ``decode_s``, ``load_s``):
``device_map_modules`` (map entries per device), ``offloaded_param_bytes``, ``gpu_bytes_budget``
(``auto`` only), ``hf_expert_format``, versions. ``bytes_copied_per_token`` is computed, not
measured: the offloaded parameter bytes, copied once per forward.

FP8 checkpoints: on CUDA, transformers' native FP8 path is tried first (only the experts are FP8
in ``make_checkpoint``, so ``modules_to_not_convert`` keeps attention and the LM head in bf16);
it needs the ``kernels-community/finegrained-fp8`` Hub kernel, which an offline host lacks. When
it fails, a ``skipped`` row says why and the run repeats with ``dequantize=True`` (bf16 experts:
twice the bytes per copy). On the CPU transformers dequantizes by itself.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import random
import time
import traceback
from pathlib import Path
from typing import Any

import torch


def bench_prompt(*, seed: int, vocab: int, tokens: int) -> list[int]:
    """The benchmark prompt: ``tokens`` ids drawn from ``[3, vocab)`` by ``random.Random(seed)`` (ours and HF's)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(tokens)]


def checkpoint_bytes(src: Path) -> dict[str, int]:
    """Bytes of a safetensors checkpoint by kind, from the file headers (no tensor read).

    Returns:
        ``{"experts": ..., "dense": ...}``: tensors under a ``.experts.`` module (weights and their
        FP8 scales) and every other tensor, in bytes (global, TP=1).
    """
    out = {"experts": 0, "dense": 0}
    for f in sorted(Path(src).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name != "__metadata__":
                start, end = meta["data_offsets"]
                out["experts" if ".experts." in name else "dense"] += end - start
    return out


def experts_cpu_device_map(model: torch.nn.Module, *, gpu: int | str = 0) -> dict[str, int | str]:
    """The coarsest ``device_map`` with every routed-experts module on ``"cpu"`` and the rest on ``gpu``.

    A module named ``...experts`` goes to the CPU, a module holding none goes whole to ``gpu``, a
    module holding some is split into its children. Works on a ``meta`` model.

    Raises:
        ValueError: a module holding experts also holds its own parameters or buffers (no map
            entry could place them).
    """
    names = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] == "experts"]
    out: dict[str, int | str] = {}

    def walk(prefix: str, mod: torch.nn.Module) -> None:
        holds = [n for n in names if not prefix or n == prefix or n.startswith(prefix + ".")]
        if prefix in names:
            out[prefix] = "cpu"
        elif not holds:
            out[prefix] = gpu
        elif any(True for _ in mod.parameters(recurse=False)) or any(True for _ in mod.buffers(recurse=False)):
            raise ValueError(f"module {prefix or '<root>'!r} holds experts and its own tensors: no device_map for it")
        else:
            for name, child in mod.named_children():
                walk(f"{prefix}.{name}" if prefix else name, child)

    walk("", model)
    return out


def load_model(src: Path, *, device_map: dict | str, max_memory: dict | None = None,
               dtype: torch.dtype = torch.bfloat16, fp8: str | None = None) -> tuple[Any, float]:
    """``from_pretrained`` with this placement; returns the model and its load seconds.

    Args:
        fp8: None for a bf16 checkpoint; ``"native"`` keeps FP8 experts (attention and LM head
            bf16); ``"dequantize"`` expands them to ``dtype`` at load.
    """
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {}
    if fp8 is not None:
        from transformers import FineGrainedFP8Config

        kw["quantization_config"] = FineGrainedFP8Config(dequantize=fp8 == "dequantize",
                                                         modules_to_not_convert=["self_attn", "lm_head"])
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype, device_map=device_map,
                                                 max_memory=max_memory, **kw)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return model.eval(), time.perf_counter() - t0


@torch.inference_mode()
def timed_greedy(model: Any, prompt: list[int], *, tokens: int, device: str) -> tuple[list[int], float]:
    """Greedy ``tokens`` ids after ``prompt``; returns them and the seconds of the ``tokens - 1`` decode steps."""
    from transformers import DynamicCache

    # later 5.x releases name the argument ``cache`` (5.24 warns on ``past_key_values``); earlier ones don't
    kv = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {kv: DynamicCache(config=model.config)}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    ids = torch.tensor([prompt], device=device)
    logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache).logits
    out = [int(logits[0, -1].argmax())]
    sync()
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        ids = torch.tensor([[out[-1]]], device=device)
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache).logits
        out.append(int(logits[0, -1].argmax()))
    sync()
    return out, time.perf_counter() - t0


def input_device(model: Any, default: str) -> str:
    """Where the token ids go: where the input embedding runs.

    An accelerate hook on the embedding (``_hf_hook.execution_device``) moves its inputs there
    itself; without one the ids must sit on the embedding weight's own device. ``device_map="auto"``
    under a GPU budget smaller than one decoder layer put the embedding on the CPU with no hook (the
    2026-11-30 H200 run failed in ``F.embedding`` with CUDA ids), so the map alone does not decide.
    """
    emb = model.get_input_embeddings()
    hook = getattr(emb, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return f"cuda:{dev}" if isinstance(dev, int) else str(dev)
    weight = getattr(emb, "weight", None)
    if weight is None or weight.device.type == "meta":
        return default
    return str(weight.device)


def placement(model: Any) -> dict[str, Any]:
    """``device_map`` summary: map entries per device, and the parameter bytes behind accelerate's offload hooks.

    With a GPU in the map, modules on ``"cpu"`` or ``"disk"`` are offloaded (their weights are
    copied to the GPU at every forward); with none, only ``"disk"`` ones are.
    """
    dm = getattr(model, "hf_device_map", None) or {"": str(next(model.parameters()).device)}
    modules: dict[str, int] = {}
    for dev in dm.values():
        key = dev if dev in ("cpu", "disk") else "cuda"  # accelerate writes GPU 0 as 0 or "cuda:0"
        modules[key] = modules.get(key, 0) + 1
    offloaded = ("cpu", "disk") if "cuda" in modules else ("disk",)
    nbytes = sum(p.numel() * p.element_size() for name, dev in dm.items() if dev in offloaded
                 for p in model.get_submodule(name).parameters())
    return {"device_map_modules": modules, "offloaded_param_bytes": nbytes}


def hf_offload_rows(src: Path, *, device: str, gpu_bytes: int | None, tokens: int, warmup_tokens: int,
                    prompt_tokens: int, seed: int) -> list[dict]:
    """The baseline rows (see the module docstring), each with ``tp: 1``; failures become ``skipped`` rows.

    Args:
        src: the Mixtral checkpoint; device: ``cuda`` or ``cpu``; gpu_bytes: GPU bytes our TP=1
            offloaded run uses (dense weights + expert cache), the ``auto`` row's GPU budget;
        tokens: generated per run (``tokens - 1`` timed); prompt_tokens, seed: as ``bench_prompt``.

    Raises:
        ValueError: ``device="cuda"`` without ``gpu_bytes``.
    """
    if device == "cuda" and gpu_bytes is None:
        raise ValueError("gpu_bytes is required on cuda: the auto row's GPU budget (our TP=1 dense + cache bytes)")
    # the checkpoint is local: offline, a Hub kernel that FP8 wants fails at once instead of after timeouts
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    prompt = bench_prompt(seed=seed, vocab=cfg["vocab_size"], tokens=prompt_tokens)
    fp8_modes = [None] if "quantization_config" not in cfg else (["native", "dequantize"] if device == "cuda"
                                                                  else ["dequantize"])
    base = {"tp": 1, "device": device, "prompt_tokens": prompt_tokens, "transformers_version": transformers.__version__}
    try:
        import accelerate

        base["accelerate_version"] = accelerate.__version__
    except ImportError:
        if device == "cuda":
            return [{"run": "hf_accelerate_experts_cpu", **base, "skipped": "accelerate is not installed"}]

    if device == "cuda":
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(src)))
        host_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        specs = [("hf_accelerate_experts_cpu", experts_cpu_device_map(meta, gpu=0), None),
                 ("hf_accelerate_auto", "auto", {0: gpu_bytes, "cpu": host_ram})]
        del meta
        run_device = "cuda:0"
    else:
        specs = [("hf_cpu", "cpu", None)]
        run_device = "cpu"

    rows = []
    for run, device_map, max_memory in specs:
        for fp8 in list(fp8_modes):
            row = {"run": run, **base, "hf_expert_format": {None: "bf16", "native": "fp8",
                                                           "dequantize": "fp8 dequantized to bf16"}[fp8]}
            if run == "hf_accelerate_auto":
                row["gpu_bytes_budget"] = gpu_bytes
            try:
                model, load_s = load_model(src, device_map=device_map, max_memory=max_memory, fp8=fp8)
                where = input_device(model, run_device)  # "auto" may place every layer on the CPU
                timed_greedy(model, prompt, tokens=max(2, warmup_tokens), device=where)
                _, decode_s = timed_greedy(model, prompt, tokens=tokens, device=where)
                row |= {"decode_tokens": tokens - 1, "decode_s": decode_s, "tokens_per_s": (tokens - 1) / decode_s,
                        "load_s": load_s, "input_device": where, **placement(model),
                        "hf_experts_implementation": getattr(model.config, "_experts_implementation", None)}
                # accelerate copies every offloaded module's weights at every forward: one forward per token
                row["bytes_copied_per_token"] = row["offloaded_param_bytes"]
            except Exception as e:  # noqa: BLE001 - a placement that cannot run is a row that says why
                what = f"transformers FP8 on {device}" if fp8 == "native" else f"{run} on {device}"
                row["skipped"] = f"{what}: {type(e).__name__}: {e}"[:400]
                traceback.print_exc()
                if fp8 == "native":
                    fp8_modes.remove("native")  # the next placement goes straight to the dequantized copy
            model = None  # here, not in the except clause: its traceback holds the model until the clause ends
            _free()
            rows.append(row)
            if "skipped" not in row or fp8 != "native":
                break  # this placement ran, or failed for a reason a dequantized retry would not change
    return rows


def _free() -> None:
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
