"""Fused decode kernels (issue 12) against the PyTorch paths they replace, on DeepSeek-V4-Flash shapes.

Per kernel, shape and batch (M = 1, 4, 16 tokens): device time per call, the bytes the call must
read (weights once, each selected expert once, activations), the bandwidth that gives against the
H200's 4.8 TB/s (datasheet) and against a measured device copy, and the time ratio to the reference:

- ``fp8_linear``: V4's dense FP8 projections (128x128 UE8M0 scales) at M tokens; references:
  ``dequant+linear`` (:func:`fp8_linear_reference`, F32 scales as the runtime holds them) and
  ``bf16_linear`` (``F.linear`` on a weight dequantized at load: today's GPU path, twice the bytes).
  Side by side, for each configuration that splits K: the split-K partials added in the kernel's
  own launch (``fused_sum``, the default: ``kernel_us``) and by a second kernel
  (``separate_sum_us``, ``speedup_vs_separate_sum``); ``splits`` is the launch's K split.
- ``fused_experts``: one layer's routed experts, 256 experts, top-6, D = 4096, I_r = 2048 (TP=1)
  and 1024 (TP=2), FP4 (V4) and bf16 banks; reference: gather + expand + bmm (the V4 pair path).

Times are CUDA-graph replays (the decode step is captured, so launch gaps are not counted), median
of ``--replays``, each graph calling the op on ``--rotate`` different weight sets or routings so
the bytes come from HBM, not the 60 MB L2. ``--sweep`` first times launch configurations and
prints the best. Example: ``python benchmarks/decode_kernels.py [--sweep] [--no-save]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

HBM_GBPS = 4800.0  # H200 datasheet
DENSE = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wo_b": (4096, 8192), "shared_w13": (4096, 4096),
         "shared_w2": (4096, 2048), "wo_a": (8192, 4096, 8)}  # (N, K[, groups]): wo_a is grouped, 8 x [1024, 4096]
TOKENS = (1, 4, 16)
EXPERTS, HIDDEN, TOP_K = 256, 4096, 6  # V4-Flash


def graph_seconds(calls: list, replays: int) -> float:
    """Median seconds per call of ``calls`` (zero-argument callables) captured in one CUDA graph, or of
    a list of such lists, each captured in its own graph and the graphs replayed in turn (inputs that
    rotate out of L2 between replays: ``router.py``). Warmed first on the capture stream (Triton and
    inductor compile there, outside the capture)."""
    groups = calls if calls and isinstance(calls[0], (list, tuple)) else [calls]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for group in groups:
            for c in group:
                c()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for group in groups:
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            for c in group:
                c()
    times = []
    for i in range(replays + 3):
        for graph, group in zip(graphs, groups):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end) / 1e3 / len(group))
    del graphs
    return statistics.median(times)


def try_seconds(calls: list, replays: int, what: str) -> float | None:
    """:func:`graph_seconds`, or None (the error printed) when a launch configuration fails to build or run."""
    try:
        return graph_seconds(calls, replays)
    except Exception as err:  # noqa: BLE001 (a failed configuration must not stop the others)
        print(f"FAILED {what}: {type(err).__name__}: {str(err)[:300]}", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def check(call, want: torch.Tensor, what: str) -> float | None:
    """``||call() - want|| / ||want||`` (the bf16 reference), or None when the call fails."""
    from shardsmith.runtime.layers.kernels.testing import rel_error

    try:
        return round(rel_error(call(), want), 5)
    except Exception as err:  # noqa: BLE001
        print(f"FAILED {what}: {type(err).__name__}: {str(err)[:300]}", file=sys.stderr)
        return None


def copy_gbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written), GB/s: the measured memory ceiling."""
    a = torch.empty(1 << 29, dtype=torch.float32, device="cuda")  # 2 GiB
    b = torch.empty_like(a)
    return 2 * a.nbytes / graph_seconds([lambda: b.copy_(a)], 10) / 1e9


def row(kernel: str, shape: str, tokens: int, config: str, seconds: float, nbytes: int, refs: dict, ceiling: float,
        **extra) -> dict:
    gbps = nbytes / seconds / 1e9
    out = {"kernel": kernel, "shape": shape, "tokens": tokens, "config": config, "kernel_us": round(seconds * 1e6, 2),
           "bytes_per_call": nbytes, "kernel_GBps": round(gbps, 1), "share_of_4800_GBps": round(gbps / HBM_GBPS, 3),
           "share_of_copy_GBps": round(gbps / ceiling, 3), **extra}
    for name, sec in refs.items():
        out[f"{name}_us"] = round(sec * 1e6, 2)
        out[f"speedup_vs_{name}"] = round(sec / seconds, 2)
    return out


