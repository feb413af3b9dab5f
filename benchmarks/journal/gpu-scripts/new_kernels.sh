#!/usr/bin/env bash
# On one H200 (issue 12, session 14): the GPU tests of the kernels added this session (the FP8 one-token
# GEMV, route_topk, hc_post, hc_pre with the norm folded), then their benchmarks side by side with the
# paths they replace: fp8_linear's GEMV against its dot kernel over launch configurations (M = 1, 4), the
# router (top-k and hash), hc_post and hc_pre+norm. About 5 minutes; no carried files. Logs and the
# results JSONs land in $OUT (res.tgz).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
OUT=${OUT:-/tmp/out}; r=/tmp/nk; mkdir -p "$OUT" $r
host=${SHARDSMITH_HOST:-h200x1ad}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$SECONDS
timeout ${TEST_S:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -k "${TEST_K:-gemv or route or hc_post or hc_pre}" \
    tests/runtime/kernels/test_kernels_gpu.py tests/runtime/kernels/test_router_kernel.py tests/runtime/kernels/test_hc_post.py \
    tests/runtime/kernels/test_hc_pre.py > $r/gpu_tests.log 2>&1
echo "gpu tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^E |^FAILED" $r/gpu_tests.log | tail -15
SHARDSMITH_HOST=$host timeout 170 python3 benchmarks/decode_kernels.py --fp8-only --fp8-tokens 1,4 --fp8-config \
    "${FP8_CONFIGS:-gemv=0;default;block_n=16;block_n=16,block_k=512;block_n=64,block_k=128;block_k=512,num_warps=8;num_stages=2;num_stages=4;ppsm=2;ppsm=8}" \
    > $r/fp8.log 2>&1; echo "fp8 rc=$? $((SECONDS - t0)) s"; tail -60 $r/fp8.log
SHARDSMITH_HOST=$host timeout 60 python3 benchmarks/router.py > $r/router.log 2>&1; echo "router rc=$? $((SECONDS - t0)) s"; tail -30 $r/router.log
SHARDSMITH_HOST=$host-hash timeout 40 python3 benchmarks/router.py --hashed --block-e 16 --block-k 256 --warps 4 > $r/router_hash.log 2>&1
echo "router hash rc=$?"; tail -8 $r/router_hash.log
SHARDSMITH_HOST=$host timeout 60 python3 benchmarks/hc_post.py > $r/hc_post.log 2>&1; echo "hc_post rc=$? $((SECONDS - t0)) s"; tail -40 $r/hc_post.log
cp benchmarks/results/*-"$host"*.json $r/ 2>/dev/null
tar czf "$OUT/res.tgz" -C /tmp nk
