#!/usr/bin/env bash
# On one H200 (issue 12): the decode kernels wired into the runtime. The GPU checks
# (tests/test_kernels*.py -m gpu: the wired models' tokens, logits and bytes, the kernels at V4
# shapes; tests/runtime/engine/test_decode_graphs.py -m gpu: captured pieces give the eager bits, kernels on) run
# while a V4-Flash-shaped checkpoint (4 layers x 256 FP4 experts, real per-layer shapes) is written;
# then v4_decode.py at TP=1, resident, eager and graphed, with the kernels on (default on CUDA) and
# off (SHARDSMITH_KERNELS=fp8_dense=reference,fused_experts=reference). Carry .inv (the real V4
# inventory); no wheels needed. Logs and both results JSONs go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
host=${SHARDSMITH_HOST:-h200x1w}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
t0=$SECONDS
(timeout "${GEN_S:-220}" python3 benchmarks/gen_v4_checkpoint.py /tmp/v4ck --layers 4 --experts 256 --mtp 0 \
    --inventory .inv/deepseek-v4-flash-0731-reap160 > "$OUT/gen.log" 2>&1) &
gen=$!
timeout "${TEST_S:-200}" python3 -m pytest tests/runtime/kernels/test_kernels_wired.py tests/runtime/kernels/test_kernels_gpu.py tests/runtime/engine/test_decode_graphs.py \
    -m gpu -q -s -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^E |^FAILED|linear bytes" "$OUT/gpu_tests.log" | tail -30
wait $gen; tail -1 "$OUT/gen.log"; echo "gen $((SECONDS - t0)) s"
for mode in on off; do
    if [ $mode = off ]; then export SHARDSMITH_KERNELS=fp8_dense=reference,fused_experts=reference; fi
    SHARDSMITH_HOST=$host-$mode timeout "${BENCH_S:-120}" python3 benchmarks/v4_decode.py /tmp/v4ck --work /tmp/v4p \
        --device cuda --tp 1 --prompt 32 --tokens 32 --hang-s 110 --profile /tmp/prof-$mode > "$OUT/v4_$mode.log" 2>&1
    echo "v4 kernels $mode rc=$? $((SECONDS - t0)) s"
    grep -E '"run"|"ms_per_token"|"tokens_per_s"|gpu_ms|"device"|fp8_weight|"pack"|Error' "$OUT/v4_$mode.log" | head -40
    cp benchmarks/results/v4_decode-*-"$host-$mode".json "$OUT/" 2>/dev/null
done
true
