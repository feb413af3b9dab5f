"""DeepSeek-V4 decode at TP 1 and 2: tokens/s, time to ready, bytes per rank, time per token by part.

For each TP: ``shardsmith split`` the checkpoint into a pack, start one process per rank (NCCL on
CUDA, gloo on CPU), load the pack, prefill a random prompt and decode greedily. Two decode runs:
a plain one (tokens/s), the same with one-token steps as piecewise CUDA graphs (``resident
graphs``: ``engine.cuda_graphs.DecodeGraphs``; on CPU the same pieces run eagerly), and an eager one with timers around every layer's attention and MoE and around each
all-reduce (CUDA events, or wall time on CPU), giving per token:

    attention (compute, excluding its wo_b all-reduce), MoE (router, experts, shared expert),
    attention all-reduce, MoE all-reduce, other (embedding and its all-reduce, head mixer, LM head)

With ``--cache-fraction F`` (repeatable), each TP also decodes with the routed experts offloaded
(``--moe-backend gpu``: FP4 experts in pinned host banks, a GPU slot cache of ``F`` x every routed
expert's bytes at TP=1, the same bytes per GPU at every TP, policy ``hot``), after a warm-up
decode that fills the cache, eagerly and then graphed (``offload graphs``); each offloaded row reports tokens/s, hit rate, copied bytes per token
and rank, achieved and probed host-to-GPU GB/s, and the floor::

    floor_s_per_token = copied_bytes_per_token / probe_h2d_bytes_per_s + resident_s_per_token

Per-layer figures are scaled to the real 43 layers by kind (2 sliding, 21 CSA, 20 HCA: each
kind's measured mean; a kind not in the checkpoint takes the mean of the others) and weight bytes
per rank are scaled the same way from the plan. Rows go to
``benchmarks/results/v4_decode-<YYYYMMDD>-<host>.json``.

Template mode (``--layers N --experts-per-layer E``, issue 12's full-depth measurement): the
checkpoint is a small template (``gen_v4_checkpoint.py --layers 5``: one layer of each kind) split
once; every rank loads weights shaped like the N-layer model with E experts per layer, each layer
drawn from the template layer of its kind (``_v4_template.py``), with per-layer compress ratios and
hash routing from ``--kinds-config`` (default: the real V4-Flash config: 43 layers = 2 sliding, 21
CSA, 20 HCA, the first 3 hash-routed). ``--layers 43 --experts-per-layer 24`` is the full depth
measured, not extrapolated; ``--layers 4 --experts-per-layer 256`` the 4-layer cache benchmark.
Graphed rows carry ``ms_per_layer``, ``device_ops_per_layer`` and ``gpu_busy_share`` (with
``--profile``). transformers' figure: not measured here (``_hf_baseline.py`` loads Mixtral-format
checkpoints only; the rows say so).

Examples::

    python benchmarks/gen_v4_checkpoint.py /data/v4-4l --layers 4 --experts 160
    python benchmarks/v4_decode.py /data/v4-4l --work /data/v4-packs --device cuda --tp 1,2
    python benchmarks/v4_decode.py /data/v4-2l-256 --device cuda --tp 1,2 --cache-fraction 0.25 --cache-fraction 0.125
    python benchmarks/v4_decode.py --tiny --work /tmp/v4-bench --device cpu --dtype float32   # CPU smoke
    python benchmarks/gen_v4_checkpoint.py /data/v4-t5 --layers 5 --experts 24 --mtp 0
    python benchmarks/v4_decode.py /data/v4-t5 --tp 1 --layers 43 --experts-per-layer 24 --cache-fraction 0.25 --profile /tmp/p
    python benchmarks/v4_decode.py --tiny --work /tmp/v4-fd --tp 1 --layers 12 --device cpu --dtype float32   # rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
REAL_KINDS = {"sliding": 2, "csa": 21, "hca": 20}  # DeepSeek-V4-Flash's 43 layers (compress_ratios)
PARTS = ("attention", "moe", "mixers", "attn_allreduce", "moe_allreduce")


class Timers:
    """Start/stop timers keyed by name: CUDA events on GPU (read after a sync), wall time on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.on, self.spans = cuda, False, {}

    def start(self) -> object:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, key: str, begin: object) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.spans.setdefault(key, []).append((begin, e))
        else:
            self.spans.setdefault(key, []).append(time.perf_counter() - begin)

    def totals_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {k: sum(a.elapsed_time(b) for a, b in v) for k, v in self.spans.items()}
        return {k: 1e3 * sum(v) for k, v in self.spans.items()}


