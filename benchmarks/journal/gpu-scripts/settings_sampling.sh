#!/usr/bin/env bash
# One H100/H200 call after the settings module and the per-row sampling fields (issues 36, 40):
#   1. the kernel GPU tests and the full-depth V4-Flash-shaped decode, resident and with a 25% expert
#      cache (benchmarks/gpu/v4_full_depth.sh, RUNS=43-24), to compare with RESULTS' figures;
#   2. benchmarks/sampling.py on the 5-layer V4-Flash-shaped template pack (the real 129,280-token
#      vocabulary): greedy, sampled and every sampling field at once, batch 1 and 8.
# Carry .inv (the real V4-Flash inventory). Logs and result JSONs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1  # pass SHARDSMITH_COMMIT=<sha>: the copy of .git there may be stale
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00' | tr 'H' 'h')
export SHARDSMITH_HOST=${SHARDSMITH_HOST:-${card:-gpu}x1ak}
t0=$SECONDS
RUNS=${RUNS:-43-24} TESTS=${TESTS:-"tests/runtime/offload/test_fused_slots.py tests/runtime/kernels/test_kernels_gpu.py"} \
    bash benchmarks/gpu/v4_full_depth.sh
timeout 120 python3 -m shardsmith.cli split /tmp/v4t5 /tmp/v4t5-tp1 --tp 1 > "$OUT/split.log" 2>&1
echo "split rc=$? $((SECONDS - t0)) s"
timeout "${SAMPLING_S:-200}" python3 benchmarks/sampling.py /tmp/v4t5-tp1 --device cuda --dtype bfloat16 \
    --batch 1 8 --steps 24 2>&1 | grep -v INFO | tee "$OUT/sampling.log" | tail -12
echo "sampling rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
cp benchmarks/results/sampling-*-"$SHARDSMITH_HOST".json "$OUT/" 2>/dev/null
true
