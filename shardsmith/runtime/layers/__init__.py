"""Building blocks every model family composes: parallel linears and embeddings, quantized weights,
index staging. A layer knows its rank's shard shape; a model file knows nothing of ranks."""
