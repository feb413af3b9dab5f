#!/usr/bin/env bash
# On one H200 (issue 12, session 14's last call): the V4-Flash-shaped template checkpoint is written in the
# background while hc_pre's block_d is timed with the norm folded (benchmarks/hc_pre.py) and its GPU
# tests run; then the full-depth model (43 layers x 24 FP4 experts, resident and 25% cache, profiled)
# with transformers timed after it at the same shapes (--hf). Carry .inv. About 6 minutes. Logs, the
# results JSONs land in $OUT, the profiles in $OUT/prof.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
OUT=${OUT:-/tmp/out}; r=$OUT; mkdir -p "$OUT"  # logs straight to $OUT: a call cut short still returns them
host=${SHARDSMITH_HOST:-h200x1ag}
inv=.inv/deepseek-v4-flash-0731-reap160
t0=$SECONDS
(timeout 170 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4t5 --layers 5 --experts 24 --mtp 0 --inventory "$inv" \
    > $r/gen.log 2>&1) &
gen=$!
SHARDSMITH_HOST=$host timeout ${HC_S:-60} python3 benchmarks/hc_pre.py --splits 0 --warps 4 --block-d 1024,4096 --norm \
    --tokens ${HC_TOKENS:-1,4,16} \
    > $r/hc_pre.log 2>&1; echo "hc_pre rc=$? $((SECONDS - t0)) s"; tail -12 $r/hc_pre.log
timeout ${TEST_S:-90} python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/kernels/test_hc_pre.py > $r/tests.log 2>&1
echo "gpu tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^FAILED|^E  " $r/tests.log | head -10
wait $gen; tail -1 $r/gen.log; echo "gen $((SECONDS - t0)) s"
SHARDSMITH_HOST=$host-43l24e timeout ${BENCH_S:-300} python3 benchmarks/v4_decode.py /tmp/v4t5 --work /tmp/v4p --device cuda \
    --tp 1 --prompt 16 --tokens 16 --kinds-config "$inv/config.json" --cache-fraction 0.25 --layers 43 \
    --experts-per-layer 24 --hf --hang-s $(( ${BENCH_S:-300} - 8 )) --profile /tmp/prof-$host > $r/v4.log 2>&1
echo "v4 rc=$? $((SECONDS - t0)) s"
grep -E '"run"|"ms_per_token"|"ms_per_layer"|"device_ops_per_layer"|speedup_vs|Error' $r/v4.log | head -30
cp benchmarks/results/*-"$host"*.json $r/ 2>/dev/null
tar czf "$OUT/prof.tgz" -C /tmp $(cd /tmp && ls -d prof-* 2>/dev/null)
