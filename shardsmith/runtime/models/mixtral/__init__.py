"""The Mixtral / Qwen3-MoE / Qwen2-MoE family: config, decoder, MoE layer."""
