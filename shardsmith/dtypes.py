"""The safetensors dtype table: element sizes and torch equivalents.

Source: the safetensors format spec (https://github.com/huggingface/safetensors, ``Dtype`` enum).
``F4`` is FP4 e2m1: the header shape counts 4-bit elements, two per byte, so a tensor's byte size
is ``numel / 2``. DeepSeek-V4 stores its FP4 experts as ``I8`` with the last dim halved instead
(two e2m1 values per byte); both are handled as packed bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ManifestError, SourceError

if TYPE_CHECKING:  # torch is imported lazily so that planning and --help stay fast
    import torch


@dataclass(frozen=True, slots=True)
class DType:
    """One safetensors dtype.

    Attributes:
        name: the header spelling (``BF16``, ``F8_E4M3``, ...).
        bits: bits per element (4 for ``F4``).
        torch_name: attribute of :mod:`torch` holding the equivalent dtype, or ``None`` when the
            installed torch has none (data is then handled as ``uint8`` bytes).
    """

    name: str
    bits: int
    torch_name: str | None

    def nbytes(self, shape: tuple[int, ...] | list[int]) -> int:
        """Bytes of a tensor of ``shape`` (elements counted as the header counts them)."""
        bits = math.prod(shape) * self.bits
        return (bits + 7) // 8

    @property
    def torch_dtype(self) -> "torch.dtype | None":
        """The torch dtype, or ``None`` if this torch build lacks it."""
        import torch

        return getattr(torch, self.torch_name, None) if self.torch_name else None


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 8, "bool"),
        DType("BF16", 16, "bfloat16"),
        DType("F16", 16, "float16"),
        DType("F32", 32, "float32"),
        DType("F64", 64, "float64"),
        DType("F8_E4M3", 8, "float8_e4m3fn"),
        DType("F8_E5M2", 8, "float8_e5m2"),
        DType("F8_E8M0", 8, "float8_e8m0fnu"),
        DType("F4", 4, None),
        DType("I8", 8, "int8"),
        DType("U8", 8, "uint8"),
        DType("I16", 16, "int16"),
        DType("I32", 32, "int32"),
        DType("I64", 64, "int64"),
    )
}



def dtype(name: str, *, where: str = "") -> DType:
    """Look up a safetensors dtype by its header name.

    Raises:
        SourceError: ``name`` is not a known safetensors dtype.
    """
    try:
        return DTYPES[name]
    except KeyError:
        known = ", ".join(sorted(DTYPES))
        raise SourceError(f"{where}unknown dtype {name!r} (known: {known})") from None


def dtype_name(t: "torch.dtype") -> str:
    """The safetensors header name of torch dtype ``t``.

    Raises:
        SourceError: ``t`` has no safetensors equivalent.
    """
    for d in DTYPES.values():
        if d.torch_name and d.torch_dtype == t:
            return d.name
    raise SourceError(f"torch dtype {t} has no safetensors equivalent")


def typed_view(buf: "torch.Tensor", dtype_name: str, shape: tuple[int, ...] | list[int]) -> "torch.Tensor":
    """The one "bytes + dtype + shape -> tensor": ``uint8`` bytes ``buf`` viewed as ``dtype_name`` (no copy).

    Args:
        buf: 1-D contiguous ``uint8`` tensor of exactly the tensor's bytes (an mmap, a read buffer).
        dtype_name: safetensors dtype (:data:`shardsmith.dtypes.DTYPES`).
        shape: the header shape. ``F4`` (e2m1, two elements per byte) and dtypes this torch lacks
            stay ``uint8`` with the last dim counted in bytes: ``[..., K] -> [..., K * bits / 8]``.

    Raises:
        ManifestError: unknown dtype, or ``buf`` is not the byte size of ``shape``.
    """
    d = DTYPES.get(dtype_name)
    if d is None:
        raise ManifestError(f"dtype {dtype_name!r}: not a safetensors dtype (known: {', '.join(sorted(DTYPES))})")
    shape = tuple(shape)
    if buf.numel() != d.nbytes(shape):
        raise ManifestError(f"{dtype_name}{list(shape)} needs {d.nbytes(shape)} bytes, the buffer holds {buf.numel()}")
    tdt = d.torch_dtype
    if tdt is None:
        return buf.view(*shape[:-1], shape[-1] * d.bits // 8) if shape else buf.view(())
    return buf.view(tdt).view(shape)
