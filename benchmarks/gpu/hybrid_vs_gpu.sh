#!/usr/bin/env bash
# On one H200 (issue 15), one call, about 4 minutes:
#  1. the host expert kernel's tests on this CPU (every instruction set it has: AVX-512 is checked
#     only here, the CI machine lacks it) and the link emulation's GPU test;
#  2. benchmarks/host_experts.py with the AVX2 and the AVX-512 path side by side (TP 1 on every core,
#     TP 2 on half), next to the memory floor;
#  3. a DeepSeek-V4-Flash-shaped checkpoint (2 layers, the inventory's 160 FP4 experts each, real
#     shapes) split at TP=1, decoded with --moe-backend gpu, hybrid and auto at a GPU expert cache of
#     6.25% of the experts (a 16 GB card's share of V4-Flash), first with the host-to-GPU link
#     emulated at 25 GB/s (PCIe Gen4; offload/link_cap.py), then at the real link.
# Carry .whl and .inv (as v4_offload.sh). Logs and results JSON land in $OUT.
# Rehearsal without a GPU: TINY=1 bash benchmarks/gpu/hybrid_vs_gpu.sh (tiny V4 on the CPU, no wheels).
set -uo pipefail
export SHARDSMITH_HOST=${SHARDSMITH_HOST:-h200x1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${TINY:-0}" = 1 ]; then
    export PYTHONPATH=$PWD SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
    he=(--formats fp4,fp8 --tokens 1,4 --experts 2 --repeat 1 --no-save)
    hv=(--tiny --work /tmp/hvg-tiny --device cpu --dtype float32 --prompt 4 --tokens 4 --cache-fraction 0.25 --no-save
        --link-gbps 25)
    gen() { :; }
else
    source benchmarks/gpu/env.sh
    he=(--experts 16 --repeat 3)
    hv=(/tmp/v4ck160 --work /tmp/hvg --cache-fraction 0.0625 --prompt 32 --tokens 32 --link-gbps 25 --link-gbps 0)
    inv=.inv/deepseek-v4-flash-0731-reap160
    [ -d "$inv" ] || inv=../shared/real-inventories/deepseek-v4-flash-0731-reap160
    gen() { timeout 150 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4ck160 --layers 2 --experts 160 --mtp 0 \
                --inventory "$inv" 2>&1 | tail -2; }
fi
lscpu | grep -E 'Model name|^CPU\(s\)|Thread\(s\)|NUMA node\(s\)'
echo "cpu flags: $(grep -o -w -E 'avx2|fma|f16c|avx512f|avx512_bf16|avx512_vnni|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
cores=$(nproc)
t0=$SECONDS

timeout 240 python3 -m pytest tests/runtime/test_host_kernel.py tests/runtime/test_link_cap.py -q -p no:cacheprovider \
    -o addopts="" -rs > "$OUT/host_kernel_tests.log" 2>&1
echo "host kernel tests rc=$? $((SECONDS - t0)) s"; tail -3 "$OUT/host_kernel_tests.log"

timeout 100 python3 benchmarks/host_experts.py --threads "$cores" --tp 1 --isa avx2,avx512 --no-reference "${he[@]}" \
    > "$OUT/host_experts_tp1.log" 2>&1
echo "host experts tp1 rc=$? $((SECONDS - t0)) s"; tail -20 "$OUT/host_experts_tp1.log"
[ "${TINY:-0}" = 1 ] || cp "$(ls -t benchmarks/results/host_experts-*-"$SHARDSMITH_HOST".json | head -1)" "$OUT/host_experts_tp1.json"
timeout 40 python3 benchmarks/host_experts.py --threads $((cores / 2)) --tp 2 --isa avx2,avx512 --no-reference \
    --formats fp4 --tokens 1 --experts 8 --repeat 3 --no-save > "$OUT/host_experts_tp2.log" 2>&1
echo "host experts tp2 rc=$? $((SECONDS - t0)) s"; tail -3 "$OUT/host_experts_tp2.log"

gen | tee "$OUT/gen.log"
echo "gen $((SECONDS - t0)) s"
timeout 240 python3 benchmarks/hybrid_vs_gpu.py "${hv[@]}" 2>&1 | tee "$OUT/hybrid_vs_gpu.log" | tail -16
echo "hybrid vs gpu rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
[ "${TINY:-0}" = 1 ] || cp "$(ls -t benchmarks/results/hybrid_vs_gpu-*-"$SHARDSMITH_HOST".json | head -1)" "$OUT/"
if [ $((SECONDS - t0)) -lt 200 ]; then  # time left: hybrid with one core kept free for the thread driving the GPU
    timeout 60 python3 benchmarks/hybrid_vs_gpu.py "${hv[@]}" --backend hybrid --threads $((cores - 1)) --no-save 2>&1 \
        | tee "$OUT/hybrid_threads_minus_1.log" | tail -4
    echo "hybrid, $((cores - 1)) threads rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
fi
true
