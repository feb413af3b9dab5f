"""DeepSeek-V4's hyper-connection mixer on one GPU: ``hc_pre`` (one split-K launch) against the path it
replaced (RMS, ``F.linear`` against ``fn``, ``hc_mix``, the collapse: 4-5 launches), side by side.

Shapes: V4-Flash's mixer (m = 4 streams, D = 4096, ``fn [24, 16384]`` float32, 20 Sinkhorn rounds), bf16
streams, T = 1, 4 and 16 tokens. Each configuration (``split_k`` x ``num_warps``) is captured in one
CUDA graph over several mixers' weights and timed over replays (``decode_kernels.py``'s ``graph_seconds``);
rows give microseconds per call and the ratio to the old path, and the error against the reference.
Rows go to ``benchmarks/results/hc_pre-<YYYYMMDD>-<host>.json``.

Example::

    python benchmarks/hc_pre.py --splits 16,32,64,128,256 --warps 1,2,4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_kernels import try_seconds  # noqa: E402

from shardsmith.runtime.layers.kernels.deepseek_v4.hc_mix import hc_mix  # noqa: E402
from shardsmith.runtime.layers.kernels.deepseek_v4.hc_pre import hc_pre, hc_pre_reference  # noqa: E402

M, D, ITERS, EPS = 4, 4096, 20, 1e-6


def old_path(streams, fn, base, scale):
    """The mixer as it ran before ``hc_pre`` on CUDA (``HyperMixer.forward``'s other branch)."""
    x = streams.flatten(1).float()
    f = torch.nn.functional.linear(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS), fn)
    pre, post, comb = hc_mix(f, base, scale, M, ITERS, EPS)
    return (pre[..., None] * streams).sum(dim=1).to(streams.dtype), pre, post, comb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--splits", default="16,32,64,128,0", help="split_k values; 0: the default (two waves)")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--block-d", default="0", help="hc_pre's block_d values (the collapse's step); 0: its default")
    ap.add_argument("--norm", action="store_true", help="fold the block's RMSNorm (out_norm), as V4's decode runs it")
    ap.add_argument("--mixers", type=int, default=8, help="mixers (distinct weights) per captured graph")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    W = (2 + M) * M
    mixers = [(torch.randn(W, M * D, generator=gen, device="cuda") * 0.01, torch.randn(W, generator=gen, device="cuda"),
               torch.rand(3, generator=gen, device="cuda")) for _ in range(a.mixers)]
    norm_w = torch.rand(D, generator=gen, device="cuda") + 0.5
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        xs = [torch.randn(T, M, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in mixers]
        old = try_seconds([lambda x=x, w=w: old_path(x, *w) for x, w in zip(xs, mixers)], a.replays, "old path")
        want = hc_pre_reference(xs[0], *mixers[0], ITERS, EPS, EPS)
        rows.append({"kernel": "rms + linear + hc_mix + collapse", "tokens": T, "config": "-",
                     "us_per_call": old * 1e6, "vs_old_path": 1.0})
        for split in (int(s) for s in a.splits.split(",")):
            for warps, block_d in ((int(w), int(b)) for w in a.warps.split(",") for b in a.block_d.split(",")):
                kw = {"split_k": split or None, "num_warps": warps, **({"block_d": block_d} if block_d else {}),
                      **({"out_norm": (norm_w, 1e-6)} if a.norm else {})}
                got = hc_pre(xs[0], *mixers[0], ITERS, EPS, EPS, **kw)
                err = max(((g.double() - r.double()).abs().max() / r.double().abs().max().clamp(min=1e-30)).item()
                          for g, r in zip(got[a.norm:], want[a.norm:]))  # with --norm: pre, post, comb
                sec = try_seconds([lambda x=x, w=w: hc_pre(x, *w, ITERS, EPS, EPS, **kw) for x, w in zip(xs, mixers)],
                                  a.replays, f"hc_pre T={T} {kw}")
                if sec is not None:
                    rows.append({"kernel": "hc_pre", "tokens": T, "config": f"split_k={split or 'auto'} warps={warps}"
                                 + (f" block_d={block_d}" if block_d else ""),
                                 "us_per_call": sec * 1e6, "vs_old_path": old / sec, "max_rel_error": err})
    print(f"{'kernel':<34} {'T':>3} {'config':<24} {'us/call':>9} {'old/this':>9} {'rel err':>9}")
    for r in rows:
        print(f"{r['kernel']:<34} {r['tokens']:>3} {r['config']:<24} {r['us_per_call']:>9.2f} {r['vs_old_path']:>9.2f} "
              f"{r.get('max_rel_error', float('nan')):>9.2e}")
    if not a.no_save:
        from _results import save_results

        save_results("hc_pre", rows, extra={"shape": f"m={M} D={D} iters={ITERS} bf16", "norm_folded": a.norm})


if __name__ == "__main__":
    main()
