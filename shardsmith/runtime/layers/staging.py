"""Small host-to-device index transfers without a stream synchronisation.

A ``cudaMemcpyAsync`` from pageable host memory synchronises the stream before it starts (CUDA
Runtime API, "API synchronization behavior": "for transfers from pageable host memory to device
memory, a stream sync is performed before the copy is initiated"), so ``torch.tensor(ids,
device="cuda")`` or ``t.to("cuda", non_blocking=True)`` on a plain CPU tensor makes the host wait
for every queued kernel. Per-expert index tensors built that way cost one such wait per expert per
layer. :func:`to_device` packs them into one page-locked buffer (torch's caching host allocator,
which keeps the block alive until the copy has run) and issues a single asynchronous copy.
"""

from __future__ import annotations

import torch


def to_device(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copy 1-D host tensors of one dtype to ``device`` with one asynchronous copy.

    Args:
        parts: 1-D CPU tensors ``[n_i]`` of one dtype (e.g. int64 token rows per expert; build
            empty ones with that dtype too: ``torch.tensor([])`` is float32).
        device: target; on a non-CUDA device the parts are returned unchanged.

    Returns:
        ``[n_i]`` device tensors in order: views of one device buffer.

    Raises:
        ValueError: parts of more than one dtype.
    """
    device = torch.device(device)
    if len({p.dtype for p in parts}) > 1:
        raise ValueError(f"to_device stages parts of one dtype, got {sorted({str(p.dtype) for p in parts})}")
    if device.type != "cuda" or not parts:
        return list(parts)
    sizes = [p.numel() for p in parts]
    staged = torch.empty(sum(sizes), dtype=parts[0].dtype, pin_memory=True)
    torch.cat(parts, out=staged)
    return list(staged.to(device, non_blocking=True).split(sizes))


def rows_by_expert(index: torch.Tensor, experts: list[int],
                   device: torch.device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Where each expert is routed: its token rows and top-k columns, on ``device`` in one copy.

    Args:
        index: ``[T, K]`` expert ids on the host (T = tokens, K = experts per token).
        experts: the experts to locate (each appears in ``index``).

    Returns:
        expert -> ``(tok [n], k [n])`` int64 with ``index[tok, k] == expert``, in row-major order.
    """
    flat = to_device([t for e in experts for t in torch.where(index == e)], device)
    return {e: (flat[2 * i], flat[2 * i + 1]) for i, e in enumerate(experts)}
