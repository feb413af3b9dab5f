"""Copy missed experts from the pinned host banks into their pool rows, on the device, with no host sync.

The copy mode of the in-place offload (``runtime`` module docstring): :class:`~.device_slots.DeviceSlots`
decides on the GPU which pairs miss and which pool row each missed expert goes to (``src = -1 - expert``,
``dst = row``); :func:`copy_misses` then copies those experts' bytes, every array of the bank (FP4 or
FP8 weights and their scales, or plain weights; gpt-oss's gate/up bias), from the host bank into the pool, and the expert
kernel reads every pair from the pool. The host banks are page-locked and so mapped into the device's
address space under unified addressing (CUDA runtime API, ``cudaHostRegister``), so a Triton kernel
reads them in place at the link's bandwidth (``benchmarks/gpu/zero_copy.py``: 48-50 GB/s on an H200,
``cudaMemcpyAsync`` 54) while the addresses come from device memory: the copy is captured in the
decode step's CUDA graph, which a ``cudaMemcpyAsync`` of data-dependent rows could not be.

One launch, grid ``(P, arrays, cdiv(max row bytes, BLOCK))``: the program ``(p, a, c)`` copies bytes
``[c * BLOCK, (c + 1) * BLOCK)`` of array ``a``'s row of pair ``p``'s expert when ``dst[p] >= 0``
(contiguous 16 KiB runs: long reads keep the link busy), else returns at once. The pair path's
in-kernel reads of a miss (16 rows x 128 B per step) reached 34-35 GB/s (h200x1ai).

Legend: P = pairs (tokens x experts per token), E_host = experts in a host bank, S = pool rows.
"""

from __future__ import annotations

import functools

import torch

from shardsmith.runtime.layers.kernels._common import KernelError, use_triton
from shardsmith.runtime.layers.kernels.fused_moe import HOST_ARRAYS as ARRAYS  # a bank's arrays, one name list

BLOCK = 16384  # bytes per program: 128 threads x 128 B


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (Triton is optional: the ``kernels`` extra)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_misses_kernel(base, src_ptr, dst_ptr, h0, d0, n0, h1, d1, n1, h2, d2, n2, h3, d3, n3, h4, d4, n4,
                            BLOCK: tl.constexpr):
        # offsets (bytes) of each array's host bank (h*) and pool (d*) from ``base``, and its row bytes (n*)
        p, a, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row = tl.load(dst_ptr + p)
        if row < 0:
            return
        e = -1 - tl.load(src_ptr + p)
        h = tl.where(a == 0, h0, tl.where(a == 1, h1, tl.where(a == 2, h2, tl.where(a == 3, h3, h4))))
        d = tl.where(a == 0, d0, tl.where(a == 1, d1, tl.where(a == 2, d2, tl.where(a == 3, d3, d4))))
        n = tl.where(a == 0, n0, tl.where(a == 1, n1, tl.where(a == 2, n2, tl.where(a == 3, n3, n4))))
        start = c.to(tl.int64) * BLOCK
        if start >= n:
            return
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        v = tl.load(base + h + e * n + offs, mask=ok, other=0)
        tl.store(base + d + row * n + offs, v, mask=ok)

    return _copy_misses_kernel


def copy_misses_reference(pool: dict[str, torch.Tensor], host: dict[str, torch.Tensor], src: torch.Tensor,
                          dst: torch.Tensor) -> None:
    """The PyTorch path the kernel replaces: ``pool[a][dst[p]] = host[a][-1 - src[p]]`` for every array
    ``a`` and every pair with ``dst[p] >= 0``, a Python loop over ``.tolist()`` copies (syncs on CUDA)."""
    for s, d in zip(src.tolist(), dst.tolist()):
        if d >= 0:
            for name, rows in pool.items():
                rows[d].copy_(host[name][-1 - s])


def copy_misses(pool: dict[str, torch.Tensor], host: dict[str, torch.Tensor], src: torch.Tensor,
                dst: torch.Tensor, *, backend: str = "auto") -> None:
    """Copy the experts of the pairs with ``dst[p] >= 0`` from ``host`` into ``pool`` rows ``dst[p]``.

    Args:
        pool: array name (``gate_up``, ``down``, their scales when the format has them) -> ``[S, ...]``
            on the device, contiguous; written in place.
        host: the same names -> ``[E_host, ...]``, the same dtype and row shape, contiguous, in
            page-locked memory mapped into the device's address space (any host memory on a CPU device).
        src: ``[P]`` int64, ``-1 - expert`` for every pair with ``dst >= 0`` (the table's ``src``).
        dst: ``[P]`` int64 on the pool's device, the pool row of each pair's copy, or -1 (none).
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    The Triton path does not sync and its launch is fixed by (P, the pool's shapes): capturable in
    a CUDA graph. Nothing is checked on the device (a check would sync): ``src`` must name host
    experts where ``dst >= 0`` and ``dst`` rows in range, as :meth:`~.device_slots.DeviceSlots.assign_rows`
    gives them.

    Raises:
        KernelError: arrays that differ between ``pool`` and ``host`` (names, dtype, row shape, not
            contiguous), an array not in the bank's list, ``src``/``dst`` not ``[P]`` int64 on the pool's
            device, or the backend cannot run (every problem listed).
    """
    problems = []
    if not pool or len(pool) > len(ARRAYS) or set(pool) - set(ARRAYS):
        problems.append(f"pool arrays {sorted(pool)}: want 1-{len(ARRAYS)} of {', '.join(ARRAYS)}")
    for name, rows in pool.items():
        h = host.get(name)
        if h is None:
            problems.append(f"host bank has no {name}")
        elif h.dtype != rows.dtype or h.shape[1:] != rows.shape[1:] or not (h.is_contiguous() and rows.is_contiguous()):
            problems.append(f"{name}: host {tuple(h.shape)} {h.dtype} against pool {tuple(rows.shape)} {rows.dtype} "
                            "(one dtype and row shape, both contiguous)")
    device = next(iter(pool.values())).device if pool else src.device
    for what, t in (("src", src), ("dst", dst)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.device != device or t.shape != dst.shape:
            problems.append(f"{what} {tuple(t.shape)} {t.dtype} on {t.device}: want [P] int64 on {device}")
    if problems:
        raise KernelError("copy_misses: " + "; ".join(problems))
    if not use_triton(dst, backend):
        copy_misses_reference(pool, host, src, dst)
        return
    import triton

    P = dst.numel()
    if P == 0:
        return
    names = list(pool)
    base = pool[names[0]]
    args = []
    for name in names + [names[0]] * (len(ARRAYS) - len(names)):  # unused slots repeat the first array
        rows, h = pool[name], host[name]
        args += [h.data_ptr() - base.data_ptr(), rows.data_ptr() - base.data_ptr(), rows[0].numel() * rows.element_size()]
    chunks = triton.cdiv(max(args[2::3]), BLOCK)
    _kernel()[(P, len(names), chunks)](base.view(torch.uint8), src, dst, *args, BLOCK=BLOCK, num_warps=4)
