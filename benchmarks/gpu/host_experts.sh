#!/usr/bin/env bash
# On the GPU host (issue 15): routed experts computed on its Sapphire Rapids cores by the stored-format
# host kernel, against the expand-then-matmul path and the host's read floor, for DeepSeek-V4-Flash
# expert shapes at TP 1 (all cores) and TP 2 (half the cores per rank). Carry .whl (env.sh). Logs and
# results JSON land in $OUT.
set -uo pipefail
source benchmarks/gpu/env.sh
nproc; lscpu | grep -E 'Model name|Flags' | cut -c1-200
cores=$(nproc)
t0=$SECONDS
timeout 200 python3 benchmarks/host_experts.py --threads "$cores" --tp 1 --experts 16 2>&1 | tee "$OUT/host_experts_tp1.log" | tail -12
cp benchmarks/results/host_experts-*-"$SHARDSMITH_HOST".json "$OUT/host_experts_tp1.json" 2>/dev/null
timeout 150 python3 benchmarks/host_experts.py --threads $((cores / 2)) --tp 2 --experts 16 --no-save 2>&1 | tee "$OUT/host_experts_tp2.log" | tail -12
echo "host experts $((SECONDS - t0)) s"
true