def instrument(model, timers: Timers) -> None:
    """Time every layer's attention and MoE, and every all-reduce inside them."""
    from shardsmith.runtime.layers import parallel
    from shardsmith.runtime.models.deepseek_v4 import moe

    where = {"part": None}
    inner = parallel.all_reduce

    def timed_all_reduce(x):
        if not timers.on or where["part"] is None:
            return inner(x)
        t = timers.start()
        y = inner(x)
        timers.stop(f"{where['part']}_allreduce.{where['layer']}", t)
        return y

    parallel.all_reduce = moe.all_reduce = timed_all_reduce
    for i, layer in enumerate(model.layers):
        mods = (("attn", layer.attn), ("moe", layer.ffn), ("mixers", layer.hc_attn), ("mixers", layer.hc_ffn))
        for part, mod in mods:
            key = f"{ {'attn': 'attention'}.get(part, part)}.{i}"

            def pre(_m, _a, part=part, i=i):
                where["part"], where["layer"], where["t"] = part, i, timers.start()

            def post(_m, _a, _o, key=key):
                if timers.on:
                    timers.stop(key, where["t"])
                where["part"] = None

            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)


def decode(model, prompt: torch.Tensor, steps: int, sync, timers: Timers | None = None,
           after_prefill=None) -> tuple[float, list[int]]:
    """Prefill ``prompt``, decode ``steps`` greedy tokens (timers on for the decode only); returns
    (decode seconds, tokens). ``after_prefill()`` runs between the two (e.g. to zero counters)."""
    logits = model(prompt, 0)
    sync()
    if after_prefill is not None:
        after_prefill()
    if timers is not None:
        timers.on = True
    t0, pos, out = time.perf_counter(), prompt.shape[0], []
    for _ in range(steps):
        tok = logits[-1].argmax().view(1)
        out.append(int(tok))
        logits = model(tok, pos)
        pos += 1
    sync()
    return time.perf_counter() - t0, out


def profile_steps(model, prompt: torch.Tensor, a: dict, sync, rank: int, world: int, name: str) -> dict:
    """Where a decode step's time goes (``--profile DIR``), over 8 one-token steps after the prompt.

    GPU: ``torch.profiler`` (CUPTI) device time per token, summed over every kernel and copy (ops
    on two streams that overlap count twice), and device ops per token. Host: ``cProfile`` over the
    same steps (run again), rank 0's top functions by own time written to
    ``DIR/tp{world}-{name}-host.txt``. Every rank runs both (the steps are collective); rank 0 reports.
    """
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    steps = 8

    def run(start, stop) -> None:
        logits, pos = model(prompt, 0), prompt.shape[0]
        sync()
        start()
        for _ in range(steps):
            logits = model(logits[-1].argmax().view(1), pos)
            pos += 1
        sync()
        stop()

    result = {}
    try:  # a profiler that cannot trace the device costs these two fields only
        prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if prompt.is_cuda else []))
        run(prof.start, prof.stop)
        device = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
        result = {"gpu_ms_per_token": sum(e.device_time_total for e in device) / 1e3 / steps,
                  "gpu_ops_per_token": len(device) / steps}
        if rank == 0 and device:  # which kernels the GPU time goes to: what to fuse next
            by: dict[str, list[float]] = {}
            for e in device:
                by.setdefault(e.name[:90], []).append(e.device_time_total)
            top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:40]
            lines = [f"{sum(v) / 1e3 / steps:9.3f} ms/token {len(v) / steps:7.1f} calls/token  {k}" for k, v in top]
            Path(a["profile"]).mkdir(parents=True, exist_ok=True)
            (Path(a["profile"]) / f"tp{world}-{name}-kernels.txt").write_text("\n".join(lines) + "\n")
    except Exception as e:  # noqa: BLE001 - reported in the row
        result = {"profile_error": f"{type(e).__name__}: {e}"[:300]}
    host = cProfile.Profile()
    run(host.enable, host.disable)
    if rank == 0:
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
        Path(a["profile"]).mkdir(parents=True, exist_ok=True)
        (Path(a["profile"]) / f"tp{world}-{name}-host.txt").write_text(text.getvalue())
    return result


