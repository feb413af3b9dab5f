#!/usr/bin/env bash
# On one H200 host (issue 15), about 3-4 minutes: the host expert kernel's software prefetch distances
# side by side (benchmarks/host_experts.py --prefetch; a layer's six experts per call, floor measured
# beside each timing), at TP 1 on every core and TP 2 on half; the kernel's tests on this CPU (AVX-512
# is checked only here); then the GPU decode-graph tests (captured pieces = eager bits uncompiled,
# within bf16 rounding compiled). No wheels needed. Logs and the results JSON go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
export SHARDSMITH_HOST=${SHARDSMITH_HOST:-h200x1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
lscpu | grep -E 'Model name|^CPU\(s\)|Thread\(s\)|L3'
cores=$(nproc)
t0=$SECONDS
timeout 150 python3 -m pytest tests/runtime/test_host_kernel.py -q -p no:cacheprovider -o addopts="" -rs \
    > "$OUT/host_kernel_tests.log" 2>&1
echo "host kernel tests rc=$? $((SECONDS - t0)) s"; tail -2 "$OUT/host_kernel_tests.log"
timeout 150 python3 benchmarks/host_experts.py --threads "$cores" --tp 1 --isa avx512 --no-reference \
    --formats fp4,fp8,bf16 --tokens 1,4 --per-call 6 --prefetch "${PREFETCH:-0,512,1024,2048,4096,8192}" \
    --repeat 3 --rounds 7 > "$OUT/host_prefetch_tp1.log" 2>&1
echo "host prefetch tp1 rc=$? $((SECONDS - t0)) s"; tail -40 "$OUT/host_prefetch_tp1.log"
cp "$(ls -t benchmarks/results/host_experts-*-"$SHARDSMITH_HOST".json | head -1)" "$OUT/" 2>/dev/null
timeout 60 python3 benchmarks/host_experts.py --threads $((cores / 2)) --tp 2 --isa avx512 --no-reference \
    --formats fp4 --tokens 1 --per-call 6 --prefetch 0,1024,2048 --repeat 3 --rounds 7 --no-save \
    > "$OUT/host_prefetch_tp2.log" 2>&1
echo "host prefetch tp2 rc=$? $((SECONDS - t0)) s"; tail -4 "$OUT/host_prefetch_tp2.log"
if [ "${GPU_TESTS:-1}" = 1 ]; then
    timeout 200 python3 -m pytest tests/runtime/test_decode_graphs.py -m gpu -q -p no:cacheprovider -o addopts="" \
        > "$OUT/decode_graph_gpu_tests.log" 2>&1
    echo "decode graph gpu tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^E  " "$OUT/decode_graph_gpu_tests.log" | tail -8
fi
true
