#!/usr/bin/env bash
# On two H200s (issue 6): DeepSeek-V4-Flash-shaped layers with all 256 routed experts, FP4 experts
# offloaded to pinned host banks, TP=1 vs TP=2 at equal cache bytes per GPU; then the Mixtral-shaped
# pack against transformers + accelerate offloading the same experts. Carry .whl and .inv (the V4
# inventory copied from ../shared/real-inventories). Logs and results JSON land in $OUT. The 25% cache
# runs twice, first and last in each rank process: the 2026-11-30 run saw it slower than 6.25% when first.
set -uo pipefail
source benchmarks/gpu/env.sh
nproc; free -g | head -2
inv=.inv/deepseek-v4-flash-0731-reap160
t0=$SECONDS
timeout 150 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4ck --layers 2 --experts 256 --mtp 0 --inventory "$inv" \
    2>&1 | tail -2 | tee "$OUT/gen.log"
echo "gen $((SECONDS - t0)) s"
timeout 240 python3 benchmarks/v4_decode.py /tmp/v4ck --work /tmp/v4p --device cuda --tp 1,2 --prompt 32 --tokens 32 \
    --cache-fraction 0.25 --cache-fraction 0.0625 --cache-fraction 0.25 2>&1 | tee "$OUT/v4_offload.log" | grep -v '^ ' | tail -40
echo "v4 $((SECONDS - t0)) s"
cp benchmarks/results/v4_decode-*-"$SHARDSMITH_HOST".json "$OUT/" 2>/dev/null
timeout 170 python3 benchmarks/decode_offload.py --make --pack-root /tmp/op --device cuda --tp 1 2 --layers 2 \
    --experts 32 --tokens 48 --cache-fraction 0.25 --hf-baseline --hf-tokens 8 2>&1 | tee "$OUT/decode_offload_hf.log" | tail -30
echo "mixtral+hf $((SECONDS - t0)) s"
cp benchmarks/results/decode_offload-*-"$SHARDSMITH_HOST".json "$OUT/" 2>/dev/null

timeout 120 python3 -m pytest tests/runtime/offload/test_offload.py tests/runtime/offload/test_offload_v4.py -m gpu -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
true
