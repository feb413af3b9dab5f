#!/usr/bin/env bash
# On two H200s (issue 6): piecewise CUDA graphs for DeepSeek-V4 decode steps. The GPU checks
# (captured pieces give the eager bits, resident and offloaded; offloaded V4 decode is the resident
# bits on CUDA) run while the V4-Flash-shaped checkpoint (2 layers x 256 FP4 experts, real per-layer
# shapes) is written; then v4_decode.py at TP 1 and 2: resident and offloaded (25% and 6.25% cache
# at equal bytes per GPU), each eager and graphed in the same process, with the graphed steps
# profiled (GPU time per token; rank 0's host profile in prof.tgz). Carry .whl and .inv.
# SKIP_TESTS=1 runs only the benchmark.
set -uo pipefail
source benchmarks/gpu/env.sh
inv=.inv/deepseek-v4-flash-0731-reap160
t0=$SECONDS
if [ "${SKIP_TESTS:-0}" = 1 ]; then
    timeout 150 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4ck --layers 2 --experts 256 --mtp 0 --inventory "$inv" \
        > "$OUT/gen.log" 2>&1
else
    (timeout 170 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4ck --layers 2 --experts 256 --mtp 0 --inventory "$inv" \
        > "$OUT/gen.log" 2>&1) &
    gen=$!
    timeout 170 python3 -m pytest tests/runtime/engine/test_decode_graphs.py tests/runtime/offload/test_offload_v4.py tests/runtime/offload/test_offload.py -m gpu \
        -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|^E |Error" | tail -20
    echo "gpu tests rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
    wait $gen
fi
tail -1 "$OUT/gen.log"; echo "gen $((SECONDS - t0)) s"
timeout 300 python3 benchmarks/v4_decode.py /tmp/v4ck --work /tmp/v4p --device cuda --tp 1,2 --prompt 32 --tokens 32 \
    --hang-s 280 --profile /tmp/prof --cache-fraction 0.25 --cache-fraction 0.0625 2>&1 | tee "$OUT/v4_graphs.log" \
    | grep '^\[tp=\|│\|Thread\|File\|Error' | tail -60
echo "v4 $((SECONDS - t0)) s"
cp benchmarks/results/v4_decode-*-"$SHARDSMITH_HOST".json "$OUT/" 2>/dev/null
tar czf "$OUT/prof.tgz" -C /tmp prof 2>/dev/null
true
