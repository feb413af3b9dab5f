#!/usr/bin/env bash
# One GPU call, the benchmarks it names: bash benchmarks/gpu/run.sh STEP [STEP ...]
#
# Steps (each runs the Python benchmark of benchmarks/ and copies its results JSON to $OUT):
#   tests           the GPU-marked tests of the kernel, graph, offload and family files (pytest -m gpu)
#   v4-full-depth   43 V4-Flash-shaped layers (the release's kinds) x 24 FP4 experts, resident and a 25%
#                   expert cache, graphed, profiled (v4_decode.py; RESULTS' decode table)
#   offload-4x256   4 layers x 256 FP4 experts at 25% and 6.25% caches: the in-place copy kernel (default),
#                   misses read in place, the host table after a sync (RESULTS' offload table)
#   conversations   prefix reuse after 8k and 2k histories on a full-depth checkpoint, structured-output
#                   masks at batch 1 and 8 (prefix_reuse.py, structured.py)
#   sampling        the sampling fields per decode step on the 5-layer template pack (sampling.py)
#   kernels         the decode kernels side by side (decode_kernels.py)
#   serve           8 concurrent streams against one through the real serve path (serve_concurrency.py)
#   prefill         the prefill kernels' GPU tests, the fused chunk maths against eager function by function
#                   (fused_chunks.py), then 1k-32k prompts through a full-depth checkpoint in 2k and 8k chunks,
#                   fused against eager, and one chunk's kernels profiled (prefill.py)
#   grouped         a chunk's routed experts through one 256-expert FP4 bank (V4-Flash shapes, 2k and 8k tokens):
#                   the FP4 tile kernel against the experts expanded to bf16, then the tile kernel's block
#                   shapes alone; then FP8 (DeepSeek-V3 shapes) and bf16 (Qwen3-30B-A3B shapes) banks expert
#                   by expert against their grouped paths (grouped_experts.py --other-banks)
#   prefill-moe     2k and 8k prompts through 4 layers x 256 FP4 experts: grouped experts (the tile kernel,
#                   then expanded to bf16) against the loop,
#                   then offloaded (a 25% cache): each chunk streaming its missing experts once against the
#                   decode-sized slot path, with the link bytes per prompt token
#   prefill-qwen3   2k and 8k prompts through 4 Qwen3-30B-A3B-shaped layers x 128 bf16 experts (top-8): grouped experts
#                   (torch._grouped_mm) against the loop, then offloaded (a 25% cache, each chunk streaming its experts)
#   tp-sim          TP 1, 2, 4 of a full-depth V4 predicted from one rank alone, resident and with a 48 GB
#                   card's expert cache, collectives priced (tp_sim.py)
#   spec-cost       a full-depth V4's decode step against its verify step (k = 1, 2, 3, rollback included and
#                   apart) and the tokens/s they give at 80% and 90% acceptance, resident then with a 25%
#                   expert cache (spec_decode.py --cost --offload 0.25)
#   long-prompt     1k, 8k and 32k-token prompts through serve on a full-depth V4 pack: time to first token and the
#                   decode step at the context, the default prefill chunk (8192) against 2048 (long_prompt.py)
#   kv-blocks       the KV cache in blocks on a Qwen3-30B-A3B-shaped Mixtral-family checkpoint (48 layers, 32 query and 4
#                   KV heads of 128, 8 random experts): a decode step whose blocks are scattered (gathered each step)
#                   against one slice of the pool at 4k and 32k, and 16 requests run to their end in a pool with preemption
#                   against slots of the same bytes (kv_blocks.py)
#   ready           time to ready through serve on a full-depth V4 pack (43 layers x 8 FP4 experts, TP=1): a
#                   start on empty compile caches, then a cached one, beside the load floor, with the pieces
#                   compiled per bucket and with the row count symbolic (ready.py --compile-rows static dynamic);
#                   with a carried .base/ (BASE=<rev> bash benchmarks/gpu/carry.sh) that commit's starts first;
#                   READY_COLD=1: the pack dropped from the page cache before every start
#
# Carry .inv/ and .whl/, made by benchmarks/gpu/carry.sh: .inv/ (the real V4-Flash inventory from ../shared/real-inventories, and SmolLM2's
# tokenizer.json as .inv/smollm2-tokenizer.json for the masks) and .whl/ (wheels the host lacks:
# llguidance). Pass SHARDSMITH_COMMIT=<sha> (the host's copy of .git may be stale) and
# SHARDSMITH_HOST=<label>. Per-step limits: <STEP>_S seconds (e.g. OFFLOAD_S=300). The per-session
# scripts this replaces are kept, as they were run, in benchmarks/journal/gpu-scripts/.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00' | tr 'H' 'h')
export SHARDSMITH_HOST=${SHARDSMITH_HOST:-${card:-gpu}x1}
inv=.inv/deepseek-v4-flash-0731-reap160
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
t0=$SECONDS
say() { echo "== $1 rc=$2 $((SECONDS - t0)) s"; }
keep() { cp benchmarks/results/"$1"-*-"$SHARDSMITH_HOST"*.json "$OUT/" 2>/dev/null; true; }

