#!/usr/bin/env bash
# On one H200 (issue 12): the fused decode kernels' tests (small ragged shapes compiled, then the
# V4-Flash shapes, CUDA graph and determinism under -m gpu), then benchmarks/decode_kernels.py; SWEEP=1
# times launch configurations first. Needs no wheels (torch and triton are on the host). Logs and
# the results JSON go to $OUT. Run from the checkout's root; SHARDSMITH_COMMIT names the commit
# of a copied tree (no .git there).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 SHARDSMITH_HOST=${SHARDSMITH_HOST:-h200x1} PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
t0=$SECONDS
timeout "${TEST_S:-240}" python3 -m pytest tests/runtime/kernels/test_kernels.py tests/runtime/kernels/test_kernels_gpu.py -m 'gpu or not slow' \
    -q -p no:cacheprovider 2>&1 | tee "$OUT/kernels_tests.log" | grep -E "passed|failed|^E |Error|^FAILED" | tail -25
echo "tests rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
timeout "${BENCH_S:-300}" python3 benchmarks/decode_kernels.py ${SWEEP:+--sweep} ${BENCH_ARGS:-} 2>&1 | tee "$OUT/kernels_bench.log"
echo "bench rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
cp benchmarks/results/decode_kernels-*-"$SHARDSMITH_HOST".json "$OUT/" 2>/dev/null
true
