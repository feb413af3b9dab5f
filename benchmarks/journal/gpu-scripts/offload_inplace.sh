#!/usr/bin/env bash
# On one H200 (issue 12): the offloaded 4-layer x 256-expert V4-Flash-shaped model at 25% and 6.25%
# cache, three ways of serving a miss in one call:
#   1. in place, copy (the defaults: offload_inplace=auto, offload_miss=copy):
#      decided on the device, missed experts copied by a kernel into their rows, each step one CUDA graph;
#   2. in place, read (MISS=read): the expert kernel reads a miss from pinned host memory itself;
#   3. copying (INPLACE=off): the host table, misses copied after one host sync per layer.
# The GPU tests of these paths run first while the template checkpoint is written. Carry .inv.
# About 5 minutes. Logs and results JSONs go to $OUT; MODES lists the runs (default "copy read off");
# SKIP_TESTS=1 skips the tests; FULL=1 adds the full-depth model (43 layers x 24 experts) offloaded
# to 25% cache in the default mode with the time left.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
host=${SHARDSMITH_HOST:-h200x1aj}
t0=$SECONDS
gen=1 skip=${SKIP_TESTS:-0}
for mode in ${MODES:-copy read off}; do
    left=$(( ${TOTAL_S:-585} - (SECONDS - t0) ))
    [ "$left" -gt 60 ] || { echo "no time left for $mode"; break; }
    inplace=auto miss=$mode name=$host-$mode
    [ "$mode" = off ] && inplace=off miss=copy
    [ "$mode" = copy ] && inplace= miss= name=$host  # the defaults
    SHARDSMITH_KERNELS=offload_inplace=$inplace SHARDSMITH_TUNING=offload_miss=$miss GEN=$gen SKIP_TESTS=$skip RUNS=4-256 \
        TESTS="${TESTS:-tests/runtime/offload/test_miss_copy.py tests/runtime/engine/test_device_slots.py tests/runtime/offload/test_fused_slots.py tests/runtime/kernels/test_hc_pre.py}" \
        TEST_S=${TEST_S:-130} CACHE="0.25 0.0625" BENCH_S=$(( left < ${BENCH_S:-150} ? left - 5 : ${BENCH_S:-150} )) \
        SHARDSMITH_HOST=$name bash benchmarks/gpu/v4_full_depth.sh
    echo "$mode done $((SECONDS - t0)) s"
    gen=0 skip=1
done
left=$(( ${TOTAL_S:-585} - (SECONDS - t0) ))
if [ "${FULL:-0}" = 1 ] && [ "$left" -gt 120 ]; then
    GEN=0 SKIP_TESTS=1 RUNS=43-24 CACHE=0.25 BENCH_S=$(( left - 5 )) SHARDSMITH_HOST=$host bash benchmarks/gpu/v4_full_depth.sh
    echo "full depth done $((SECONDS - t0)) s"
fi
