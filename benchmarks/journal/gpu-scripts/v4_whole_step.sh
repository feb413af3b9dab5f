#!/usr/bin/env bash
# On one H200 (issues 12 and 14): DeepSeek-V4's decode step captured whole (static decode core), the
# full-depth model, transformers at the same shapes, torch.compile of the row-wise pieces. Carry .inv
# (the real V4-Flash inventory: headers and config.json) and, for transformers' DeepSeek-V4 where the
# host's transformers predates it, .whl-hf. Steps (RUNS picks among the benchmark runs):
#   1. the V4-Flash-shaped template checkpoint (5 layers, 24 FP4 experts, real per-layer shapes) is
#      written while the GPU checks run (decode graphs, every family on CUDA, the kernels);
#   2. v4_decode.py template mode, TP=1, eager and graphed, profiled (device ops, GPU busy share, the
#      top kernels by GPU time), each run one of
#        4l256e    4 layers x 256 experts, resident and a 25% cache, with transformers (--hf)
#        43l24e    the full-depth model (43 layers, the release's kinds, 24 experts/layer), resident
#                  and 25%, with transformers (--hf)
#        43l24e-r  the full-depth model resident only
#        43l24e-e  the same with SHARDSMITH_KERNELS=compile_pieces=reference (the attn_in / ffn pieces not torch.compile'd;
#                  compiling them is the default on CUDA since session 8)
# Logs, result JSONs and profiles go to $OUT. SKIP_TESTS=1 skips step 1's tests.
# Measured: benchmarks/RESULTS.md, "the whole decode step in one CUDA graph".
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD} SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
host=${SHARDSMITH_HOST:-h200x1ws}
RUNS=${RUNS:-4l256e 43l24e 43l24e-e}
inv=.inv/deepseek-v4-flash-0731-reap160
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
if ! python3 -c 'from transformers import DeepseekV4ForCausalLM' 2>/dev/null && ls .whl-hf/*.whl >/dev/null 2>&1; then
    # the host's transformers predates DeepSeek-V4: a newer one (carried in .whl-hf) for --hf only
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/hfsite .whl-hf/*.whl
    export SHARDSMITH_HF_PYTHONPATH=/tmp/hfsite
fi
t0=$SECONDS
if [ ! -f /tmp/v4t5/config.json ]; then
    (timeout "${GEN_S:-150}" python3 benchmarks/gen_v4_checkpoint.py /tmp/v4t5 --layers 5 --experts 24 --mtp 0 \
        --inventory "$inv" > "$OUT/gen.log" 2>&1) &
    gen=$!
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    timeout "${TEST_S:-110}" python3 -m pytest tests/runtime/engine/test_decode_graphs.py tests/runtime/models/test_families_cuda.py \
        tests/runtime/offload/test_fused_slots.py tests/runtime/kernels/test_kernels.py -m "gpu or not gpu" -q -p no:cacheprovider \
        -o addopts="" -x > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^E |^FAILED" "$OUT/gpu_tests.log" | tail -20
fi
[ -n "${gen:-}" ] && { wait $gen; tail -1 "$OUT/gen.log"; echo "gen $((SECONDS - t0)) s"; }
common=(/tmp/v4t5 --work /tmp/v4p --device cuda --tp 1 --prompt 16 --tokens 32 --kinds-config "$inv/config.json")
bench() {  # name, timeout, args...
    local name=$1 limit=$2; shift 2
    SHARDSMITH_HOST=$name timeout "$limit" python3 benchmarks/v4_decode.py "${common[@]}" "$@" \
        --hang-s $(( limit - 8 )) --profile "/tmp/prof-$name" > "$OUT/v4_$name.log" 2>&1
    echo "$name rc=$? $((SECONDS - t0)) s"
    grep -E '"run"|"ms_per_token"|"ms_per_layer"|"device_ops_per_layer"|"gpu_busy_share"|"hit_rate"|time_per_token_over_floor|speedup_vs|"error"|Error' \
        "$OUT/v4_$name.log" | head -40
    cp benchmarks/results/v4_decode-*-"$name".json "$OUT/" 2>/dev/null
    head -12 /tmp/prof-$name/*graphs-kernels.txt 2>/dev/null
}
for run in $RUNS; do
    case $run in
        4l256e) bench "$host-4l256e" "${BENCH_S:-165}" --layers 4 --experts-per-layer 256 --cache-fraction 0.25 --hf ;;
        43l24e) bench "$host-43l24e" "${BENCH_S:-165}" --layers 43 --experts-per-layer 24 --cache-fraction 0.25 --hf ;;
        43l24e-r) bench "$host-43l24e" "${BENCH_S:-165}" --layers 43 --experts-per-layer 24 ;;
        43l24e-e) SHARDSMITH_KERNELS=compile_pieces=reference bench "$host-43l24e-eager-pieces" "${BENCH_S:-165}" --layers 43 --experts-per-layer 24 ;;
        *) echo "unknown run $run" ;;
    esac
done
tar czf "$OUT/prof.tgz" -C /tmp $(cd /tmp && ls -d prof-* 2>/dev/null) 2>/dev/null
true