def progress(rank: int, world: int, what: str) -> None:
    """Rank 0's progress on stderr, so a run stopped by a time limit still says how far it got."""
    if rank == 0:
        print(f"[tp={world}] {what}", file=sys.stderr, flush=True)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def rank_main(rank: int, world: int, port: int, a: dict, out_dir: str) -> None:
    """One rank: load the pack, decode plain and instrumented; write this rank's numbers."""
    import faulthandler

    faulthandler.dump_traceback_later(a.get("hang_s") or 1e9, exit=True)  # a hung rank says where, then exits
    try:
        from shardsmith.runtime.engine.cuda_graphs import DecodeGraphs
        from shardsmith.runtime.models.deepseek_v4 import DeepseekV4
        from shardsmith.runtime.engine.dist import init_distributed
        from shardsmith.runtime.layers.parallel import use_kernels_
        from shardsmith.runtime.layers.quant import dequantize_fp8_
        from shardsmith.runtime.engine.loader import load_rank_weights

        cuda = a["device"] == "cuda"
        if not cuda:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        init_distributed(rank, world, master_port=port, device=a["device"])
        dev = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        barrier = torch.distributed.barrier if world > 1 else (lambda: None)
        barrier()
        t0 = time.perf_counter()
        weights = load_rank_weights(a["pack"], rank=rank, world_size=world)
        if a.get("template"):  # the N-layer model drawn from the template pack (module docstring)
            from _v4_template import TemplateWeights

            t = a["template"]
            weights = TemplateWeights(weights, Path(t["ckpt"]), Path(t["work"]), layers=t["layers"],
                                      experts=t["experts"], kinds=t["kinds"])
        model = DeepseekV4.from_weights(weights, device=dev, dtype=getattr(torch, a["dtype"]),
                                        max_seq_len=a["max_seq_len"])
        use_kernels_(model, dev)  # as Engine.load does: on CUDA FP8 linears stay FP8, banks run fused_experts
        if a["fp8"] == "load":  # as Engine.load does by default
            dequantize_fp8_(model, getattr(torch, a["dtype"]))
        # as Engine.load does: the cache set up after the kernels are chosen (V4's attention then merges its
        # projections of x: Attention.fuse_projections_)
        model.setup_cache(a["max_seq_len"], dev, getattr(torch, a["dtype"]))
        sync()
        barrier()
        ready = time.perf_counter() - t0
        mem = {"gpu_bytes": torch.cuda.memory_allocated() if cuda else 0, "host_rss_bytes": rss_bytes(),
               "linear_bytes": linear_bytes(model, weights.plan, rank)}
        prompt = torch.randint(0, model.args.vocab_size, (a["prompt"],), generator=torch.Generator().manual_seed(0)).to(dev)
        decode(model, prompt[:8], 4, sync)  # warm-up (kernels, allocator)
        seconds, tokens = decode(model, prompt, a["tokens"], sync)
        progress(rank, world, f"resident eager {a['tokens'] / seconds:.1f} tok/s")
        graphed_s, graphed_tokens, prof = float("nan"), [], {}
        try:  # a failing capture costs its rows, not the run (every rank fails alike)
            graphed = DecodeGraphs(model, dev)
            decode(graphed, prompt[:8], 4, sync)  # warm-up: captures every piece
            graphed_s, graphed_tokens = decode(graphed, prompt, a["tokens"], sync)
            progress(rank, world, f"resident graphed {a['tokens'] / graphed_s:.1f} tok/s")
            prof = profile_steps(graphed, prompt, a, sync, rank, world, "resident-graphs") if a.get("profile") else {}
        except Exception as e:  # noqa: BLE001 - reported in the row
            prof = {"graphs_error": f"{type(e).__name__}: {e}"[:500]}
            progress(rank, world, f"resident graphed FAILED: {prof['graphs_error']}")
        # the instrumented run below is eager, on the model itself (events inside a graph would be captured)
        timers = Timers(cuda)
        instrument(model, timers)
        t_inst, _ = decode(model, prompt, a["tokens"], sync, timers)
        spans = {k: v / a["tokens"] for k, v in timers.totals_ms().items()}  # ms per decode token
        mem.update(gpu_peak_bytes=torch.cuda.max_memory_allocated() if cuda else 0)
        local = {"rank": rank, "ready_s": ready, "decode_s": seconds, "instrumented_decode_s": t_inst,
                 "tokens": tokens, "graphed_decode_s": graphed_s, "graphed_tokens": graphed_tokens, "profile": prof,
                 "spans_ms": spans, "memory": mem, "plan_bytes": plan_bytes(weights.plan, rank)}
        del model
        local["offload"] = [offloaded_decode(weights, dev, a, prompt, sync, barrier, world, f)
                            for f in a.get("cache_fractions") or []]
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(local))
        if world > 1:
            torch.distributed.barrier()
    except Exception:
        (Path(out_dir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    if world > 1:  # no destroy_process_group: it can hang once NCCL work was captured (pytorch#115388)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def offloaded_decode(weights, dev: torch.device, a: dict, prompt: torch.Tensor, sync, barrier, world: int,
                     fraction: float) -> dict:
    """Build the model with offloaded experts (a cache of ``fraction`` x the TP=1 expert bytes), warm
    the cache with one decode, then time a second decode of the same tokens; this rank's numbers."""
    from shardsmith.runtime.models.registry import build_v4
    from shardsmith.runtime.engine.cuda_graphs import DecodeGraphs
    from shardsmith.runtime.offload import OffloadConfig, attach_offload
    from shardsmith.runtime.layers.parallel import use_kernels_
    from shardsmith.runtime.layers.quant import dequantize_fp8_

    bank_bytes = sum(t.numel() * t.element_size() for layer, arrays in weights.banks().items()
                     if not layer.startswith("mtp.") for t in arrays.values())
    cache_bytes = int(fraction * bank_bytes * world)  # this rank's share x world size = the TP=1 bytes
    dtype = getattr(torch, a["dtype"])
    cfg = OffloadConfig(backend="gpu", cache_bytes=cache_bytes, policy="hot", probe=dev.type == "cuda")
    barrier()
    t0 = time.perf_counter()
    model, rt = build_v4(weights, rank=weights.rank, dtype=dtype, device=dev,
                         place_experts=lambda m: attach_offload(m, weights, cfg, device=dev, dtype=dtype))
    use_kernels_(model, dev)
    if a["fp8"] == "load":
        dequantize_fp8_(model, dtype)
    model.setup_cache(a["max_seq_len"], dev, dtype)
    rt.start()
    sync()
    barrier()
    ready = time.perf_counter() - t0
    decode(model, prompt, a["tokens"], sync)  # warm-up: fills the cache with this prompt's experts

    def timed(run=model) -> dict:
        seconds, tokens = decode(run, prompt, a["tokens"], sync, after_prefill=rt.reset_stats)
        st = rt.stats()
        return {"decode_s": seconds, "tokens": tokens, "decode_tokens_counted": st["tokens"],
                **{k: st.get(k) for k in ("backend", "slots", "hit_rate", "misses", "slot_bytes", "bytes_copied",
                                          "h2d_gb_per_s", "probe_h2d_gb_per_s", "host_bytes", "host_pinned",
                                          "decode_steps", "steps_all_hit", "layer_steps", "layer_steps_all_hit",
                                          "mode", "miss", "table_slots", "staging_rows", "device_policy")},
                # decode steps a device-side slot table would run with no host sync (every layer hit)
                "steps_all_hit_share": st["steps_all_hit"] / max(1, st["decode_steps"]),
                "slot_kernel": rt.kernel}

    out = {"cache_fraction_at_tp1": fraction, "cache_bytes_per_gpu": rt.stats().get("pool_bytes", 0),
           "ready_s": ready, "ready_log": rt.ready_line(), **timed()}
    try:
        graphed = DecodeGraphs(model, dev)  # the same model and warm cache, one-token steps as graphed pieces
        decode(graphed, prompt[:8], 4, sync)  # warm-up: captures every piece
        out["graphed"] = timed(graphed)
        if a.get("profile"):
            out["graphed"]["profile"] = profile_steps(graphed, prompt, a, sync, weights.rank, world,
                                                      f"offload{fraction:g}-graphs")
        progress(weights.rank, world, f"offload {fraction:g}: eager {a['tokens'] / out['decode_s']:.1f}, "
                                      f"graphed {a['tokens'] / out['graphed']['decode_s']:.1f} tok/s")
    except Exception as e:  # noqa: BLE001 - reported in the row
        out["graphed"] = {**{k: v for k, v in out.items() if k != "graphed"}, "decode_s": float("nan"),
                          "profile": {"graphs_error": f"{type(e).__name__}: {e}"[:500]}}
        progress(weights.rank, world, f"offload {fraction:g} graphed FAILED: {out['graphed']['profile']}")
    rt.close()
    model = None  # frees the device memory before the next fraction (timed() holds the name)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def offload_rows(ranks: list[dict], resident: dict, graphed: dict, tp: int, tokens: int) -> list[dict]:
    """Two rows per cache fraction (eager, graphed): rank 0's cache numbers, the slowest rank's time,
    the floor (against the resident run of the same mode)."""
    rows = []
    for i, first in enumerate(ranks[0]["offload"]):
        for run, base, pick in (("offload", resident, lambda o: o), ("offload graphs", graphed, lambda o: o["graphed"])):
            o = pick(first)
            decode_s = max(pick(r["offload"][i])["decode_s"] for r in ranks)
            per_token = o["bytes_copied"] / max(1, o["decode_tokens_counted"])  # counters zeroed after the prefill
            bw = (o.get("probe_h2d_gb_per_s") or 0) * 1e9
            floor_s = (per_token / bw if bw else 0.0) + base["ms_per_token"] / 1e3
            keep = {k: v for k, v in first.items() if k not in ("tokens", "graphed", "profile")} | \
                {k: v for k, v in o.items() if k not in ("tokens", "graphed", "profile")} | (o.get("profile") or {})
            rows.append({"tp": tp, "run": run, **keep,
                         "tokens_per_s": tokens / decode_s, "ms_per_token": 1e3 * decode_s / tokens,
                         "bytes_copied_per_token_per_rank": per_token, "resident_tokens_per_s": base["tokens_per_s"],
                         "floor_tokens_per_s": 1 / floor_s, "time_per_token_over_floor": (decode_s / tokens) / floor_s,
                         # bytes over the link per second of time above the resident step: what the misses cost
                         # (in place there is no copy to time: ``h2d_gb_per_s`` is None)
                         "marginal_link_gb_per_s": per_token / extra / 1e9
                         if (extra := decode_s / tokens - base["ms_per_token"] / 1e3) > 0 else None,
                         "tokens_match_resident": o["tokens"] == ranks[0]["tokens"]})
    return rows


def linear_bytes(model, plan, rank: int) -> dict:
    """Bytes of the parallel linears (weights, scales, biases) on the device and in the pack, the FP8
    weights' alone, and how many linears / expert banks run the kernels."""
    from shardsmith.runtime.layers.experts import ExpertBank
    from shardsmith.runtime.layers.parallel import _Linear

    out = {"device": 0, "pack": 0, "fp8_weight_device": 0, "fp8_weight_pack": 0, "kernel_linears": 0,
           "kernel_banks": sum(1 for m in model.modules() if isinstance(m, ExpertBank) and m.kernel)}
    for name, m in model.named_modules():
        if not isinstance(m, _Linear) or name + ".weight" not in plan.tensors:
            continue
        tp = plan.tensors[name + ".weight"]
        out["device"] += sum(b.nbytes for b in m.buffers())
        out["pack"] += sum(t.local_nbytes(rank) for t in plan.tensors.values() if t.name == tp.name or t.scale_of == tp.name)
        out["kernel_linears"] += m.kernel
        if tp.quant == "fp8-block":
            out["fp8_weight_device"] += m.weight.nbytes
            out["fp8_weight_pack"] += tp.local_nbytes(rank)
    return out


def plan_bytes(plan, rank: int) -> dict:
    """Weight bytes of ``rank`` by layer key (``layers.N``) and ``other`` (MTP excluded)."""
    out: dict[str, int] = {}
    for tp in plan.tensors.values():
        parts = tp.name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else "other"
        out[key] = out.get(key, 0) + tp.local_nbytes(rank)
    return out


def summarize(ranks: list[dict], kinds: tuple[str, ...], tokens: int) -> dict:
    """One row's timing and byte fields from every rank's numbers (rank 0's spans)."""
    r0 = ranks[0]
    sp = r0["spans_ms"]
    n = len(kinds)
    per = {part: [0.0] * n for part in PARTS}
    for i in range(n):
        per["attn_allreduce"][i] = sp.get(f"attn_allreduce.{i}", 0.0)
        per["moe_allreduce"][i] = sp.get(f"moe_allreduce.{i}", 0.0)
        per["attention"][i] = sp.get(f"attention.{i}", 0.0) - per["attn_allreduce"][i]
        per["moe"][i] = sp.get(f"moe.{i}", 0.0) - per["moe_allreduce"][i]
        per["mixers"][i] = sp.get(f"mixers.{i}", 0.0)
    inst_ms = 1e3 * r0["instrumented_decode_s"] / tokens
    other = inst_ms - sum(sum(v) for v in per.values())
    decode_s = max(r["decode_s"] for r in ranks)

    def scale(values: list[float]) -> float:  # per-layer values -> 43 real layers by kind
        mean = sum(values) / len(values)
        by_kind = {k: [v for v, kk in zip(values, kinds) if kk == k] for k in REAL_KINDS}
        return sum(c * (sum(by_kind[k]) / len(by_kind[k]) if by_kind[k] else mean) for k, c in REAL_KINDS.items())

    scaled = {f"{p}_ms_per_token_43_layers": scale(per[p]) for p in PARTS}
    ms43 = sum(scaled.values()) + other
    pb = [r["plan_bytes"] for r in ranks]
    layer_bytes = [[b.get(f"layers.{i}", 0) for i in range(n)] for b in pb]
    row = {
        "time_to_ready_seconds": max(r["ready_s"] for r in ranks),
        "tokens_per_s": tokens / decode_s, "ms_per_token": 1e3 * decode_s / tokens,
        "instrumented_ms_per_token": inst_ms,
        **{f"{p}_ms_per_token": sum(per[p]) for p in PARTS}, "other_ms_per_token": other,
        **{f"{p}_ms_per_layer_{k}": (sum(v for v, kk in zip(per[p], kinds) if kk == k) / kinds.count(k))
           for p in ("attention", "moe", "mixers") for k in REAL_KINDS if k in kinds},
        **scaled, "other_ms_per_token_43_layers": other, "ms_per_token_43_layers": ms43,
        "tokens_per_s_43_layers": 1e3 / ms43,
        "gpu_bytes_per_rank": max(r["memory"]["gpu_bytes"] for r in ranks),
        "gpu_peak_bytes_per_rank": max(r["memory"]["gpu_peak_bytes"] for r in ranks),
        "host_rss_bytes_per_rank": max(r["memory"]["host_rss_bytes"] for r in ranks),
        "weight_bytes_per_rank": max(sum(v for k, v in b.items() if not k.startswith("mtp.")) for b in pb),
        "weight_bytes_per_rank_43_layers": max(b["other"] + (scale(lb) if n else 0) for b, lb in zip(pb, layer_bytes)),
        "tokens": r0["tokens"][:16],
        "linear_bytes_rank0": r0["memory"]["linear_bytes"],
    }
    return row


def run_tp(a: argparse.Namespace, ckpt: Path, tp: int) -> dict:
    """Split (unless the pack exists), run the rank processes, return the row."""
    import tempfile

    import torch.multiprocessing as mp

    from shardsmith.runtime.models.deepseek_v4 import V4Args
    from shardsmith.writer.split import split_checkpoint

    pack = a.work / f"tp{tp}"
    split_s = None
    if not (pack / "pack.yaml").is_file():
        t0 = time.perf_counter()
        split_checkpoint(ckpt, pack, world_size=tp, force=True)
        split_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        max_seq_len = a.max_seq_len or a.prompt + 2 * a.tokens + 8
        opts = {"pack": str(pack), "device": a.device, "dtype": a.dtype, "prompt": a.prompt, "tokens": a.tokens,
                "max_seq_len": max_seq_len,
                "cache_fractions": a.cache_fraction, "hang_s": a.hang_s,
                "profile": str(a.profile) if a.profile else None, "fp8": a.fp8, "template": template(a, ckpt)}
        try:
            mp.spawn(rank_main, args=(tp, port, opts, out), nprocs=tp, join=True)
        except Exception:
            errs = "\n".join(p.read_text() for p in sorted(Path(out).glob("error*.txt")))
            raise SystemExit(f"TP={tp} failed:\n{errs}")
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(tp)]
    config = json.loads((ckpt / "config.json").read_text())
    if opts["template"]:
        from _v4_template import target_config

        t = opts["template"]
        config = target_config(config, layers=t["layers"], experts=t["experts"], kinds=t["kinds"])
    args = V4Args.from_config(config)
    from shardsmith import settings

    kernels = settings.items(settings.current(), "SHARDSMITH_KERNELS")  # the kernel settings this run had
    row = {"tp": tp, "device": a.device, "dtype": a.dtype, "fp8": a.fp8, "kernels": kernels, "layers": args.n_layers, "layer_kinds": list(args.kinds),
           "experts": args.n_experts, "hidden": args.dim, "prompt_tokens": a.prompt, "decode_tokens": a.tokens,
           "max_seq_len_tokens": max_seq_len, "split_seconds": split_s}
    row.update(summarize(ranks, args.kinds, a.tokens), run="resident")
    common = {k: row[k] for k in ("device", "dtype", "fp8", "kernels", "layers", "experts", "hidden",
                                  "max_seq_len_tokens")}
    graphed_s = max(r["graphed_decode_s"] for r in ranks)
    graphed = {"tp": tp, **common, "run": "resident graphs", "tokens_per_s": a.tokens / graphed_s,
               "ms_per_token": 1e3 * graphed_s / a.tokens, "tokens_match_eager": ranks[0]["graphed_tokens"] == ranks[0]["tokens"],
               **ranks[0]["profile"]}
    rows = [row, graphed, *(common | o for o in offload_rows(ranks, row, graphed, tp, a.tokens))]
    for r in rows:
        per_layer(r, args.n_layers)
        r["template"] = opts["template"] and {k: v for k, v in opts["template"].items() if k != "kinds"}
        r["transformers"] = "not measured (pass --hf)"
    if a.hf and tp == 1:
        hf = hf_baseline(config, a)
        for r in rows:
            r["transformers"] = hf
            if "ms_per_token" in hf:
                r["speedup_vs_transformers"] = hf["ms_per_token"] / r["ms_per_token"]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("layer_kinds", "ready_log")}, indent=1), flush=True)
    return rows


