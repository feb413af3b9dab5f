"""On one H200 (issue 12): hc_pre eager against hc_pre inside ``torch.compile`` (as V4's decode pieces
run it), block_d 1024 and 4096, one token, the norm folded; us per call over 50 events-timed calls
after warm-up (launch-bound: no graph, the same for both). Prints as it goes (a short call may be cut);
rows go to ``benchmarks/results/hc_pre_compiled-<YYYYMMDD>-<host>.json``."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import save_results  # noqa: E402

from shardsmith.runtime.layers.kernels.hc_pre import hc_pre  # noqa: E402

M, D, ITERS, EPS = 4, 4096, 20, 1e-6
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(1, M, D, generator=g, device="cuda").to(torch.bfloat16)
fn = torch.randn((2 + M) * M, M * D, generator=g, device="cuda") * 0.01
base, scale = torch.randn((2 + M) * M, generator=g, device="cuda"), torch.rand(3, generator=g, device="cuda")
w = torch.rand(D, generator=g, device="cuda") + 0.5


def timed(f, n=50):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        f()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


rows = []
for block_d in (1024, 4096):
    call = lambda x, bd=block_d: hc_pre(x, fn, base, scale, ITERS, EPS, EPS, out_norm=(w, 1e-6), block_d=bd)[0]  # noqa: E731
    t0 = time.time()
    e = timed(lambda: call(x))
    comp = torch.compile(call, dynamic=False)
    c = timed(lambda: comp(x))
    same = torch.equal(comp(x), call(x))
    print(f"block_d={block_d}: eager {e:.1f} us, compiled {c:.1f} us per call (launch-bound: no graph), "
          f"same bits {same}, {time.time() - t0:.0f} s", flush=True)
    rows.append({"tokens": 1, "block_d": block_d, "eager_us_per_call": e, "compiled_us_per_call": c,
                 "compiled_over_eager": c / e, "same_bits": same})
save_results("hc_pre_compiled", rows, extra={"shape": f"m={M} D={D} iters={ITERS} bf16, norm folded"})
