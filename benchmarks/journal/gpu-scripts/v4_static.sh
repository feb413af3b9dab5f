#!/usr/bin/env bash
# On one H200: DeepSeek-V4's device-only decode core (branch v4static) captured as ONE CUDA graph per
# step (step_rows + every layer's attn_static and ffn_block + logits) on the tiny checkpoint, replayed
# across CSA/HCA window completions with padding rows: the eager bits (tests/runtime/models/test_deepseek_v4_static.py,
# -m gpu). Then the CPU tests of the same file on CUDA's host, as a check of the carried tree.
set -uo pipefail
source benchmarks/gpu/env.sh
t0=$SECONDS
timeout 400 python3 -m pytest tests/runtime/models/test_deepseek_v4_static.py -m gpu -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/v4_static_gpu.log" | grep -E "passed|failed|skipped|^E |Error" | tail -30
echo "v4 static gpu rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
true