def hf_baseline(config: dict, a: argparse.Namespace) -> dict:
    """transformers' ``DeepseekV4ForCausalLM`` at the run's shapes (``config``: the model the ranks
    ran), same device, timed by ``hf_v4_baseline.py`` in its own process once the ranks have freed
    the GPU; its row, or ``{"error": ...}``."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config))
        cmd = [sys.executable, str(Path(__file__).with_name("hf_v4_baseline.py")), str(path),
               "--layers", str(config["num_hidden_layers"]), "--experts", str(config["n_routed_experts"]),
               "--prompt", str(a.prompt), "--tokens", str(a.tokens), "--device", a.device]
        env = dict(os.environ)  # SHARDSMITH_HF_PYTHONPATH: a newer transformers for this process only
        if os.environ.get("SHARDSMITH_HF_PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["SHARDSMITH_HF_PYTHONPATH"] + os.pathsep + env.get("PYTHONPATH", "")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.hf_timeout_s, env=env)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout)[-600:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def template(a: argparse.Namespace, ckpt: Path) -> dict | None:
    """Template mode's options for the ranks (module docstring), or None."""
    if not a.layers:
        return None
    kinds = json.loads(a.kinds_config.read_text())
    return {"ckpt": str(ckpt), "work": str(a.work), "layers": a.layers, "kinds_config": str(a.kinds_config),
            "experts": a.experts_per_layer or json.loads((ckpt / "config.json").read_text())["n_routed_experts"],
            "kinds": {k: kinds[k] for k in ("compress_ratios", "num_hash_layers") if k in kinds}}


