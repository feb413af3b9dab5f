#!/usr/bin/env bash
# Make the two ignored folders a GPU call carries (run from the checkout, on this machine, with the
# project installed): bash benchmarks/gpu/carry.sh
#   .inv/  the real DeepSeek-V4-Flash inventory (config, index, safetensors headers) from
#          ../shared/real-inventories, and SmolLM2's tokenizer.json (from the demo checkpoint)
#          as .inv/smollm2-tokenizer.json for the structured-output masks
#   .whl/  the Python 3.12 wheels the GPU host lacks (../shared/device/fetch-wheels.sh) and llguidance
#   .base/ with BASE=<rev>: that commit's source (git archive), which run.sh's ready step starts beside this one
# Both are added to .git/info/exclude. Then: run(command="bash benchmarks/gpu/run.sh ...", carry=[".inv", ".whl"]).
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
inv=../shared/real-inventories/deepseek-v4-flash-0731-reap160
mkdir -p .inv
[ -d .inv/deepseek-v4-flash-0731-reap160 ] || cp -r "$inv" .inv/
grep -qx "/.inv/" .git/info/exclude 2>/dev/null || echo "/.inv/" >> .git/info/exclude
if [ ! -f .inv/smollm2-tokenizer.json ]; then
    demo=$(python3 -c 'from shardsmith.demo import build_demo_checkpoint, default_demo_dir as d; print(build_demo_checkpoint(d(False)))')
    cp "$demo/tokenizer.json" .inv/smollm2-tokenizer.json
fi
bash ../shared/device/fetch-wheels.sh .whl llguidance > /dev/null
if [ -n "${BASE:-}" ]; then  # .base/: the source of commit BASE, for run.sh's side-by-side starts
    rm -rf .base && mkdir .base && git archive "$BASE" | tar -x -C .base && git rev-parse --short "$BASE" > .base/REV
    grep -qx "/.base/" .git/info/exclude || echo "/.base/" >> .git/info/exclude
fi
du -sh .inv .whl $([ -d .base ] && echo .base)
