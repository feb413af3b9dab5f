#!/usr/bin/env bash
# On one H200 (issue 12): the decode kernels' GPU tests, then the full-depth model (43 layers x 24 FP4
# experts, v4_full_depth.sh) in several configurations side by side in one call. Carry .inv. Each line of
# AB is one run: a name, then VAR=value settings for it (MAX_SEQ_LEN, EXTRA and RUNS reach
# v4_full_depth.sh; SHARDSMITH_* switches reach the model). The default AB is session 13's second call: the
# short default context with and without the merged projections, and max_seq_len 8192 with this
# session's kernels and with the PyTorch compressor/indexer path (about 7 minutes). TESTS names the gpu
# test files run first (while the template checkpoint is written). Everything lands in $OUT/res.tgz
# (logs, results JSONs, profiles) and $OUT/summary.log.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
res=/tmp/res; mkdir -p $res
export TEST_S=${TEST_S:-170} BENCH_S=${BENCH_S:-150}
AB=${AB:-"h200x1z-nomerge SHARDSMITH_KERNELS=merge_projections=reference
h200x1z
h200x1z-8k MAX_SEQ_LEN=8192
h200x1z-8k-off MAX_SEQ_LEN=8192 SHARDSMITH_KERNELS=compressor_step=reference,indexer_scores=reference,merge_projections=reference"}
first=1
while read -r name settings; do
    [ -z "$name" ] && continue
    if [ $first = 1 ]; then  # the first run writes the checkpoint and runs the tests beside it
        pre=(SKIP_TESTS=0 GEN=1 "TESTS=${TESTS:-tests/runtime/kernels/test_compressor_step.py tests/runtime/kernels/test_kernels_wired.py tests/runtime/engine/test_decode_graphs.py}")
        first=0
    else
        pre=(SKIP_TESTS=1 GEN=0)
    fi
    # shellcheck disable=SC2086  # settings: VAR=value words
    env "${pre[@]}" RUNS=43-24 $settings SHARDSMITH_HOST="$name" OUT="$res/$name" \
        bash benchmarks/gpu/v4_full_depth.sh 2>&1 | tee -a "$OUT/summary.log"
    cp benchmarks/results/v4_decode-*-"$name"-*.json "$res/" 2>/dev/null
done <<< "$AB"
tar czf "$OUT/res.tgz" -C /tmp res $(cd /tmp && ls -d prof-* 2>/dev/null)
