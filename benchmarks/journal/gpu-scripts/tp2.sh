#!/usr/bin/env bash
# Issue 16 on two H200s of one host (kind nvidia-h200-x2), in one call of under 10 minutes; with one
# GPU it runs every step at TP=1 only (the rehearsal the issue asks for when two GPUs are not lent).
#   1. v4_decode.py template mode (a 5-layer V4-Flash-shaped template checkpoint, real per-layer
#      shapes; benchmarks/_v4_template.py), 4 layers x 256 FP4 experts (sliding, sliding, CSA, HCA),
#      TP 1 and 2, resident and offloaded at 25% and 6.25% of the TP=1 expert bytes per GPU, graphed;
#   2. the full-depth model (43 layers, the release's kinds, 24 experts per layer) at TP 1 and 2 with
#      a 25% cache: a 48 GB GPU's share of the release (48 GB less the dense 8.8 GB and ~2 GB of KV and
#      graphs leaves ~37 GB for experts: 23.5% of the 157 GB of routed experts at TP=1, 26.4% at TP=2
#      counted in TP=1 bytes), so 25% stands for both;
#   3. the GPU test marker.
# Carry .inv (the V4 inventory copied from ../shared/real-inventories). JSON and logs land in $OUT.
# The concurrency benchmark at TP=2 is benchmarks/gpu/serve_concurrency.sh with TP=2 (needs .whl).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
inv=.inv/deepseek-v4-flash-0731-reap160
gpus=$(nvidia-smi -L | wc -l)
tps=1; [ "$gpus" -ge 2 ] && tps=1,2
host=${SHARDSMITH_HOST:-h200x${gpus}tp}
echo "GPUs: $gpus; TP $tps"
t0=$SECONDS
timeout 150 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4t5 --layers 5 --experts 24 --mtp 0 --inventory "$inv" \
    > "$OUT/gen.log" 2>&1
tail -1 "$OUT/gen.log"; echo "gen $((SECONDS - t0)) s"
run() {  # name layers experts cache-fraction...
    SHARDSMITH_HOST=$host-$1 timeout "${BENCH_S:-150}" python3 benchmarks/v4_decode.py /tmp/v4t5 --work /tmp/v4p \
        --device cuda --tp "$tps" --prompt 16 --tokens 16 --kinds-config "$inv/config.json" --layers "$2" \
        --experts-per-layer "$3" $(printf -- "--cache-fraction %s " "${@:4}") --hang-s $(( ${BENCH_S:-150} - 8 )) > "$OUT/v4_$1.log" 2>&1
    echo "v4 $1 rc=$? $((SECONDS - t0)) s"; grep -E '^\[tp=' "$OUT/v4_$1.log" | head -12
    cp benchmarks/results/v4_decode-*-"$host-$1".json "$OUT/" 2>/dev/null
}
run 4l256e 4 256 0.25 0.0625
run 43l24e 43 24 0.25
timeout "${TEST_S:-200}" python3 -m pytest tests -m gpu -q -p no:cacheprovider -o addopts="" -m gpu -rs \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^FAILED" "$OUT/gpu_tests.log" | tail -10
true