def bench_fp8(a, ceiling: float, configs: list[dict], shapes: dict, with_refs: bool) -> list[dict]:
    from shardsmith.runtime.layers.kernels import fp8_linear, fp8_linear_reference
    from shardsmith.runtime.layers.kernels._common import sm_count
    from shardsmith.runtime.layers.kernels.fp8_linear import (GEMV_BLOCK_K, GEMV_BLOCK_N, gemv_splits, k_splits,
                                                              scale_as_float)
    from shardsmith.runtime.layers.kernels.testing import random_fp8_linear

    gen, rows = torch.Generator(device="cuda").manual_seed(1), []
    for name, (n, k, *grouped) in shapes.items():
        groups = grouped[0] if grouped else 1
        sets = [random_fp8_linear(n, k, (128, 128), ue8m0=True, gen=gen) for _ in range(max(2, (256 << 20) // (n * k)))]
        sets = sets[:a.rotate * 4]
        f32 = [scale_as_float(s) for _, s in sets]
        for m in getattr(a, "tokens", TOKENS):
            if m * groups > 16:
                continue  # the grouped kernel path stops at 16 rows (the model's einsum runs past it)
            shape = (m, groups, k) if groups > 1 else (m, k)
            x = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
            nbytes = n * k + sets[0][1].numel() + 2 * m * (n + k * groups)
            refs = {}
            if with_refs:
                refs["dequant_linear"] = graph_seconds([lambda w=w, s=s: fp8_linear_reference(x, w, s, (128, 128),
                                                                                              groups)
                                                        for (w, _), s in zip(sets, f32)], a.replays)
                bf16 = [w.to(torch.bfloat16) for w, _ in sets[:max(2, (256 << 20) // (2 * n * k))]]
                refs["bf16_linear"] = graph_seconds([lambda wb=wb: torch.nn.functional.linear(x, wb) for wb in bf16],
                                                    a.replays)
                del bf16
            want = fp8_linear_reference(x, *sets[0], (128, 128), groups)
            for named in configs:
                cfg = {**_with_waves(named, m, n, k, sm_count(x.device)), "groups": groups}
                gemv = m == 1 and cfg.get("gemv", 1) != 0
                if "gemv" in cfg:
                    cfg["gemv"] = bool(cfg["gemv"])
                err = check(lambda: fp8_linear(x, *sets[0], (128, 128), **cfg), want, f"fp8_linear {name} {cfg}")
                sec = try_seconds([lambda w=w, s=s: fp8_linear(x, w, s, (128, 128), **cfg) for w, s in sets],
                                  a.replays, f"fp8_linear {name} M={m} {cfg}")
                if gemv:
                    splits, _ = gemv_splits(n, k, block_n=cfg.get("block_n") or GEMV_BLOCK_N,
                                            block_k=cfg.get("block_k") or GEMV_BLOCK_K, sms=sm_count(x.device),
                                            split_k=cfg.get("split_k"))
                else:
                    splits, _ = k_splits(m * groups, n, k, block_k=128, block_n=cfg.get("block_n") or 32,
                                         split_k=cfg.get("split_k"), sms=sm_count(x.device))
                sums = dict(refs)
                if splits > 1 and "fused_sum" not in cfg and not gemv:  # the same call with the second sum kernel
                    sep = {**cfg, "fused_sum": False}
                    calls = [lambda w=w, s=s, x=x, sep=sep: fp8_linear(x, w, s, (128, 128), **sep) for w, s in sets]
                    sums["separate_sum"] = try_seconds(calls, a.replays, f"fp8_linear {name} M={m} {sep}")
                if sec is not None:
                    rows.append(row("fp8_linear", f"{name} [{n}, {k}]", m, _cfg(named), sec, nbytes,
                                    {r: t for r, t in sums.items() if t is not None}, ceiling,
                                    rel_err_vs_reference=err, splits=splits))
        del sets, f32
    return rows


def bench_experts(a, ceiling: float, configs: list[dict], banks: list[tuple[bool, int]], with_refs: bool,
                  tokens_list: tuple[int, ...] = TOKENS) -> list[dict]:
    from shardsmith.runtime.layers.kernels import fused_experts, fused_experts_reference
    from shardsmith.runtime.layers.kernels.testing import random_bank, random_routing

    gen, rows = torch.Generator(device="cuda").manual_seed(2), []
    for fp4, inter in banks:
        bank = random_bank(EXPERTS, HIDDEN, inter, fp4=fp4, gen=gen)
        per_expert = sum(t[0].nbytes for t in bank.values())
        for tokens in tokens_list:
            routes = [random_routing(tokens, TOP_K, EXPERTS, gen=gen) for _ in range(a.rotate)]
            x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)
            distinct = statistics.mean(len(set(ids.flatten().tolist())) for ids, _ in routes)
            nbytes = int(distinct * per_expert) + 4 * tokens * HIDDEN + 12 * tokens * TOP_K  # x in, out, ids+weights
            refs = {}
            if with_refs:
                ref = [lambda i=i, w=w: fused_experts_reference(x, i, w, **bank, limit=10.0) for i, w in routes]
                refs["expand_bmm"] = graph_seconds(ref, a.replays)
            want = fused_experts_reference(x, *routes[0], **bank, limit=10.0)
            for cfg in configs:
                shape = f"{'fp4' if fp4 else 'bf16'} E={EXPERTS} D={HIDDEN} I_r={inter} top-{TOP_K}"
                err = check(lambda: fused_experts(x, *routes[0], **bank, limit=10.0, **cfg), want, f"{shape} {cfg}")
                sec = try_seconds([lambda i=i, w=w: fused_experts(x, i, w, **bank, limit=10.0, **cfg)
                                   for i, w in routes], a.replays, f"fused_experts {shape} T={tokens} {cfg}")
                if sec is not None:
                    rows.append(row("fused_experts", shape, tokens, _cfg(cfg), sec, nbytes, refs, ceiling,
                                    distinct_experts=round(distinct, 1), rel_err_vs_reference=err))
        del bank
        torch.cuda.empty_cache()
    return rows


def _with_waves(cfg: dict, m: int, n: int, k: int, sms: int) -> dict:
    """``cfg`` with ``waves=W`` (a sweep knob: aim the split-K at W waves of the multiprocessors, where
    :func:`auto_split` aims at 2) turned into this shape's ``split_k``."""
    if "ppsm" in cfg:  # the GEMV's knob: aim its split-K at this many programs per multiprocessor
        from shardsmith.runtime.layers.kernels.fp8_linear import GEMV_BLOCK_N

        out = {key: v for key, v in cfg.items() if key != "ppsm"}
        out["split_k"] = -(-cfg["ppsm"] * sms // -(-n // (cfg.get("block_n") or GEMV_BLOCK_N)))
        return out
    if "waves" not in cfg:
        return cfg
    from shardsmith.runtime.layers.kernels.fp8_linear import auto_split

    out = {key: v for key, v in cfg.items() if key != "waves"}
    out["split_k"] = auto_split(m, -(-n // cfg.get("block_n", 32)), -(-k // 128), sms * cfg["waves"] // 2)
    return out


def _cfg(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(cfg.items())) or "default"


def _parse(text: str | None) -> list[dict]:
    """``k=v,k=v`` (one configuration) or several separated by ``;`` (``default``: the kernel's own); values
    are integers or words (``path=pairs``)."""
    if not text:
        return [{}]
    value = lambda v: int(v) if v.lstrip("-").isdigit() else v  # noqa: E731
    return [dict((kv.split("=")[0], value(kv.split("=")[1])) for kv in one.split(",") if kv and kv != "default")
            for one in text.split(";")]


FP8_SWEEP = [dict(block_n=bn, num_stages=st) for bn, st in ((32, 3), (64, 3), (128, 3), (32, 4), (64, 4))]
MOE_SWEEP = [dict(block_i=bi, block_n=bn, block_k=bk, scaled_dot=sd)
             for bi, bn, bk in ((32, 64, 128), (64, 128, 128), (32, 64, 256), (64, 128, 256)) for sd in (False, True)]


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ("kernel", "shape", "M", "config", "err", "us", "GB/s", "of 4.8 TB/s", "ref us", "x ref", "bf16 us",
                "x bf16", "splits", "2-kernel sum us", "x 2-kernel"):
        t.add_column(col)
    for r in rows:
        ref = r.get("dequant_linear_us", r.get("expand_bmm_us"))
        x_ref = r.get("speedup_vs_dequant_linear", r.get("speedup_vs_expand_bmm"))
        t.add_row(r["kernel"], r["shape"], str(r["tokens"]), r["config"], str(r.get("rel_err_vs_reference")),
                  f"{r['kernel_us']:.1f}",
                  f"{r['kernel_GBps']:.0f}", f"{r['share_of_4800_GBps']:.0%}", "-" if ref is None else f"{ref:.1f}",
                  "-" if x_ref is None else f"{x_ref:.2f}", str(r.get("bf16_linear_us", "-")),
                  str(r.get("speedup_vs_bf16_linear", "-")), str(r.get("splits", "-")),
                  str(r.get("separate_sum_us", "-")), str(r.get("speedup_vs_separate_sum", "-")))
    Console(width=200).print(t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--rotate", type=int, default=8, help="routings (weight sets: up to 4x) per captured graph")
    p.add_argument("--sweep", action="store_true", help="time launch configurations first (M = 1 and 16)")
    p.add_argument("--fp8-config", help="e.g. block_n=64,num_stages=4 (default: fp8_linear's defaults); several "
                   "separated by ';' run side by side; waves=W aims the split-K at W waves (auto: 2); gemv=0 keeps "
                   "one token on the dot kernel; ppsm=P aims the GEMV's split-K at P programs per SM (auto: 4)")
    p.add_argument("--moe-config", help="e.g. block_i=32,block_n=64,num_warps=4 (default: fused_experts's); "
                   "several separated by ';' run side by side")
    p.add_argument("--moe-only", action="store_true",
                   help="only fused_experts on --moe-banks at T = 1, 4, 8, 16, each --moe-config side by side")
    p.add_argument("--moe-banks", default="fp4:2048",
                   help="--moe-only's banks, format:I_r pairs (fp4 or bf16), e.g. fp4:2048,bf16:1024")
    p.add_argument("--fp8-only", action="store_true", help="only fp8_linear, with its references")
    p.add_argument("--fp8-tokens", default="1,4,16", help="fp8_linear's M values, comma list")
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    a.tokens = tuple(int(t) for t in a.fp8_tokens.split(","))
    if not torch.cuda.is_available():
        sys.exit("decode_kernels.py times CUDA graphs: it needs a CUDA GPU")
    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device copy {ceiling:.0f} GB/s (read + write)")
    fp8_cfgs, moe_cfgs = _parse(a.fp8_config), _parse(a.moe_config)
    if a.sweep:
        sweep = bench_fp8(a, ceiling, FP8_SWEEP, {k: DENSE[k] for k in ("wq_b", "wo_b")}, with_refs=False)
        sweep += bench_experts(a, ceiling, MOE_SWEEP, [(True, 2048)], with_refs=False)
        print_table(sweep, "launch configurations")
        for kernel, cfgs, space in (("fp8_linear", fp8_cfgs, FP8_SWEEP), ("fused_experts", moe_cfgs, MOE_SWEEP)):
            total = {}  # config -> summed time over the sweep's shapes and batches, correct runs only
            for r in sweep:
                if r["kernel"] == kernel:
                    ok = r["rel_err_vs_reference"] is not None and r["rel_err_vs_reference"] < 2e-2
                    total[r["config"]] = total.get(r["config"], 0.0) + (r["kernel_us"] if ok else float("inf"))
            best = min(total, key=total.get)
            print(f"best {kernel}: {best} ({total[best]:.1f} us summed over the sweep)")
            cfgs.append(next(c for c in space if _cfg(c) == best))
    rows = [{"kernel": "device_copy", "copy_GBps": round(ceiling, 1)}]
    if a.moe_only:
        banks = [(fmt == "fp4", int(inter)) for fmt, inter in (b.split(":") for b in a.moe_banks.split(","))]
        rows += bench_experts(a, ceiling, moe_cfgs, banks, with_refs=False, tokens_list=(1, 4, 8, 16))
    else:
        rows += bench_fp8(a, ceiling, fp8_cfgs, DENSE, with_refs=True)
        if not a.fp8_only:
            rows += bench_experts(a, ceiling, moe_cfgs, [(True, 2048), (True, 1024), (False, 1024)], with_refs=True)
    print_table(rows[1:], f"fused decode kernels, {torch.cuda.get_device_name()}, CUDA-graph replays, bf16 activations")
    if not a.no_save:
        from _results import save_results

        save_results("decode_kernels", rows, extra={"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                             "triton": __import__("triton").__version__})


if __name__ == "__main__":
    main()
