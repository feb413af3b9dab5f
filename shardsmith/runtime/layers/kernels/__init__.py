"""Fused decode kernels (Triton) beside the plain PyTorch functions they replace (issue 12).

=======================  ==================================  ===========================================
kernel                   replaces (the reference)            what it reads
=======================  ==================================  ===========================================
:func:`fp8_linear`       :func:`fp8_linear_reference`:       FP8 e4m3 ``W [N, K]`` once, with 128x128
                         dequantize + ``F.linear``           (or b0 x b1) F32 / UE8M0 block scales
:func:`fused_experts`    :func:`fused_experts_reference`:    the selected experts of a bank ``[E, ...]``
                         gather + expand + bmm (V4           (resident or the GPU slot pool), FP4 e2m1
                         ``routed_pairs``)                   packed with 1x32 UE8M0 scales, or bf16
=======================  ==================================  ===========================================

Each public function takes ``backend="auto" | "triton" | "reference"``; ``auto`` runs Triton on
CUDA tensors (or on CPU under ``TRITON_INTERPRET=1``) and the reference otherwise, so callers need
no Triton to import or run this package. Triton comes with the ``kernels`` extra.
"""

from shardsmith.runtime.layers.kernels._common import KernelError, triton_available
from shardsmith.runtime.layers.kernels.fp8_linear import fp8_linear, fp8_linear_reference
from shardsmith.runtime.layers.kernels.fused_moe import fused_experts, fused_experts_reference

__all__ = ["KernelError", "fp8_linear", "fp8_linear_reference", "fused_experts", "fused_experts_reference",
           "triton_available"]
