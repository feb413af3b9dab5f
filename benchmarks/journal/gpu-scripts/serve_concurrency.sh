#!/usr/bin/env bash
# On one H200 (issue 14): 1, 2, 4 and 8 concurrent streams through `shardsmith serve` with continuous
# batching, on a DeepSeek-V4-Flash-shaped pack at TP=1 ($LAYERS layers, default 2 as v4_offload.sh; 256 FP4
# routed experts per layer), experts resident, then offloaded with a GPU expert cache of 25% of the
# rank's expert bytes (the checkpoint is written while tests/runtime/models/test_families_cuda.py and the host
# kernel tests run; TESTS=0 skips them). The server needs fastapi/uvicorn: carry .whl/ (env.sh installs it) and .inv (the
# V4 inventory copied from ../shared/real-inventories). Logs and the results JSON land in $OUT.
# Each concurrency is run REPEAT (3) times, medians reported: the first use of a new prompt length
# compiles Triton kernel specializations (seconds, once per length per host cache).
# Target (issue 14): 8 streams >= 4x the single-stream aggregate tokens/s, per-stream >= 0.5x.
# OFFLOAD=0 serves with experts resident only; PREFILL_EACH=1 adds resident rows with --decode-prompt-tokens 0;
# SWITCH_MS="0.2 1" adds resident rows per thread switch interval (SHARDSMITH_TUNING=switch_interval_ms=MS);
# UNCOMPILED=1 adds resident rows with SHARDSMITH_KERNELS=compile_pieces=reference (the pieces not torch.compile'd);
# PLAIN=1 adds resident rows with SHARDSMITH_TUNING=overlap_steps=0 (each step's tokens read before the next is launched);
# FEED_TOKENS="32 64" adds resident rows per --decode-prompt-tokens value (prompts up to N tokens fed through decode rows);
# every serving row also writes the server's step trace to $OUT/steps-<label>.jsonl (prefill / feeding / decode steps).
# BATCH_STEP=1 times the engine step alone at 1-8 rows (benchmarks/batch_step.py, device time by kernel).
# Rows also say where a step's time went (engine step ms, text side ms, engine busy share: from /metrics).
# PHASE=gen writes and splits the checkpoint only (to run beside other GPU work); PHASE=serve then serves it.
set -uo pipefail
source benchmarks/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
inv=.inv/deepseek-v4-flash-0731-reap160
LAYERS=${LAYERS:-2} TOKENS=${TOKENS:-64}
PHASE=${PHASE:-all}  # gen: only write and split the checkpoint; serve: only serve an existing pack; all: both
t0=$SECONDS
if [ "$PHASE" = serve ]; then
    until [ -f /tmp/v4sc-tp1/pack.yaml ] || [ $((SECONDS - t0)) -gt 300 ]; do sleep 2; done
    TESTS=0
fi
[ "$PHASE" != serve ] && (timeout 300 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4sc --layers "$LAYERS" --experts 256 --mtp 0 --inventory "$inv" \
    2>&1 | tail -2
# the generated checkpoint has no tokenizer: a small byte-level BPE (ids past it decode to nothing)
python3 -c 'from pathlib import Path; from shardsmith.testing.tokenizer import deepseek_tokenizer; deepseek_tokenizer(Path("/tmp/v4sc"), vocab_size=512, chat="template")'
rm -rf /tmp/v4sc-tp1
timeout 300 python3 -m shardsmith.cli split /tmp/v4sc /tmp/v4sc-tp1 --tp 1 2>&1 | tail -2) > "$OUT/gen_sc.log" 2>&1 &
gen=$!
[ "$PHASE" = gen ] && { wait $gen; cat "$OUT/gen_sc.log"; exit 0; }
# meanwhile (GPU idle): every family graphed and batched on CUDA, and the host kernel's checks
if [ "${TESTS:-1}" = 1 ]; then
    timeout "${TEST_S:-300}" python3 -m pytest tests/runtime/models/test_families_cuda.py tests/runtime/offload/test_host_kernel.py \
        -m "gpu or not gpu" -q -p no:cacheprovider -o addopts="" -rs > "$OUT/tests.log" 2>&1
    echo "tests rc=$? $((SECONDS - t0)) s"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | head -12
fi
[ "$PHASE" != serve ] && { wait $gen; cat "$OUT/gen_sc.log"; }
echo "gen + split $((SECONDS - t0)) s"
json="$OUT/serve_concurrency-$(date +%Y%m%d)-${SHARDSMITH_HOST}.json"
rm -f "$json"
timeout "${SERVE_S:-200}" python3 benchmarks/serve_concurrency.py /tmp/v4sc-tp1 --device cuda --dtype bfloat16 --tokens "$TOKENS" --repeat "${REPEAT:-3}" \
    --label resident --out "$json" --append --step-trace "$OUT/steps-resident.jsonl" 2>&1 | tee "$OUT/resident.log" | tail -12
