"""DeepSeek-V4 decode at TP 1, 2 and 4 predicted on one device: one rank alone, its collectives priced.

For each TP the template checkpoint is split at that world size and, in a process of its own, rank 0
joins a fake process group of that size (``shardsmith.runtime.engine.rank_alone``): every kernel runs
at the rank's real shapes (a 1/TP share of the heads, the expert width and the vocabulary) and every
collective returns at once. **The values are not the model's** (the reductions are skipped): the
run measures time only. It measures:

- the rank's decode step (``rank_step_ms``, greedy, batch 1, graphed on CUDA), resident and with the
  routed experts offloaded (``--moe-backend gpu``, policy ``hot``);
- the collectives one decode step issues (counted in one eager step with ``CollectiveLog``: ops and
  bytes), priced on two links (``rank_alone.LINKS``: NVLink, measured on two H200s; PCIe, a public
  report): ``collective_ms``;
- ``predicted_tokens_per_s = 1000 / (rank_step_ms + collective_ms)``; ``ratio_to_tp1`` against the
  TP=1 row of the same backend and links.
- ``--real``: each TP > 1 also runs for real (gloo on CPU, NCCL on that many GPUs), resident; its row
  (``collective_link`` ``measured``) prices the step's collectives with the backend's latency measured
  in that run and gives ``real_tokens_per_s`` and ``predicted_over_real``: the model checked.

Offloaded rows hold the expert cache of a ``--card-gib`` GPU at every TP: what the card holds after the
rank's resident weights (measured: GPU memory of the resident build less its banks) and
``--reserve-gib`` (state, activations, graphs), as a share of the real model's routed experts on
that rank (``--real-experts`` x the model's layers, each the template's per-expert bytes). The
template run gets that share of its own banks, so with near-uniform (random-weight) routing it copies
what the real model would per token. The ``link_gb_per_s`` rows: the measured host link, and a
slower one (``--slow-link-gb-per-s``) emulated by adding the copied bytes' extra time at that rate
(copies assumed not to overlap compute: a bound from below on tokens/s).

Writes ``benchmarks/results/tp_sim-<YYYYMMDD>-<host>.json``. The template is
``gen_v4_checkpoint.py --layers 5`` (as ``v4_decode.py``'s template mode). Examples::

    python benchmarks/gen_v4_checkpoint.py /tmp/v4t5 --layers 5 --experts 24 --mtp 0
    python benchmarks/tp_sim.py /tmp/v4t5 --work /tmp/tps --layers 43 --experts-per-layer 24
    python benchmarks/tp_sim.py --tiny --work /tmp/tps-tiny --layers 8 --device cpu --dtype float32  # CPU smoke
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
GiB = 1 << 30


def rank_run(rank: int, world_size: int, port: int, a: dict, queue) -> None:
    """One TP's rank 0, alone (a spawned process): time its decode steps, count its collectives."""
    try:
        queue.put(("ok", _measure(a)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))
        raise


