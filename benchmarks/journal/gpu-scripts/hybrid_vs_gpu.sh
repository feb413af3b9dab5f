#!/usr/bin/env bash
# On one H200 (issue 15), one call, about 6 minutes (HOST_CHECKS=1 adds steps 1-2, ~4 more):
#  0. the split hybrid step on CUDA: the tiny V4 decoded with hybrid through captured graphs (the
#     ffn_gpu piece) against eager, the probe's round trip and slot-compute timings from the device;
#  1. the host expert kernel's tests on this CPU (every instruction set it has: AVX-512 is checked
#     only here, the CI machine lacks it) and the link emulation's GPU test;
#  2. benchmarks/host_experts.py with the AVX2 and the AVX-512 path side by side (TP 1 on every core,
#     TP 2 on half), one expert per call and a layer's six, next to the memory floor; then one expert
#     over and over (cache-resident: the kernel's compute rate with memory out of the way);
#  3. a DeepSeek-V4-Flash-shaped checkpoint (2 layers, the inventory's 160 FP4 experts each, real
#     shapes) split at TP=1, decoded with --moe-backend gpu, hybrid and auto at a GPU expert cache of
#     6.25% of the experts (a 16 GB card's share of V4-Flash), first with the host-to-GPU link
#     emulated at 25 GB/s (PCIe Gen4; offload/link_cap.py), then at the real link; eager and graphed;
#     rows record the probe's split and its terms, the split layer steps and the host round trip's
#     parts per call (d2h, compute, wait, h2d);
#  4. time left: hybrid at fixed host shares (1/3 and 1/2 of the misses) at 25 GB/s, whatever the probe says.
# Carry .whl and .inv (as v4_offload.sh). Logs and results JSON land in $OUT.
# Rehearsal without a GPU: TINY=1 bash benchmarks/gpu/hybrid_vs_gpu.sh (tiny V4 on the CPU, no wheels).
set -uo pipefail
export SHARDSMITH_HOST=${SHARDSMITH_HOST:-h200x1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${TINY:-0}" = 1 ]; then
    export PYTHONPATH=$PWD SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
    he=(--formats fp4,fp8 --tokens 1,4 --experts 2 --per-call 1,2 --repeat 1 --rounds 2 --no-save)
    hv=(--tiny --work /tmp/hvg-tiny --device cpu --dtype float32 --prompt 4 --tokens 4 --cache-fraction 0.25 --no-save
        --link-gbps 25)
    gen() { :; }
else
    source benchmarks/gpu/env.sh
    he=(--repeat 3)
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

if [ "${TINY:-0}" != 1 ]; then
    timeout 150 python3 -m pytest tests/runtime/engine/test_decode_graphs.py tests/runtime/offload/test_probe.py -m gpu -q \
        -p no:cacheprovider -o addopts="" -k "captured_decode_graphs or round_trip_from_the_device" -rs \
        > "$OUT/hybrid_gpu_tests.log" 2>&1
    echo "hybrid gpu tests rc=$? $((SECONDS - t0)) s"; tail -3 "$OUT/hybrid_gpu_tests.log"
fi

if [ "${HOST_CHECKS:-0}" = 1 ]; then  # steps 1-2 (measured at h200x1b; ~3-4 min): only when asked
    timeout 240 python3 -m pytest tests/runtime/offload/test_host_kernel.py tests/runtime/offload/test_link_cap.py -q -p no:cacheprovider \
        -o addopts="" -rs > "$OUT/host_kernel_tests.log" 2>&1
    echo "host kernel tests rc=$? $((SECONDS - t0)) s"; tail -3 "$OUT/host_kernel_tests.log"

    timeout 100 python3 benchmarks/host_experts.py --threads "$cores" --tp 1 --isa avx2,avx512 --no-reference "${he[@]}" \
        > "$OUT/host_experts_tp1.log" 2>&1
    echo "host experts tp1 rc=$? $((SECONDS - t0)) s"; tail -40 "$OUT/host_experts_tp1.log"
    [ "${TINY:-0}" = 1 ] || cp "$(ls -t benchmarks/results/host_experts-*-"$SHARDSMITH_HOST".json | head -1)" "$OUT/host_experts_tp1.json"
    timeout 40 python3 benchmarks/host_experts.py --threads $((cores / 2)) --tp 2 --isa avx2,avx512 --no-reference \
        --formats fp4 --tokens 1 --repeat 3 --no-save > "$OUT/host_experts_tp2.log" 2>&1
    echo "host experts tp2 rc=$? $((SECONDS - t0)) s"; tail -5 "$OUT/host_experts_tp2.log"
    # one expert over and over: its bytes stay in the last-level cache, so this is the kernel's compute
    # rate with memory out of the way (set against the rows above: memory- or instruction-bound?)
    timeout 40 python3 benchmarks/host_experts.py --threads "$cores" --tp 1 --isa "$(python3 -c 'from shardsmith.runtime.offload import host_kernel as h; print(h.default_isa())')" \
        --no-reference --formats fp4,fp8,bf16 --tokens 1 --experts 1 --per-call 1 --repeat 20 --no-save \
        > "$OUT/host_experts_cached.log" 2>&1
    echo "host experts cache-resident rc=$? $((SECONDS - t0)) s"; tail -4 "$OUT/host_experts_cached.log"
fi

gen | tee "$OUT/gen.log"
echo "gen $((SECONDS - t0)) s"
timeout 240 python3 benchmarks/hybrid_vs_gpu.py "${hv[@]}" 2>&1 | tee "$OUT/hybrid_vs_gpu.log" | tail -16
echo "hybrid vs gpu rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
[ "${TINY:-0}" = 1 ] || cp "$(ls -t benchmarks/results/hybrid_vs_gpu-*-"$SHARDSMITH_HOST".json | head -1)" "$OUT/"
for f in 0.34 0.5; do  # the split at fixed host shares, 25 GB/s only
    [ $((SECONDS - t0)) -lt 420 ] || break
    one=("${hv[@]}"); [ "${TINY:-0}" = 1 ] || one=(/tmp/v4ck160 --work /tmp/hvg --cache-fraction 0.0625 --prompt 32 --tokens 32 --link-gbps 25)
    timeout 80 python3 benchmarks/hybrid_vs_gpu.py "${one[@]}" --backend gpu,hybrid --hybrid-fraction $f --no-save 2>&1 \
        | tee "$OUT/hybrid_fraction_$f.log" | tail -5
    echo "hybrid at $f of the misses rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
done
true