template() {  # the 5-layer V4-Flash-shaped checkpoint v4_decode.py stacks to any depth (written once)
    [ -f /tmp/v4t5/config.json ] || timeout 200 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4t5 --layers 5 --experts 24 \
        --mtp 0 --inventory "$inv" > "$OUT/gen_v4t5.log" 2>&1
}

v4_decode() {  # NAME LAYERS EXPERTS CACHE... [env: extra settings]
    local name=$1 layers=$2 experts=$3; shift 3
    local fractions=(); for f in "$@"; do fractions+=(--cache-fraction "$f"); done
    local limit=${V4_S:-$([ "$layers" -gt 8 ] && echo 330 || echo 150)}
    SHARDSMITH_HOST=$name timeout "$limit" python3 benchmarks/v4_decode.py /tmp/v4t5 --work /tmp/v4p --device cuda --tp 1 \
        --prompt 16 --tokens 16 --kinds-config "$inv/config.json" "${fractions[@]}" --layers "$layers" \
        --experts-per-layer "$experts" --hang-s $((limit - 8)) --profile "/tmp/prof-$name" > "$OUT/v4_$name.log" 2>&1
    local rc=$?
    grep -E '^\[tp=|Error' "$OUT/v4_$name.log" | head -12
    cp benchmarks/results/v4_decode-*-"$name".json "$OUT/" 2>/dev/null
    return $rc
}

step_tests() {
    timeout "${TESTS_S:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/runtime/kernels tests/runtime/engine/test_decode_graphs.py tests/runtime/engine/test_deferred_buckets.py tests/runtime/engine/test_speculative.py tests/runtime/offload tests/runtime/models/test_families_cuda.py \
        > "$OUT/gpu_tests.log" 2>&1
    local rc=$?; grep -E "passed|failed|^FAILED|^E  " "$OUT/gpu_tests.log" | tail -15; return $rc
}

step_v4_full_depth() { template && v4_decode "$SHARDSMITH_HOST-43l24e" 43 24 0.25; }

step_offload_4x256() {
    template || return 1
    v4_decode "$SHARDSMITH_HOST-4l256e" 4 256 0.25 0.0625  # the defaults: in place, misses copied by a kernel
    SHARDSMITH_TUNING=offload_miss=read v4_decode "$SHARDSMITH_HOST-read-4l256e" 4 256 0.25 0.0625
    SHARDSMITH_KERNELS=offload_inplace=reference v4_decode "$SHARDSMITH_HOST-off-4l256e" 4 256 0.25 0.0625
}

step_conversations() {
    timeout 90 python3 benchmarks/structured.py .inv/smollm2-tokenizer.json --device cuda --batch 1 8 --steps 300 \
        2>&1 | tail -4
    full_depth || return 1
    timeout "${CONVERSATIONS_S:-420}" python3 benchmarks/prefix_reuse.py /tmp/v4f --from-checkpoint --device cuda \
        --dtype bfloat16 --history 8192 2048 --added 64 --answer 32 --chunk 2048 --repeat 3 2>&1 | grep -v INFO | tail -6
    local rc=${PIPESTATUS[0]}; keep structured; keep prefix_reuse; return $rc
}

step_sampling() {
    template || return 1
    [ -f /tmp/v4t5-tp1/pack.yaml ] || timeout 120 python3 -m shardsmith.cli split /tmp/v4t5 /tmp/v4t5-tp1 --tp 1 > "$OUT/split.log" 2>&1
    timeout "${SAMPLING_S:-200}" python3 benchmarks/sampling.py /tmp/v4t5-tp1 --device cuda --dtype bfloat16 --batch 1 8 \
        --steps 24 2>&1 | grep -v INFO | tail -10
    local rc=${PIPESTATUS[0]}; keep sampling; return $rc
}

step_kernels() {
    timeout "${KERNELS_S:-300}" python3 benchmarks/decode_kernels.py 2>&1 | tee "$OUT/kernels_bench.log" | tail -20
    local rc=${PIPESTATUS[0]}; keep decode_kernels; return $rc
}

