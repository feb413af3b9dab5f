#!/usr/bin/env bash
# On one H200 (issues 12 and 14): the routed-expert kernel with the weights on the dot's M side
# (fused_experts swap_ab) against the previous operand order, one call, ~6 minutes:
#  1. a 2-layer DeepSeek-V4-Flash-shaped pack (256 FP4 experts per layer) is written in the background;
#  2. the kernel tests: tests/runtime/test_kernels.py compiled on the GPU and test_kernels_gpu.py -m gpu
#     (V4 shapes, both operand orders against the float32 reference, one CUDA graph, run-to-run equality);
#  3. benchmarks/kernels.py --moe-only: the FP4 TP=1 bank at T = 1, 4, 8, 16, MOE_CONFIGS side by side;
#  4. benchmarks/batch_step.py on the pack: the engine step at 1-8 rows, device time by kernel kind.
# Carry .inv and .whl (env.sh). Logs and results JSON land in $OUT.
set -uo pipefail
source benchmarks/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
inv=.inv/deepseek-v4-flash-0731-reap160
t0=$SECONDS
(timeout 240 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4sc --layers 2 --experts 256 --mtp 0 --inventory "$inv" 2>&1 | tail -1
 rm -rf /tmp/v4sc-tp1; timeout 200 python3 -m shardsmith.cli split /tmp/v4sc /tmp/v4sc-tp1 --tp 1 2>&1 | tail -1) > "$OUT/gen.log" 2>&1 &
gen=$!
timeout "${TEST_S:-150}" python3 -m pytest tests/runtime/test_kernels.py tests/runtime/test_kernels_gpu.py -m "gpu or not slow" \
    -k "fused or capture" -q -p no:cacheprovider -o addopts="" > "$OUT/kernel_tests.log" 2>&1
echo "kernel tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^FAILED|^E  " "$OUT/kernel_tests.log" | head -12
MOE_CONFIGS=${MOE_CONFIGS:-"swap_ab=0;swap_ab=1;swap_ab=1,scaled_dot=0;swap_ab=1,block_i=128;swap_ab=1,block_k=256;swap_ab=1,num_warps=8"}
timeout "${BENCH_S:-150}" python3 benchmarks/kernels.py --moe-only --moe-config "$MOE_CONFIGS" --replays 10 2>&1 \
    | tee "$OUT/kernels_moe.log" | tail -40
echo "kernels rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
cp benchmarks/results/kernels-*-"$SHARDSMITH_HOST".json "$OUT/" 2>/dev/null
wait $gen; cat "$OUT/gen.log"; echo "gen $((SECONDS - t0)) s"
timeout "${STEP_S:-150}" python3 benchmarks/batch_step.py /tmp/v4sc-tp1 --device cuda --dtype bfloat16 \
    --out "$OUT/batch_step-$(date +%Y%m%d)-${SHARDSMITH_HOST}.json" 2>&1 | grep -v -E "INFO|Warning|warn|This call|File|runnable" \
    | tee "$OUT/batch_step.log" | tail -7
echo "batch step $((SECONDS - t0)) s"
true
