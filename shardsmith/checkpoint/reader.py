"""A validated checkpoint's tables, and reading tensors and slices of them without a copy of the rest.

A checkpoint directory holds ``config.json`` (DeepSeek-V4 may add ``inference/config.json``),
``model.safetensors.index.json`` or a single ``model.safetensors``, and the shard files. In place
of any shard ``X.safetensors`` the directory may hold ``X.safetensors.json``: exactly the JSON of
that file's header, so a checkpoint can be inspected and planned before its data is downloaded.

File format source: the safetensors spec (8-byte little-endian header length ``N``, ``N`` bytes of
JSON mapping names to ``{dtype, shape, data_offsets: [begin, end)}`` relative to the byte buffer
that follows the header, optional ``__metadata__`` of strings). :func:`~.validate.open_checkpoint`
builds a :class:`Checkpoint` after validating everything eagerly.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..dtypes import DTYPES
from ..errors import SourceError

if TYPE_CHECKING:  # imported lazily: planning needs no torch
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HEADER_SUFFIX = ".json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True, slots=True)
class ShardFile:
    """One shard of a checkpoint.

    Attributes:
        name: the file name as the index spells it (``model-00001-of-00048.safetensors``).
        path: the path read (symlinks resolved); ``X.safetensors.json`` for a header-only shard.
        size: bytes of the file on disk (the header JSON's size for a header-only shard).
        data_start: absolute offset of the byte buffer (``8 + N``); 0 for a header-only shard.
        header_only: True when only the header is present (planning works, reading does not).
        metadata: the header's ``__metadata__`` strings.
    """

    name: str
    path: Path
    size: int
    data_start: int
    header_only: bool
    metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives.

    Attributes:
        name: tensor name as stored (``layers.3.ffn.experts.7.w1.weight``).
        dtype: safetensors dtype name.
        shape: shape as the header states it (``F4`` counts 4-bit elements).
        file: the shard's name, a key of :attr:`Checkpoint.files`.
        offset: absolute byte offset of the data in the shard file.
        nbytes: bytes of data.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int


@dataclass(slots=True)
class Checkpoint:
    """A validated checkpoint: its config, shard files and tensor table.

    Attributes:
        root: the checkpoint directory.
        config: parsed ``config.json``.
        inference_config: parsed ``inference/config.json`` if present (DeepSeek-V4), else ``None``.
        files: shard files by index name, in index order.
        tensors: every tensor by name, ordered by (file, offset).
    """

    root: Path
    config: dict
    inference_config: dict | None
    files: dict[str, ShardFile]
    tensors: dict[str, TensorInfo]
    _maps: dict[str, np.memmap] = field(default_factory=dict, repr=False)

    @property
    def architecture(self) -> str:
        """``config.json``'s first ``architectures`` entry, else its ``model_type``."""
        archs = self.config.get("architectures") or []
        return archs[0] if archs else str(self.config.get("model_type", "unknown"))

    @property
    def header_only(self) -> bool:
        """True when any shard is header-only (the checkpoint can be planned but not split)."""
        return any(f.header_only for f in self.files.values())

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data over all shards."""
        return sum(t.nbytes for t in self.tensors.values())

    # ---------------------------------------------------------------- reading

    def raw(self, info: TensorInfo) -> np.ndarray:
        """Tensor ``info``'s bytes as a read-only ``uint8`` view of the memory-mapped shard (no copy).

        Raises:
            SourceError: the shard is header-only.
        """
        shard = self.files[info.file]
        if shard.header_only:
            raise SourceError(
                f"{shard.path.name}: header-only shard; tensor {info.name!r} has no data to read "
                f"(download {shard.name} to split this checkpoint)"
            )
        mm = self._maps.get(info.file)
        if mm is None:
            mm = np.memmap(shard.path, dtype=np.uint8, mode="r")
            self._maps[info.file] = mm
        return mm[info.offset : info.offset + info.nbytes]

    def read_bytes(self, name: str) -> bytes:
        """All bytes of tensor ``name``, read with one ``pread`` (nothing else in the file is read).

        Raises:
            SourceError: unknown tensor, header-only shard, or the file shrank since validation.
        """
        info = self.info(name)
        shard = self.files[info.file]
        if shard.header_only:
            self.raw(info)  # raises the header-only error
        with open(shard.path, "rb", buffering=0) as fh:
            data = os.pread(fh.fileno(), info.nbytes, info.offset)
        if len(data) != info.nbytes:
            raise SourceError(
                f"{shard.path}: tensor {name!r} wants {info.nbytes} bytes at offset {info.offset}, "
                f"got {len(data)} (file changed after validation?)"
            )
        return data

    def read(self, name: str) -> "torch.Tensor":
        """Tensor ``name`` as a torch tensor of its dtype (a copy, not a view of the file).

        ``F4`` and dtypes this torch build lacks come back as ``uint8`` with the last dim in bytes.

        Raises:
            SourceError: as :meth:`read_bytes`.
        """
        info = self.info(name)
        return bytes_to_tensor(bytearray(self.read_bytes(name)), info.dtype, info.shape)

    def read_slice(self, name: str, dim: int, start: int, length: int) -> "torch.Tensor":
        """Elements ``[start, start + length)`` of tensor ``name`` along ``dim``, as a copy.

        Only the pages holding the slice are read (a memory map; one contiguous range for dim 0).
        Shapes: source ``[..., D, ...]`` -> ``[..., length, ...]`` with ``D`` at ``dim``.

        Raises:
            SourceError: unknown tensor, header-only shard, out-of-range slice, or a slice of a
                4-bit last dim that does not start and end on a whole byte.
        """
        info = self.info(name)
        raw = slice_bytes(self.raw(info), info.dtype, info.shape, dim, start, length, name=name)
        shape = list(info.shape)
        shape[dim] = length
        return bytes_to_tensor(bytearray(raw.tobytes()), info.dtype, tuple(shape))

    def info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of ``name``.

        Raises:
            SourceError: no such tensor.
        """
        try:
            return self.tensors[name]
        except KeyError:
            raise SourceError(f"{self.root}: no tensor named {name!r}") from None


def slice_bytes(
    buf: np.ndarray, dtype_name: str, shape: tuple[int, ...], dim: int, start: int, length: int,
    *, name: str = "",
) -> np.ndarray:
    """Cut elements ``[start, start + length)`` along ``dim`` out of a tensor's raw bytes.

    Args:
        buf: the tensor's bytes, ``uint8`` of ``nbytes`` elements (any array, memmap included).
        dtype_name: safetensors dtype; ``F4`` packs two elements per byte on the last dim.
        shape: the header shape.

    Returns:
        ``uint8`` array of shape ``[outer, length, inner_bytes]`` (may be a view of ``buf``).

    Raises:
        SourceError: ``dim``/range out of bounds, or a 4-bit last-dim cut inside a byte.
    """
    nd = len(shape)
    if not 0 <= dim < nd:
        raise SourceError(f"tensor {name!r}: dim {dim} out of range for shape {list(shape)}")
    if start < 0 or length < 0 or start + length > shape[dim]:
        raise SourceError(
            f"tensor {name!r}: slice [{start}, {start + length}) outside dim {dim} of size {shape[dim]}"
        )
    bits = DTYPES[dtype_name].bits
    outer = math.prod(shape[:dim])
    if dim == nd - 1 and bits < 8:
        per = 8 // bits
        if start % per or length % per or shape[dim] % per:
            raise SourceError(
                f"tensor {name!r}: {dtype_name} slice [{start}, {start + length}) of dim {dim} "
                f"cuts inside a byte ({per} elements per byte)"
            )
        view = buf.reshape(outer, shape[dim] // per, 1)
        return view[:, start // per : (start + length) // per, :]
    inner = math.prod(shape[dim + 1 :]) * bits // 8
    view = buf.reshape(outer, shape[dim], inner)
    return view[:, start : start + length, :]


def bytes_to_tensor(data: bytearray | memoryview, dtype_name: str, shape: tuple[int, ...]) -> "torch.Tensor":
    """Interpret raw little-endian bytes as a tensor of ``dtype_name`` and ``shape`` (no copy of ``data``).

    ``F4`` (and any dtype this torch lacks) becomes ``uint8`` with the last dim in bytes
    (:func:`shardsmith.pack.format.typed_view`, the one typed view of bytes).
    """
    import torch

    from shardsmith.dtypes import typed_view

    t = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return typed_view(t, dtype_name, shape)