step_serve() {
    [ -f /tmp/v4sc-tp1/pack.yaml ] || {
        timeout 300 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4sc --layers 2 --experts 256 --mtp 0 --inventory "$inv" \
            > "$OUT/gen_sc.log" 2>&1
        python3 -c 'from pathlib import Path; from shardsmith.testing.tokenizer import deepseek_tokenizer; deepseek_tokenizer(Path("/tmp/v4sc"), vocab_size=512, chat="template")'
        timeout 300 python3 -m shardsmith.cli split /tmp/v4sc /tmp/v4sc-tp1 --tp 1 >> "$OUT/gen_sc.log" 2>&1
    }
    timeout "${SERVE_S:-240}" python3 benchmarks/serve_concurrency.py /tmp/v4sc-tp1 --device cuda --dtype bfloat16 --tokens 64 \
        --repeat 3 --label resident 2>&1 | grep -v INFO | tail -12
    local rc=${PIPESTATUS[0]}; keep serve_concurrency; return $rc
}

full_depth() {  # 43 V4-Flash-shaped layers x 8 FP4 experts (written once)
    [ -f /tmp/v4f/config.json ] || timeout "${GEN_S:-300}" python3 benchmarks/gen_v4_checkpoint.py /tmp/v4f --layers 43 \
        --experts 8 --mtp 0 --inventory "$inv" > "$OUT/gen_v4f.log" 2>&1
}

step_prefill() {
    timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/kernels/test_prefill_attention.py \
        tests/runtime/kernels/test_grouped_experts.py tests/runtime/kernels/test_fused_chunks.py 2>&1 | tail -3
    timeout "${FUSED_S:-180}" python3 benchmarks/fused_chunks.py --device cuda --tokens 2048 8192 2>&1 | grep -v INFO \
        | tee "$OUT/fused_chunks.log" | tail -16; keep fused_chunks
    full_depth || return 1
    timeout "${PREFILL_S:-420}" python3 benchmarks/prefill.py /tmp/v4f --from-checkpoint --device cuda \
        --prompt ${PREFILL_PROMPTS:-1024 8192 32768} --chunk ${PREFILL_CHUNKS:-2048 8192} --baseline-max 8192 \
        --paths ${PREFILL_PATHS:-kernel/grouped/fused kernel/grouped/eager} \
        --profile 18 --out "$OUT/prefill-$SHARDSMITH_HOST.json" 2>&1 | grep -v INFO | tee "$OUT/prefill.log" | tail -60
}

step_grouped() {
    timeout "${GROUPED_S:-300}" python3 benchmarks/grouped_experts.py --tokens 2048 8192 --other-banks 2>&1 | grep -v INFO \
        | tee "$OUT/grouped_experts.log" | tail -30
    local rc=${PIPESTATUS[0]}; keep grouped_experts; return $rc
}

step_prefill_moe() {  # 4 layers x 256 FP4 experts: a chunk routes to every expert, grouped against the loop
    [ -f /tmp/v4m/config.json ] || timeout 300 python3 benchmarks/gen_v4_checkpoint.py /tmp/v4m --layers 4 \
        --experts 256 --mtp 0 --inventory "$inv" > "$OUT/gen_v4m.log" 2>&1
    timeout "${PREFILL_MOE_S:-420}" python3 benchmarks/prefill.py /tmp/v4m --from-checkpoint --device cuda \
        --prompt 2048 8192 --chunk 2048 8192 --paths kernel/grouped kernel/expanded kernel/loop --profile 12 \
        --offload 0.25 --offload-paths stream slots \
        --out "$OUT/prefill-$SHARDSMITH_HOST-moe.json" 2>&1 | grep -v INFO | tee "$OUT/prefill_moe.log" | tail -30
}

step_prefill_qwen3() {  # the Mixtral family's prefill: Qwen3-30B-A3B shapes, 4 layers x 128 bf16 experts, top-8
    [ -f /tmp/q3m/config.json ] || timeout 300 python3 -c 'from pathlib import Path; from shardsmith.testing.tiny import tiny_qwen_moe; tiny_qwen_moe(Path("/tmp/q3m"), layers=4, hidden=2048, heads=32, kv_heads=4, head_dim=128, moe_intermediate=768, experts=128, top_k=8, vocab=2048)' \
        > "$OUT/gen_q3m.log" 2>&1 || return 1
    timeout "${PREFILL_QWEN3_S:-300}" python3 benchmarks/prefill.py /tmp/q3m --from-checkpoint --device cuda \
        --prompt 2048 8192 --chunk 2048 8192 --paths kernel/grouped kernel/loop --offload 0.25 --offload-paths stream \
        --out "$OUT/prefill-$SHARDSMITH_HOST-qwen3.json" 2>&1 | grep -v INFO | tee "$OUT/prefill_qwen3.log" | tail -16
}

