#!/usr/bin/env bash
# On one H200: the whole `gpu` test marker on this tree (the CUDA checks of every layer: kernels and
# their wiring, captured decode pieces, offload), then the host expert kernel on the host's cores
# (benchmarks/host_experts.py at TP 1 with every core and TP 2 with half). No wheels needed (the
# marker's tests use no server). Logs and the results JSON go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
export SHARDSMITH_HOST=${SHARDSMITH_HOST:-h200x1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
nproc; lscpu | grep -E 'Model name' ; which g++ c++ || true
t0=$SECONDS
timeout "${TEST_S:-300}" python3 -m pytest tests -m gpu -q -p no:cacheprovider -o addopts="" -m gpu -rs > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^E |^FAILED|^SKIPPED" "$OUT/gpu_tests.log" | tail -30
cores=$(nproc)
timeout "${HOST_S:-150}" python3 benchmarks/host_experts.py --threads "$cores" --tp 1 --repeat 3 > "$OUT/host_experts_tp1.log" 2>&1
echo "host experts tp1 rc=$? $((SECONDS - t0)) s"; tail -12 "$OUT/host_experts_tp1.log"
cp benchmarks/results/host_experts-*-"$SHARDSMITH_HOST".json "$OUT/host_experts_tp1.json" 2>/dev/null
timeout "${HOST_S:-120}" python3 benchmarks/host_experts.py --threads $((cores / 2)) --tp 2 --repeat 3 --no-save \
    > "$OUT/host_experts_tp2.log" 2>&1
echo "host experts tp2 rc=$? $((SECONDS - t0)) s"; tail -12 "$OUT/host_experts_tp2.log"
true
