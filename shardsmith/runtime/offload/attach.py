"""Offloaded experts in the model: :func:`attach_offload` swaps each resident expert module (an
:class:`~shardsmith.runtime.layers.experts.ExpertBank`, or gpt-oss's stacked
:class:`~shardsmith.runtime.models.gpt_oss.moe.Experts`: any with a ``math``) of a built (``meta``) model for an
:class:`OffloadedExperts` over the rank's host banks and slot pool, with the same interface
(:class:`~shardsmith.runtime.layers.experts.RoutedExperts`), so the MoE layer, its router and its
single all-reduce stay as they are, and the decode graphs drive it as any bank.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import UsageError
from shardsmith.runtime.layers.experts import RoutedExperts
from .config import BACKENDS, OffloadConfig
from .host_bank import load_host_banks
from .runtime import OffloadRuntime


class OffloadedExperts(RoutedExperts):
    """Drop-in for a resident :class:`~shardsmith.runtime.layers.experts.ExpertBank`: layer ``layer``
    of the runtime's host banks and slot pool, ``(x [T, D], index [T, K], weight [T, K]) -> [T, D]`` partial."""

    def __init__(self, runtime: OffloadRuntime, layer: int) -> None:
        super().__init__()
        self.runtime, self.layer = runtime, layer

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.runtime.run_layer(self.layer, x, index, weight)

    def slot_path(self) -> bool:
        return self.runtime.slot_path()

    def decode_sync_free(self) -> bool:
        """In-place mode (``runtime`` module docstring): device work only, so the whole step is captured."""
        return self.runtime.decode_sync_free()

    def sync_free(self, rows: int, top_k: int | None) -> bool:
        """As :meth:`decode_sync_free` for a batch of ``rows`` rows (chunked past ``FUSED_TOKENS_MAX``)."""
        return self.runtime.decode_sync_free()

    def use_kernel_(self, device: torch.device) -> None:
        """The kernel switch of :func:`~shardsmith.runtime.layers.parallel.use_kernels_`, for the
        runtime's slot steps (one runtime for every layer: the same answer each call)."""
        self.runtime.use_kernel_(device)

    def may_split(self) -> bool:
        return self.runtime.backend == "hybrid" and self.runtime.slot_path()

    def decode_slots(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> tuple:
        return self.runtime.decode_slots(self.layer, x, index, weight)

    def apply_slots(self, x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, *,
                    masked: bool = False) -> torch.Tensor:
        return self.runtime.apply_slots(x, weight, slots, masked=masked)



def attach_offload(model: nn.Module, weights, config: OffloadConfig, *, device: torch.device,
                   dtype: torch.dtype) -> OffloadRuntime:
    """Read the rank's banks into host memory and swap the model's expert banks for offloaded ones.

    Call on the ``meta`` model before the family's ``assign_weights`` (pass it no banks), then
    :meth:`OffloadRuntime.start` once the dense weights and KV cache are placed.

    Args:
        model: the built model; its resident expert modules (a
            :class:`~shardsmith.runtime.layers.experts.RoutedExperts` with a ``math``), named
            ``<layer>.<moe>.experts`` with ``<layer>`` a bank layer key (or one the model's
            ``bank_layer_key(layer)`` maps to a bank layer key: DeepSeek-V3's MTP layer ``mtp.0``),
            are replaced (banks of other layers, e.g. DeepSeek-V4's MTP layers, are not read). The banks' own
            :class:`~shardsmith.runtime.layers.experts.ExpertMath` and FP8 block size are kept, so
            offloaded experts compute what the resident ones would.

    Raises:
        RuntimeLoadError: from :func:`~.host_bank.load_host_banks`.
        UsageError: an unknown backend; no expert bank in the model; banks of different maths;
            a model MoE layer with no bank in the pack.
    """
    if config.backend not in BACKENDS:
        raise UsageError(f"moe backend must be one of {', '.join(BACKENDS)}, got {config.backend!r}")
    banks = {name: m for name, m in model.named_modules()
             if isinstance(m, RoutedExperts) and m.math is not None}  # model order
    if not banks:
        raise UsageError("expert offload: the model has no resident expert modules to offload")
    kinds = sorted({(str(b.math), str(b.block)) for b in banks.values()})
    if len(kinds) > 1:
        raise UsageError(f"expert offload: the model's expert banks differ in maths or FP8 block: {kinds}")
    first = next(iter(banks.values()))
    # model.layers.N.<moe>.experts -> model.layers.N; a layer loaded under another name (DeepSeek-V3's MTP
    # layer, mtp.0) -> its bank's layer key in the pack (the model's bank_layer_key)
    bank_key = getattr(model, "bank_layer_key", lambda key: key)
    keys = {bank_key(name.rsplit(".", 2)[0]): name for name in banks}
    layers = list(keys)
    pin = config.pin if torch.device(device).type == "cuda" else "off"
    host = load_host_banks(weights, pin=pin, layers=set(layers))
    missing = sorted(set(keys) ^ set(host.layers))
    if missing:
        host.close()
        raise UsageError(f"expert offload: model MoE layers and host banks differ: {missing}")
    rt = OffloadRuntime(config, host, layers, device=torch.device(device), dtype=dtype,
                        dim=next(iter(host.layers.values()))["down"].shape[1], block=first.block, math=first.math,
                        top_k=getattr(first, "top_k", None))
    for i, layer in enumerate(layers):
        name = keys[layer]
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, OffloadedExperts(rt, i))
    return rt
