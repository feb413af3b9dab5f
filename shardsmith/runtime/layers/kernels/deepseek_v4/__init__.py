"""DeepSeek-V4's own kernels: the hyper-connection mixes, the compressors' decode step, the indexer's
scores and the attention over sink, window and compressed entries.

Only ``runtime/models/deepseek_v4`` calls them (``tests/test_layering.py`` holds that). Each module keeps
its PyTorch reference beside its Triton kernel, as the shared kernels in the folder above do.

==========================  ===============================================================
module                      what
==========================  ===============================================================
``hc_mix``                  the hyper-connection mixing weights (Sinkhorn-normalised)
``hc_pre``                  the hyper-connections' input side (norm, mix, reduce)
``hc_post``                 the hyper-connections' output side (expand, add)
``compressor_step``         one decode token into a compressor's window, pooled on completion
``indexer_scores``          the lightning indexer's scores of a decode row's entries
``sink_attention``          decode attention over sink, window and compressed entries
==========================  ===============================================================
"""
