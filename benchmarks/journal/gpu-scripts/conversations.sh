#!/usr/bin/env bash
# One H100/H200 call for conversations (prefix reuse, structured output):
#   1. a full-depth DeepSeek-V4-Flash-shaped checkpoint (43 layers with the release's kinds, 8 FP4
#      experts per layer, random values from the real inventory) is written while
#   2. benchmarks/structured.py times llguidance's masks and their application to [B, 129280] logits
#      on the GPU at batch 1 and 8 (SmolLM2's tokenizer: carried as .inv/smollm2-tokenizer.json);
#   3. benchmarks/prefix_reuse.py: a second turn's TTFT after an 8k- and a 2k-token history, reused
#      against computed again, on that checkpoint (bf16, prefill chunks of 2048).
# Carry .inv (the real V4-Flash inventory and the tokenizer). Logs and result JSONs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00' | tr 'H' 'h')
export SHARDSMITH_HOST=${SHARDSMITH_HOST:-${card:-gpu}x1al}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$SECONDS
(timeout "${GEN_S:-300}" python3 benchmarks/gen_v4_checkpoint.py /tmp/v4f --layers 43 --experts 8 --mtp 0 \
    --inventory .inv/deepseek-v4-flash-0731-reap160 > "$OUT/gen.log" 2>&1) &
gen=$!
timeout 90 python3 benchmarks/structured.py .inv/smollm2-tokenizer.json --device cuda --batch 1 8 --steps 300 \
    2>&1 | tee "$OUT/structured.log" | tail -4
echo "structured rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
wait $gen; echo "gen rc=$? $((SECONDS - t0)) s"; tail -2 "$OUT/gen.log"
timeout "${REUSE_S:-420}" python3 benchmarks/prefix_reuse.py /tmp/v4f --from-checkpoint --device cuda --dtype bfloat16 \
    --history ${HISTORY:-8192 2048} --added 64 --answer 32 --chunk 2048 --repeat 3 2>&1 | grep -v INFO \
    | tee "$OUT/prefix_reuse.log" | tail -8
echo "prefix_reuse rc=${PIPESTATUS[0]} $((SECONDS - t0)) s"
cp benchmarks/results/structured-*-"$SHARDSMITH_HOST".json benchmarks/results/prefix_reuse-*-"$SHARDSMITH_HOST".json \
    "$OUT/" 2>/dev/null
true
