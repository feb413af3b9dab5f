#!/usr/bin/env bash
# On one H200 (issue 12): offloaded experts through the fused kernel, and the full-depth measurement.
# One call, about 4-5 minutes. Carry .inv (the real V4-Flash inventory copied from
# ../shared/real-inventories: headers and config.json); no wheels needed. Steps:
#   1. a V4-Flash-shaped template checkpoint (5 layers: sliding x2 and CSA hash-routed, HCA, CSA;
#      24 FP4 experts; real per-layer shapes; ~4.5 GB) is written while the GPU checks run
#      (tests/runtime/offload/test_fused_slots.py -m gpu: the slot pool through fused_experts == the resident
#      bank bitwise at V4 shapes, FP4/FP8/bf16, T = 1/4/16, in a CUDA graph; the tiny V4 offloaded
#      through the kernel, graphed, == resident);
#   2. v4_decode.py, template mode, 4 layers x 256 experts (the cache benchmark: last numbers resident
#      graphed 4.03 ms/token, offloaded 25% graphed 13.7 ms/token at an older commit), TP=1, resident
#      and 25% cache, eager and graphed, graphed steps profiled (device ops, GPU busy share);
#   3. the same at full depth: 43 layers with the release's kinds (2 sliding, 21 CSA, 20 HCA, first 3
#      hash-routed) x 24 experts, resident and 25% cache.
# Logs, the results JSONs and the host profiles go to $OUT. SKIP_TESTS=1 skips step 1's tests, TESTS
# names other test files for it (the gpu marker); GEN=0 reuses step 1's checkpoint from an earlier run;
# RUNS="43-24" runs step 3 alone (layers-experts pairs, space separated); MAX_SEQ_LEN=8192 gives every
# compressed layer entries (v4_decode.py --max-seq-len); EXTRA adds arguments (e.g. --hf: transformers at the
# same shapes, after the ranks; the host's transformers 5.17 has DeepSeek-V4); CACHE lists the offload rows'
# GPU cache shares (default 0.25; "0.25 0.0625" for issue 12's two). Each run's limit: BENCH_S, else
# 125 s for a few layers and 330 s at full depth (whose profiled replay ran past 125 s at h200x1l).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
host=${SHARDSMITH_HOST:-h200x1fd}
inv=.inv/deepseek-v4-flash-0731-reap160
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
t0=$SECONDS
gen=
if [ "${GEN:-1}" = 1 ]; then
    (timeout "${GEN_S:-150}" python3 benchmarks/gen_v4_checkpoint.py /tmp/v4t5 --layers 5 --experts 24 --mtp 0 \
        --inventory "$inv" > "$OUT/gen.log" 2>&1) &
    gen=$!
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    timeout "${TEST_S:-100}" python3 -m pytest ${TESTS:-tests/runtime/offload/test_fused_slots.py} -m gpu -s \
        -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^E |^FAILED|through the kernel" "$OUT/gpu_tests.log" | tail -20
fi
if [ -n "$gen" ]; then wait $gen; tail -1 "$OUT/gen.log"; echo "gen $((SECONDS - t0)) s"; fi
fractions=(); for f in ${CACHE:-0.25}; do fractions+=(--cache-fraction "$f"); done  # offload rows: GPU cache shares
common=(/tmp/v4t5 --work /tmp/v4p --device cuda --tp 1 --prompt 16 --tokens 16 --kinds-config "$inv/config.json"
        "${fractions[@]}" ${MAX_SEQ_LEN:+--max-seq-len $MAX_SEQ_LEN} ${EXTRA:-})
for run in ${RUNS:-4-256 43-24}; do
    set -- ${run/-/ }
    name=$host-${1}l${2}e
    limit=${BENCH_S:-$([ "$1" -gt 8 ] && echo 330 || echo 125)}  # full depth with its profile: 95 s at h200x1s, past 125 at h200x1l
    SHARDSMITH_HOST=$name timeout "$limit" python3 benchmarks/v4_decode.py "${common[@]}" --layers "$1" \
        --experts-per-layer "$2" --hang-s $(( limit - 8 )) --profile "/tmp/prof-$name" > "$OUT/v4_$name.log" 2>&1
    echo "v4 ${1} layers x ${2} experts rc=$? $((SECONDS - t0)) s"
    grep -E '^\[tp=|"run"|"ms_per_token"|"ms_per_layer"|"device_ops_per_layer"|"gpu_busy_share"|"hit_rate"|time_per_token_over_floor|Error' \
        "$OUT/v4_$name.log" | head -40
    cp benchmarks/results/v4_decode-*-"$name".json "$OUT/" 2>/dev/null
done
tar czf "$OUT/prof.tgz" -C /tmp $(cd /tmp && ls -d prof-* 2>/dev/null) 2>/dev/null
true
