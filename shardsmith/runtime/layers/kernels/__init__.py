"""Fused kernels (Triton) beside the plain PyTorch functions they replace: decode steps, and a prefill chunk's experts.

=======================  ==================================  ===========================================
kernel                   replaces (the reference)            what it reads
=======================  ==================================  ===========================================
:func:`fp8_linear`       :func:`fp8_linear_reference`:       FP8 e4m3 ``W [N, K]`` once, with 128x128
                         dequantize + ``F.linear``           (or b0 x b1) F32 / UE8M0 block scales
:func:`fused_experts`    :func:`fused_experts_reference`:    the selected experts of a bank ``[E, ...]``
                         gather + expand + bmm (V4           (resident, or the GPU slot pool by slot id),
                         ``routed_pairs``)                   FP4 e2m1 packed with 1x32 UE8M0 scales, FP8
                                                             e4m3 with F32 block scales, or bf16
:func:`grouped_gemm`     :func:`grouped_gemm_reference`:     a prefill chunk's (token, expert) rows
                         each expert's matrix expanded,      sorted by expert, in tiles of 64 or 128 rows
                         ``F.linear`` on its run of rows     of one expert; that expert's FP4 bytes and
                                                             UE8M0 scales, FP8 bytes and F32 block
                                                             scales, or bf16 rows read in registers (on
                                                             CUDA ``experts.grouped_experts`` calls it)
:func:`hc_mix`           :func:`hc_mix_reference`: V4's      ``[T, (2+m)*m]`` mixer logits; one program
                         hyper-connection pre/post and       per token, the 20 Sinkhorn rounds in
                         Sinkhorn comb                       registers
:func:`sink_attention`   :func:`sink_attention_reference`:   each decode row's key columns straight
                         V4's decode core (gather, float32   from the layer's key buffer, once; split
                         ``baddbmm``, softmax, ``bmm``)      over programs, merged with the sink
:func:`indexer_scores`   :func:`indexer_scores_reference`:   a CSA layer's compressed entries straight
                         V4's indexer (gather, float32       from the indexer's buffer, scored against
                         einsum, relu, weighted head sum)    every index head with ``tl.dot``
:func:`compressor_step`  :func:`compressor_step_reference`:  each row's new kv/gate into its window; the
                         V4's compressor decode step         window (and CSA carry) pooled, normed and
                         (gathers, softmax pool, RMSNorm,    roped into an entry only on the rows that
                         RoPE, index_puts: 22-30 kernels)    complete it (one program per row)
:func:`hc_pre`           :func:`hc_pre_reference`: V4's      the streams ``[T, m, D]`` and ``fn``
                         whole mixer (RMS, ``F.linear``      ``[(2+m)*m, m*D]`` float32 once, split-K;
                         against ``fn``, ``hc_mix``, the     the last program of each token tile adds
                         weighted sum: 4-5 launches; and     the partials, mixes and collapses (and
                         the block's RMSNorm after it)       norms the collapse: ``out_norm``)
:func:`hc_post`          :func:`hc_post_reference`: V4's     the streams and the sublayer's output once;
                         expansion after a sublayer          one program per token and ``BLOCK_D``
                         (matmul, multiply, add, cast)       channels writes all ``m`` output streams
:func:`route_topk`       :func:`route_topk_reference`: a     the gate ``[E, D]`` float32 once, split
                         MoE router (GEMV, score, top-k or   over E and D; the last program of each
                         hash table, gather, normalise:      token tile scores, picks the top-K and
                         about 6 launches)                   normalises the weights
=======================  ==================================  ===========================================

The kernels only DeepSeek-V4 runs (``hc_mix``, ``sink_attention``, ``indexer_scores``, ``compressor_step``,
``hc_pre``, ``hc_post``) live in :mod:`.deepseek_v4`; the others serve every family.

Each public function takes ``backend="auto" | "triton" | "reference"``; ``auto`` runs Triton on
CUDA tensors (or on CPU under ``TRITON_INTERPRET=1``) and the reference otherwise, so callers need
no Triton to import or run this package. Triton comes with the ``kernels`` extra. Measured on an
H200: ``benchmarks/RESULTS.md`` (kernels).

Compiles: each kernel compiles a bounded set of variants whatever the prompt length
(:mod:`.compile_keys` computes Triton's cache key of a launch on CPU; the engine's warm-up,
``runtime/engine/warmup.py``, launches every variant at start).

Wiring (``runtime/layers``): an FP8 ``_Linear`` keeps ``weight`` and its block scale as loaded and
calls ``fp8_linear``; V4's ``Attention.decode_core`` calls ``sink_attention`` (and ``Indexer.step``
``indexer_scores``, ``Compressor.step`` ``compressor_step``; ``HyperMixer`` ``hc_pre`` and ``hc_post``; ``MoE.route``
``route_topk``, up to 16 tokens); an ``ExpertBank``
(resident) and the offload runtime's slot steps (the expert
cache's pool, slot ids for expert ids) call ``fused_experts`` through ``experts.fused_bank`` for
decode batches of up to 16 tokens; Mixtral-family bf16 banks pass ``gate_up`` and ``down`` alone
and ``limit=0``, FP8 banks their scales and ``block``.
"""

from shardsmith.runtime.layers.kernels._common import KernelError, triton_available
from shardsmith.runtime.layers.kernels.fp8_linear import fp8_linear, fp8_linear_reference
from shardsmith.runtime.layers.kernels.fused_moe import (fused_experts, fused_experts_reference, grouped_gemm,
                                                         grouped_gemm_reference)

__all__ = ["KernelError", "fp8_linear", "fp8_linear_reference", "fused_experts", "fused_experts_reference",
           "grouped_gemm", "grouped_gemm_reference", "triton_available"]
