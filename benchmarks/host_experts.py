"""Routed experts computed on the host: the stored-format kernel against the expand-then-matmul path
and against the host's memory floor, per expert and per token.

For DeepSeek-V4-Flash expert shapes (D = 4096, I = 2048 / tp) in three stored formats (FP4 e2m1 +
UE8M0 per 32 as V4 ships them, FP8 e4m3 + float32 128x128 block scales, bf16), at 1, 4 and 8 tokens
routed to the expert, and for each instruction set of the kernel (``--isa``: by default every one
this CPU supports but ``scalar``; ``isa_default`` marks the one the runtime uses), rows give:

- ``kernel_ms_per_expert``: :func:`shardsmith.runtime.offload.host_kernel.experts_swiglu_host` with
  ``experts_per_call`` experts in each call (``--per-call``: 1 is one call per expert, the runtime's
  way before 2026-12-02; 6 is a V4 layer's top-6 at batch 1 in one call, the runtime's way now), the
  call's time over its experts; layouts checked once, as the runtime does (``check=False``);
- ``reference_ms_per_expert``: :func:`shardsmith.runtime.layers.experts.expert_output` (the path the
  ``cpu`` and ``hybrid`` backends took before: expand to the compute dtype, then matmul);
- ``floor_ms_per_expert``: the expert's stored bytes over the host read bandwidth measured with the
  same threads (a float32 sum over 1 GiB), the time no kernel can beat at batch 1;
- ``kernel_over_floor``: a call's time (all its tokens) over that floor; ``kernel_token_over_floor``:
  the time per expert per token (issue 15's measure) over it. Past one token the call does the
  multiply-adds of every token on one read of the weights, so the first grows with the tokens (the
  FMAs, not the bytes, set it) while the second falls.

A shared host's bandwidth moves between calls (1.5-2x on the GPU host), so floor and kernel are
measured in ``--rounds`` alternating pairs: ``kernel_over_floor`` is the median of the rounds'
ratios, the times the medians of theirs. Experts are cycled through distinct copies whose bytes are
at least twice the last-level cache (``--experts``, default from the cache size sysfs reports: the
GPU host's L3 is 300 MiB, which 12 FP4 experts of 13.4 MB fit in), so every call reads its weights
from memory, as a decode step over 43 layers does; rows record ``experts_cycled`` and
``llc_bytes``. Example: ``python benchmarks/host_experts.py --threads 16 --tp 1`` (on the GPU host: the
numbers behind ``--moe-backend auto``'s choice; ``--isa avx2,avx512`` there compares the two paths).
``--model gpt-oss`` takes gpt-oss-120b's expert shapes (D = I = 2880, MXFP4 with the gate/up bias) and its
GLU (interleaved gate/up rows, ``alpha``, the clamp at 7) in both the kernel and the reference, FP4 only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

D, I_FULL = 4096, 2048  # DeepSeek-V4-Flash hidden and routed-expert intermediate (--model gpt-oss: 2880, 2880)


def make_expert(fmt: str, inter: int, g: torch.Generator, bias: bool = False) -> dict[str, torch.Tensor]:
    """One expert's arrays in stored format, random but finite (no NaN codes); ``bias``: gpt-oss's gate/up bias."""
    if bias:
        return make_expert(fmt, inter, g) | {"gate_up_bias": torch.randn(2 * inter, generator=g).bfloat16()}
    def raw(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    if fmt == "fp4":
        scale = lambda r, c: torch.randint(118, 124, (r, c), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)  # noqa: E731
        return {"gate_up": raw(2 * inter, D // 2).view(torch.int8), "gate_up_scale": scale(2 * inter, D // 32),
                "down": raw(D, inter // 2).view(torch.int8), "down_scale": scale(D, inter // 32)}
    if fmt == "fp8":
        f8 = lambda r, c: (raw(r, c) & 0xF7).view(torch.float8_e4m3fn)  # noqa: E731  (bit 3 clear: never NaN)
        blocks = lambda r, c: torch.rand(-(-r // 128), -(-c // 128), generator=g) * 1e-3  # noqa: E731
        return {"gate_up": f8(2 * inter, D), "gate_up_scale": blocks(2 * inter, D), "down": f8(D, inter),
                "down_scale": blocks(D, inter)}
    return {"gate_up": torch.randn(2 * inter, D, generator=g).bfloat16(), "down": torch.randn(D, inter, generator=g).bfloat16()}


def llc_bytes() -> int:
    """The largest CPU cache's size in bytes, from sysfs (``cpu0/cache/index*/size``); 0 where unknown."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * unit)
    return best