step_tp_sim() {
    template || return 1
    timeout "${TP_SIM_S:-540}" python3 benchmarks/tp_sim.py /tmp/v4t5 --work /tmp/tps --layers 43 --experts-per-layer 24 \
        --tp ${TP_SIM_TP:-1,2,4} --kinds-config "$inv/config.json" --timeout-s 240 2>&1 | grep -v INFO | tee "$OUT/tp_sim.log" | tail -40
    local rc=${PIPESTATUS[0]}; keep tp_sim; return $rc
}

step_spec_cost() {
    full_depth || return 1
    timeout "${SPEC_COST_S:-420}" python3 benchmarks/spec_decode.py /tmp/v4f --from-checkpoint --cost --k 1 2 3 \
        --device cuda --dtype bfloat16 --prompt-tokens 1024 --offload ${SPEC_OFFLOAD:-0.25} \
        --out "$OUT/spec_decode-$SHARDSMITH_HOST.json" 2>&1 | grep -v INFO | tee "$OUT/spec_cost.log" | tail -18
}

full_depth_pack() {  # full_depth split as a TP=1 pack with a tokenizer, for the serve path (written once)
    full_depth || return 1
    [ -f /tmp/v4f/tokenizer.json ] || python3 -c 'from pathlib import Path; from shardsmith.testing.tokenizer import deepseek_tokenizer; deepseek_tokenizer(Path("/tmp/v4f"), vocab_size=512, chat="template")'
    [ -f /tmp/v4f-tp1/pack.yaml ] || timeout 300 python3 -m shardsmith.cli split /tmp/v4f /tmp/v4f-tp1 --tp 1 \
        > "$OUT/split_v4f.log" 2>&1
}

step_long_prompt() {
    full_depth_pack || return 1
    timeout "${LONG_PROMPT_S:-500}" python3 benchmarks/long_prompt.py /tmp/v4f-tp1 --device cuda --dtype bfloat16 \
        --prompt ${LONG_PROMPTS:-1024 8192 32768} --decode-tokens 32 --config "default=" \
        --config "chunk2k=--prefill-chunk 2048" 2>&1 | grep -v INFO | tee "$OUT/long_prompt.log" | tail -10
    local rc=${PIPESTATUS[0]}; keep long_prompt; return $rc
}

step_kv_blocks() {
    [ -f /tmp/q3s/config.json ] || timeout 300 python3 -c 'from pathlib import Path; from shardsmith.testing.tiny import tiny_qwen_moe; tiny_qwen_moe(Path("/tmp/q3s"), layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, moe_intermediate=768, experts=8, top_k=2, vocab=2048)' \
        > "$OUT/gen_q3s.log" 2>&1 || return 1
    timeout "${KV_BLOCKS_S:-300}" python3 benchmarks/kv_blocks.py /tmp/q3s --from-checkpoint --device cuda --dtype bfloat16 \
        --context ${KV_CONTEXTS:-4096 32768} --steps 30 --max-model-len 8192 --max-num-seqs 16 --pool 32768 \
        --requests 16 --prompt 2048 --max-tokens 256 2>&1 | grep -v INFO | tee "$OUT/kv_blocks.log" | tail -12
    local rc=${PIPESTATUS[0]}; keep kv_blocks; return $rc
}

step_ready() {
    full_depth_pack || return 1
    local base=(); [ -d .base/shardsmith ] && base=(--checkout "base-$(cat .base/REV 2>/dev/null)=.base" --checkout new=.)
    timeout "${READY_S:-480}" python3 benchmarks/ready.py /tmp/v4f-tp1 --device cuda --dtype bfloat16 --starts 2 \
        --buckets ${READY_BUCKETS:-all} --compile-rows ${READY_COMPILE:-static dynamic} "${base[@]}" ${READY_COLD:+--cold-page-cache} \
        --cache /tmp/ready-cache 2>&1 | grep -v INFO | tee "$OUT/ready.log" | tail -14
    local rc=${PIPESTATUS[0]}; keep ready; return $rc
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
for step in "$@"; do
    fn="step_${step//-/_}"
    if ! declare -F "$fn" > /dev/null; then echo "unknown step: $step"; continue; fi
    "$fn"; say "$step" $?
done
tar czf "$OUT/prof.tgz" -C /tmp $(cd /tmp && ls -d prof-* 2>/dev/null) 2>/dev/null
true
