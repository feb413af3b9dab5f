"""On one H200 (issue 12): hc_pre eager against hc_pre inside ``torch.compile`` (as V4's decode pieces
run it, a user Triton kernel that inductor launches) and against hc_pre behind a ``torch.library``
custom op inside ``torch.compile`` (inductor calls it as an opaque extern: Triton's own launch),
block_d 1024 and 4096, one token, the norm folded; us per call over 50 events-timed calls after
warm-up (launch-bound: no graph) and from CUDA-graph replays of 20 calls (GPU time, as in the model). Prints as it goes (a short call may be cut);
rows go to ``benchmarks/results/hc_pre_compiled-<YYYYMMDD>-<host>.json``."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import save_results  # noqa: E402
from decode_kernels import graph_seconds  # noqa: E402

from shardsmith.runtime.layers.kernels.deepseek_v4.hc_pre import hc_pre  # noqa: E402

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



@torch.library.custom_op("shardsmith_bench::hc_pre", mutates_args=())
def hc_pre_op(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, w: torch.Tensor,
              block_d: int) -> torch.Tensor:
    return hc_pre(x, fn, base, scale, ITERS, EPS, EPS, out_norm=(w, 1e-6), block_d=block_d)[0]


@hc_pre_op.register_fake
def _(x, fn, base, scale, w, block_d):
    return x.new_empty(x.shape[0], x.shape[2])


rows = []
for block_d in (1024, 4096):
    call = lambda x, bd=block_d: hc_pre(x, fn, base, scale, ITERS, EPS, EPS, out_norm=(w, 1e-6), block_d=bd)[0]  # noqa: E731
    t0 = time.time()
    comp = torch.compile(call, dynamic=False)
    opaque = torch.compile(lambda x, bd=block_d: hc_pre_op(x, fn, base, scale, w, bd), dynamic=False)
    row = {"tokens": 1, "block_d": block_d}
    for name, f in (("eager", call), ("compiled", comp), ("custom_op", opaque)):
        row[f"{name}_us_per_call"] = timed(lambda: f(x))
        row[f"{name}_graphed_us_per_call"] = graph_seconds([lambda: f(x)] * 20, 50) * 1e6
    ref = call(x)
    row["compiled_same_bits"], row["custom_op_same_bits"] = torch.equal(comp(x), ref), torch.equal(opaque(x), ref)
    row["compiled_over_eager_graphed"] = row["compiled_graphed_us_per_call"] / row["eager_graphed_us_per_call"]
    print(f"block_d={block_d}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in row.items()) + f" ({time.time() - t0:.0f} s)", flush=True)
    rows.append(row)
save_results("hc_pre_compiled", rows, extra={"shape": f"m={M} D={D} iters={ITERS} bf16, norm folded"})
