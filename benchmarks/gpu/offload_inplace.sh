#!/usr/bin/env bash
# On one H200 (issue 12, session 15): offloaded experts read in place and decided on the device
# (SHARDSMITH_OFFLOAD_INPLACE=auto, each decode step one CUDA graph) against the copying cache
# (=off, one host sync per layer), the 4-layer x 256-expert V4-Flash-shaped model at 25% and 6.25%
# cache, in one call; the GPU tests of the in-place path first (tiny V4 offloaded, graphed, both modes,
# against the resident bank; hc_pre) while the template checkpoint is written. Carry .inv. ~8 minutes.
# Logs and results JSONs go to $OUT; COPYING=0 skips the copying cache's run (a short call).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
host=${SHARDSMITH_HOST:-h200x1ai}
t0=$SECONDS
TESTS="${TESTS:-tests/runtime/test_fused_slots.py tests/runtime/test_hc_pre.py tests/runtime/test_device_slots.py}" TEST_S=${TEST_S:-150} RUNS=4-256 \
    CACHE="0.25 0.0625" BENCH_S=${BENCH_S:-160} SHARDSMITH_HOST=$host bash benchmarks/gpu/v4_full_depth.sh
echo "in place done $((SECONDS - t0)) s"
[ "${COPYING:-1}" = 1 ] || exit 0
SHARDSMITH_OFFLOAD_INPLACE=off GEN=0 SKIP_TESTS=1 RUNS=4-256 CACHE="0.25 0.0625" BENCH_S=${BENCH_S:-160} \
    SHARDSMITH_HOST=$host-off bash benchmarks/gpu/v4_full_depth.sh
echo "copying done $((SECONDS - t0)) s"
