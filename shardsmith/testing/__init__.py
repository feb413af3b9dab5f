"""Test support shipped with the package: reference quantizers and tiny real-format checkpoints."""

from .tiny import tiny_deepseek_v3, tiny_mixtral, tiny_qwen_moe, write_checkpoint
from .tiny_v4 import tiny_deepseek_v4

__all__ = ["tiny_deepseek_v3", "tiny_deepseek_v4", "tiny_mixtral", "tiny_qwen_moe", "write_checkpoint"]