def real_run(rank: int, world_size: int, port: int, a: dict, queue) -> None:
    """``--real``: one rank of the real TP world (gloo on CPU, NCCL on CUDA): the resident decode step
    with its collectives, and the backend's own latency for the step's collectives (each call of the
    step's list issued alone, timed over ``REPEATS``); rank 0 reports."""
    try:
        from _v4_template import TemplateWeights
        from v4_decode import decode

        import torch.distributed as dist

        from shardsmith.runtime.engine.cuda_graphs import DecodeGraphs
        from shardsmith.runtime.engine.dist import init_distributed
        from shardsmith.runtime.engine.build import build_model
        from shardsmith.runtime.engine.loader import load_rank_weights
        from shardsmith.runtime.engine.rank_alone import CollectiveLog
        from shardsmith.runtime.layers import parallel

        cuda = a["device"] == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
        init_distributed(rank, world_size, master_port=port, device=a["device"])
        dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        t = a["template"]
        weights = TemplateWeights(load_rank_weights(a["pack"], rank=rank, world_size=world_size), Path(t["ckpt"]),
                                  Path(t["work"]), layers=t["layers"], experts=t["experts"], kinds=t["kinds"])
        model, *_ = build_model(weights, rank=rank, device=dev, dtype=getattr(torch, a["dtype"]),
                                max_seq_len=a["max_seq_len"], check_fit=False)
        prompt = torch.randint(0, int(weights.config["vocab_size"]), (a["prompt"],),
                               generator=torch.Generator().manual_seed(0)).to(dev)
        runner = DecodeGraphs(model, dev) if cuda else model
        decode(runner, prompt[:8], 4, sync)
        seconds, _ = decode(runner, prompt, a["tokens"], sync)
        logits = model(prompt, 0)
        with CollectiveLog() as log:
            model(logits[-1:].argmax(-1), prompt.shape[0])
        per_call = []
        for c in log.calls[:4]:  # the first few: the step's sizes repeat layer after layer
            x = torch.zeros(max(1, c.nbytes // 2), dtype=torch.bfloat16, device=dev)
            parts = [torch.empty_like(x) for _ in range(world_size)]
            # the model's own all-reduce (on gloo a small one is a gather and a local sum)
            issue = (lambda: parallel.all_reduce(x)) if c.op == "allreduce" else (lambda: dist.all_gather(parts, x))
            for _ in range(5):
                issue()
            sync()
            t0 = time.perf_counter()
            for _ in range(REPEATS):
                issue()
            sync()
            per_call.append((time.perf_counter() - t0) / REPEATS)
        if rank == 0:
            queue.put(("ok", {"tp": world_size, "real_step_ms": 1e3 * seconds / a["tokens"],
                              "measured_latency_s": sorted(per_call)[len(per_call) // 2],
                              "collectives": len(log.calls)}))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


REPEATS = 50


def _measure(a: dict) -> dict:
    from _v4_template import TemplateWeights
    from v4_decode import decode

    from shardsmith.runtime.engine.cuda_graphs import DecodeGraphs
    from shardsmith.runtime.engine.build import build_model
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.runtime.engine.rank_alone import CollectiveLog, init_rank_alone
    from shardsmith.runtime.offload import OffloadConfig

    tp, cuda = a["tp"], a["device"] == "cuda"
    if not cuda:  # a CPU rank of a TP world gets its share of the cores (as the real ranks are clamped)
        torch.set_num_threads(max(1, torch.get_num_threads() // tp))
    if tp > 1:
        init_rank_alone(0, tp)
    dev = torch.device("cuda:0" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t = a["template"]
    weights = TemplateWeights(load_rank_weights(a["pack"], rank=0, world_size=tp), Path(t["ckpt"]), Path(t["work"]),
                              layers=t["layers"], experts=t["experts"], kinds=t["kinds"])
    dtype = getattr(torch, a["dtype"])
    prompt = torch.randint(0, int(weights.config["vocab_size"]), (a["prompt"],),
                           generator=torch.Generator().manual_seed(0)).to(dev)
    bank_bytes = sum(x.numel() * x.element_size() for arrays in weights.banks().values() for x in arrays.values())
    layers, experts = t["layers"], t["experts"]
    out: dict = {"tp": tp, "layers": layers, "experts_per_layer": experts, "template_bank_bytes": bank_bytes,
                 "expert_bytes_per_rank": bank_bytes / (layers * experts)}

    def timed(model, after_prefill=None) -> float:
        runner = DecodeGraphs(model, dev) if cuda else model  # graphed on CUDA, as serve runs decode
        decode(runner, prompt[:8], 4, sync)  # warm-up: captures every piece, fills the allocator
        seconds, _ = decode(runner, prompt, a["tokens"], sync, after_prefill=after_prefill)
        return 1e3 * seconds / a["tokens"]

    def counted(model) -> list[dict]:
        logits = model(prompt, 0)
        with CollectiveLog() as log:
            model(logits[-1:].argmax(-1), prompt.shape[0])  # one eager decode step
        return [{"op": c.op, "bytes": c.nbytes, "group_size": c.group_size} for c in log.calls]

    model, *_ = build_model(weights, rank=0, device=dev, dtype=dtype, max_seq_len=a["max_seq_len"], check_fit=False)
    sync()
    out["resident_bytes"] = torch.cuda.memory_allocated(dev) - bank_bytes if cuda else None
    out["collectives"] = counted(model)
    out["resident_step_ms"] = timed(model)
    del model
    if cuda:
        torch.cuda.empty_cache()
        real_bank = a["real_experts"] * layers * out["expert_bytes_per_rank"]
        cache = a["card_bytes"] - out["resident_bytes"] - a["reserve_bytes"]
        share = max(0.0, min(1.0, cache / real_bank))
        cfg = OffloadConfig(backend="gpu", cache_bytes=max(1, int(share * bank_bytes)), policy="hot", probe=True)
        model, _, rt, _ = build_model(weights, rank=0, device=dev, dtype=dtype, max_seq_len=a["max_seq_len"],
                                      offload=cfg, check_fit=False)
        rt.start(graphed=True)
        decode(model, prompt, a["tokens"], sync)  # fills the cache with this prompt's experts
        out["offload_step_ms"] = timed(model, after_prefill=rt.reset_stats)
        st = rt.stats()
        out |= {"cache_bytes_per_gpu": int(cache), "cache_share_of_real_experts": share,
                "template_cache_bytes": st.get("pool_bytes"), "hit_rate": st.get("hit_rate"),
                "bytes_copied_per_token": st.get("bytes_per_token"), "probe_h2d_gb_per_s": st.get("probe_h2d_gb_per_s")}
        rt.close()
    return out


def rows_for(measured: list[dict], a: argparse.Namespace) -> list[dict]:
    """The issue's rows: per TP, backend, host link and collective link; ratios to TP=1."""
    from shardsmith.runtime.engine.rank_alone import LINKS, CollectiveCall, Link, collective_seconds

    rows = []
    for m in measured:
        calls = [CollectiveCall(c["op"], c["bytes"], (), "", c["group_size"]) for c in m["collectives"]]
        runs = [("resident", None, m["resident_step_ms"], None)]
        if "offload_step_ms" in m:
            link = m["probe_h2d_gb_per_s"] or float("nan")
            slow_extra = m["bytes_copied_per_token"] * (1 / (a.slow_link_gb_per_s * 1e9) - 1 / (link * 1e9)) * 1e3
            runs += [("gpu offload", link, m["offload_step_ms"], m["hit_rate"]),
                     ("gpu offload", a.slow_link_gb_per_s, m["offload_step_ms"] + max(0.0, slow_extra), m["hit_rate"])]
        for backend, link_gb, step_ms, hit in runs:
            for name, link in LINKS.items():
                coll_ms = 1e3 * collective_seconds(calls, link)
                rows.append({"tp": m["tp"], "layers": m["layers"], "moe_backend": backend,
                             "cache_bytes_per_gpu": m.get("cache_bytes_per_gpu") if backend != "resident" else None,
                             "cache_share_of_real_experts": m.get("cache_share_of_real_experts") if hit is not None else None,
                             "link_gb_per_s": link_gb, "link_emulated": link_gb == a.slow_link_gb_per_s,
                             "rank_step_ms": step_ms, "collectives_per_step": len(calls),
                             "collective_bytes_per_step": sum(c.nbytes for c in calls), "collective_link": name,
                             "collective_ms": coll_ms, "predicted_tokens_per_s": 1e3 / (step_ms + coll_ms),
                             "hit_rate": hit, "values": "not the model's (rank alone; reductions skipped)"})
    for m in measured:
        real = m.get("real")
        if real is None:
            continue
        link = Link("measured", real["measured_latency_s"], float("inf"), "this run's backend, the step's collective sizes")
        calls = [CollectiveCall(c["op"], c["bytes"], (), "", c["group_size"]) for c in m["collectives"]]
        coll_ms = 1e3 * collective_seconds(calls, link)
        predicted = 1e3 / (m["resident_step_ms"] + coll_ms)
        rows.append({"tp": m["tp"], "layers": m["layers"], "moe_backend": "resident", "cache_bytes_per_gpu": None,
                     "cache_share_of_real_experts": None, "link_gb_per_s": None, "link_emulated": False,
                     "rank_step_ms": m["resident_step_ms"], "collectives_per_step": len(calls),
                     "collective_bytes_per_step": sum(c.nbytes for c in calls), "collective_link": "measured",
                     "collective_ms": coll_ms, "predicted_tokens_per_s": predicted, "hit_rate": None,
                     "real_step_ms": real["real_step_ms"], "real_tokens_per_s": 1e3 / real["real_step_ms"],
                     "predicted_over_real": predicted * real["real_step_ms"] / 1e3,
                     "values": "real TP run beside the rank-alone prediction"})
    for r in rows:
        base = next((b for b in rows if b["tp"] == 1 and b["moe_backend"] == r["moe_backend"]
                     and b["collective_link"] in (r["collective_link"], "nvlink" if r["collective_link"] == "measured" else "")
                     and b["link_emulated"] == r["link_emulated"]), None)
        r["ratio_to_tp1"] = r["predicted_tokens_per_s"] / base["predicted_tokens_per_s"] if base else None
    return rows


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="DeepSeek-V4 decode by TP, one rank measured alone (time only), collectives priced")
    for col in ("tp", "backend", "host link GB/s", "hit rate", "rank step ms", "collectives", "link",
                "collective ms", "predicted tok/s", "vs TP=1", "real tok/s"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["tp"]), r["moe_backend"],
                  "-" if r["link_gb_per_s"] is None else f"{r['link_gb_per_s']:.0f}" + (" (emulated)" if r["link_emulated"] else ""),
                  "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}", f"{r['rank_step_ms']:.2f}",
                  str(r["collectives_per_step"]), r["collective_link"], f"{r['collective_ms']:.2f}",
                  f"{r['predicted_tokens_per_s']:.1f}", "-" if r["ratio_to_tp1"] is None else f"{r['ratio_to_tp1']:.2f}x",
                  f"{r['real_tokens_per_s']:.1f}" if "real_tokens_per_s" in r else "-")
    Console(stderr=True, width=170).print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, nargs="?", help="the template (gen_v4_checkpoint.py --layers 5)")
    ap.add_argument("--tiny", action="store_true", help="build and use the tiny 5-layer template instead")
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardsmith-tp-sim"), help="packs go here (tp1/, tp2/, ...)")
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--experts-per-layer", type=int, default=24, help="routed experts per template-built layer")
    ap.add_argument("--real-experts", type=int, default=256, help="routed experts per layer of the model predicted")
    ap.add_argument("--kinds-config", type=Path, default=None, help="layer kinds (default: the real V4-Flash config)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--card-gib", type=float, default=48.0, help="GPU memory of the card whose cache is modelled")
    ap.add_argument("--reserve-gib", type=float, default=6.0, help="kept off the cache: state, activations, graphs")
    ap.add_argument("--slow-link-gb-per-s", type=float, default=25.0)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per TP")
    ap.add_argument("--real", action="store_true",
                    help="also run each TP > 1 for real (gloo on CPU, NCCL on as many GPUs), resident, beside the "
                         "prediction priced with the backend's own measured latency")
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    from _v4_template import REAL_CONFIG, tiny_template
    from v4_decode import template as template_options

    from shardsmith.testing.ranks import run_ranks
    from shardsmith.writer.split import split_checkpoint

    a.kinds_config = a.kinds_config or REAL_CONFIG
    if a.tiny:
        ckpt = tiny_template(a.work)
    elif a.checkpoint is None:
        raise SystemExit("give a template checkpoint directory or --tiny")
    else:
        ckpt = a.checkpoint
    template = template_options(a, ckpt)
    measured = []
    for tp in (int(x) for x in a.tp.split(",")):
        pack = a.work / f"tp{tp}"
        if not (pack / "pack.yaml").is_file():
            split_checkpoint(ckpt, pack, world_size=tp, force=True)
        t0 = time.perf_counter()
        opts = {"tp": tp, "device": a.device, "dtype": a.dtype, "pack": str(pack), "template": template,
                "prompt": a.prompt, "tokens": a.tokens, "max_seq_len": a.max_seq_len, "real_experts": a.real_experts,
                "card_bytes": int(a.card_gib * GiB), "reserve_bytes": int(a.reserve_gib * GiB)}
        measured.append(run_ranks(rank_run, 1, opts, timeout=a.timeout_s))
        if a.real and tp > 1:
            measured[-1]["real"] = run_ranks(real_run, tp, opts, timeout=a.timeout_s)
        print(f"[tp={tp}] measured in {time.perf_counter() - t0:.0f} s: resident step "
              f"{measured[-1]['resident_step_ms']:.2f} ms, {len(measured[-1]['collectives'])} collectives per step",
              file=sys.stderr, flush=True)
    rows = rows_for(measured, a)
    print_table(rows)
    if not a.no_save:
        from _results import save_results

        card = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
        save_results("tp_sim", rows, extra={"template": str(ckpt), "device": a.device, "card": card, "dtype": a.dtype,
                                             "card_gib": a.card_gib, "measured": measured})


if __name__ == "__main__":
    main()