def per_layer(row: dict, layers: int) -> None:
    """Issue 12's per-layer fields, where the row has what they need: ``ms_per_layer``,
    ``device_ops_per_layer`` and ``gpu_busy_share`` (GPU time over wall time, from the profile)."""
    row["ms_per_layer"] = row["ms_per_token"] / layers
    if row.get("gpu_ops_per_token") is not None:
        row["device_ops_per_layer"] = row["gpu_ops_per_token"] / layers
    if row.get("gpu_ms_per_token") is not None:
        row["gpu_busy_share"] = row["gpu_ms_per_token"] / row["ms_per_token"]


def print_table(rows: list[dict]) -> None:
    """Side by side: tokens/s per TP and run, with TP=2/TP=1 ratios at equal cache bytes per GPU."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="DeepSeek-V4 decode (checkpoint layers; offload: same cache bytes per GPU at every TP)")
    for col in ("tp", "run", "cache/GPU GiB", "hit rate", "MB copied/token/rank", "H2D GB/s (probe)",
                "tok/s", "floor tok/s", "vs TP=1"):
        t.add_column(col, justify="right")
    first = {(r["run"], r.get("cache_fraction_at_tp1")): r["tokens_per_s"] for r in rows if r["tp"] == rows[0]["tp"]}
    for r in rows:
        key = (r["run"], r.get("cache_fraction_at_tp1"))
        off = r["run"].startswith("offload")
        t.add_row(str(r["tp"]), r["run"] + (f" {r['cache_fraction_at_tp1']:.3g}" if off else ""),
                  f"{r['cache_bytes_per_gpu'] / 2**30:.2f}" if off else "-",
                  f"{r['hit_rate']:.1%}" if off else "-",
                  f"{r['bytes_copied_per_token_per_rank'] / 1e6:.0f}" if off else "-",
                  (f"{r['h2d_gb_per_s']:.1f}" if r.get("h2d_gb_per_s") is not None else
                   f"in place, {r['marginal_link_gb_per_s'] or 0:.1f} marginal")
                  + f" ({r['probe_h2d_gb_per_s'] or 0:.1f})" if off else "-",
                  f"{r['tokens_per_s']:.1f}", f"{r['floor_tokens_per_s']:.1f}" if off else "-",
                  f"{r['tokens_per_s'] / first[key]:.2f}x" if key in first else "-")
    Console(stderr=True, width=160).print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, nargs="?", help="a DeepSeek-V4 checkpoint (gen_v4_checkpoint.py)")
    ap.add_argument("--tiny", action="store_true", help="build and use the tiny test checkpoint instead")
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardsmith-v4-bench"), help="packs go here (tp1/, tp2/)")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="positions per sequence slot (default prompt + 2 x tokens + 8); at 8192 every compressed "
                         "layer has entries and a step attends over the smallest length bucket (512 positions: "
                         "CSA 128 entries, HCA 4), as a served model would, where the default leaves HCA layers "
                         "(ratio 128) without entries")
    ap.add_argument("--cache-fraction", type=float, action="append", default=[],
                    help="also decode with offloaded experts and a cache of this share of the TP=1 expert bytes")
    ap.add_argument("--fp8", choices=("load", "on-the-fly"), default="load",
                    help="FP8 dense weights: dequantized once at load (the runtime's default) or per matmul")
    ap.add_argument("--hang-s", type=float, default=None,
                    help="a rank still running after this many seconds dumps its stacks and exits")
    ap.add_argument("--profile", type=Path, default=None,
                    help="also profile the graphed runs' one-token steps: GPU time per token in the rows, "
                         "rank 0's host profile as text files in this folder")
    ap.add_argument("--layers", type=int, default=None,
                    help="template mode: decode an N-layer model drawn from the checkpoint's layers by kind")
    ap.add_argument("--experts-per-layer", type=int, default=None,
                    help="template mode: routed experts per layer (default: the checkpoint's)")
    ap.add_argument("--kinds-config", type=Path, default=None,
                    help="template mode: config.json whose compress_ratios / num_hash_layers give the layer kinds "
                         "(default: the real V4-Flash release's, ../shared/real-inventories/...)")
    ap.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/")
    ap.add_argument("--hf", action="store_true",
                    help="also time transformers' DeepseekV4ForCausalLM at the same shapes (hf_v4_baseline.py)")
    ap.add_argument("--hf-timeout-s", type=float, default=240)
    a = ap.parse_args()
    if a.layers:
        from _v4_template import REAL_CONFIG

        a.kinds_config = a.kinds_config or REAL_CONFIG
    if a.tiny:
        from _v4_template import tiny_template

        from shardsmith.testing.tiny_v4 import tiny_deepseek_v4

        ckpt = tiny_template(a.work) if a.layers else a.work / "tiny-ckpt"
        if not (ckpt / "config.json").is_file():
            tiny_deepseek_v4(ckpt)
    elif a.checkpoint is None:
        raise SystemExit("give a checkpoint directory or --tiny")
    else:
        ckpt = a.checkpoint
    rows = [r for tp in a.tp.split(",") for r in run_tp(a, ckpt, int(tp))]
    for row in rows:  # greedy tokens of every TP against the first one's (bf16: may drift late)
        if row["run"] == "resident":
            row["tokens_match_first_tp"] = row["tokens"] == rows[0]["tokens"]
    print_table(rows)
    if not a.no_save:
        from _results import save_results

        save_results("v4_decode", rows, extra={"checkpoint": str(ckpt), "tiny": a.tiny,
                                                "scaling": "per-layer means by kind x (2 sliding, 21 CSA, 20 HCA)"})


if __name__ == "__main__":
    main()
