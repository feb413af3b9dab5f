#!/usr/bin/env bash
# On two H200s: offloaded-expert decode at TP=1 vs TP=2 at equal cache bytes per GPU (issue 6),
# then the GPU-only offload tests. Writes logs and the results JSON under $OUT.
set -uo pipefail
source benchmarks/gpu/env.sh
python3 benchmarks/decode_offload.py --make --pack-root /tmp/op --device cuda --tp 1 2 --tokens 128 \
    --cache-fraction 0.25 2>&1 | tee "$OUT/decode_offload.log"
python3 -m pytest tests/runtime/offload/test_offload.py tests/runtime/offload/test_expert_cache.py -m gpu -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/offload_gpu_tests.log"
cp benchmarks/results/decode_offload-*-"$SHARDSMITH_HOST".json "$OUT/" 2>/dev/null
true