echo "resident $((SECONDS - t0)) s"
if [ "${PREFILL_EACH:-0}" = 1 ]; then  # side by side: every prompt through its own prefill forward, as before d3b2661
    timeout "${SERVE_S:-200}" python3 benchmarks/serve_concurrency.py /tmp/v4sc-tp1 --device cuda --dtype bfloat16 --tokens "$TOKENS" \
        --repeat "${REPEAT:-3}" --label "resident, prefill each" --out "$json" --append -- --decode-prompt-tokens 0 \
        2>&1 | tee "$OUT/resident_prefill_each.log" | tail -8
    echo "resident, prefill each $((SECONDS - t0)) s"
fi
if [ "${PLAIN:-0}" = 1 ]; then  # side by side: steps not overlapped (the tokens read before the next step launches)
    SHARDSMITH_TUNING=overlap_steps=0 timeout "${SERVE_S:-200}" python3 benchmarks/serve_concurrency.py /tmp/v4sc-tp1 --device cuda \
        --dtype bfloat16 --tokens "$TOKENS" --repeat "${REPEAT:-3}" --label "resident, plain steps" --out "$json" --append \
        --step-trace "$OUT/steps-plain.jsonl" 2>&1 | tee "$OUT/resident_plain.log" | tail -12
    echo "resident, plain steps $((SECONDS - t0)) s"
fi
for n in ${FEED_TOKENS:-}; do  # side by side: longer prompts fed through decode rows instead of an eager prefill
    timeout "${SERVE_S:-200}" python3 benchmarks/serve_concurrency.py /tmp/v4sc-tp1 --device cuda --dtype bfloat16 --tokens "$TOKENS" \
        --repeat "${REPEAT:-3}" --label "resident, prompts of <= $n fed" --out "$json" --append --step-trace "$OUT/steps-feed$n.jsonl" \
        -- --decode-prompt-tokens "$n" 2>&1 | tee "$OUT/resident_feed$n.log" | tail -12
    echo "resident, prompts of <= $n fed $((SECONDS - t0)) s"
done
for ms in ${SWITCH_MS:-}; do  # side by side: the interpreter's switch interval (SHARDSMITH_TUNING=switch_interval_ms=MS)
    SHARDSMITH_TUNING=switch_interval_ms=$ms timeout "${SERVE_S:-200}" python3 benchmarks/serve_concurrency.py /tmp/v4sc-tp1 \
        --device cuda --dtype bfloat16 --tokens "$TOKENS" --repeat "${REPEAT:-3}" --label "resident, switch interval $ms ms" \
        --out "$json" --append 2>&1 | tee "$OUT/resident_switch_$ms.log" | tail -8
    echo "resident, switch interval $ms ms $((SECONDS - t0)) s"
done
if [ "${UNCOMPILED:-0}" = 1 ]; then  # side by side: the row-wise pieces not torch.compile'd (SHARDSMITH_KERNELS=compile_pieces=reference)
    SHARDSMITH_KERNELS=compile_pieces=reference timeout "${SERVE_S:-200}" python3 benchmarks/serve_concurrency.py /tmp/v4sc-tp1 --device cuda \
        --dtype bfloat16 --tokens "$TOKENS" --repeat "${REPEAT:-3}" --label "resident, pieces not compiled" --out "$json" \
        --append 2>&1 | tee "$OUT/resident_uncompiled.log" | tail -8
    echo "resident, pieces not compiled $((SECONDS - t0)) s"
fi
if [ "${BATCH_STEP:-0}" = 1 ]; then  # the engine step alone at 1-8 rows, device time split by kernel (no server)
    timeout "${STEP_S:-150}" python3 benchmarks/batch_step.py /tmp/v4sc-tp1 --device cuda --dtype bfloat16 --profile "$OUT/prof" \
        --out "$OUT/batch_step-$(date +%Y%m%d)-${SHARDSMITH_HOST}.json" --append 2>&1 | grep -v "INFO" | tee "$OUT/batch_step.log" | tail -6
    echo "batch step $((SECONDS - t0)) s"
fi
[ "${OFFLOAD:-1}" = 1 ] || exit 0  # OFFLOAD=0: experts resident only
cache_gb=$(python3 -c 'import glob, os; print(0.25 * sum(os.path.getsize(f) for f in glob.glob("/tmp/v4sc-tp1/rank-0-of-1/experts-*.safetensors")) / 2**30)')
echo "expert cache ${cache_gb} GiB (25% of the rank's expert bytes)"
timeout "${SERVE_S:-200}" python3 benchmarks/serve_concurrency.py /tmp/v4sc-tp1 --device cuda --dtype bfloat16 --tokens "$TOKENS" --repeat "${REPEAT:-3}" \
    --label offload-25% --out "$json" --append --step-trace "$OUT/steps-offload.jsonl" -- --moe-backend gpu \
    --expert-cache-gb "$cache_gb" 2>&1 | tee "$OUT/offload.log" | tail -12
echo "offload $((SECONDS - t0)) s"
cp /tmp/serve_concurrency*.log "$OUT/" 2>/dev/null
true
