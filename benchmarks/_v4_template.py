"""A DeepSeek-V4 model of any depth and expert count built from a small template pack, for decode timing.

Writing, splitting and loading a 43-layer checkpoint takes longer than a GPU call allows, and every
V4-Flash layer of one kind has the same shapes. So ``benchmarks/v4_decode.py --layers N
--experts-per-layer E`` splits a small checkpoint holding one layer of each (kind, routing)
combination (``gen_v4_checkpoint.py --layers 5``: sliding hash-routed 0-1, CSA hash-routed 2, HCA 3,
CSA 4) and loads rank weights shaped like the real N-layer model:

=====================  ======================================================================
what                   how
=====================  ======================================================================
config                 the template's, with ``num_hidden_layers`` N, ``n_routed_experts`` E, no
                       MTP, and ``compress_ratios`` / ``num_hash_layers`` from a kinds config
                       (default: the real V4-Flash release's: 2 sliding, 21 CSA, 20 HCA, 3 hashed)
plan                   resolved from a header-only virtual checkpoint of the N-layer tensor
                       set (``shardsmith plan`` would print the same), at the pack's world size
layer ``i``'s tensors  the template layer of the same compress ratio and routing (identity for
                       ``i`` < the template's layers when they match); each layer gets its own
                       device copy when assigned, so nothing is shared on the GPU
expert ``j``           template expert ``j mod E_t`` (a fresh host copy per layer: distinct
                       memory, pinnable); when E != E_t the router rows are drawn afresh with
                       the template's mean and std (copies would tie) and ``tid2eid`` redrawn
=====================  ======================================================================

Values are random either way (the template is ``gen_v4_checkpoint.py``'s), so routing and timing
behave as in a generated N-layer checkpoint; what is not exercised is reading N layers from disk.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8, "F16": 2}
LAYER = re.compile(r"^layers\.(\d+)\.")
EXPERT = re.compile(r"\.experts\.(\d+)\.")
REAL_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "real-inventories" / \
    "deepseek-v4-flash-0731-reap160" / "config.json"


def _headers(ckpt: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the checkpoint at ``ckpt`` (shards or header-only ``.json``): name -> (dtype, shape)."""
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")) + sorted(ckpt.glob("*.safetensors.json")):
        if f.suffix == ".json":
            header = json.loads(f.read_text())
        else:
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        out.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


def target_config(template: dict, *, layers: int, experts: int, kinds: dict) -> dict:
    """The N-layer config: the template's dims, the kinds config's per-layer compress ratios and hashing."""
    ratios = list(kinds["compress_ratios"])
    if layers > len(ratios):
        raise SystemExit(f"kinds config has {len(ratios)} compress ratios, {layers} layers asked")
    cfg = dict(template, num_hidden_layers=layers, n_routed_experts=experts, num_nextn_predict_layers=0,
               compress_ratios=ratios[:layers],
               num_hash_layers=min(int(kinds.get("num_hash_layers", 0)), layers))
    return cfg


def layer_templates(template: dict, target: dict) -> list[int]:
    """For each target layer, the template layer of the same (compress ratio, hash-routed) kind.

    Raises:
        SystemExit: a kind the template does not have (listed).
    """
    def kind(cfg: dict, i: int) -> tuple[int, bool]:
        return int(cfg["compress_ratios"][i]), i < int(cfg.get("num_hash_layers", 0))

    have: dict[tuple[int, bool], int] = {}
    for i in range(int(template["num_hidden_layers"])):
        have.setdefault(kind(template, i), i)
    out, missing = [], set()
    for i in range(int(target["num_hidden_layers"])):
        k = kind(target, i)
        same = i < int(template["num_hidden_layers"]) and kind(template, i) == k
        out.append(i if same else have.get(k, -1))
        if out[-1] < 0:
            missing.add(k)
    if missing:
        raise SystemExit(f"the template checkpoint has no layer of kind (compress ratio, hashed) {sorted(missing)}; "
                         "make it with gen_v4_checkpoint.py --layers 5")
    return out


