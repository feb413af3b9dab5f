#!/usr/bin/env bash
# On one H200 (issue 13, issue 14's model side): DeepSeek-V3 on CUDA.
#  1. the tiny V3 (FP8, float32): decode steps as captured piecewise CUDA graphs (the model's new
#     batched-decode pieces, one row) against eager: same tokens (row "resident" vs "resident eager");
#  2. `shardsmith parity` on that checkpoint on CUDA, TP=1 against transformers (the dequantized copy of
#     its edge-cut FP8 blocks; ranks without CUDA graphs): exit 0, no defect;
#  3. a checkpoint with the release's per-layer shapes (hidden 7168, 1 dense layer + 2 MoE layers of
#     256 FP8 experts of 7168x2048, vocabulary 129280; ~27 GB), decoded resident (graphed) and with
#     the routed experts offloaded to pinned host memory behind a 25% device cache; tokens/s.
# Everything lands in $OUT (JSON + logs). Budget: under 4 minutes (timeouts 40 + 40 + 80 + 75 s).
set -uo pipefail
source benchmarks/gpu/env.sh
t0=$SECONDS
timeout 40 python3 benchmarks/v3_decode.py --tiny --work /tmp/v3t --device cuda --dtype float32 --eager \
    --prompt 16 --tokens 16 --json "$OUT/v3_tiny_cuda.json" 2>&1 | tee "$OUT/v3_tiny_cuda.log" | tail -4
echo "tiny $((SECONDS - t0)) s"
timeout 40 python3 -m shardsmith.cli parity /tmp/v3t/tiny-ckpt --tp 1 --reference transformers --device cuda \
    --dtype float32 --max-tokens 8 --layers --json > "$OUT/parity_v3_cuda.json" 2> "$OUT/parity_v3_cuda.log"
echo "parity exit $? ($((SECONDS - t0)) s)"; tail -3 "$OUT/parity_v3_cuda.log"
df -h /tmp | tail -1
timeout 80 python3 benchmarks/v3_decode.py --make /tmp/v3ck --make-only --dense-layers 1 --moe-layers 2 --experts 256 \
    --json "$OUT/v3_make.json" 2>&1 | tail -2
echo "make $((SECONDS - t0)) s"
timeout 75 python3 benchmarks/v3_decode.py /tmp/v3ck --device cuda --dtype bfloat16 --prompt 32 --tokens 32 \
    --cache-fraction 0.25 --json "$OUT/v3_decode.json" 2>&1 | tee "$OUT/v3_decode.log" | tail -6
echo "v3 decode $((SECONDS - t0)) s"
true
