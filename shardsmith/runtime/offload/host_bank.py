"""Host expert banks: one rank's routed experts read into host memory, pinned after filling.

Each rank reads only its own bank files (``rank-R-of-N/experts-<layer>.safetensors``): per layer,
one sequential read of the byte range from the first bank array to the end of the last into one
fresh, page-aligned anonymous buffer; when the pack was opened with ``verify`` (the default) each
array is hashed (XXH3-128) as its bytes arrive and a damaged one is refused. Each buffer is page-locked **after** it is filled (pinning a
lazily mapped region first would fault in and zero every page, then the read writes them again),
with ``cudaHostRegister`` in chunks of whole expert slots below ``chunk_bytes`` (a single
registration of 512 GiB or more fails on current drivers; whole slots keep every expert's copy
inside one registration). A reader thread reads layer L+1 while layer L is being pinned.

Families whose experts are stacked ``[E, ...]`` source tensors (gpt-oss) have no bank files: their
rank shards sit in the dense files, each contiguous per expert, and are read the same way (one
buffer per tensor, hashed against its dense record) and viewed as bank arrays
(:func:`~shardsmith.pack.banks.stacked_bank_specs`).

Arrays are views of the buffer in their stored format (``manifests/README.md``, bank files):

=================  ==================  ===========================================
array              shape               dtype
=================  ==================  ===========================================
``gate_up``        ``[E, 2*I_r, D]``   bf16, ``float8_e4m3fn``, or packed e2m1 int8 ``[E, 2*I_r, D/2]``
                                       (gpt-oss: MXFP4 as int8, gate/up rows interleaved)
``down``           ``[E, D, I_r]``     as ``gate_up``
``*_scale``        ``[E, rows, cols]`` float32 (FP8 blocks) or ``float8_e8m0fnu`` (FP4 groups)
``gate_up_bias``   ``[E, 2*I_r]``      gpt-oss only: bf16, split with its rows
=================  ==================  ===========================================

Host memory per rank is the rank's bank bytes (1/world_size of the model's expert bytes, as the
pack slices every expert on its intermediate dim) plus the gaps between arrays (< 4 KiB each).

Example:
    >>> from shardsmith.pack.reader import open_rank
    >>> hb = load_host_banks(open_rank("out/", 0, 2), pin="auto")  # doctest: +SKIP
    >>> hb.layers["model.layers.0"]["gate_up"].shape  # doctest: +SKIP
    torch.Size([8, 1536, 576])
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import xxhash

from shardsmith.errors import IntegrityError, RuntimeLoadError, UsageError
from shardsmith.pack.banks import stacked_bank_specs
from shardsmith.dtypes import typed_view

log = logging.getLogger("shardsmith.runtime.offload")
CHUNK_BYTES = 1 << 30  # per cudaHostRegister call
READ_BYTES = 64 << 20  # per readinto call


@dataclass(slots=True)
class HostBanks:
    """One rank's expert banks in host memory.

    Attributes:
        layers: layer key -> array name -> ``[E, ...]`` host tensor (stored format).
        nbytes: host bytes held (buffers, gaps included); array_bytes: bytes of the arrays alone.
        pinned: every buffer is page-locked; pin_error: why pinning was refused (None if not tried/ok).
        read_s, pin_s: seconds spent reading and pinning (they overlap, so wall time is less).
    """

    layers: dict[str, dict[str, torch.Tensor]]
    nbytes: int = 0
    array_bytes: int = 0
    pinned: bool = False
    pin_error: str | None = None
    read_s: float = 0.0
    pin_s: float = 0.0
    wall_s: float = 0.0
    _buffers: list = field(default_factory=list, repr=False)
    _registered: list[int] = field(default_factory=list, repr=False)

    def close(self) -> None:
        """Unregister pinned chunks (the buffers are freed with this object)."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered.clear()
            self.pinned = False


def _ok(err: object) -> bool:
    return int(getattr(err, "value", err)) == 0


def _register(ptr: int, nbytes: int) -> str | None:
    """``cudaHostRegister`` one range; None on success, else the CUDA error name."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if _ok(err):
        return None
    torch.cuda.synchronize()  # clear the sticky-free error state left by the failed call
    return str(getattr(err, "name", err))


def check_pinning() -> str | None:
    """Try to pin one small buffer: None if page-locking works here, else the reason."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    buf = mmap.mmap(-1, 1 << 21)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t.fill_(0)
    err = _register(t.data_ptr(), t.numel())
    if err is None:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    del t
    buf.close()
    return err


