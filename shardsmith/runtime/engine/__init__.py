"""The engine: loading a rank's weights, process groups, sampling, decode-step CUDA graphs."""
