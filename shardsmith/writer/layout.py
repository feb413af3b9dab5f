"""Where every rank-local shard goes: the files of a pack, their entries and byte offsets.

Computed from the resolved plan alone (no tensor data), so ``split`` can lay every file out
before reading a byte and ``verify`` can recompute what each rank must hold.

Per rank ``r`` of ``N`` (directory ``rank-<r>-of-<N>/``):

- ``dense-00001.safetensors`` ...: every non-bank tensor's shard under its source name, in
  checkpoint order, data 64-byte aligned; a new file starts when the next tensor would pass
  ``max_file_bytes`` (a tensor larger than that gets a file of its own).
- ``experts-<layer>.safetensors``: one per MoE layer, arrays ``gate_up``, ``gate_up_scale``,
  ``down``, ``down_scale`` (those present) in that order, each 4096-byte aligned; expert ``e``'s
  segment ``s`` at ``(e * n_segments + s) * slot_bytes`` inside its array.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plans.resolve import ResolvedPlan
from shardsmith.pack.banks import bank_specs, expected_entries
from shardsmith.pack.format import BANK_ALIGN, DENSE_ALIGN, FORMAT, FORMAT_VERSION, Entry, FileLayout, layout_file, rank_dir

DEFAULT_MAX_FILE_BYTES = 4 << 30


@dataclass(frozen=True, slots=True)
class PackFile:
    """One weight file of one rank.

    Attributes:
        path: POSIX path relative to the pack root (``rank-0-of-2/dense-00001.safetensors``).
        rank: the rank; kind: ``dense`` or ``bank``; layer: the layer key of a bank, else ``None``.
        layout: header, entries and size.
    """

    path: str
    rank: int
    kind: str
    layer: str | None
    layout: FileLayout


@dataclass(frozen=True, slots=True)
class Target:
    """Where one rank's shard of one source tensor goes: ``file`` (a :attr:`PackFile.path`) at
    absolute byte ``offset``, ``nbytes`` long."""

    rank: int
    file: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PackLayout:
    """Every file of the selected ranks and every shard's destination.

    Attributes:
        world_size: ranks in the pack; ranks: the ranks laid out (sorted).
        files: by path, dense files first then banks, per rank.
        targets: per source tensor (checkpoint order), its destinations on the selected ranks.
    """

    world_size: int
    ranks: tuple[int, ...]
    files: dict[str, PackFile]
    targets: dict[str, tuple[Target, ...]]


def _meta(rank: int, world_size: int, kind: str, layer: str | None = None) -> dict[str, str]:
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "rank": str(rank),
            "world_size": str(world_size), "kind": kind}
    if layer is not None:
        meta["layer"] = layer
    return meta


def layout_pack(plan: ResolvedPlan, *, ranks: tuple[int, ...] | None = None,
                max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> PackLayout:
    """Lay out the files of ``ranks`` (default: all) for ``plan``.

    Raises:
        PlanError: experts of one layer with differing shard shapes (from ``bank_specs``).
    """
    world = plan.world_size
    ranks = tuple(sorted(set(range(world) if ranks is None else ranks)))
    files: dict[str, PackFile] = {}
    targets: dict[str, list[Target]] = {n: [] for n in plan.tensors}
    for r in ranks:
        d = rank_dir(r, world)
        dense, banks = expected_entries(plan, r)
        groups: list[list[Entry]] = [[]]
        size = 0
        for e in dense.values():
            need = e.nbytes + -size % DENSE_ALIGN
            if groups[-1] and size + need > max_file_bytes:
                groups.append([])
                size, need = 0, e.nbytes
            groups[-1].append(e)
            size += need
        for i, group in enumerate(g for g in groups if g):
            path = f"{d}/dense-{i + 1:05d}.safetensors"
            lay = layout_file(group, align=DENSE_ALIGN, metadata=_meta(r, world, "dense"))
            files[path] = PackFile(path, r, "dense", None, lay)
            for p in lay.entries:
                targets[p.name].append(Target(r, path, p.offset, p.nbytes))
        specs = {layer: {s.name: s for s in ss} for layer, ss in bank_specs(plan, r).items()}
        for layer, entries in banks.items():
            path = f"{d}/experts-{layer}.safetensors"
            lay = layout_file(entries, align=BANK_ALIGN, metadata=_meta(r, world, "bank", layer))
            files[path] = PackFile(path, r, "bank", layer, lay)
            for p in lay.entries:
                spec = specs[layer][p.name]
                for (expert, seg), src in spec.members.items():
                    targets[src].append(Target(r, path, p.offset + spec.slot_offset(expert, seg), spec.slot_nbytes))
    return PackLayout(world, ranks, files, {n: tuple(t) for n, t in targets.items()})
