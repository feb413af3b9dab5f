"""DeepSeek-V4's hyper-connection launches around a sublayer on one GPU, side by side with the paths they
replace: ``hc_post`` against ``expand`` (eager: casts, a batched matmul, a multiply and an add;
compiled, as the decode pieces run it: a matmul, a pointwise kernel and a cast), and ``hc_pre`` with the
block's RMSNorm folded (``out_norm``) against ``hc_pre`` followed by the norm (eager, and compiled as the
pieces run it: inductor's ``..._add_mean_mul_pow_rsqrt`` reduction), with the norm's own time.

Shapes: V4-Flash's (m = 4 streams, D = 4096, ``fn [24, 16384]`` float32, 20 Sinkhorn rounds), bf16, T =
1, 4 and 16 tokens. Each path is captured in one CUDA graph over ``--layers`` distinct inputs and
weights and timed over replays (``decode_kernels.py``'s ``graph_seconds``): microseconds per call, the ratio
to the path replaced (``old/this``), and against the eager reference the largest error relative to its
largest value and the share of elements whose bits differ. ``hc_post`` is swept over ``block_d`` x
``num_warps``. Rows go to ``benchmarks/results/hc_post-<YYYYMMDD>-<host>.json``.

Example::

    python benchmarks/hc_post.py --block-d 128,256,512,1024 --warps 1,2,4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_kernels import try_seconds  # noqa: E402

from shardsmith.runtime.layers.kernels.deepseek_v4.hc_post import BLOCK_D, hc_post, hc_post_reference  # noqa: E402
from shardsmith.runtime.layers.kernels.deepseek_v4.hc_pre import hc_pre, rms_norm_reference  # noqa: E402
from shardsmith.runtime.models.deepseek_v4.hyper import expand  # noqa: E402

M, D, ITERS, EPS = 4, 4096, 20, 1e-6
DEVICE = "cuda"


def _errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    diff = (got.double() - want.double()).abs()
    return {"max_rel_error": (diff.max() / want.double().abs().max().clamp(min=1e-30)).item(),
            "bits_differ": (got != want).float().mean().item()}


def _row(rows: list, kernel: str, T: int, config: str, sec: float | None, old: float | None, **extra) -> None:
    if sec is not None:
        rows.append({"kernel": kernel, "tokens": T, "config": config, "us_per_call": sec * 1e6,
                     "vs_old_path": (old / sec) if old else 1.0, **extra})


def post_rows(T: int, a, gen: torch.Generator) -> list[dict]:
    """``hc_post`` (swept) against ``expand``, eager and compiled, on ``a.layers`` distinct inputs."""
    cases = []
    for _ in range(a.layers):
        comb = torch.rand(T, M, M, generator=gen, device=DEVICE) + 1e-3
        cases.append((torch.randn(T, M, D, generator=gen, device=DEVICE).bfloat16(),
                      torch.randn(T, D, generator=gen, device=DEVICE).bfloat16(),
                      2 * torch.rand(T, M, generator=gen, device=DEVICE), comb / comb.sum(dim=1, keepdim=True)))
    want = hc_post_reference(*cases[0])
    compiled = torch.compile(expand, dynamic=False)
    rows: list[dict] = []
    old = try_seconds([lambda c=c: compiled(*c) for c in cases], a.replays, "expand compiled")
    _row(rows, "expand (compiled: mm + pointwise + cast)", T, "-", old, None, **_errors(compiled(*cases[0]), want))
    eager = try_seconds([lambda c=c: expand(*c) for c in cases], a.replays, "expand eager")
    _row(rows, "expand (eager)", T, "-", eager, old, **_errors(expand(*cases[0]), want))
    for block_d in (int(b) for b in a.block_d.split(",")):
        for warps in (int(w) for w in a.warps.split(",")):
            kw = {"block_d": block_d, "num_warps": warps}
            sec = try_seconds([lambda c=c, kw=kw: hc_post(*c, **kw) for c in cases], a.replays, f"hc_post T={T} {kw}")
            default = " (default)" if block_d == BLOCK_D and warps == 1 else ""
            _row(rows, "hc_post", T, f"block_d={block_d} warps={warps}{default}", sec, old,
                 **_errors(hc_post(*cases[0], **kw), want))
    return rows


def pre_rows(T: int, a, gen: torch.Generator) -> list[dict]:
    """``hc_pre`` with the norm folded against ``hc_pre`` then the norm (eager / compiled), and the norm alone."""
    W = (2 + M) * M
    layers = [(torch.randn(T, M, D, generator=gen, device=DEVICE).bfloat16(),
               torch.randn(W, M * D, generator=gen, device=DEVICE) * 0.01, torch.randn(W, generator=gen, device=DEVICE),
               torch.rand(3, generator=gen, device=DEVICE), 1 + 0.1 * torch.randn(D, generator=gen, device=DEVICE))
              for _ in range(a.layers)]
    norm_c = torch.compile(rms_norm_reference, dynamic=False)  # ops.RMSNorm's ops, as the pieces compile them

    def pre(x, fn, base, scale, w, *, fold: bool = False, norm=None):
        y = hc_pre(x, fn, base, scale, ITERS, EPS, EPS, out_norm=(w, EPS) if fold else None)[0]
        return norm(y, w, EPS) if norm is not None else y

    x0 = layers[0]
    want = rms_norm_reference(pre(*x0), x0[4], EPS)
    rows: list[dict] = []
    old = try_seconds([lambda c=c: pre(*c, norm=norm_c) for c in layers], a.replays, "hc_pre + compiled norm")
    _row(rows, "hc_pre, then RMSNorm (compiled)", T, "-", old, None, **_errors(pre(*x0, norm=norm_c), want))
    sec = try_seconds([lambda c=c: pre(*c, norm=rms_norm_reference) for c in layers], a.replays, "hc_pre + eager norm")
    _row(rows, "hc_pre, then RMSNorm (eager)", T, "-", sec, old, **_errors(want, want))
    sec = try_seconds([lambda c=c: pre(*c, fold=True) for c in layers], a.replays, "hc_pre + folded norm")
    _row(rows, "hc_pre(out_norm): norm folded", T, "-", sec, old, **_errors(pre(*x0, fold=True), want))
    sec = try_seconds([lambda c=c: pre(*c) for c in layers], a.replays, "hc_pre alone")
    _row(rows, "hc_pre alone (no norm)", T, "-", sec, old)
    xs = [(pre(*c), c[4]) for c in layers]
    sec = try_seconds([lambda x=x, w=w: norm_c(x, w, EPS) for x, w in xs], a.replays, "norm alone")
    _row(rows, "RMSNorm alone (compiled)", T, "-", sec, old)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--block-d", default="128,256,512,1024", help="hc_post's hidden channels per program")
    ap.add_argument("--warps", default="1,2,4", help="hc_post's num_warps")
    ap.add_argument("--layers", type=int, default=8, help="distinct inputs and weights per captured graph")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        rows += post_rows(T, a, gen) + pre_rows(T, a, gen)
    print(f"{'path':<42} {'T':>3} {'config':<30} {'us/call':>8} {'old/this':>9} {'rel err':>9} {'bits diff':>9}")
    for r in rows:
        print(f"{r['kernel']:<42} {r['tokens']:>3} {r['config']:<30} {r['us_per_call']:>8.2f} {r['vs_old_path']:>9.2f} "
              f"{r.get('max_rel_error', float('nan')):>9.2e} {r.get('bits_differ', float('nan')):>9.2%}")
    if not a.no_save:
        from _results import save_results

        save_results("hc_post", rows, extra={"shape": f"m={M} D={D} iters={ITERS} bf16",
                                             "old_path": "expand compiled / hc_pre then the compiled RMSNorm"})


if __name__ == "__main__":
    main()
