"""Write a DeepSeek-V4-Flash-shaped checkpoint from the real inventory, with random values.

Names, dtypes and per-layer shapes come from the raw headers in
``shared/real-inventories/deepseek-v4-flash-0731-reap160/``; the config is the release's with the
layer and expert counts changed. ``--layers 4`` keeps layers 0-3 (sliding, sliding, CSA, HCA; the
first three hash-routed), ``--experts N`` keeps routed experts ``0..N-1`` (router rows, bias and
``tid2eid`` follow; past the inventory's 160, expert ``j`` takes expert 0's names and shapes, so
``--experts 256`` gives the unpruned release's count), ``--mtp M`` keeps draft layers ``mtp.0..M-1``.

Values (sane scales, valid formats): FP8 e4m3 ``N(0, 16^2)`` with UE8M0 block scales making the
weight's std about ``fan_in^-0.5``; FP4 experts as random e2m1 codes (rms 2.9) with 1x32 UE8M0
scales for the same std; BF16 matrices ``N(0, fan_in^-1)``; norms about 1; mixers, sinks, ``ape``
and biases small; ``tid2eid`` ``top_k`` distinct experts per token. Tensors are generated one at a
time and shards (``--shard-gb``) are written as they fill, so memory stays under one shard plus
one tensor. Full size per layer: ~2.1 GB (160 experts) plus 2.1 GB of embedding and head.

Example::

    python benchmarks/gen_v4_checkpoint.py /data/v4-4l --layers 4 --experts 160
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

INVENTORY = Path(__file__).resolve().parents[2] / "shared" / "real-inventories" / "deepseek-v4-flash-0731-reap160"
DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "I64": torch.int64}
BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}
E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)


def inventory(root: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the real checkpoint: name -> (dtype, shape), in shard then header order."""
    out: dict[str, tuple[str, list[int]]] = {}
    for f in sorted(root.glob("model-*.safetensors.json")):
        header = json.loads(f.read_text())
        out.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


def select(tensors: dict, *, layers: int, experts: int, mtp: int) -> dict[str, tuple[str, list[int]]]:
    """Tensors kept at ``layers``/``experts``/``mtp``, router shapes set to ``experts``.

    Experts past the inventory's count are added with expert 0's names (index replaced) and shapes.
    """
    have = 1 + max((int(m.group(1)) for n in tensors if (m := re.search(r"\.experts\.(\d+)\.", n))), default=-1)
    keep = {}
    for name, (dt, shape) in tensors.items():
        m = re.match(r"(layers|mtp)\.(\d+)\.", name)
        if m and int(m.group(2)) >= (layers if m.group(1) == "layers" else mtp):
            continue
        e = re.search(r"\.experts\.(\d+)\.", name)
        if e and int(e.group(1)) >= experts:
            continue
        if re.search(r"\.ffn\.gate\.(weight|bias)$", name):
            shape = [experts, *shape[1:]]
        keep[name] = (dt, list(shape))
        if e and int(e.group(1)) == 0:
            for j in range(have, experts):
                keep[name.replace(".experts.0.", f".experts.{j}.")] = (dt, list(shape))
    return keep


def make(name: str, dt: str, shape: list[int], scales: dict, *, top_k: int, experts: int) -> torch.Tensor:
    """Random tensor ``name`` (seeded by its name); a weight's UE8M0 scale is stored in ``scales``."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dt == "I64":  # tid2eid: top_k distinct experts per token
        return torch.rand(shape[0], experts, generator=g).topk(top_k, dim=-1).indices
    if name.endswith(".scale"):
        return scales.pop(name)
    if dt == "I8":  # FP4 e2m1 codes, two per byte; scale per 32 for std ~ fan_in^-0.5
        fan_in = shape[1] * 2
        e = round(math.log2(fan_in ** -0.5 / E2M1_RMS))
        scales[name[: -len(".weight")] + ".scale"] = _ue8m0(shape[0], fan_in // 32, e, g)
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int16).to(torch.int8)
    if dt == "F8_E4M3":
        e = round(math.log2(shape[1] ** -0.5 / 16))
        scales[name[: -len(".weight")] + ".scale"] = _ue8m0(-(-shape[0] // 128), -(-shape[1] // 128), e, g)
        return (torch.randn(shape, generator=g) * 16).clamp(-448, 448).to(torch.float8_e4m3fn)
    if name.endswith("norm.weight"):
        return (1 + 0.05 * torch.randn(shape, generator=g)).to(DTYPES[dt])
    std = 0.02 if re.search(r"hc_|attn_sink|\.ape$|gate\.bias$", name) else shape[-1] ** -0.5
    return (torch.randn(shape, generator=g) * std).to(DTYPES[dt])


def _ue8m0(rows: int, cols: int, exponent: int, g: torch.Generator) -> torch.Tensor:
    jitter = torch.randint(-1, 2, (rows, cols), generator=g)  # scales of 2^(e-1) .. 2^(e+1)
    return (127 + exponent + jitter).to(torch.uint8).view(torch.float8_e8m0fnu)


def generate(out: Path, *, layers: int, experts: int, mtp: int, shard_bytes: int, source: Path = INVENTORY) -> dict:
    """Write the checkpoint to ``out``; returns a summary (tensors, bytes, shards, seconds)."""
    t0 = time.perf_counter()
    config = json.loads((source / "config.json").read_text())
    plan = select(inventory(source), layers=layers, experts=experts, mtp=mtp)
    order = []  # each scale right after its weight, so one shard holds both
    for name in plan:
        stem = name[: -len(".weight")]
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in plan:
            continue
        order += [name, stem + ".scale"] if name.endswith(".weight") and stem + ".scale" in plan else [name]
    shards, size = [[]], 0
    for name in order:
        nbytes = math.prod(plan[name][1]) * BYTES[plan[name][0]]
        if size and size + nbytes > shard_bytes and not name.endswith(".scale"):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total, scales = {}, 0, {}
    top_k = int(config["num_experts_per_tok"])
    for i, names in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: make(n, *plan[n], scales, top_k=top_k, experts=experts) for n in names}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, fname))
        print(f"  {fname}: {len(names)} tensors", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=2))
    ratios, real_layers = config["compress_ratios"], int(config["num_hidden_layers"])
    config.update(num_hidden_layers=layers, n_routed_experts=experts, num_nextn_predict_layers=mtp,
                  compress_ratios=ratios[:layers] + ratios[real_layers: real_layers + mtp],
                  num_hash_layers=min(int(config.get("num_hash_layers", 3)), layers))
    config.pop("reap_pruning", None)
    for key in [k for k in config if k.startswith("dspark_")]:
        config.pop(key)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return {"tensors": len(plan), "bytes": total, "shards": len(shards), "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=160, help="routed experts per layer (real: 160)")
    ap.add_argument("--mtp", type=int, default=1, help="MTP draft layers to include (kept in packs, not run)")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--inventory", type=Path, default=INVENTORY)
    a = ap.parse_args()
    s = generate(a.out, layers=a.layers, experts=a.experts, mtp=a.mtp, shard_bytes=int(a.shard_gb * 2**30),
                 source=a.inventory)
    print(f"wrote {a.out}: {s['tensors']} tensors, {s['bytes'] / 1e9:.2f} GB in {s['shards']} shards, "
          f"{s['seconds']:.1f} s")


if __name__ == "__main__":
    main()
