"""What :meth:`~shardsmith.runtime.engine.engine.Engine.load` runs between reading a rank's pack and
the step protocol: the model built from the rank's weights (:func:`build_model`: family, dtype,
kernels, expert offload, per-sequence state), and the checks that a context fits the device, before
the load from the model's sizes (:func:`preflight_state`) and after it (:func:`check_state_fits`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardsmith.errors import UsageError
from shardsmith.runtime.layers.parallel import use_kernels_
from shardsmith.runtime.layers.quant import dequantize_fp8_
from shardsmith.runtime.models.registry import ModelFamily, family_for, skeleton

if TYPE_CHECKING:
    from shardsmith.runtime.offload import OffloadConfig

log = logging.getLogger("shardsmith.runtime")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# GPU memory left free after the per-sequence state: a prefill chunk's activations (a 2048-token chunk
# of DeepSeek-V4-Flash: its streams, logits, up to 32 expanded FP4 experts) and the CUDA graphs' pools
ACTIVATION_RESERVE_BYTES = 6 << 30


def check_state_fits(model: Any, max_seq_len: int, max_num_seqs: int, dtype: torch.dtype, *, free_bytes: int,
                     where: str, reserve: int = ACTIVATION_RESERVE_BYTES, kv_cache_tokens: int | None = None) -> None:
    """Refuse a context the device cannot hold, before the per-sequence state is allocated.

    The state ``model.state_bytes_for(max_seq_len, max_num_seqs, dtype)`` (with ``kv_cache_tokens``:
    a KV pool of that many positions, :mod:`~shardsmith.runtime.models.kv_blocks`) must fit in
    ``free_bytes`` (free on the device once the weights are there) less ``reserve`` (a step's
    activations).

    Raises:
        UsageError: it does not fit; the message gives what it needs, what is free, and what fits: the
            largest ``--kv-cache-tokens`` when a pool size was given, else the longest
            ``--max-model-len`` with these slots and the most slots at this length.
    """
    pool = {} if kv_cache_tokens is None else {"kv_cache_tokens": kv_cache_tokens}
    need = model.state_bytes_for(max_seq_len, max_num_seqs, dtype, **pool)
    budget = free_bytes - reserve
    if need <= budget:
        return

    def largest(fits: Callable[[int], bool], high: int) -> int:  # the largest n in [0, high] with fits(n)
        low = 0
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return low

    gib = 2 ** 30
    if kv_cache_tokens is not None:
        tokens = largest(lambda n: model.state_bytes_for(max_seq_len, max_num_seqs, dtype, kv_cache_tokens=n)
                         <= budget, kv_cache_tokens)
        raise UsageError(
            f"--kv-cache-tokens {kv_cache_tokens} needs {need / gib:.2f} GiB of KV cache on {where}, and "
            f"{free_bytes / gib:.2f} GiB are free there after the weights, of which {reserve / gib:.0f} GiB stay free "
            f"for a step's activations: "
            + (f"--kv-cache-tokens {tokens} fits" if tokens >= max_seq_len else
               f"no pool of one --max-model-len {max_seq_len} sequence fits"))
    length = largest(lambda n: model.state_bytes_for(n, max_num_seqs, dtype) <= budget, max_seq_len)
    slots = largest(lambda n: model.state_bytes_for(max_seq_len, n, dtype) <= budget, max_num_seqs)
    raise UsageError(
        f"--max-model-len {max_seq_len} with {max_num_seqs} sequence slot(s) needs {need / gib:.2f} GiB of "
        f"per-sequence state on {where}, and {free_bytes / gib:.2f} GiB are free there after the weights, of which "
        f"{reserve / gib:.0f} GiB stay free for a step's activations: "
        + (f"--max-model-len {length} fits with {max_num_seqs} slot(s)" if length >= 2 else "no context fits")
        + (f", or --max-num-seqs {slots} at {max_seq_len}" if slots >= 1 else ""))


def preflight_state(weights, family: ModelFamily, *, rank: int, dtype: torch.dtype, max_seq_len: int,
                    max_num_seqs: int, offloaded: bool, free_bytes: int, where: str,
                    kv_cache_tokens: int | None = None, **extra: Any) -> int:
    """Refuse a context that cannot fit before any weight reaches the device (a load of a large pack
    takes minutes; this takes a moment): :func:`check_state_fits` on the rank's model skeleton
    (:func:`~shardsmith.runtime.models.registry.skeleton`) with ``free_bytes`` (free on the device
    now) less the weights the device will hold, estimated from the skeleton's buffers (the routed
    experts' banks left out when ``offloaded``; FP8 weights counted at one byte, as the kernels keep
    them). The estimate is a lower bound, so it refuses only what surely does not fit; the check
    after the load stays exact.

    Returns:
        The estimated weight bytes on the device.

    Raises:
        UsageError: the state does not fit (:func:`check_state_fits`' message, with the estimate).
    """
    from shardsmith.runtime.layers.experts import RoutedExperts

    model = skeleton(family, weights, rank=rank, dtype=dtype, **extra)
    if not hasattr(model, "state_bytes_for"):
        return 0
    banks = {id(b) for m in model.modules() if isinstance(m, RoutedExperts) for b in m.buffers()} if offloaded else set()
    on_device = sum(b.nbytes for b in model.buffers() if id(b) not in banks)
    on_device += sum(p.nbytes for p in model.parameters())
    check_state_fits(model, max_seq_len, max_num_seqs if getattr(model, "SUPPORTS_BATCHING", False) else 1, dtype,
                     free_bytes=free_bytes - on_device, kv_cache_tokens=kv_cache_tokens,
                     where=f"{where} (checked before loading: the weights will take about {on_device / 2**30:.2f} GiB)")
    return on_device


def build_model(weights, *, rank: int, device: torch.device, dtype: torch.dtype | str | None, max_seq_len: int,
                max_num_seqs: int = 1, offload: "OffloadConfig | None" = None, fp8: str = "load",
                check_fit: bool = True, mtp_layers: int = 0,
                kv_cache_tokens: int | None = None) -> tuple[torch.nn.Module, ModelFamily, Any, torch.dtype]:
    """Build rank ``rank``'s model from its loaded weights, kernels chosen and per-sequence state
    allocated: what :meth:`Engine.load` runs between reading the pack and the step protocol.

    Args:
        weights: :func:`~shardsmith.runtime.engine.loader.load_rank_weights`' result for ``rank``.
        device: where the model runs; dtype: compute dtype or its name (None: the config's
            ``dtype``/``torch_dtype``, else bfloat16).
        max_seq_len, max_num_seqs: per-sequence state, as :meth:`Engine.load` takes them.
        offload: routed experts in host memory with a device cache (None: resident).
        fp8: ``load`` or ``on-the-fly`` (:meth:`Engine.load`).
        check_fit: on CUDA, refuse state that does not fit the free memory, before the load
            (:func:`preflight_state`, from the sizes) and after it (:func:`check_state_fits`).
        mtp_layers: the checkpoint's MTP layers to load for speculative drafts (DeepSeek-V3).
        kv_cache_tokens: positions of the KV pool all slots share (a family whose KV sits in blocks:
            every family but DeepSeek-V4); None: ``max_num_seqs * max_seq_len``.

    Returns:
        ``(model, family, offload runtime or None, dtype)``.

    Raises:
        UsageError: an unknown dtype or ``fp8`` value, state that does not fit, MTP layers asked of
            a family that does not run them, or ``kv_cache_tokens`` for a family whose KV is not in blocks.
    """
    config = weights.config
    family = family_for(config)
    extra = {}
    pool = {} if kv_cache_tokens is None else {"kv_cache_tokens": kv_cache_tokens}
    if pool and not family.kv_blocks:
        raise UsageError(f"--kv-cache-tokens: {family.name} keeps each slot's state for max_seq_len positions "
                         f"(the KV caches of the Mixtral family, DeepSeek-V3 and gpt-oss are in blocks)")
    if mtp_layers:
        if "mtp_layers" not in inspect.signature(family.build).parameters:
            raise UsageError(f"{family.name} does not run MTP draft layers (DeepSeek-V3 does); use --speculative ngram")
        extra["mtp_layers"] = mtp_layers
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    dtype = dtype or DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")), torch.bfloat16)
    if check_fit and device.type == "cuda":  # before the weights take minutes to reach the device
        preflight_state(weights, family, rank=rank, dtype=dtype, max_seq_len=max_seq_len, max_num_seqs=max_num_seqs,
                        offloaded=offload is not None, free_bytes=torch.cuda.mem_get_info(device)[0],
                        where=str(device), kv_cache_tokens=kv_cache_tokens, **extra)
    place = None
    if offload is not None:  # swaps the expert banks for host banks + a device cache
        from shardsmith.runtime.offload import attach_offload

        def place(meta_model):
            return attach_offload(meta_model, weights, offload, device=device, dtype=dtype)
    model, offloaded = family.build(weights, rank=rank, dtype=dtype, device=device, place_experts=place, **extra)
    if fp8 not in ("load", "on-the-fly"):
        raise UsageError(f"fp8 must be 'load' or 'on-the-fly', got {fp8!r}")
    use_kernels_(model, device)  # on CUDA: FP8 linears stay FP8 (fp8_linear), banks run fused_experts
    if fp8 == "load":
        dequantize_fp8_(model, dtype)  # what use_kernels_ did not keep FP8
    batching = getattr(model, "SUPPORTS_BATCHING", False)
    if check_fit and device.type == "cuda" and hasattr(model, "state_bytes_for"):
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        check_state_fits(model, max_seq_len, max_num_seqs if batching else 1, dtype, free_bytes=free,
                         where=str(device), kv_cache_tokens=kv_cache_tokens)  # the allocator's cached blocks count as free
    if batching:
        model.setup_cache(max_seq_len, device, dtype, max_num_seqs=max_num_seqs, **pool)
    else:
        if max_num_seqs > 1:
            log.info("%s decodes one sequence at a time (no batched decode yet): max_num_seqs %d -> 1",
                     family.name, max_num_seqs)
        model.setup_cache(max_seq_len, device, dtype)
    return model, family, offloaded, dtype
