"""Decode tokens/s with routed experts offloaded to host memory, TP=1 vs TP=2 at equal cache bytes per GPU.

Two modes:

``decode`` (default): on a pack (``--pack-root`` holding ``tp1/`` and ``tp2/``, built once from a
Mixtral-shaped synthetic checkpoint with ``--make``), for each TP: a resident run (every expert on
the device: compute + all-reduce time per token) and an offloaded run with the expert cache capped
to ``--cache-fraction`` of each layer's experts at TP=1 (the same bytes per GPU at every TP). Each
row reports tokens/s, hit rate, missed bytes per token and rank, achieved H2D GB/s during miss
copies, the probe's pinned GB/s, and the floor::

    floor_s_per_token = missed_bytes_per_token / probe_h2d_bytes_per_s + resident_s_per_token

With ``--hf-baseline`` (decode mode), the same run then times transformers + accelerate on the
same checkpoint with the same experts in host RAM (``_hf_baseline``: ``hf_accelerate_experts_cpu``,
and ``hf_accelerate_auto`` under our TP=1 GPU bytes) and adds ``speedup_vs_hf`` to our offloaded
rows. Our rows sample (temperature 1, seeded), the baseline decodes greedily: the same number of
forwards per token, different tokens.

``sweep``: slot-table hit rates (LRU, hot set, Belady's optimum) on the SmolLM2 MoE routing trace
(captured by decoding with the real checkpoint, ``--smollm2``) and on a synthetic Zipf trace.

Examples (two H200s; CPU at tiny size with ``--device cpu --tiny``)::

    python benchmarks/decode_offload.py --make --pack-root /tmp/offload-packs --device cuda
    python benchmarks/decode_offload.py --pack-root /tmp/offload-packs --device cuda --tp 1 2 --hf-baseline
    python benchmarks/decode_offload.py --pack-root /tmp/offload-packs --device cpu --tiny --make
    python benchmarks/decode_offload.py --mode sweep --smollm2 ~/.cache/shardsmith/demo/smollm2-moe-bf16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch
from shardsmith.testing.ranks import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _hf_baseline import bench_prompt  # noqa: E402

GiB = 1 << 30


# ------------------------------------------------------------------ synthetic pack


def make_checkpoint(root: Path, *, layers: int, experts: int, hidden: int, intermediate: int, top_k: int,
                    heads: int, kv_heads: int, vocab: int, fmt: str, seed: int = 0) -> Path:
    """A Mixtral-format checkpoint with random weights (bf16 dense; experts bf16 or block FP8)."""
    from shardsmith.testing import write_checkpoint

    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    def expert(t, name, *shape):
        if fmt == "bf16":
            t[name] = w(*shape)
            return
        x = torch.randn(*shape, generator=g).clamp(-8, 8).to(torch.float8_e4m3fn)  # unit-scale blocks
        t[name] = x
        t[name[: -len("weight")] + "weight_scale_inv"] = torch.full((-(-shape[0] // 128), -(-shape[1] // 128)),
                                                                     shape[-1] ** -0.5, dtype=torch.float32)

    t = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[f"{p}.self_attn.q_proj.weight"] = w(heads * hd, hidden)
        t[f"{p}.self_attn.k_proj.weight"] = w(kv_heads * hd, hidden)
        t[f"{p}.self_attn.v_proj.weight"] = w(kv_heads * hd, hidden)
        t[f"{p}.self_attn.o_proj.weight"] = w(hidden, heads * hd)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[f"{p}.block_sparse_moe.gate.weight"] = (torch.randn(experts, hidden, generator=g) * 2 * hidden ** -0.5).to(torch.bfloat16)
        for e in range(experts):
            q = f"{p}.block_sparse_moe.experts.{e}"
            expert(t, f"{q}.w1.weight", intermediate, hidden)
            expert(t, f"{q}.w2.weight", hidden, intermediate)
            expert(t, f"{q}.w3.weight", intermediate, hidden)
    t["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    t["lm_head.weight"] = w(vocab, hidden)
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hd,
              "num_local_experts": experts, "num_experts_per_tok": top_k, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2}
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    return write_checkpoint(root, t, config, max_shard_bytes=2 * GiB)


# ------------------------------------------------------------------ one TP world


def _rank(rank: int, ws: int, port: int, job: dict, queue) -> None:
    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ["LOCAL_RANK"] = str(rank)
        from shardsmith.runtime.engine.engine import Engine, SamplingParams
        from shardsmith.runtime.offload import OffloadConfig
        from shardsmith.runtime.engine.dist import init_distributed

        init_distributed(rank, ws, master_port=port, device=job["device"])
        rows = []
        prompt = bench_prompt(seed=job["seed"], vocab=job["vocab"], tokens=job["prompt_tokens"])
        params = SamplingParams(max_tokens=job["tokens"], temperature=1.0, seed=job["seed"])
        warm = SamplingParams(max_tokens=job["warmup_tokens"], temperature=1.0, seed=job["seed"] + 1)
        for run, graphs in [(r, g) for r in job["runs"] for g in job["graphs"]]:
            offload = None if run == "resident" else OffloadConfig(
                backend=run, cache_bytes=job["cache_bytes"], policy=job["policy"], pin="auto")
            eng = Engine.load(job["pack"], rank=rank, world_size=ws, device=job["device"], offload=offload,
                              max_seq_len=job["prompt_tokens"] + job["tokens"] + job["warmup_tokens"] + 8,
                              cuda_graphs=graphs)
            if rank == 0:
                list(eng.generate(prompt, warm))
                if eng.offload:
                    eng.offload.reset_stats()
                sync = torch.cuda.synchronize if job["device"] == "cuda" else (lambda: None)
                sync()
                first = None
                n = 0
                for s in eng.generate(prompt, params):
                    n += 1
                    if first is None:  # prefill done: time and count the decode steps only
                        if eng.offload:
                            eng.offload.reset_stats()
                        first = time.perf_counter()
                sync()
                dt = time.perf_counter() - first
                row = {"run": run + (" graphs" if graphs else ""), "cuda_graphs": graphs,
                       "decode_tokens": n - 1, "decode_s": dt, "tokens_per_s": (n - 1) / dt, "load_s": eng.load_seconds}
                if eng.offload:
                    s = eng.offload.stats()
                    decode_tokens = max(1, s["tokens"])
                    row |= {k: s.get(k) for k in ("backend", "slots", "hit_rate", "hits", "misses", "slot_bytes",
                                                  "pool_bytes", "h2d_gb_per_s", "probe_h2d_gb_per_s",
                                                  "probe_cpu_s_per_expert", "host_bytes", "host_pinned")}
                    row["ready_log"] = eng.offload.ready_line()
                    row["bytes_copied_per_token"] = s.get("bytes_copied", 0) / decode_tokens
                rows.append(row)
                eng.shutdown()
            else:
                eng.follow()
            if eng.offload:
                eng.offload.close()
            del eng
            if job["device"] == "cuda":
                torch.cuda.empty_cache()
        if rank == 0:
            queue.put(("ok", rows))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def run_world(ws: int, job: dict, timeout: float) -> list[dict]:
    return run_ranks(_rank, ws, job, timeout=timeout, join_timeout=60)


def decode_mode(a: argparse.Namespace) -> list[dict]:
    from shardsmith.writer.split import split_checkpoint

    root = Path(a.pack_root)
    shape = (dict(layers=2, experts=16, hidden=256, intermediate=512, top_k=4, heads=4, kv_heads=2, vocab=512)
             if a.tiny else dict(layers=a.layers, experts=a.experts, hidden=a.hidden, intermediate=a.intermediate,
                                 top_k=a.top_k, heads=32, kv_heads=8, vocab=2048))
    if a.make:
        t0 = time.perf_counter()
        src = root / "src"
        if not (src / "config.json").is_file():
            make_checkpoint(src, fmt=a.format, **shape)
        for ws in a.tp:
            if not (root / f"tp{ws}" / "pack.yaml").is_file():
                split_checkpoint(src, root / f"tp{ws}", world_size=ws)
        print(f"packs ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    cfg = json.loads((root / f"tp{a.tp[0]}" / "config.json").read_text())
    from shardsmith.pack.reader import open_rank
    from shardsmith.runtime.offload.expert_cache import slot_nbytes, slot_signature
    from shardsmith.runtime.offload.host_bank import load_host_banks

    # the TP=1 slot size, from the TP=1 pack's plan (no read): cache = fraction x one layer's experts
    rp = open_rank(root / "tp1", 0, 1, verify=False) if (root / "tp1").is_dir() else None
    if rp is not None:
        banks = rp.banks()
        one = next(iter(banks.values()))
        slot1 = sum(x[0].numel() * x.element_size() for x in one.values())
    else:
        hb = load_host_banks(open_rank(root / f"tp{a.tp[0]}", 0, a.tp[0]), pin="off")
        slot1 = slot_nbytes(slot_signature(hb)) * a.tp[0]
    n_exp = cfg["num_local_experts"]
    moe_layers = cfg["num_hidden_layers"]
    cache_bytes = int(round(a.cache_fraction * n_exp * moe_layers)) * slot1  # that share of every layer's experts
    rows = []
    for ws in a.tp:
        job = dict(pack=str(root / f"tp{ws}"), device=a.device, cache_bytes=cache_bytes, policy=a.policy,
                   runs=["resident", *a.backend], tokens=a.tokens, warmup_tokens=a.warmup_tokens,
                   graphs={"on": [True], "off": [False], "both": [False, True]}[a.graphs],
                   prompt_tokens=a.prompt_tokens, seed=a.seed, vocab=cfg["vocab_size"])
        got = run_world(ws, job, timeout=a.timeout)
        for r in got:
            resident = next(x for x in got if x["run"] == "resident" + (" graphs" if r["run"].endswith(" graphs") else ""))
            r |= {"tp": ws, "cache_bytes_per_gpu": cache_bytes, "cache_fraction_at_tp1": a.cache_fraction,
                  "experts_per_layer": n_exp, "layers": cfg["num_hidden_layers"], "top_k": cfg["num_experts_per_tok"],
                  "hidden": cfg["hidden_size"], "intermediate": cfg["intermediate_size"], "device": a.device}
            if r is not resident:
                bw = (r.get("probe_h2d_gb_per_s") or 0) * 1e9
                copy_s = r["bytes_copied_per_token"] / bw if bw else 0.0
                floor = copy_s + 1 / resident["tokens_per_s"]
                r |= {"resident_tokens_per_s": resident["tokens_per_s"], "floor_copy_s_per_token": copy_s,
                      "floor_tokens_per_s": 1 / floor, "time_per_token_over_floor": (1 / r["tokens_per_s"]) / floor}
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "ready_log"}), file=sys.stderr)
    base = {r["run"]: r for r in rows if r["tp"] == a.tp[0]}
    for r in rows:
        if r["tp"] != a.tp[0] and r["run"] in base:
            r["speedup_vs_tp%d" % a.tp[0]] = r["tokens_per_s"] / base[r["run"]]["tokens_per_s"]
    if a.hf_baseline:
        rows += hf_baseline(a, root / "src", rows, cache_bytes=cache_bytes)
    return rows


def hf_baseline(a: argparse.Namespace, src: Path, ours: list[dict], *, cache_bytes: int) -> list[dict]:
    """transformers + accelerate rows after ``ours`` (their ranks have exited); adds ``speedup_vs_hf`` to ours.

    The ``auto`` row's GPU budget is what our TP=1 offloaded run holds: the checkpoint's dense
    bytes + ``cache_bytes``. A baseline that fails becomes a ``skipped`` row so that our rows are
    still saved.
    """
    from _hf_baseline import checkpoint_bytes, hf_offload_rows

    if not (src / "config.json").is_file():
        return [{"run": "hf_baseline", "tp": 1, "skipped": f"no checkpoint at {src} (build it with --make)"}]
    gpu_bytes = checkpoint_bytes(src)["dense"] + cache_bytes
    try:  # a few warm-up tokens: accelerate has no cache to fill, only CUDA and cuBLAS to start
        rows = hf_offload_rows(src, device=a.device, gpu_bytes=gpu_bytes, tokens=a.hf_tokens or a.tokens,
                               warmup_tokens=min(a.warmup_tokens, 4), prompt_tokens=a.prompt_tokens, seed=a.seed)
    except Exception as e:  # noqa: BLE001 - keep our rows; the traceback goes to stderr
        traceback.print_exc()
        rows = [{"run": "hf_baseline", "tp": 1, "skipped": f"{type(e).__name__}: {e}"[:400]}]
    for r in rows:
        print(json.dumps(r), file=sys.stderr)
    ref = next((r for r in rows if r["run"] in ("hf_accelerate_experts_cpu", "hf_cpu") and "tokens_per_s" in r), None)
    if ref is not None:
        for r in ours:
            if not r["run"].startswith("resident"):
                r |= {"speedup_vs_hf": r["tokens_per_s"] / ref["tokens_per_s"], "speedup_vs_hf_run": ref["run"]}
    return rows


def print_table(rows: list[dict]) -> None:
    """The decode rows side by side on stderr: tokens/s, cache hit rate, copied MiB per token, floor, ratios."""
    from rich.console import Console
    from rich.table import Table

    def num(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    ratios = sorted({k for r in rows for k in r if k.startswith("speedup_vs_")} - {"speedup_vs_hf_run"})
    t = Table("run", "tp", "tokens/s", "hit rate", "copied MiB/token", "floor tokens/s", "time/floor", *ratios,
              "note", title="decode with routed experts in host memory")
    for r in rows:
        copied = r.get("bytes_copied_per_token")
        t.add_row(r["run"], str(r.get("tp", "-")), num(r.get("tokens_per_s"), ".1f"), num(r.get("hit_rate"), ".3f"),
                  num(None if copied is None else copied / 2**20, ".2f"), num(r.get("floor_tokens_per_s"), ".1f"),
                  num(r.get("time_per_token_over_floor"), ".2f"), *(num(r.get(k), ".2f") for k in ratios),
                  r.get("skipped") or r.get("hf_expert_format") or "")
    Console(stderr=True, width=200).print(t)


# ------------------------------------------------------------------ policy sweep


def smollm2_trace(path: Path, tokens: int) -> list[list[tuple[int, int]]]:
    """Per decode token and MoE layer, the selected experts of the real SmolLM2 MoE (TP=1, CPU)."""
    from tokenizers import Tokenizer

    from shardsmith.runtime.engine.engine import Engine, SamplingParams
    from shardsmith.runtime.layers.experts import ExpertBank

    eng = Engine.load(path, rank=0, world_size=1, from_checkpoint=True, max_seq_len=tokens + 64)
    trace: list[list[tuple[int, int]]] = []
    banks = [m for m in eng.model.modules() if isinstance(m, ExpertBank)]
    for i, bank in enumerate(banks):
        def hook(mod, args, i=i):
            index = args[1]
            if index.shape[0] == 1:  # decode steps only
                trace.append([(i, e) for e in sorted(index[0].tolist())])
        bank.register_forward_pre_hook(hook)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompts = ["The history of the Roman Empire began", "def quicksort(arr):\n",
               "Photosynthesis is the process by which", "My favourite recipe for dinner is"]
    for p in prompts:
        list(eng.generate(tok.encode(p).ids, SamplingParams(max_tokens=tokens // len(prompts), temperature=0.7, seed=1)))
    return trace


def zipf_trace(*, layers: int, experts: int, k: int, tokens: int, s: float, seed: int) -> list[list[tuple[int, int]]]:
    """Per token and layer, k distinct experts drawn from a Zipf(s) popularity, permuted per layer."""
    rng = random.Random(seed)
    perms = [rng.sample(range(experts), experts) for _ in range(layers)]
    w = [1 / (i + 1) ** s for i in range(experts)]
    out = []
    for _ in range(tokens):
        for layer in range(layers):
            picked: set[int] = set()
            while len(picked) < k:
                picked.add(perms[layer][rng.choices(range(experts), w)[0]])
            out.append([(layer, e) for e in sorted(picked)])
    return out


def sweep_mode(a: argparse.Namespace) -> list[dict]:
    from shardsmith.runtime.offload.slots import belady, simulate

    traces = {"zipf1.0-256x6x8layers": zipf_trace(layers=8, experts=256, k=6, tokens=600, s=1.0, seed=0),
              "zipf0.6-256x6x8layers": zipf_trace(layers=8, experts=256, k=6, tokens=600, s=0.6, seed=0)}
    if a.smollm2:
        traces["smollm2-moe-8x2x30layers"] = smollm2_trace(Path(a.smollm2), a.tokens)
    rows = []
    for name, trace in traces.items():
        total = len({k for req in trace for k in req})
        for frac in (0.125, 0.25, 0.5):
            n = max(1, int(frac * total))
            row = {"trace": name, "requests": len(trace), "distinct_experts": total, "cache_fraction": frac, "slots": n,
                   "lru_hit_rate": simulate(trace, n, policy="lru"),
                   "belady_hit_rate": belady(trace, n)}
            for hf in (0.25, 0.5, 0.75):
                row[f"hot{hf}_hit_rate"] = simulate(trace, n, policy="hot", hot_fraction=hf)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["decode", "sweep"], default="decode")
    p.add_argument("--pack-root", default="/tmp/shardsmith-offload-packs")
    p.add_argument("--make", action="store_true", help="build the synthetic checkpoint and its packs if missing")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--format", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", nargs="+", default=["gpu"], help="offloaded runs (gpu, hybrid, cpu)")
    p.add_argument("--policy", default="hot")
    p.add_argument("--cache-fraction", type=float, default=0.25, help="cache bytes per GPU = this share of all experts at TP=1 (every TP gets the same bytes)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--smollm2", default=None, help="SmolLM2 MoE checkpoint for the sweep's real routing trace")
    p.add_argument("--hf-baseline", action="store_true",
                   help="then time transformers + accelerate on the same checkpoint, experts in host RAM (needs accelerate)")
    p.add_argument("--hf-tokens", type=int, default=None, help="tokens per baseline run (default: --tokens)")
    p.add_argument("--graphs", choices=["on", "off", "both"], default=None,
                   help="decode steps as CUDA graphs (the runtime's default), eager, or both side by side "
                        "(default: both on CUDA, off on CPU)")
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    if a.graphs is None:
        a.graphs = "both" if a.device == "cuda" else "off"
    rows = decode_mode(a) if a.mode == "decode" else sweep_mode(a)
    if a.mode == "decode":
        print_table(rows)
    if not a.no_save:
        from _results import save_results

        save_results("decode_offload" if a.mode == "decode" else "offload_policy", rows)


if __name__ == "__main__":
    main()
