"""Offloaded decode with ``--moe-backend gpu``, ``hybrid`` and ``auto`` at a capped cache and link (issue 15).

One TP=1 pack of a DeepSeek-V4-Flash-shaped checkpoint (``gen_v4_checkpoint.py``: the real expert
shapes, FP4 experts; or ``--tiny``). For each cache fraction F and each backend, in one process:
build the model with its routed experts in pinned host banks and a GPU slot cache of F x every
routed expert's bytes (policy ``hot``), decode once to warm the cache, then time a greedy decode of
the same prompt eagerly and with one-token steps as piecewise CUDA graphs (the hybrid's host
experts run between the graphed pieces). ``--link-gbps R`` (repeatable) caps the host-to-GPU copy
rate at R GB/s by emulation (:mod:`shardsmith.runtime.offload.link_cap`; the probe and the cache's
copies both see it), as on a PCIe Gen4 box (~25 GB/s); ``0`` (or no option) is the real link.

Why these numbers emulate a 16 GB card: DeepSeek-V4-Flash's routed experts are ~140 GB of FP4 at
TP=1 (43 layers x 256 x 12.75 MB); a 16 GB card keeps roughly 8-9 GB of them after the dense
weights and the KV cache, ~6%, hence F = 0.0625 (four such cards at TP=4: ~25%). The synthetic
checkpoint's router is random, so the hit rate is about F: fewer hits than a trained model's skewed
routing gives, i.e. more misses for the host or the link to cover.

Rows (one per link, fraction, backend and mode): ``link_cap_gb_per_s`` (None: the real link),
``backend`` (requested), ``chosen`` (what the probe picked), ``hybrid_fraction``, ``tokens_per_s``,
``hit_rate``, ``host_experts_per_token``, ``h2d_gb_per_s`` (achieved by the miss copies) and
``probe_h2d_gb_per_s``, ``probe_host_ms_per_expert``, ``probe_host_round_trip_ms``, ``probe_gpu_fused_ms``,
``probe_hybrid_gain``, ``host_isa``, ``speedup_vs_gpu`` (same link, fraction and mode) and
``tokens_match_gpu``; per decoded token: ``moe_ms_per_token`` (host wall time in the offload runtime's
layers), ``host_calls_per_token``, ``host_compute_ms_per_token`` (the worker thread), ``host_expert_ms_per_token`` (of which in the expert calls),
``host_d2h_ms_per_token`` (the one D2H per hybrid layer, a stream sync), ``host_h2d_ms_per_token``,
``host_wait_ms_per_token`` (the driving thread blocked on the host), ``host_threads``,
``split_steps_per_token`` (MoE layers run as split steps: GPU experts on the slot path, the host's
share overlapped) and the round trip's parts per host call (``d2h_ms_per_call``: the id read that
brings x along, a stream sync; ``compute_ms_per_call``; ``wait_ms_per_call``: blocked on the host
after the GPU's work was queued; ``h2d_ms_per_call``: the partial's copy and add);
``prefill_host_experts`` (experts the host computed for the prompt: float32 where the GPU computes
bf16, so a hybrid run's tokens may part from the ``gpu`` run's there even with none in decode). Example (GPU host)::

    python benchmarks/hybrid_vs_gpu.py /tmp/v4ck --work /tmp/hvg --link-gbps 25 --link-gbps 0 --cache-fraction 0.0625
    python benchmarks/hybrid_vs_gpu.py --tiny --work /tmp/hvg-tiny --device cpu --dtype float32   # rehearsal
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from v4_decode import decode, progress  # noqa: E402

BACKENDS = ("gpu", "hybrid", "auto")


def offloaded_runs(weights, dev: torch.device, a: argparse.Namespace, prompt: torch.Tensor, fraction: float,
                   backend: str, link: float | None) -> list[dict]:
    """Eager and graphed rows for one backend at one cache fraction and link cap (None: the real link), TP=1."""
    from shardsmith import settings
    from shardsmith.runtime.engine.cuda_graphs import DecodeGraphs
    from shardsmith.runtime.layers.parallel import use_kernels_
    from shardsmith.runtime.layers.quant import dequantize_fp8_
    from shardsmith.runtime.models.registry import build_v4
    from shardsmith.runtime.offload import OffloadConfig, attach_offload

    os.environ.update(settings.overrides(emulate_h2d_gbps=str(link) if link else ""))  # "": the real link
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    bank_bytes = sum(t.numel() * t.element_size() for layer, arrays in weights.banks().items()
                     if not layer.startswith("mtp.") for t in arrays.values())
    dtype = getattr(torch, a.dtype)
    cfg = OffloadConfig(backend=backend, cache_bytes=int(fraction * bank_bytes), policy="hot", probe=cuda,
                        hybrid_fraction=a.hybrid_fraction if backend == "hybrid" else None)
    t0 = time.perf_counter()
    model, rt = build_v4(weights, rank=0, dtype=dtype, device=dev,
                         place_experts=lambda m: attach_offload(m, weights, cfg, device=dev, dtype=dtype))
    use_kernels_(model, dev)
    dequantize_fp8_(model, dtype)
    model.setup_cache(a.prompt + 2 * a.tokens + 8, dev, dtype)
    rt.start()
    sync()
    ready = time.perf_counter() - t0
    where = f"link {link or 'real'} F={fraction:g} {backend}"
    progress(0, 1, f"{where}: {rt.ready_line()}")
    decode(model, prompt, a.tokens, sync)  # warm-up: fills the cache with this prompt's experts
    base = {"backend": backend, "chosen": rt.backend, "hybrid_fraction": rt.hybrid_fraction,
            "cache_fraction": fraction, "ready_s": ready, "ready_log": rt.ready_line(),
            "link_cap_gb_per_s": link or None, "threads": torch.get_num_threads(),
            "gil_switch_interval_s": sys.getswitchinterval()}  # the host's worker waits up to this for the GIL
    if rt.probe is not None:
        base |= {"probe_h2d_gb_per_s": rt.probe.h2d_gb_per_s, "probe_host_ms_per_expert": rt.probe.cpu_s_per_expert * 1e3,
                 "probe_host_round_trip_ms": rt.probe.host_round_trip_s * 1e3,
                 "probe_gpu_fused_ms": rt.probe.gpu_fused_s * 1e3, "probe_hybrid_gain": rt.probe.hybrid_gain,
                 "host_isa": rt.probe.cpu_isa, "probe_reason": rt.probe.reason}
    rows = []
    runs = [("eager", model)]
    try:
        graphed = DecodeGraphs(model, dev)
        decode(graphed, prompt[:8], 4, sync)  # captures every piece
        runs.append(("graphs", graphed))
    except Exception as e:  # noqa: BLE001 - reported in the row
        rows.append(base | {"mode": "graphs", "error": f"{type(e).__name__}: {e}"[:300]})
    for mode, run in runs:
        prefill = {}

        def after_prefill() -> None:
            prefill["host_experts"] = rt.stats()["host_experts"]  # float32 host maths from here on: tokens may differ
            rt.reset_stats()
            rt.cpu.reset_timings()

        seconds, tokens = decode(run, prompt, a.tokens, sync, after_prefill=after_prefill)
        st = rt.stats()
        n = max(1, st["tokens"])
        ht = rt.cpu.timings()
        host = {"host_calls_per_token": ht["host_calls"] / n, "host_threads": ht["host_threads"],
                "moe_ms_per_token": 1e3 * st["moe_s"] / n, "steps_all_hit": st["steps_all_hit"],
                "decode_steps": st["decode_steps"], "prefill_host_experts": prefill.get("host_experts", 0)}
        host |= {f"{k[:-2]}_ms_per_token": 1e3 * v / n for k, v in ht.items() if k.endswith("_s")}
        host["split_steps_per_token"] = st["split_steps"] / n  # MoE layers run split (GPU slots + host share)
        calls = max(1, ht["host_calls"])  # the round trip's parts per host call (one per split layer step)
        host |= {f"{k[5:-2]}_ms_per_call": 1e3 * ht[k] / calls for k in ("host_d2h_s", "host_compute_s", "host_wait_s",
                                                                         "host_h2d_s")}
        rows.append(base | {"mode": mode, "tokens_per_s": a.tokens / seconds, "ms_per_token": 1e3 * seconds / a.tokens,
                            "tokens": tokens, "hit_rate": st.get("hit_rate"), "misses_per_token": st.get("misses", 0) / n,
                            "host_experts_per_token": st["host_experts"] / n,
                            "bytes_copied_per_token": st.get("bytes_copied", 0) / n,
                            "h2d_gb_per_s": st.get("h2d_gb_per_s"), "slots": st.get("slots")} | host)
        progress(0, 1, f"{where} ({rt.backend}) {mode}: {a.tokens / seconds:.1f} tok/s, "
                       f"hit {st.get('hit_rate', 0):.2f}, host experts/token {st['host_experts'] / n:.1f}, "
                       f"H2D {st.get('h2d_gb_per_s') or 0:.1f} GB/s; per token: MoE {host['moe_ms_per_token']:.2f} ms, "
                       f"split layers {host['split_steps_per_token']:.2f}, "
                       f"host calls {host['host_calls_per_token']:.2f}, host compute "
                       f"{host['host_compute_ms_per_token']:.2f} ms (experts {host['host_expert_ms_per_token']:.2f}), D2H {host['host_d2h_ms_per_token']:.2f} ms, "
                       f"wait {host['host_wait_ms_per_token']:.2f} ms")
    rt.close()
    del model, runs
    if cuda:
        torch.cuda.empty_cache()
    return rows


def compare(rows: list[dict]) -> None:
    """``speedup_vs_gpu`` and ``tokens_match_gpu`` against the ``gpu`` row of the same link, fraction and mode."""
    key = lambda r: (r["link_cap_gb_per_s"], r["cache_fraction"], r["mode"])  # noqa: E731
    gpu = {key(r): r for r in rows if r["backend"] == "gpu" and "tokens_per_s" in r}
    for r in rows:
        g = gpu.get(key(r))
        if g is not None and "tokens_per_s" in r:
            r["speedup_vs_gpu"] = r["tokens_per_s"] / g["tokens_per_s"]
            r["tokens_match_gpu"] = r["tokens"] == g["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, nargs="?", help="a DeepSeek-V4 checkpoint (gen_v4_checkpoint.py)")
    ap.add_argument("--tiny", action="store_true", help="build and use the tiny test checkpoint instead")
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardsmith-hybrid-bench"), help="the TP=1 pack goes here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens")
    ap.add_argument("--cache-fraction", type=float, action="append", default=[],
                    help="cache = this share of every routed expert's bytes (repeatable; default 0.0625)")
    ap.add_argument("--backend", default=",".join(BACKENDS), help="comma list of gpu, hybrid, auto, cpu")
    ap.add_argument("--link-gbps", type=float, action="append", default=[],
                    help="emulate a host-to-GPU link of this rate in GB/s, 0 for the real link (repeatable)")
    ap.add_argument("--threads", type=int, default=None, help="host threads (default: torch's)")
    ap.add_argument("--hybrid-fraction", type=float, default=None,
                    help="share of misses the hybrid backend sends to the host (default: the probe's split)")
    ap.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/")
    a = ap.parse_args()
    from shardsmith.runtime.engine.dist import init_distributed
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.writer.split import split_checkpoint

    if a.tiny:
        from shardsmith.testing.tiny_v4 import tiny_deepseek_v4

        ckpt = a.work / "tiny-ckpt"
        if not (ckpt / "config.json").is_file():
            tiny_deepseek_v4(ckpt)
    elif a.checkpoint is None:
        raise SystemExit("give a checkpoint directory or --tiny")
    else:
        ckpt = a.checkpoint
    if a.threads:
        torch.set_num_threads(a.threads)
    pack = a.work / "tp1"
    if not (pack / "pack.yaml").is_file():
        split_checkpoint(ckpt, pack, world_size=1, force=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(0, 1, master_port=port, device=a.device)
    dev = torch.device(f"cuda:{torch.cuda.current_device()}" if a.device == "cuda" else "cpu")
    weights = load_rank_weights(str(pack), rank=0, world_size=1)
    vocab = weights.config["vocab_size"]
    prompt = torch.randint(0, vocab, (a.prompt,), generator=torch.Generator().manual_seed(0)).to(dev)
    rows = [r for link in (a.link_gbps or [0.0]) for f in (a.cache_fraction or [0.0625]) for b in a.backend.split(",")
            for r in offloaded_runs(weights, dev, a, prompt, f, b, link)]
    compare(rows)
    cols = ("link_cap_gb_per_s", "cache_fraction", "backend", "chosen", "mode", "tokens_per_s", "speedup_vs_gpu", "hit_rate",
            "host_experts_per_token", "split_steps_per_token", "wait_ms_per_call", "h2d_gb_per_s",
            "probe_host_ms_per_expert", "tokens_match_gpu")
    print(" ".join(f"{c:>14.14}" for c in cols))
    for r in rows:
        print(" ".join(f"{(f'{v:.3g}' if isinstance(v, float) else str(v)):>14.14}" for v in (r.get(c) for c in cols)))
    if not a.no_save:
        from _results import save_results

        save_results("hybrid_vs_gpu", rows, extra={"checkpoint": str(ckpt), "tiny": a.tiny})


if __name__ == "__main__":
    main()
