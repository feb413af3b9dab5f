"""Read and validate Hugging Face safetensors checkpoints (``config.json``, index, shards, or the
shards' raw ``.safetensors.json`` headers).

Example:
    >>> ckpt = open_checkpoint("ckpt/")  # doctest: +SKIP
    >>> ckpt.read_slice("embed.weight", 0, 0, 1024).shape  # doctest: +SKIP
    torch.Size([1024, 4096])
"""

from .reader import (HEADER_SUFFIX, INDEX_NAME, SINGLE_NAME, Checkpoint, ShardFile, TensorInfo, bytes_to_tensor,
                     slice_bytes)
from .validate import open_checkpoint

__all__ = ["Checkpoint", "HEADER_SUFFIX", "INDEX_NAME", "SINGLE_NAME", "ShardFile", "TensorInfo", "bytes_to_tensor",
           "open_checkpoint", "slice_bytes"]
