"""DeepSeek-V3 decode with the release's per-layer shapes: resident and offloaded experts, tokens/s.

``--make DIR`` writes a DeepSeek-V3-shaped checkpoint with random values: names, dtypes and shapes
of one dense and one MoE layer are taken from :func:`shardsmith.testing.tiny_v3.deepseek_v3_headers`
(the release's: hidden 7168, MLA with q latent 1536 and KV latent 512 + 64, dense intermediate
18432, routed experts of 7168x2048 and one shared expert, FP8 with F32 ``weight_scale_inv`` on
128x128 blocks, ``kv_a_proj_with_mqa`` 576 rows = 4.5 blocks) and repeated: ``--dense-layers``
dense layers, then ``--moe-layers`` MoE layers of ``--experts`` routed experts (real: 256), no MTP
layer, vocabulary ``--vocab`` (real: 129280). Values: FP8 e4m3 codes uniform over the finite
ones (each FP8 tensor a slice of one random pool at its own offset), each block's scale making the
weight's rms about ``fan_in^-0.5``; norms about 1; router ``N(0, 1/D)``; the embedding and head
repeat one random block every 9362 rows (generation time). Shards (``--shard-gb``) are written as
they fill: memory stays under one shard. ``--make-only`` stops there.

Then per ``--tp`` world size, one process per rank (NCCL on CUDA, gloo on CPU), each run loads
the checkpoint (sliced at start-up, ``--from-checkpoint``: the same tensors a pack at that world
size holds; ``--pack`` splits one first), prefills a random ``--prompt`` and decodes ``--tokens``
greedily through :class:`~shardsmith.runtime.engine.engine.Engine` (what ``serve`` runs):

- ``resident``: every expert on the device (piecewise CUDA graphs on CUDA; ``--eager`` adds a run
  without them);
- ``offload F`` per ``--cache-fraction F``: routed experts in pinned host banks (FP8 as stored), a
  device slot cache of ``F`` x the rank's routed-expert bytes, policy ``hot``, after a warm-up decode.

Rows (tokens/s over the decode steps, time to ready, hit rate, bytes copied per token, whether
the greedy tokens equal the resident run's) print as JSON lines and go to ``--json``.

Examples::

    python benchmarks/v3_decode.py --make /data/v3 --moe-layers 2 --experts 256 --device cuda --json out.json
    python benchmarks/v3_decode.py --make /tmp/v3s --dense-layers 0 --moe-layers 1 --experts 8 --vocab 1024 \\
        --device cpu --dtype bfloat16 --tokens 3 --prompt 4       # CPU rehearsal at real per-layer shapes
    python benchmarks/v3_decode.py --tiny --work /tmp/v3t --device cpu --dtype float32 --tp 1,2
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

import torch

POOL_BYTES = 160 << 20  # > the largest FP8 tensor (the dense MLP's 18432 x 7168 = 126 Mi)
_ALL = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_RMS = float(_ALL[~_ALL.isnan()].pow(2).mean().sqrt())  # rms of a uniformly random finite code (~100)
TILE_ELEMENTS = 1 << 26  # a larger BF16 tensor (embedding, head: 129280 x 7168) repeats a block of this many
_pool: list[torch.Tensor] = []


def code_pool() -> torch.Tensor:
    """``POOL_BYTES`` uniformly random finite e4m3 codes (uint8; NaN codes 0x7F/0xFF moved one down), made once."""
    if not _pool:
        # int32 random_ is ~8x faster than uint8 randint, but [0, 2^31): every 4th byte's top bit (an
        # e4m3 sign) is 0; it takes the sign bit of the byte 3 before it
        x = torch.empty(POOL_BYTES // 4, dtype=torch.int32).random_(generator=torch.Generator().manual_seed(0))
        x = x.view(torch.uint8)
        x[3::4] |= x[0::4] & 0x80
        x[(x & 0x7F) == 0x7F] -= 1
        _pool.append(x)
    return _pool[0]


def templates() -> tuple[dict, dict, dict, dict]:
    """``(dense layer, MoE layer, other tensors, config)``: layer tensors keyed by the name after
    ``model.layers.N.``, each ``(dtype, shape)``, from the release-shaped headers."""
    from shardsmith.testing.tiny_v3 import deepseek_v3_headers

    with tempfile.TemporaryDirectory() as tmp:
        root = deepseek_v3_headers(Path(tmp), layers=4)  # layers 0-2 dense, 3 MoE, 4 the MTP layer
        header = {}
        for f in sorted(root.glob("*.safetensors.json")):
            header.update(json.loads(f.read_text()))
        config = json.loads((root / "config.json").read_text())
    spec = {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
    layer = {i: {k[len(f"model.layers.{i}."):]: v for k, v in spec.items() if k.startswith(f"model.layers.{i}.")}
             for i in (0, 3)}
    other = {k: v for k, v in spec.items() if not k.startswith("model.layers.")}
    return layer[0], layer[3], other, config


def plan(*, dense_layers: int, moe_layers: int, experts: int, vocab: int) -> tuple[dict, dict]:
    """Every tensor ``name -> (dtype, shape)`` in write order, and the config."""
    dense, moe, other, config = templates()
    out = {"model.embed_tokens.weight": ("BF16", [vocab, other["model.embed_tokens.weight"][1][1]])}
    for i in range(dense_layers + moe_layers):
        for k, (dt, shape) in (dense if i < dense_layers else moe).items():
            e = re.match(r"mlp\.experts\.(\d+)\.", k)
            if e and int(e.group(1)) >= experts:
                continue
            if k in ("mlp.gate.weight", "mlp.gate.e_score_correction_bias"):
                shape = [experts, *shape[1:]]
            out[f"model.layers.{i}.{k}"] = (dt, list(shape))
    out["model.norm.weight"] = other["model.norm.weight"]
    out["lm_head.weight"] = ("BF16", [vocab, other["lm_head.weight"][1][1]])
    groups = math.gcd(int(config["n_group"]), max(1, experts // 2))  # groups of >= 2 experts (a group's score: its best 2)
    config.update(num_hidden_layers=dense_layers + moe_layers, first_k_dense_replace=dense_layers,
                  n_routed_experts=experts, num_nextn_predict_layers=0, vocab_size=vocab, n_group=groups,
                  topk_group=min(int(config["topk_group"]), groups), num_experts_per_tok=min(8, max(1, experts // 2)))
    return out, config


def make(name: str, dt: str, shape: list[int], spec: dict) -> torch.Tensor:
    """Random tensor ``name`` (seeded by its name; see the module docstring for the values)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dt == "F8_E4M3":  # a slice of one random pool at a name-seeded offset: fast for 10^3 expert tensors
        n, pool = math.prod(shape), code_pool()
        start = int(torch.randint(0, pool.numel() - n + 1, (1,), generator=g))
        return pool[start: start + n].clone().view(torch.float8_e4m3fn).view(shape)
    if name.endswith("_scale_inv"):  # weight rms ~ fan_in^-0.5, each block's scale x 2^-1, 1 or 2
        fan_in = spec[name[: -len("_scale_inv")]][1][1]
        return torch.full(shape, fan_in ** -0.5 / E4M3_RMS) * 2.0 ** torch.randint(-1, 2, shape, generator=g).float()
    if name.endswith("norm.weight"):
        return (1 + 0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    if name.endswith("e_score_correction_bias"):
        return 0.01 * torch.randn(shape, generator=g)
    std = 1.0 if name.endswith("embed_tokens.weight") else shape[-1] ** -0.5
    rows = min(shape[0], max(1, TILE_ELEMENTS // math.prod(shape[1:])))  # embedding and head: rows repeat
    block = (torch.randn([rows, *shape[1:]], generator=g) * std).to(torch.bfloat16)
    return block if rows == shape[0] else block.repeat(-(-shape[0] // rows), *[1] * (len(shape) - 1))[: shape[0]]


def make_checkpoint(out: Path, *, dense_layers: int, moe_layers: int, experts: int, vocab: int,
                    shard_bytes: int) -> dict:
    """Write the checkpoint (each scale in its weight's shard); returns tensors, bytes, shards, seconds."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    spec, config = plan(dense_layers=dense_layers, moe_layers=moe_layers, experts=experts, vocab=vocab)
    out.mkdir(parents=True, exist_ok=True)
    size = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    weight_map, total, names, fill, n = {}, 0, [], 0, 0

    def flush() -> None:
        nonlocal names, fill, n, total
        n += 1
        fname = f"model-{n:05d}.safetensors"
        tensors = {k: make(k, *spec[k], spec) for k in names}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, fname))
        names, fill = [], 0

    for name, (dt, shape) in spec.items():
        if name.endswith("_scale_inv"):
            continue
        group = [name] + ([name + "_scale_inv"] if name + "_scale_inv" in spec else [])
        nbytes = sum(math.prod(spec[k][1]) * size[spec[k][0]] for k in group)
        if names and fill + nbytes > shard_bytes:
            flush()
        names += group
        fill += nbytes
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return {"tensors": len(spec), "bytes": total, "shards": n, "seconds": time.perf_counter() - t0}


def decode(eng, prompt: list[int], tokens: int) -> tuple[float, list[int], float]:
    """Greedy ``tokens`` after ``prompt`` (rank 0): (decode seconds after the first token, tokens, prefill s)."""
    from shardsmith.runtime.engine.engine import SamplingParams

    t0, out, first = time.perf_counter(), [], 0.0
    for s in eng.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0.0)):
        out.append(s.token_id)
        if len(out) == 1:
            first = time.perf_counter()
    return time.perf_counter() - first, out, first - t0


def rank_main(rank: int, world: int, port: int, a: dict, queue) -> None:
    """One rank: every run of ``a["runs"]`` in turn (load, warm-up, timed decode); rank 0 reports rows."""
    try:
        from shardsmith.runtime.engine.engine import Engine
        from shardsmith.runtime.engine.dist import init_distributed
        from shardsmith.runtime.offload import OffloadConfig

        init_distributed(rank, world, master_port=port, device=a["device"])
        cuda = a["device"] == "cuda"
        prompt = torch.randint(0, a["vocab"], (a["prompt"],), generator=torch.Generator().manual_seed(0)).tolist()
        rows = []
        for run, fraction in a["runs"]:
            offload = None
            if fraction is not None:
                offload = OffloadConfig(backend="gpu", cache_bytes=int(a["expert_bytes"] / world * fraction),
                                        policy="hot", probe=cuda)
            t0 = time.perf_counter()
            eng = Engine.load(a["path"], rank=rank, world_size=world, device=a["device"], dtype=a["dtype"],
                              from_checkpoint=a["from_checkpoint"], max_seq_len=a["prompt"] + a["tokens"] + 16,
                              offload=offload, cuda_graphs=run != "resident eager", verify_hashes=False)
            ready = time.perf_counter() - t0
            if rank != 0:
                eng.follow()
            else:
                decode(eng, prompt[: max(2, a["prompt"] // 4)], 3)  # warm-up: kernels, graph captures, cache
                if eng.offload is not None:
                    decode(eng, prompt, a["tokens"])  # fills the expert cache with this prompt's experts
                    eng.offload.reset_stats()
                seconds, tokens, prefill = decode(eng, prompt, a["tokens"])
                st = eng.offload.stats() if eng.offload is not None else {}
                row = {"tp": world, "run": run, "cache_fraction": fraction, "ready_s": ready, "prefill_s": prefill,
                       "tokens_per_s": (len(tokens) - 1) / seconds, "ms_per_token": 1e3 * seconds / (len(tokens) - 1),
                       "tokens": tokens, "gpu_bytes": torch.cuda.memory_allocated() if cuda else 0,
                       "state_bytes": eng.model.state_bytes() if hasattr(eng.model, "state_bytes") else None}
                if st:
                    steps = max(1, st.get("tokens") or 1)
                    row.update({k: st.get(k) for k in ("backend", "slots", "hit_rate", "slot_bytes", "pool_bytes",
                                                       "h2d_gb_per_s", "probe_h2d_gb_per_s", "host_pinned")},
                               bytes_copied_per_token=(st.get("bytes_copied") or 0) / steps)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
                eng.shutdown()
            if eng.offload is not None:
                eng.offload.close()
            del eng
            if cuda:
                torch.cuda.empty_cache()
        if rank == 0:
            queue.put(("ok", rows))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def expert_bytes(ckpt: Path) -> int:
    """Bytes of every routed expert tensor (weights and scales) in the checkpoint (its index)."""
    from safetensors import safe_open

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    total = 0
    for fname in sorted(set(index.values())):
        with safe_open(str(ckpt / fname), "pt") as h:
            for k in h.keys():
                if ".mlp.experts." in k:
                    sl = h.get_slice(k)
                    total += math.prod(sl.get_shape()) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[sl.get_dtype()]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, nargs="?", help="a DeepSeek-V3 checkpoint (else --make or --tiny)")
    ap.add_argument("--make", type=Path, help="write the release-shaped checkpoint here first (kept if present)")
    ap.add_argument("--make-only", action="store_true", help="stop after --make (the summary goes to --json)")
    ap.add_argument("--tiny", action="store_true", help="use the tiny test checkpoint (under --work)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardsmith-v3-bench"))
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--tp", default="1")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cache-fraction", type=float, action="append", default=None,
                    help="offloaded runs: device cache as this share of the rank's routed-expert bytes (default 0.25)")
    ap.add_argument("--no-resident", action="store_true", help="skip the resident runs")
    ap.add_argument("--eager", action="store_true", help="add a resident run without CUDA graphs")
    ap.add_argument("--pack", action="store_true", help="split into a pack per world size and load that")
    ap.add_argument("--json", type=Path, help="write the rows (and the checkpoint summary) here")
    a = ap.parse_args()
    from shardsmith.testing.ranks import run_ranks

    summary = None
    if a.tiny:
        from shardsmith.testing.tiny_v3 import tiny_deepseek_v3_model

        ckpt = a.work / "tiny-ckpt"
        if not (ckpt / "config.json").is_file():
            tiny_deepseek_v3_model(ckpt, experts=16, top_k=4)
    elif a.make is not None:
        ckpt = a.make
        if not (ckpt / "config.json").is_file():
            summary = make_checkpoint(ckpt, dense_layers=a.dense_layers, moe_layers=a.moe_layers, experts=a.experts,
                                      vocab=a.vocab, shard_bytes=int(a.shard_gb * 2**30))
            print(f"wrote {ckpt}: {summary['bytes'] / 1e9:.2f} GB in {summary['seconds']:.1f} s", file=sys.stderr)
        if a.make_only:
            if a.json and summary:
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps({"benchmark": "v3_decode", "made": summary}, indent=1))
            return
    elif a.checkpoint is None:
        raise SystemExit("give a checkpoint directory, --make DIR or --tiny")
    else:
        ckpt = a.checkpoint
    config = json.loads((ckpt / "config.json").read_text())
    fractions = a.cache_fraction or [0.25]
    runs = ([] if a.no_resident else [("resident", None)] + ([("resident eager", None)] if a.eager else [])) + \
        [(f"offload {f:g}", f) for f in fractions]
    rows = []
    for tp in (int(t) for t in a.tp.split(",")):
        path, split_s = ckpt, None
        if a.pack:
            from shardsmith.writer.split import split_checkpoint

            path, t0 = a.work / f"tp{tp}", time.perf_counter()
            if not (path / "pack.yaml").is_file():
                split_checkpoint(ckpt, path, world_size=tp, force=True)
            split_s = time.perf_counter() - t0
        opts = {"path": str(path), "from_checkpoint": not a.pack, "device": a.device, "dtype": a.dtype,
                "prompt": a.prompt, "tokens": a.tokens, "vocab": int(config["vocab_size"]), "runs": runs,
                "expert_bytes": expert_bytes(ckpt)}
        got = run_ranks(rank_main, tp, opts, timeout=3600)
        base = next((r["tokens"] for r in got if r["run"] == "resident"), None)
        for r in got:
            r.update(split_s=split_s, tokens_match_resident=None if base is None else r["tokens"] == base)
        rows += got
    shape = {k: config.get(k) for k in ("hidden_size", "num_hidden_layers", "first_k_dense_replace", "n_routed_experts",
                                        "moe_intermediate_size", "num_experts_per_tok", "vocab_size")}
    result = {"benchmark": "v3_decode", "device": a.device, "dtype": a.dtype, "checkpoint": str(ckpt), "shape": shape,
              "made": summary, "prompt": a.prompt, "decode_tokens": a.tokens, "rows": rows}
    for r in rows:
        print(f"tp={r['tp']} {r['run']:>16}: {r['tokens_per_s']:8.2f} tok/s  ready {r['ready_s']:.1f} s  "
              f"hit {r.get('hit_rate', '-')}  same tokens as resident: {r['tokens_match_resident']}", file=sys.stderr)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
