#!/usr/bin/env bash
# On one H200 (issue 12, session 13): the decode kernels' GPU tests, then the full-depth model (43 layers x 24
# FP4 experts, v4_full_depth.sh) side by side in one call: at the default short context (max_seq_len 56: the
# HCA layers have no entries) with and without the merged projections, and at max_seq_len 8192 (every
# compressed layer has entries; the 512-position bucket) with this session's kernels and with the PyTorch
# compressor/indexer path and unmerged projections (the path before them). About 7 minutes. Carry .inv.
# Everything lands in $OUT/res.tgz (logs, results JSONs, profiles) and $OUT/summary.log.
set -u
OUT=${OUT:-/tmp/out}
res=/tmp/res; mkdir -p $res
export TEST_S=${TEST_S:-170} BENCH_S=${BENCH_S:-150}
run() {  # name, then VAR=value... for the run
    local name=$1; shift
    env "$@" SKIP_TESTS=${SKIP:-1} GEN=${GEN_IT:-0} RUNS=43-24 SHARDSMITH_HOST=$name OUT=$res/$name \
        bash benchmarks/gpu/v4_full_depth.sh 2>&1 | tee -a $OUT/summary.log
    cp benchmarks/results/v4_decode-*-"$name"-43l24e.json $res/ 2>/dev/null
}
SKIP=0 GEN_IT=1 TESTS="${TESTS:-tests/runtime/test_compressor_step.py tests/runtime/test_kernels_wired.py tests/runtime/test_decode_graphs.py}" \
    run h200x1z-nomerge SHARDSMITH_MERGE_PROJECTIONS=0
run h200x1z
run h200x1z-8k MAX_SEQ_LEN=8192
run h200x1z-8k-off MAX_SEQ_LEN=8192 SHARDSMITH_COMPRESSOR_STEP=off SHARDSMITH_INDEXER_SCORES=off SHARDSMITH_MERGE_PROJECTIONS=0
tar czf $OUT/res.tgz -C /tmp res $(cd /tmp && ls -d prof-* 2>/dev/null)
