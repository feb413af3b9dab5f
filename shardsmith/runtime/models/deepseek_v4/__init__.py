"""DeepSeek-V4 in the runtime: tensor-parallel forward pass from release checkpoint names.

======================  ===================================================================
module                  contents
======================  ===================================================================
``config``              :class:`V4Args` from ``config.json`` (layer kinds, hash layers, YaRN)
``ops``                 RMSNorms, interleaved partial RoPE, YaRN frequencies
``quant``               FP4 e2m1 / UE8M0 dequantization (FP8 goes through the parallel layers)
``compressor``          KV compressors (HCA, CSA with overlap) and the Lightning Indexer
``attention``           shared-latent-KV attention with sinks, window and compressed entries
``hyper``               manifold-constrained hyper-connection mixers and the head mixer
``moe``                 sqrt-softplus / hash router, FP4 expert bank, shared expert
``block``               the decoder layer, its decode pieces, a batched decode step's context
``model``               :class:`DeepseekV4`: per-sequence slots, forward, batched decode step;
                        the strict weight assignment
======================  ===================================================================

Example:
    >>> from shardsmith.runtime.models.deepseek_v4 import DeepseekV4  # doctest: +SKIP
    >>> from shardsmith.runtime.engine.loader import load_rank_weights  # doctest: +SKIP
    >>> w = load_rank_weights("ckpt/", rank=0, world_size=1, from_checkpoint=True)  # doctest: +SKIP
    >>> model = DeepseekV4.from_weights(w, dtype=torch.float32, max_num_seqs=2)  # doctest: +SKIP
    >>> logits = model(torch.tensor([0, 5, 7]), 0)  # slot 0: [1, V]  # doctest: +SKIP
    >>> logits = model(torch.tensor([0, 9]), 0, slot=1)  # slot 1, independent  # doctest: +SKIP
    >>> step = model.decode_step(torch.tensor([4, 8]), [3, 2], [0, 1])  # one token each  # doctest: +SKIP
"""

from shardsmith.runtime.models.deepseek_v4.config import V4Args
from shardsmith.runtime.models.deepseek_v4.model import DeepseekV4, assign_weights

__all__ = ["DeepseekV4", "V4Args", "assign_weights"]