def _view(buf: torch.Tensor, base: int, t, as_bank: tuple[str, str, tuple[int, ...]] | None = None) -> torch.Tensor:
    """Array ``t`` (a :class:`~shardsmith.pack.records.TensorRecord`) as a view of ``buf`` holding file
    bytes from ``base``, in its recorded dtype and shape or, for a stacked expert tensor, as the bank
    array ``as_bank = (name, dtype, shape)`` says."""
    dtype, shape = (t.dtype, t.shape) if as_bank is None else as_bank[1:]
    return typed_view(buf[t.offset - base: t.offset - base + t.bytes], dtype, shape)


def _read_layer(path: str, start: int, nbytes: int, tensors: tuple = (),
                verify: bool = False) -> tuple[mmap.mmap, torch.Tensor, float]:
    """Read ``nbytes`` at ``start`` of ``path`` into a fresh page-aligned buffer, sequentially.

    With ``verify``, each array of ``tensors`` is hashed (XXH3-128) from the buffer as soon as its
    last byte has arrived, while the rest is still being read, and compared with its manifest digest.

    Raises:
        RuntimeLoadError: a short read.
        IntegrityError: with ``verify``, an array whose bytes differ from the manifest (file and array named).
    """
    t0 = time.perf_counter()
    buf = mmap.mmap(-1, max(nbytes, 1))
    mv = memoryview(buf)
    todo = sorted(tensors, key=lambda t: t.offset) if verify else []
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, start, nbytes, os.POSIX_FADV_SEQUENTIAL)
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [mv[done: done + READ_BYTES]], start + done)
            if n <= 0:
                raise RuntimeLoadError(f"{path}: short read at byte {start + done} (file changed under the loader?)")
            done += n
            while todo and todo[0].offset + todo[0].bytes - start <= done:
                t = todo.pop(0)
                found = xxhash.xxh3_128(mv[t.offset - start: t.offset - start + t.bytes]).hexdigest()
                if found != t.xxh3_128:
                    raise IntegrityError(f"{path}: bank array {t.name!r} xxh3_128 expected {t.xxh3_128}, found {found}; "
                                         f"the file is damaged (run shardsmith verify on the pack)")
    finally:
        os.close(fd)
        mv.release()
    return buf, torch.frombuffer(buf, dtype=torch.uint8)[:nbytes], time.perf_counter() - t0


