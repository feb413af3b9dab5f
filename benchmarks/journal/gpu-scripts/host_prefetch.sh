#!/usr/bin/env bash
# On one H200 host (issue 15), about 3-4 minutes: the host expert kernel's software prefetch distances
# side by side (benchmarks/host_experts.py --prefetch; a layer's six experts per call, floor measured
# beside each timing; ROW_BLOCKING=1,0 also times one row per call beside several), at TP 1 on every
# core and TP 2 on half (the second run saves over the first's file: both are copied to $OUT); the
# kernel's tests on this CPU (AVX-512 on Sapphire Rapids); then the GPU decode-graph tests (captured pieces = eager bits uncompiled,
# within bf16 rounding compiled). No wheels needed. Logs and the results JSON go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
export SHARDSMITH_HOST=${SHARDSMITH_HOST:-h200x1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
lscpu | grep -E 'Model name|^CPU\(s\)|Thread\(s\)|L3'
cores=$(nproc)
t0=$SECONDS
timeout 150 python3 -m pytest tests/runtime/offload/test_host_kernel.py -q -p no:cacheprovider -o addopts="" -rs \
    > "$OUT/host_kernel_tests.log" 2>&1
echo "host kernel tests rc=$? $((SECONDS - t0)) s"; tail -2 "$OUT/host_kernel_tests.log"
timeout 300 python3 benchmarks/host_experts.py --threads "$cores" --tp 1 --isa avx512 --no-reference \
    --formats fp4,fp8,bf16 --tokens "${TOKENS:-1,4,8}" --per-call 6 --prefetch "${PREFETCH:-0,512,1024,2048,4096,8192}" \
    --row-blocking "${ROW_BLOCKING:-1}" --repeat 3 --rounds 7 > "$OUT/host_prefetch_tp1.log" 2>&1
echo "host prefetch tp1 rc=$? $((SECONDS - t0)) s"; tail -40 "$OUT/host_prefetch_tp1.log"
cp "$(ls -t benchmarks/results/host_experts-*-"$SHARDSMITH_HOST".json | head -1)" "$OUT/" 2>/dev/null
timeout 120 python3 benchmarks/host_experts.py --threads $((cores / 2)) --tp 2 --isa avx512 --no-reference \
    --formats "${TP2_FORMATS:-fp4}" --tokens "${TP2_TOKENS:-1}" --per-call 6 --prefetch "${TP2_PREFETCH:-0,1024,2048}" \
    --row-blocking "${ROW_BLOCKING:-1}" --repeat 3 --rounds 7 > "$OUT/host_prefetch_tp2.log" 2>&1
echo "host prefetch tp2 rc=$? $((SECONDS - t0)) s"; tail -30 "$OUT/host_prefetch_tp2.log"
cp "$(ls -t benchmarks/results/host_experts-*-"$SHARDSMITH_HOST".json | head -1)" "$OUT/host_experts-tp2.json" 2>/dev/null
if [ "${GPU_TESTS:-1}" = 1 ]; then
    timeout 200 python3 -m pytest tests/runtime/engine/test_decode_graphs.py -m gpu -q -p no:cacheprovider -o addopts="" \
        > "$OUT/decode_graph_gpu_tests.log" 2>&1
    echo "decode graph gpu tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^E  " "$OUT/decode_graph_gpu_tests.log" | tail -8
fi
true