def read_bandwidth(repeat: int = 5) -> float:
    """Host read bandwidth in bytes/s with the current threads: a float32 sum over 1 GiB, best of ``repeat``."""
    buf = torch.ones(1 << 28)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(repeat))
    return buf.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def per_expert_s(fn, experts: list[dict], x: torch.Tensor, repeat: int, per_call: int = 1) -> float:
    """Seconds per expert, cycling through ``experts`` ``repeat`` times in calls of ``per_call``
    experts each, ``fn(list_of_experts, x)`` (after one warm pass)."""
    calls = [experts[i:i + per_call] for i in range(0, len(experts) - per_call + 1, per_call)]
    for c in calls:
        fn(c, x)
    t = time.perf_counter()
    for _ in range(repeat):
        for c in calls:
            fn(c, x)
    return (time.perf_counter() - t) / (repeat * len(calls) * per_call)


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    from shardsmith.runtime.offload import host_kernel
    from shardsmith.runtime.layers.experts import ExpertMath, expert_output

    def ints(low: int, high: int | None = None, words: str = "whole numbers"):
        def parse(text: str) -> list[int]:
            try:
                values = [int(v) for v in text.split(",")]
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r}: want {words}, comma separated") from None
            if any(v < low or high is not None and v > high for v in values):
                raise argparse.ArgumentTypeError(f"{text!r}: each must be {low} .. {high if high is not None else 'up'}")
            return values
        return parse

    def formats(text: str) -> list[str]:
        bad = [f for f in text.split(",") if f not in ("fp4", "fp8", "bf16")]
        if bad:
            raise argparse.ArgumentTypeError(f"{','.join(bad)}: the formats are fp4, fp8 and bf16")
        return text.split(",")

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads (default: torch's, %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="intermediate share: I = 2048 / tp (default %(default)s)")
    p.add_argument("--formats", type=formats, default="fp4,fp8,bf16", help="stored formats, comma list (default %(default)s)")
    p.add_argument("--tokens", type=ints(1), default="1,4,8", help="tokens routed to each expert, comma list (default %(default)s)")
    p.add_argument("--experts", type=int, default=0,
                   help="distinct experts cycled through (default: enough for twice the last-level cache, at least 12)")
    p.add_argument("--per-call", type=ints(1), default="1,6", help="experts per kernel call, comma list (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="passes over the experts per round (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="alternating floor / kernel measurements (medians; default %(default)s)")
    p.add_argument("--prefetch", type=ints(0, 1 << 20, "bytes"), default=None,
                   help="software prefetch distances in bytes, comma list (default: the runtime's)")
    p.add_argument("--row-blocking", type=ints(0, 1, "0 or 1"), default="1",
                   help="1: at 2+ tokens several rows per call share each activation load (the runtime's way); 0: one "
                        "row per call (the same bits); '1,0' times both and prints their ratio, above 1 when "
                        "blocking is faster (default %(default)s)")
    p.add_argument("--model", default="v4", choices=("v4", "gpt-oss"),
                   help="expert shapes and maths: DeepSeek-V4-Flash's SwiGLU, or gpt-oss-120b's GLU (FP4 only)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="activation dtype")
    p.add_argument("--isa", default="", help="comma list of kernel instruction sets (default: all but scalar)")
    p.add_argument("--no-reference", action="store_true", help="skip the expand-then-matmul timing")
    p.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/")
    a = p.parse_args()
    global D, I_FULL
    math = ExpertMath()
    if a.model == "gpt-oss":
        D, I_FULL, math = 2880, 2880, ExpertMath(limit=7.0, alpha=1.702, interleaved=True)
        if a.formats != ["fp4"]:
            p.error("--model gpt-oss: its experts are MXFP4 (--formats fp4)")
    torch.set_num_threads(a.threads)
    if not host_kernel.available():
        sys.exit("the host expert kernel could not be compiled on this machine (see the warning above)")
    isas = a.isa.split(",") if a.isa else [i for i in host_kernel.isas() if i != "scalar"] or ["scalar"]
    missing = [i for i in isas if i not in host_kernel.isas()]
    if missing:
        p.error(f"--isa {','.join(missing)}: this build and CPU support {','.join(host_kernel.isas())}")
    per_call = a.per_call
    prefetch = a.prefetch if a.prefetch is not None else [host_kernel.prefetch_bytes()]
    blocking = [bool(b) for b in a.row_blocking]
    if a.experts and max(per_call) > a.experts:
        p.error(f"--per-call {max(per_call)}: more than --experts ({a.experts})")
    llc = llc_bytes()
    default = host_kernel.default_isa()
    act = getattr(torch, a.dtype)
    inter = I_FULL // a.tp
    bw = read_bandwidth()
    print(f"threads {a.threads}, read bandwidth {bw / 1e9:.1f} GB/s, expert intermediate {inter} (tp {a.tp}), "
          f"kernel isas {','.join(host_kernel.isas())} (default {default}), last-level cache {llc / 2**20:.0f} MiB; "
          f"kernel_over_floor is the median of the rounds' ratios (not the ratio of the median times)", file=sys.stderr)
    g = torch.Generator().manual_seed(0)
    rows = []
    for fmt in a.formats:
        first = make_expert(fmt, inter, g, bias=a.model == "gpt-oss")
        nbytes = sum(t.numel() * t.element_size() for t in first.values())
        count = a.experts or max(12, max(per_call), -(-2 * llc // nbytes))
        experts = [first] + [make_expert(fmt, inter, g, bias=a.model == "gpt-oss") for _ in range(count - 1)]
        if llc and count * nbytes < 2 * llc:
            print(f"{fmt}: {count} experts are {count * nbytes / 2**20:.0f} MiB, under twice the {llc / 2**20:.0f} MiB "
                  "last-level cache: the kernel may read from the cache while the floor is memory's", file=sys.stderr)
        block = (128, 128) if fmt == "fp8" else None
        for n in a.tokens:
            x = torch.randn(n, D, generator=g).to(act)
            ref = 0.0 if a.no_reference else per_expert_s(lambda es, x: expert_output(es[0], x, block, math=math),
                                                          experts, x, max(1, a.repeat // 2))
            for isa, k, pf, rb in ((isa, k, pf, rb) for isa in isas for k in per_call for pf in prefetch
                                   for rb in blocking):
                host_kernel.set_prefetch_bytes(pf)
                host_kernel.set_row_blocking(rb)
                glu = dict(limit=math.limit, alpha=math.alpha, interleaved=math.interleaved)
                call = lambda es, x: host_kernel.experts_swiglu_host(es, [x] * len(es), block, isa=isa, check=False,  # noqa: E731
                                                                     **glu)
                host_kernel.experts_swiglu_host(experts[:1], [x], block, isa=isa, **glu)  # the runtime's one check per layout
                kerns, floors = [], []
                for _ in range(a.rounds):
                    floors.append(nbytes / read_bandwidth(repeat=2))
                    kerns.append(per_expert_s(call, experts, x, a.repeat, k))
                kern, floor = median(kerns), median(floors)
                rows.append({"model": a.model, "format": fmt, "tokens": n, "tp": a.tp, "threads": a.threads, "activation_dtype": a.dtype,
                             "isa": isa, "isa_default": isa == default, "experts_per_call": k, "prefetch_bytes": pf,
                             "row_blocking": rb,
                             "rounds": a.rounds, "experts_cycled": len(experts), "llc_bytes": llc,
                             "expert_bytes": nbytes, "read_gb_per_s": round(nbytes / floor / 1e9, 2),
                             "kernel_ms_per_expert": round(kern * 1e3, 3),
                             "kernel_ms_per_expert_token": round(kern * 1e3 / n, 3),
                             "kernel_gb_per_s": round(nbytes / kern / 1e9, 2),
                             "reference_ms_per_expert": round(ref * 1e3, 3) if ref else None,
                             "floor_ms_per_expert": round(floor * 1e3, 3),
                             "kernel_over_floor": round(median([kt / ft for kt, ft in zip(kerns, floors)]), 2),
                             "kernel_over_floor_best": round(min(kt / ft for kt, ft in zip(kerns, floors)), 2),
                             "kernel_token_over_floor": round(median([kt / n / ft for kt, ft in zip(kerns, floors)]), 2),
                             "reference_over_kernel": round(ref / kern, 2) if ref else None})
    hdr = ["model", "format", "tokens", "isa", "experts_per_call", "prefetch_bytes", "row_blocking", "experts_cycled",
           "kernel_ms_per_expert",
           "kernel_ms_per_expert_token", "floor_ms_per_expert", "kernel_over_floor", "kernel_over_floor_best",
           "kernel_token_over_floor"]
    if not a.no_reference:
        hdr[hdr.index("kernel_ms_per_expert_token") + 1:hdr.index("kernel_ms_per_expert_token") + 1] = \
            ["reference_ms_per_expert"]
        hdr.append("reference_over_kernel")
    width = {h: max(len(h), *(len(str(r[h])) for r in rows)) for h in hdr}
    print(" ".join(f"{h:>{width[h]}}" for h in hdr))
    for r in rows:
        print(" ".join(f"{r[h]!s:>{width[h]}}" for h in hdr))
    if len(blocking) > 1:  # side by side: one row per call over several rows per call, same run
        key = lambda r: (r["format"], r["tokens"], r["isa"], r["experts_per_call"], r["prefetch_bytes"])  # noqa: E731
        single = {key(r): r for r in rows if not r["row_blocking"]}
        print("row blocking: kernel_ms_per_expert with one row per call over several rows per call")
        for r in (r for r in rows if r["row_blocking"] and key(r) in single):
            r["row_blocking_speedup"] = round(single[key(r)]["kernel_ms_per_expert"] / r["kernel_ms_per_expert"], 2)
            print(f"  {r['format']:>4} tokens {r['tokens']:>2} {r['isa']} per call {r['experts_per_call']} prefetch "
                  f"{r['prefetch_bytes']}: {single[key(r)]['kernel_ms_per_expert']} / {r['kernel_ms_per_expert']} ms "
                  f"= {r['row_blocking_speedup']}x")
    if not a.no_save:
        from _results import save_results

        save_results("host_experts", rows)


if __name__ == "__main__":
    main()