def _slot_chunks(arrays: dict[str, torch.Tensor], chunk_bytes: int) -> list[tuple[int, int]]:
    """``(ptr, nbytes)`` ranges covering every array, cut only between experts, each <= chunk_bytes."""
    out = []
    for a in arrays.values():
        slot = a[0].numel() * a.element_size()
        step = max(1, chunk_bytes // max(slot, 1)) * slot
        total = a.numel() * a.element_size()
        for off in range(0, total, step):
            out.append((a.data_ptr() + off, min(step, total - off)))
    return out


def load_host_banks(weights, *, pin: str = "auto", chunk_bytes: int = CHUNK_BYTES,
                    layers: set[str] | None = None) -> HostBanks:
    """Read this rank's expert banks into host memory and pin them (when CUDA is present).

    Args:
        weights: a :class:`~shardsmith.pack.reader.RankPack` (bank files read directly), or any
            :class:`~shardsmith.runtime.engine.loader.RankWeights` (its ``banks()`` arrays are used as
            they are, e.g. the ``--from-checkpoint`` copies).
        pin: ``auto`` (pin when CUDA is available; if refused, log the reason and fall back to
            pageable memory), ``require`` (refusal is an error), ``off``.
        chunk_bytes: upper bound of one ``cudaHostRegister`` call, in bytes.
        layers: read only these bank layers (None: every bank of the rank).

    Raises:
        RuntimeLoadError: ``pin="require"`` and page-locking is refused (e.g. ``ulimit -l``, or no
            CUDA), checked on a small buffer before any bank is read; a short read.
        IntegrityError: ``weights`` is a pack opened with ``verify`` and an array's bytes differ
            from its manifest digest (hashed while the layer is read).
        UsageError: an unknown ``pin`` mode.
    """
    if pin not in ("auto", "require", "off"):
        raise UsageError(f"pin must be auto, require or off, got {pin!r}")
    t0 = time.perf_counter()
    reason = None if pin == "off" else check_pinning()
    if reason is not None and pin == "require":
        raise RuntimeLoadError(f"cannot page-lock host memory for the expert banks ({reason}); raise the "
                               "memlock limit (ulimit -l unlimited) or pass pin='auto'/'off' to use pageable "
                               "memory (host-to-GPU copies then run at roughly half the pinned bandwidth)")
    do_pin = pin != "off" and reason is None
    if reason is not None and pin == "auto" and torch.cuda.is_available():
        log.warning("expert banks: page-locking refused (%s); falling back to pageable host memory: "
                    "host-to-GPU expert copies will be slower and synchronous", reason)
    hb = HostBanks({}, pinned=do_pin, pin_error=reason if pin != "off" else None)
    jobs = _read_jobs(weights)
    if jobs is not None and layers is not None:
        jobs = [j for j in jobs if j[0] in layers]
    if jobs is None:  # not a pack: take the arrays we are given
        hb.layers = {layer: dict(arrays) for layer, arrays in weights.banks().items() if layers is None or layer in layers}
        stacked = {layer: specs for layer, specs in stacked_bank_specs(weights.plan, weights.rank).items()
                   if layers is None or layer in layers}
        dense = weights.dense() if stacked else {}
        for layer, specs in stacked.items():
            hb.layers[layer] = {s.name: typed_view(dense[s.source].contiguous().view(-1).view(torch.uint8), s.dtype, s.shape)
                                for s in specs}
        hb.nbytes = hb.array_bytes = sum(a.numel() * a.element_size() for arr in hb.layers.values() for a in arr.values())
        if do_pin:
            _pin_or_fall_back(hb, [c for arr in hb.layers.values() for c in _slot_chunks(arr, chunk_bytes)], pin)
        hb.wall_s = time.perf_counter() - t0
        return hb
    with ThreadPoolExecutor(1, thread_name_prefix="bank-reader") as pool:
        verify = bool(getattr(weights, "verify", False))
        nxt = pool.submit(_read_layer, *jobs[0][1:5], verify) if jobs else None
        for i, (layer, path, start, nbytes, tensors, as_bank) in enumerate(jobs):
            buf, flat, read_s = nxt.result()
            nxt = pool.submit(_read_layer, *jobs[i + 1][1:5], verify) if i + 1 < len(jobs) else None
            hb._buffers.append(buf)
            hb.read_s += read_s
            arrays = ({t.name: _view(flat, start, t) for t in tensors} if as_bank is None else
                      {a[0]: _view(flat, start, t, a) for t, a in zip(tensors, as_bank)})
            hb.layers.setdefault(layer, {}).update(arrays)
            hb.nbytes += nbytes
            hb.array_bytes += sum(t.bytes for t in tensors)
            if do_pin:
                do_pin = _pin_or_fall_back(hb, _slot_chunks(arrays, chunk_bytes), pin)
    hb.wall_s = time.perf_counter() - t0
    return hb


def _read_jobs(weights) -> list[tuple] | None:
    """Read jobs ``(layer, path, first array offset, byte span, tensor records, as_bank)``: one per bank
    file (``as_bank`` None: arrays named and shaped as recorded), and one per stacked expert tensor of
    a dense file (gpt-oss, :func:`~shardsmith.pack.banks.stacked_bank_specs`; ``as_bank`` the bank
    array's ``(name, dtype, shape)``); None if ``weights`` is not a pack."""
    manifest, root = getattr(weights, "manifest", None), getattr(weights, "dir", None)
    if manifest is None or root is None:
        return None
    jobs = []
    for rec in manifest.files:
        if rec.kind != "bank" or not rec.tensors:
            continue
        start = min(t.offset for t in rec.tensors)
        end = max(t.offset + t.bytes for t in rec.tensors)
        jobs.append((rec.layer, str(root / rec.path), start, end - start, rec.tensors, None))
    stacked = {s.source: s for specs in stacked_bank_specs(weights.plan, weights.rank).values() for s in specs}
    records = {t.name: (rec, t) for rec in manifest.files if rec.kind == "dense" for t in rec.tensors if t.name in stacked}
    for name, spec in stacked.items():
        if name not in records:
            raise RuntimeLoadError(f"{root}: stacked expert tensor {name} is not in the rank's dense files")
        rec, t = records[name]
        jobs.append((spec.layer, str(root / rec.path), t.offset, t.bytes, (t,), ((spec.name, spec.dtype, spec.shape),)))
    return jobs


def _pin_or_fall_back(hb: HostBanks, chunks: list[tuple[int, int]], pin: str) -> bool:
    """Register ``chunks``; on refusal unpin everything and fall back (``auto``) or raise (``require``).

    Returns:
        whether pinning continues for later layers.
    """
    t0 = time.perf_counter()
    for ptr, n in chunks:
        err = _register(ptr, n)
        if err is not None:
            done = len(hb._registered)
            hb.close()
            hb.pin_error = f"cudaHostRegister of {n} bytes failed ({err}) after {done} chunks"
            if pin == "require":
                raise RuntimeLoadError(f"expert banks: {hb.pin_error}; raise the memlock limit "
                                       "(ulimit -l unlimited) or load with pin='auto' (pageable fallback)")
            log.warning("expert banks: %s; falling back to pageable host memory: host-to-GPU expert copies "
                        "will be slower and synchronous", hb.pin_error)
            hb.pin_s += time.perf_counter() - t0
            return False
        hb._registered.append(ptr)
    hb.pin_s += time.perf_counter() - t0
    return True
