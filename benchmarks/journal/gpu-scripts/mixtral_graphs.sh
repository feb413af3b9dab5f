#!/usr/bin/env bash
# On two H200s (issue 6): the CUDA checks that captured decode pieces give the eager bits (DeepSeek-V4
# and the Mixtral family), then the Mixtral-shaped offload pack (2 layers x 32 experts, D=4096, I=2048,
# bf16, top-6, cache 25%) at TP 1 and 2, eager and graphed side by side. Carry .whl.
set -uo pipefail
source benchmarks/gpu/env.sh > /dev/null
t0=$SECONDS
timeout 90 python3 -m pytest tests/runtime/engine/test_decode_graphs.py -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|^E |Error" | tail -20
echo "tests $((SECONDS - t0)) s"
timeout 140 python3 benchmarks/decode_offload.py --make --pack-root /tmp/op --device cuda --tp 1 2 --layers 2 \
    --experts 32 --tokens 48 --warmup-tokens 8 --cache-fraction 0.25 --graphs both 2>&1 | tee "$OUT/mixtral_graphs.log" | tail -14
echo "all $((SECONDS - t0)) s"
cp benchmarks/results/decode_offload-*-"$SHARDSMITH_HOST".json "$OUT/" 2>/dev/null
true
