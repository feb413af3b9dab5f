"""Prefill speed of a long prompt at the engine level: DeepSeek-V4's prefill kernels side by side with the
PyTorch reference path and the FP4 experts' grouped matmuls beside the expert-by-expert loop, per prompt
length and chunk size, and where a chunk's GPU time goes.

One engine (rank 0, world size 1, weights resident) loads ``PATH`` (a pack, or a checkpoint with
``--from-checkpoint``: e.g. ``gen_v4_checkpoint.py --layers 43``, the full V4-Flash depth with random
weights). For each prompt length (random token ids) and chunk size it prefills the prompt chunk by
chunk into one slot, as the scheduler feeds a long prompt, once per ``--paths`` entry ``ATTENTION/MOE``:
attention ``kernel`` (:func:`~shardsmith.runtime.layers.kernels.deepseek_v4.prefill_attention.prefill_attention`
and the indexer's kernel scores) or ``reference`` (the same maths in float32 einsums); MoE ``grouped``
(:func:`~shardsmith.runtime.layers.experts.grouped_experts`: on a GPU the FP4 tile kernel), ``expanded`` (the same,
experts expanded to bf16 for ``torch._grouped_mm``) or ``loop`` (expert by expert). Time from the
first chunk to the last logits on the host (``ttft_s``, median of ``--repeat`` after one untimed run
that compiles). With ``--profile`` one chunk at the longest prompt's end runs under ``torch.profiler``
on the first path and the GPU kernels that take the most time are listed.

Rows: ``device``, ``tp``, ``layers``, ``experts_per_layer``, ``prompt_tokens``, ``chunk_tokens``,
``attention``, ``moe``, ``ttft_s``, ``prefill_tokens_per_s``, ``ratio_to_baseline`` (the last path's
time over this row's), ``same_last_token`` (the greedy token after the prompt equals the baseline's),
``moe_backend`` (``resident``), ``peak_memory_gib`` (the allocator's most during a row's last run, weights,
caches and state included; on a GPU); saved as ``benchmarks/results/prefill-<date>-<host>.json``
with the profiles under ``profile``. ``--offload 0.25`` adds the same prompts with the routed experts
offloaded (a cache of 25% of them): rows with ``moe_backend`` ``offloaded (stream)`` (each chunk
copies every missing expert once, ``OffloadRuntime.run_chunk``) or ``offloaded (slots)`` (the
decode-sized path in 16-token pieces, ``--offload-paths``), ``cache_bytes_per_gpu`` and
``link_bytes_per_prompt_token``. Not yet here (the long-prompt issue's full benchmark): the real
``serve`` path over HTTP, decode speed at the context, transformers beside it.

    python benchmarks/gen_v4_checkpoint.py /data/v4f --layers 43 --experts 8 --mtp 0
    python benchmarks/prefill.py /data/v4f --from-checkpoint --device cuda --prompt 1024 8192 32768 --chunk 2048 8192
    python benchmarks/gen_v4_checkpoint.py /data/v4m --layers 4 --experts 256 --mtp 0
    python benchmarks/prefill.py /data/v4m --from-checkpoint --paths kernel/grouped kernel/loop --prompt 8192
    python benchmarks/prefill.py /tmp/v4t --from-checkpoint --device cpu --dtype float32 --prompt 256 --chunk 64  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardsmith.runtime.engine.engine import Engine


def set_path(model: torch.nn.Module, path: str) -> None:
    """Switch the prefill path for this run: ``ATTENTION/MOE[/MATHS]``, attention ``kernel`` or ``reference``
    (every V4 attention layer's ``prefill_kernel``), MoE ``grouped`` (FP4 banks' grouped matmuls, the FP4
    tile kernel where it runs), ``expanded`` (grouped, each group's experts expanded to the activations'
    dtype first) or ``loop`` (expert by expert, as before them), the chunk's row-wise maths ``fused`` (compiled,
    :mod:`~shardsmith.runtime.layers.fused`) or ``eager`` (default: as ``compile_pieces`` says)."""
    from shardsmith.runtime.layers import experts, fused

    attention, moe, *maths = path.split("/")
    for m in model.modules():
        if hasattr(m, "prefill_kernel"):
            m.prefill_kernel = attention == "kernel"
    if moe not in ("grouped", "expanded", "loop"):
        raise SystemExit(f"--paths {path!r}: MoE must be grouped, expanded or loop")
    experts.GROUPED = moe != "loop"
    experts.TILE_KERNEL = False if moe == "expanded" else None
    fused.ENABLED = {"fused": True, "eager": False}[maths[0]] if maths else None


def chunk_maths(path: str) -> str:
    """The row-wise maths a path ran: ``fused`` or ``eager``."""
    from shardsmith.runtime.layers import fused

    parts = path.split("/")
    return parts[2] if len(parts) > 2 else ("fused" if fused.compiles() else "eager")


def peak_gib(engine: Engine) -> float | None:
    """The device memory the allocator held at most since the last :func:`prefill` began, GiB (None on
    a CPU): what a chunk of this size needs beside the weights, caches and state."""
    return round(torch.cuda.max_memory_allocated(engine.device) / 2**30, 3) if engine.device.type == "cuda" else None


def prefill(engine: Engine, ids: list[int], chunk: int, sync) -> tuple[float, int]:
    """``(seconds, greedy next token)`` of one prompt fed in chunks of ``chunk`` tokens into slot 0."""
    engine.release(0)
    sync()
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    t0 = time.perf_counter()
    for a in range(0, len(ids), chunk):
        logits = engine.prefill(0, ids[a:a + chunk], a)
    sync()
    return time.perf_counter() - t0, int(logits[-1].argmax())


def profile_chunk(engine: Engine, ids: list[int], chunk: int, top: int) -> list[dict]:
    """The GPU kernels of one chunk at the end of ``ids`` (the rest prefilled first), by total time."""
    from torch.profiler import ProfilerActivity, profile

    engine.release(0)
    start = max(0, len(ids) - chunk)
    for a in range(0, start, chunk):
        engine.prefill(0, ids[a:min(a + chunk, start)], a)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.prefill(0, ids[start:], start)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            t = totals[e.name[:90]]
            t[0] += e.device_time_total / 1e3
            t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    whole = sum(v[0] for v in totals.values())
    return [{"kernel": k, "ms": round(v[0], 3), "calls": v[1], "share": round(v[0] / whole, 4)}
            for k, v in ranked[:top]] + [{"kernel": "(all)", "ms": round(whole, 3), "calls": sum(v[1] for v in totals.values()),
                                          "share": 1.0}]


def offloaded_rows(a: argparse.Namespace, fraction: float, device: str, layers, experts, gen_seed: int,
                   rows: list[dict], keep) -> None:
    """The prompts and chunks again with the routed experts offloaded (``--moe-backend gpu``, a cache of
    ``fraction`` of every layer's experts, the first ``--paths`` entry's attention): per
    ``--offload-paths`` entry, time and ``link_bytes_per_prompt_token`` (what the chunks copied over
    the link per prompt token, from the offload counters), appended to ``rows``, ``keep()`` after each.
    The caller frees the resident engine first."""
    from shardsmith.runtime.offload import OffloadConfig

    path = a.paths[0]
    total = (layers or 1) * (experts or 1)
    engine = Engine.load(a.path, rank=0, world_size=1, device=a.device, dtype=getattr(torch, a.dtype),
                         max_seq_len=max(a.prompt) + 8, max_num_seqs=1, from_checkpoint=a.from_checkpoint,
                         offload=OffloadConfig(backend="gpu", cache_slots=max(1, round(fraction * total)), probe=False))
    rt = engine.offload
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    set_path(engine.model, path)
    streams = rt.streams_chunk
    gen = torch.Generator().manual_seed(gen_seed)
    for length in a.prompt:
        ids = torch.randint(3, engine.vocab_size, (length,), generator=gen).tolist()
        for chunk in a.chunk:
            for how in a.offload_paths:
                if how == "slots" and length > a.slots_max:
                    continue
                rt.streams_chunk = streams if how == "stream" else (lambda x: False)
                prefill(engine, ids, chunk, sync)  # compiles, fills the allocator and the cache
                rt.reset_stats()
                runs = [prefill(engine, ids, chunk, sync) for _ in range(a.repeat)]
                peak = peak_gib(engine)
                st = rt.stats()
                if how == "stream" and not st["prefill_tokens"]:
                    print(f"prompt {length} chunk {chunk}: the chunks did not stream their experts: "
                          f"{rt.stream_refused or 'no long step reached the experts'}", flush=True)
                secs = statistics.median(r[0] for r in runs)
                link = st["prefill_link_bytes"] if how == "stream" else st["bytes_copied"]
                print(f"prompt {length} chunk {chunk} offloaded {fraction:.0%} {how}: {secs:.3f} s, "
                      f"{link / (a.repeat * length) / 2**20:.2f} MiB over the link per prompt token", flush=True)
                attention, moe = path.split("/")
                rows.append({"device": device, "tp": 1, "layers": layers, "experts_per_layer": experts,
                             "prompt_tokens": length, "chunk_tokens": chunk, "attention": attention, "moe": moe,
                             "ttft_s": round(secs, 4), "prefill_tokens_per_s": round(length / secs, 1),
                             "ratio_to_baseline": None, "same_last_token": None,
                             "moe_backend": f"offloaded ({how})", "cache_fraction": fraction,
                             "cache_bytes_per_gpu": rt.cache.n_slots * rt.cache.slot_bytes,
                             "link_bytes_per_prompt_token": round(link / (a.repeat * length), 1),
                             "peak_memory_gib": peak})
                keep()
    rt.streams_chunk = streams
    rt.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path)
    ap.add_argument("--from-checkpoint", action="store_true", help="PATH is a checkpoint (sliced as TP=1)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--chunk", type=int, nargs="+", default=[2048])
    ap.add_argument("--paths", nargs="+", default=["kernel/grouped", "reference/grouped"],
                    help="ATTENTION/MOE[/MATHS]: attention kernel|reference, MoE grouped|expanded|loop, the chunk's row-wise "
                         "maths fused|eager (default: compile_pieces'); the last is the baseline")
    ap.add_argument("--baseline-max", type=int, default=32768, help="longest prompt the baseline path runs")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, metavar="TOP", help="list the TOP kernels of one chunk (CUDA)")
    ap.add_argument("--offload", type=float, nargs="*", default=[], metavar="FRACTION",
                    help="also run with the routed experts offloaded (backend gpu), a cache of FRACTION of them")
    ap.add_argument("--offload-paths", nargs="+", choices=("stream", "slots"), default=["stream"],
                    help="offloaded chunks: stream each missing expert once per chunk (run_chunk) or the "
                         "decode-sized slot path in 16-token pieces (as before)")
    ap.add_argument("--slots-max", type=int, default=2048,
                    help="longest prompt the offloaded slot path runs (it moves each missing expert once per "
                         "16-token piece: minutes a layer at 8k tokens and the real expert count)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from _results import save_results

    engine = Engine.load(a.path, rank=0, world_size=1, device=a.device, dtype=getattr(torch, a.dtype),
                         max_seq_len=max(a.prompt) + 8, max_num_seqs=1, from_checkpoint=a.from_checkpoint)
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = json.loads((a.path / "config.json").read_text()) if (a.path / "config.json").exists() else {}
    layers = cfg.get("num_hidden_layers")
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    device = torch.cuda.get_device_name() if cuda else "cpu"
    gen = torch.Generator().manual_seed(0)
    rows, profiles = [], {}

    def keep(complete: bool = False) -> None:  # the rows so far on disk: a step cut off by its limit keeps them
        save_results("prefill", rows, extra={"path": a.path.name, "dtype": a.dtype, "profile": profiles,
                                             "complete": complete}, path=a.out)

    for length in a.prompt:
        ids = torch.randint(3, engine.vocab_size, (length,), generator=gen).tolist()
        for chunk in a.chunk:
            got, peaks = {}, {}
            for path in a.paths:
                if path == a.paths[-1] and len(a.paths) > 1 and length > a.baseline_max:
                    continue
                set_path(engine.model, path)
                prefill(engine, ids, chunk, sync)  # compiles, fills the allocator
                runs = [prefill(engine, ids, chunk, sync) for _ in range(a.repeat)]
                peaks[path] = peak_gib(engine)
                got[path] = (statistics.median(r[0] for r in runs), runs[0][1])
                print(f"prompt {length} chunk {chunk} {path}: {got[path][0]:.3f} s", flush=True)
            base = got.get(a.paths[-1])
            for path, (secs, token) in got.items():
                attention, moe = path.split("/")[:2]
                rows.append({"device": device, "tp": 1, "layers": layers, "experts_per_layer": experts,
                             "prompt_tokens": length, "chunk_tokens": chunk, "attention": attention, "moe": moe,
                             "chunk_maths": chunk_maths(path),
                             "ttft_s": round(secs, 4), "prefill_tokens_per_s": round(length / secs, 1),
                             "ratio_to_baseline": round(base[0] / secs, 3) if base else None,
                             "same_last_token": token == base[1] if base else None, "moe_backend": "resident",
                             "peak_memory_gib": peaks.get(path)})
            keep()
    if a.profile and cuda:
        longest, chunk = max(a.prompt), max(a.chunk)
        ids = torch.randint(3, engine.vocab_size, (longest,), generator=gen).tolist()
        set_path(engine.model, a.paths[0])
        profiles[f"{a.paths[0]}-{longest}-{chunk}"] = ops = profile_chunk(engine, ids, chunk, a.profile)
        print(f"\nGPU kernels of the last {chunk}-token chunk of a {longest}-token prompt, {a.paths[0]}:")
        for op in ops:
            print(f"  {op['ms']:>10.2f} ms {op['share']:>6.1%} {op['calls']:>6}  {op['kernel']}")
    del engine  # the offloaded runs load their own: the resident one's memory is given back first
    if cuda:
        torch.cuda.empty_cache()
    for fraction in a.offload:  # the same prompts with the experts in host memory, a cache of ``fraction``
        offloaded_rows(a, fraction, device, layers, experts, 0, rows, keep)
    print(f"\n{'prompt':>7} {'chunk':>6} {'path':<24} {'experts':<20} {'ttft s':>9} {'tok/s':>9} {'vs base':>8} "
          f"{'same':>5} {'link MiB/token':>15}")
    for r in rows:
        ratio = "" if r["ratio_to_baseline"] is None else f"{r['ratio_to_baseline']:.2f}"
        link = r.get("link_bytes_per_prompt_token")
        where = r["moe_backend"] + (f" {r['cache_fraction']:.0%}" if "cache_fraction" in r else "")
        label = "/".join(p for p in (r["attention"], r["moe"], r.get("chunk_maths")) if p)
        print(f"{r['prompt_tokens']:>7} {r['chunk_tokens']:>6} {label:<24} {where:<20} "
              f"{r['ttft_s']:>9.3f} {r['prefill_tokens_per_s']:>9.1f} {ratio:>8} {str(r['same_last_token']):>5} "
              f"{'' if link is None else f'{link / 2**20:.2f}':>15}")
    keep(complete=True)


if __name__ == "__main__":
    main()
