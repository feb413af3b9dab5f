#!/usr/bin/env bash
# On one H200 (issue 14): time to first token for 8 new prompt lengths (3..700 tokens) right after
# `shardsmith serve` says ready, on the DeepSeek-V4-Flash-shaped pack of serve_concurrency.sh ($LAYERS
# layers, default 2; 256 FP4 routed experts per layer), experts resident, then offloaded to a GPU
# expert cache of 25% of the expert bytes. Each server starts with EMPTY Triton / Inductor caches, so
# its warm-up compiles everything; the script prints the warm-up seconds and whether serving added any
# compile-cache file (it should not: "NO compile while serving"; before the fix each new length
# compiled for 0.6-3.6 s). Carry .whl/ and .inv as for serve_concurrency.sh. Results JSON in $OUT.
set -uo pipefail
source benchmarks/gpu/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
inv=.inv/deepseek-v4-flash-0731-reap160
LAYERS=${LAYERS:-2}
t0=$SECONDS
if [ ! -d /tmp/v4sc-tp1 ]; then
    timeout 300 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4sc --layers "$LAYERS" --experts 256 --mtp 0 \
        --inventory "$inv" 2>&1 | tail -2
    python3 -c 'from pathlib import Path; from shardsmith.testing.tokenizer import deepseek_tokenizer; deepseek_tokenizer(Path("/tmp/v4sc"), vocab_size=512, chat="template")'
    timeout 300 python3 -m shardsmith.cli split /tmp/v4sc /tmp/v4sc-tp1 --tp 1 2>&1 | tail -2
fi
echo "gen + split $((SECONDS - t0)) s"
export SHARDSMITH_COMMIT=${SHARDSMITH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
timeout "${SERVE_S:-240}" python3 benchmarks/ttft.py /tmp/v4sc-tp1 --device cuda --dtype bfloat16 \
    --out "$OUT/ttft-resident-$(date +%Y%m%d)-${SHARDSMITH_HOST}.json" 2>&1 | tee "$OUT/ttft-resident.log" | tail -10
mv "$OUT/ttft-serve.log" "$OUT/ttft-serve-resident.log"
echo "resident $((SECONDS - t0)) s"
cache_gb=$(python3 -c 'import glob, os; print(0.25 * sum(os.path.getsize(f) for f in glob.glob("/tmp/v4sc-tp1/rank-0-of-1/experts-*.safetensors")) / 2**30)')
timeout "${SERVE_S:-240}" python3 benchmarks/ttft.py /tmp/v4sc-tp1 --device cuda --dtype bfloat16 \
    --out "$OUT/ttft-offload-$(date +%Y%m%d)-${SHARDSMITH_HOST}.json" -- --moe-backend gpu --expert-cache-gb "$cache_gb" \
    2>&1 | tee "$OUT/ttft-offload.log" | tail -10
mv "$OUT/ttft-serve.log" "$OUT/ttft-serve-offload.log"
echo "offload $((SECONDS - t0)) s"
true
