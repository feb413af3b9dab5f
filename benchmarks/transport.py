"""Compression ratio and speed of ``export`` (one rank as ``.tar.zst``) and ``import`` on bf16,
FP8 and FP4 data.

Data is realistic in its bit patterns, not random bytes: BF16 weights are normals (std 0.02),
FP8 weights are normals block-quantized to e4m3 with E8M0 128x128 scales, FP4 weights are normals
group-quantized to e2m1 (two per byte, I8) with 1x32 E8M0 scales
(:mod:`shardsmith.testing.quant`, the reference quantizers). Each checkpoint is a Mixtral-shaped
MoE (``--hidden``, ``--inter``, ``--experts``, ``--layers``), split at TP=1, and rank 0 exported at
zstd levels 1 and 3 with all cores, then imported (hash-checked).

Usage: ``python benchmarks/transport.py [--dir /tmp/shardsmith-transport]``
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import save_results  # noqa: E402


def build(root: Path, kind: str, *, layers: int, experts: int, hidden: int, inter: int) -> Path:
    """A MoE checkpoint whose expert weights are ``kind`` (bf16, fp8 or fp4) data."""
    import torch

    from shardsmith.testing import write_checkpoint
    from shardsmith.testing.quant import quantize_fp4_group, quantize_fp8_block

    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for e in range(experts):
            for w, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
                x = torch.randn(shape, generator=g) * 0.02
                name = f"layers.{layer}.ffn.experts.{e}.{w}"
                if kind == "bf16":
                    tensors[f"{name}.weight"] = x.bfloat16()
                elif kind == "fp8":
                    q, s = quantize_fp8_block(x, ue8m0=True)
                    tensors[f"{name}.weight"], tensors[f"{name}.scale"] = q, s
                else:
                    q, s = quantize_fp4_group(x)
                    tensors[f"{name}.weight"], tensors[f"{name}.scale"] = q, s
    config = {"architectures": ["DeepseekV4ForCausalLM"], "num_attention_heads": 8, "head_dim": 64, "o_groups": 8,
              "o_lora_rank": 64, "hidden_size": hidden, "moe_intermediate_size": inter, "n_routed_experts": experts,
              "quantization_config": {"weight_block_size": [128, 128], "fmt": "e4m3", "scale_fmt": "ue8m0"}}
    return write_checkpoint(root, tensors, config, max_shard_bytes=256 << 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardsmith-transport"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    args = ap.parse_args()
    from shardsmith.writer.split import split_checkpoint
    from shardsmith.writer.transport import export_rank, import_rank

    rows = []
    for kind in ("bf16", "fp8", "fp4"):
        base = args.dir / kind
        shutil.rmtree(base, ignore_errors=True)
        src = build(base / "src", kind, layers=args.layers, experts=args.experts, hidden=args.hidden, inter=args.inter)
        split_checkpoint(src, base / "pack", world_size=1)
        for level in (1, 3):
            arc = base / f"r0-l{level}.tar.zst"
            ex = export_rank(base / "pack", 0, arc, level=level)
            im = import_rank(arc, base / f"imported-l{level}")
            row = {"data": kind, "zstd_level": level, "bytes": ex.raw_bytes, "archive_bytes": ex.archive_bytes,
                   "ratio": round(ex.ratio, 4), "export_seconds": round(ex.seconds, 3),
                   "export_mb_per_s": round(ex.raw_bytes / ex.seconds / 1e6, 1),
                   "import_seconds": round(im.seconds, 3), "import_mb_per_s": round(ex.raw_bytes / im.seconds / 1e6, 1)}
            rows.append(row)
            print(row, file=sys.stderr)
        shutil.rmtree(base)
    print("\n| data | zstd level | MB | ratio | export MB/s | import MB/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['data']} | {r['zstd_level']} | {r['bytes'] / 1e6:.0f} | {r['ratio']:.3f} | {r['export_mb_per_s']:.0f} | "
              f"{r['import_mb_per_s']:.0f} |")
    save_results("transport", rows, extra={"config": vars(args) | {"dir": str(args.dir)}})
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
