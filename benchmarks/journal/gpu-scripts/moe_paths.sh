#!/usr/bin/env bash
# On one H200 (issues 12 and 14): the routed-expert kernel's two paths side by side. One call, ~8 min.
# Carry .inv (the V4-Flash inventory) and .whl. Steps:
#   1. a 2-layer V4-Flash-shaped checkpoint (256 FP4 experts) is written and split in the background;
#   2. the kernel GPU tests (both paths against the float32 reference at V4 shapes, the pair path's
#      batch invariance), then `decode_kernels.py --moe-only` on the FP4 TP=1 and bf16 TP=2 banks at
#      T = 1, 4, 8, 16: the grouped path and the pair path in $PAIR_CONFIGS launch shapes;
#   3. `batch_step.py` on the 2-layer pack at 1-8 rows (the engine's own path choice, `pick_path`).
# Logs and the results JSONs go to $OUT.
set -uo pipefail
source benchmarks/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
inv=.inv/deepseek-v4-flash-0731-reap160
t0=$SECONDS
(timeout 300 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4sc --layers 2 --experts 256 --mtp 0 --inventory "$inv" \
    && timeout 300 python3 -m shardsmith.cli split /tmp/v4sc /tmp/v4sc-tp1 --tp 1) > "$OUT/gen.log" 2>&1 &
gen=$!
timeout "${TEST_S:-200}" python3 -m pytest tests/runtime/kernels/test_kernels.py tests/runtime/kernels/test_kernels_gpu.py -m 'gpu or not slow' \
    -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/kernels_tests.log" | grep -E "passed|failed|^E |^FAILED" | tail -15
echo "tests rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
PAIR_CONFIGS=${PAIR_CONFIGS:-"path=pairs;path=pairs,block_r=8;path=pairs,block_r=32;path=pairs,block_g=4;path=pairs,block_g=16;path=pairs,num_warps=2;path=pairs,num_warps=8;path=pairs,block_r=32,block_g=16,num_warps=8"}
timeout "${BENCH_S:-240}" python3 benchmarks/decode_kernels.py --moe-only --moe-banks fp4:2048,bf16:1024 \
    --moe-config "path=grouped;$PAIR_CONFIGS" 2>&1 | tee "$OUT/kernels_bench.log" | grep -v "^FAILED" | tail -90
echo "bench rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
cp benchmarks/results/decode_kernels-*-"$SHARDSMITH_HOST".json "$OUT/" 2>/dev/null
wait $gen; tail -2 "$OUT/gen.log"; echo "gen + split $((SECONDS - t0)) s"
timeout "${STEP_S:-150}" python3 benchmarks/batch_step.py /tmp/v4sc-tp1 --device cuda \
    --dtype bfloat16 --label "resident, auto path" --out "$OUT/batch_step-$(date +%Y%m%d)-${SHARDSMITH_HOST}.json" --append \
    --profile "$OUT/prof-auto" 2>&1 | grep -v INFO | tail -7
echo "batch step $((SECONDS - t0)) s"
true