def virtual_checkpoint(template_ckpt: Path, out: Path, config: dict, templates: list[int]) -> Path:
    """Write a header-only checkpoint of the target's tensor set (config, index, one shard header)."""
    src = _headers(template_ckpt)
    experts = int(config["n_routed_experts"])
    tensors: dict[str, tuple[str, list[int]]] = {}
    for name, (dt, shape) in src.items():
        m = LAYER.match(name)
        if name.startswith("mtp.") or (m and int(m.group(1)) not in templates):
            continue
        e = EXPERT.search(name)
        if e and int(e.group(1)) != 0:
            continue
        if re.search(r"\.ffn\.gate\.(weight|bias)$", name):
            shape = [experts, *shape[1:]]
        targets = [i for i, t in enumerate(templates) if m and t == int(m.group(1))] if m else [None]
        for i in targets:
            base = name if i is None else LAYER.sub(f"layers.{i}.", name)
            for j in range(experts) if e else [None]:
                tensors[base if j is None else base.replace(".experts.0.", f".experts.{j}.")] = (dt, list(shape))
    header, off = {}, 0
    for name in sorted(tensors):
        dt, shape = tensors[name]
        n = math.prod(shape) * BYTES[dt]
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    out.mkdir(parents=True, exist_ok=True)
    shard = "model-00001-of-00001.safetensors"
    (out / f"{shard}.json").write_text(json.dumps(header))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": off},
                                                                  "weight_map": dict.fromkeys(header, shard)}))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


class TemplateWeights:
    """:class:`~shardsmith.runtime.engine.loader.RankWeights` of the target model, drawn from ``base``
    (the template pack's rank weights) by layer template (module table). ``banks()`` is built once
    and kept (offloaded runs pin those arrays)."""

    def __init__(self, base, template_ckpt: Path, work: Path, *, layers: int, experts: int, kinds: dict) -> None:
        from shardsmith.checkpoint.validate import open_checkpoint
        from shardsmith.plans import plan_checkpoint

        self.base, self.rank, self.world_size, self.root = base, base.rank, base.world_size, base.root
        self.config = target_config(base.config, layers=layers, experts=experts, kinds=kinds)
        self.templates = layer_templates(base.config, self.config)
        vdir = virtual_checkpoint(template_ckpt, work / f"virtual-{layers}l-{experts}e-rank{self.rank}", self.config,
                                  self.templates)
        self.plan = plan_checkpoint(open_checkpoint(vdir), base.world_size)
        self.experts, self.base_experts = experts, int(base.config["n_routed_experts"])
        self._banks = None

    def _source(self, name: str) -> str:
        m = LAYER.match(name)
        return LAYER.sub(f"layers.{self.templates[int(m.group(1))]}.", name) if m else name

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t [E_t, ...]`` as ``[E, ...]``: row ``j`` is row ``j mod E_t`` (a fresh copy)."""
        return t.index_select(0, torch.arange(self.experts) % self.base_experts)

    def dense(self) -> dict[str, torch.Tensor]:
        base = self.base.dense()
        out = {}
        for name, tp in self.plan.tensors.items():
            if tp.bank is not None:
                continue
            t = base[self._source(name)]
            g = torch.Generator().manual_seed(int(LAYER.match(name).group(1)) if LAYER.match(name) else 0)
            if self.experts != self.base_experts and re.search(r"\.ffn\.gate\.(weight|bias)$", name):
                # fresh router rows with the template's statistics (copied rows would tie, routing in clusters)
                f = t.float()
                t = (torch.randn(self.experts, *t.shape[1:], generator=g) * f.std() + f.mean()).to(t.dtype)
            elif self.experts != self.base_experts and name.endswith(".ffn.gate.tid2eid"):
                t = torch.rand(t.shape[0], self.experts, generator=g).topk(t.shape[1], dim=-1).indices.to(t.dtype)
            out[name] = t
        return out

    def banks(self) -> dict[str, dict[str, torch.Tensor]]:
        if self._banks is None:
            base = self.base.banks()
            self._banks = {f"layers.{i}": {a: self._rows(t) for a, t in base[f"layers.{src}"].items()}
                           for i, src in enumerate(self.templates)}
        return self._banks


def tiny_template(work: Path) -> Path:
    """The tiny DeepSeek-V4 checkpoint with one layer of each (kind, routing), as the template mode
    needs (``work/tiny-template``, written once): CPU rehearsals of the template benchmarks."""
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4

    ckpt = work / "tiny-template"
    if not (ckpt / "config.json").is_file():
        tiny_deepseek_v4(ckpt, layers=5, hash_layers=3, mtp_layers=0, compress_ratios=(0, 0, 4, 128, 4, 0))
    return ckpt
