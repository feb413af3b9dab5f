"""Randomized fault injection: >= 300 seeded trials, each a fresh copy of a tiny pack damaged once.

Every trial must end as ``verify`` exit 2 naming the problem (never a traceback, never "intact"),
in one of four modes (plain, ``--deep``, ``--against SOURCE``, ``--expect DIGEST``), and the
loader (:func:`shardsmith.pack.reader.open_rank`, then ``dense()`` and ``banks()`` with the default
verified load) may only fail with a :class:`~shardsmith.errors.ShardsmithError`; for damage to
anything a rank loads, it must refuse.

Fault kinds: the single-fault kinds of ``test_verify_faults.py`` (flipped byte, truncated, missing,
extra or swapped file, a rank of another world size), plus symbolic links (a file, ``pack.yaml``, a
manifest or a whole rank directory replaced by a link to an identical copy outside the pack; a link
to ``/etc/passwd``), paths outside the pack (``copied_files`` and rank file paths, hashes forged),
truncated and bit-flipped manifests, keys renamed and values of the wrong type with every hash
recomputed ("forged"), ``plan.json`` edits with every hash recomputed, and ``pack.yaml`` fields that
other evidence contradicts. Whitespace-only edits of a YAML manifest are not damage (the own hash
is over the parsed document, ``manifests/README.md``), so truncations always cut a visible character
and bit flips that parse to the same document are drawn again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shardsmith.cli import app
from shardsmith.errors import IntegrityError, RuntimeLoadError, ShardsmithError, exit_code_for
from shardsmith.pack.format import hash_file, root_digest
from shardsmith.pack.reader import open_rank
from shardsmith.testing.forge import forge, load as _load
from shardsmith.writer.split import split_checkpoint

TRIALS = 330
runner = CliRunner()


@pytest.fixture(scope="module")
def packs(tiny, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fuzz-packs")
    out = {}
    for name in ("mixtral", "deepseek-v4"):
        src = tiny(name)
        for tp in (2, 4):
            split_checkpoint(src, root / f"{name}-tp{tp}", world_size=tp)
        out[name] = (src, root / f"{name}-tp2", root / f"{name}-tp4")
    return out


# ------------------------------------------------------------------ helpers


def _mappings(obj, path=()):
    if isinstance(obj, dict):
        yield path, obj
        for k, v in obj.items():
            yield from _mappings(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _mappings(v, path + (i,))


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list) and obj and not all(isinstance(x, int) for x in obj):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    else:
        yield path, obj


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _files(pack: Path, *, weights_only: bool = False) -> list[Path]:
    out = sorted(p for p in pack.rglob("*") if p.is_file())
    return [p for p in out if p.suffix == ".safetensors"] if weights_only else out


def _flip(path: Path, offset: int, mask: int = 0x5A) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def _rel(pack: Path, p: Path) -> str:
    return p.relative_to(pack).as_posix()


# ------------------------------------------------------------------ fault kinds: each returns (needles, loader_refuses)


def flip_weight(rng, pack, ctx):
    f = rng.choice(_files(pack, weights_only=True) + [pack / "config.json"])
    _flip(f, rng.randrange(f.stat().st_size))
    return [_rel(pack, f)], True


def truncate(rng, pack, ctx):
    f = rng.choice(_files(pack))
    data = f.read_bytes()
    if f.suffix == ".yaml":
        data = data[: rng.randrange(len(data.rstrip()))]  # cut at least one visible character
    else:
        data = data[: rng.randrange(len(data))]
    f.write_bytes(data)
    return [_rel(pack, f)], True


def delete(rng, pack, ctx):
    f = rng.choice(_files(pack) + [p for p in pack.iterdir() if p.is_dir()])
    shutil.rmtree(f) if f.is_dir() else f.unlink()
    return [_rel(pack, f)], True


def extra(rng, pack, ctx):
    where = rng.choice([pack, *[p for p in pack.iterdir() if p.is_dir()]])
    name = rng.choice(["stray.safetensors", "notes.txt", "tokenizer.json", "junk"])
    (where / name).mkdir() if name == "junk" else (where / name).write_bytes(os.urandom(rng.randrange(1, 64)))
    return [_rel(pack, where / name)], False


def swap_ranks(rng, pack, ctx):
    name = rng.choice([p.name for p in _files(pack, weights_only=True)])
    a, b = pack / "rank-0-of-2" / name, pack / "rank-1-of-2" / name
    tmp = a.with_suffix(".tmp")
    a.rename(tmp), b.rename(a), tmp.rename(b)
    return [f"rank-0-of-2/{name}", f"rank-1-of-2/{name}"], True


def other_world_rank(rng, pack, ctx):
    r = rng.randrange(4)
    replace = rng.random() < 0.5
    if replace:
        shutil.rmtree(pack / f"rank-{r % 2}-of-2")
        shutil.copytree(ctx["tp4"] / f"rank-{r}-of-4", pack / f"rank-{r % 2}-of-2")
        return [f"rank-{r % 2}-of-2/manifest.yaml"], True
    shutil.copytree(ctx["tp4"] / f"rank-{r}-of-4", pack / f"rank-{r}-of-4")
    return ["world_size=4"], False


def symlink_file(rng, pack, ctx):
    f = rng.choice(_files(pack))
    copy = ctx["outside"] / f"copy-{rng.randrange(1 << 30)}"
    shutil.copyfile(f, copy)
    f.unlink()
    f.symlink_to(copy)
    return ["symbolic link"], True


def symlink_rank_dir(rng, pack, ctx):
    d = pack / f"rank-{rng.randrange(2)}-of-2"
    copy = ctx["outside"] / f"rank-{rng.randrange(1 << 30)}"
    shutil.copytree(d, copy)
    shutil.rmtree(d)
    d.symlink_to(copy, target_is_directory=True)
    return ["symbolic link"], True


def symlink_extra(rng, pack, ctx):
    where = rng.choice([pack, pack / "rank-0-of-2"])
    (where / rng.choice(["passwd", "tokenizer.json", "extra.safetensors"])).symlink_to("/etc/passwd")
    return ["symbolic link"], False


def outside_copied(rng, pack, ctx):
    target = ctx["outside"] / "config.json"
    shutil.copyfile(pack / "config.json", target)
    rel = rng.choice([os.path.relpath(target, pack), "../" * 12 + "etc/passwd", str(target), "", "./config.json"])
    size, digest = hash_file(Path(os.path.normpath(pack / rel))) if rel and Path(os.path.normpath(pack / rel)).is_file() else (1, "0" * 32)

    def edit(d):
        d["copied_files"].append({"path": rel, "bytes": size, "xxh3_128": digest})
    forge(pack, doc=edit)
    return ["copied_files"], True


def outside_rank_path(rng, pack, ctx):
    r = rng.randrange(2)
    d = pack / f"rank-{r}-of-2"
    m = _load(d / "manifest.yaml")
    i = rng.randrange(len(m["files"]))
    src = d / m["files"][i]["path"]
    target = ctx["outside"] / f"x{rng.randrange(1 << 30)}.safetensors"
    shutil.copyfile(src, target)
    rel = rng.choice([os.path.relpath(target, d), str(target), "../" + src.name, "sub/" + src.name])

    def edit(rank, m):
        if rank == r:
            m["files"][i]["path"] = rel
    forge(pack, rank=edit)
    return [f"files[{i}].path"], True


def manifest_bitflip(rng, pack, ctx):
    f = rng.choice([pack / "pack.yaml", *pack.glob("rank-*/manifest.yaml")])
    text = f.read_bytes()
    load = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    before = yaml.load(text, Loader=load)
    for _ in range(100):
        i, bit = rng.randrange(len(text)), 1 << rng.randrange(7)
        new = text[:i] + bytes([text[i] ^ bit]) + text[i + 1:]
        try:
            if yaml.load(new, Loader=load) == before:
                continue
        except Exception:
            pass
        f.write_bytes(new)
        return [_rel(pack, f)], True
    raise AssertionError("no effective bit flip found")


def _forge_leaf(rng, pack, change):
    """Forge one edit of ``pack.yaml`` or a rank manifest, hashes recomputed; returns the document's name."""
    target = rng.choice(["pack.yaml", "rank-0-of-2", "rank-1-of-2"])
    if target == "pack.yaml":
        forge(pack, doc=lambda d: change(d, "pack"))
        return "pack.yaml"
    r = int(target[5])
    forge(pack, rank=lambda rank, m: change(m, "rank") if rank == r else None)
    return f"{target}/manifest.yaml"


def renamed_key(rng, pack, ctx):
    def change(d, kind):
        m = rng.choice([m for _, m in _mappings(d) if m])
        k = rng.choice(list(m))
        j = rng.randrange(len(k))
        m[k[:j] + "%s" + k[j + 1:]] = m.pop(k)  # bytes -> byt%s, as a bit flip in a key
    return [_forge_leaf(rng, pack, change), "field"], True


WRONG = {str: [7, [], {}, None, True, 1.5], int: ["x", -1, 2 ** 70, 1.5, True, None, [1]], list: ["x", 3, {}, None, [[]]]}


def wrong_type(rng, pack, ctx):
    def change(d, kind):
        leaves = [(p, v) for p, v in _leaves(d) if p != ("manifest_xxh3_128",)]  # the own hash is recomputed
        p, v = rng.choice(leaves)
        _set(d, p, rng.choice(WRONG[type(v)]))
    return [_forge_leaf(rng, pack, change), "field"], True


def plan_edit(rng, pack, ctx):
    def edit(d):
        names = list(d["tensors"])
        t = d["tensors"][rng.choice(names)]
        how = rng.randrange(7)
        if how == 0:
            t["shard_dim"] = len(t["shape"]) + rng.randrange(2)
        elif how == 1:
            t["dtype"] = rng.choice(["F99", 3, None])
        elif how == 2:
            t["ranges"] = t["ranges"][:-1]
        elif how == 3:
            t["shape"] = [x + 1 for x in t["shape"]] or [1]
        elif how == 4:
            d["world_size"] = rng.choice([1, 3, "2", 16777216])
        elif how == 5:
            del d["tensors"][rng.choice(names)]
        else:
            t["ranges"] = [[[s + 1, n] for s, n in rr] for rr in t["ranges"]]
    forge(pack, plan=edit)
    return ["plan.json", "from the plan"], True


def contradicted_field(rng, pack, ctx):
    how = rng.randrange(6)

    def edit(d):
        if how == 0:
            d["ranks"][0]["rank"], d["ranks"][1]["rank"] = 1, 0
        elif how == 1:
            d["plan"]["file"] = rng.choice(["plan2.json", "../plan.json", "config.json"])
        elif how == 2:
            d["ranks_written"] = rng.choice([[0], [1], [0, 1, 2], []])
        elif how == 3:
            d["world_size"] = rng.choice([16777216, 3, 1, 0])
        elif how == 4:
            d["ranks"][1]["dir"] = "rank-0-of-2"
        else:
            d["ranks"][rng.randrange(2)]["manifest_xxh3_128"] = None
    forge(pack, doc=edit)
    return ["pack.yaml", "field"], True


def renamed_rank_dirs(rng, pack, ctx):
    a, b = pack / "rank-0-of-2", pack / "rank-1-of-2"
    tmp = pack / "tmp-rank"
    a.rename(tmp), b.rename(a), tmp.rename(b)
    return ["rank expected"], True


KINDS = [flip_weight, truncate, delete, extra, swap_ranks, other_world_rank, symlink_file, symlink_rank_dir,
         symlink_extra, outside_copied, outside_rank_path, manifest_bitflip, renamed_key, wrong_type, plan_edit,
         contradicted_field, renamed_rank_dirs]


def _verify(pack: Path, args: list[str]) -> list[str]:
    r = runner.invoke(app, ["verify", str(pack), *args, "--json"])
    assert isinstance(r.exception, IntegrityError) and exit_code_for(r.exception) == 2, (r.exception, r.output[-3000:])
    return json.loads(r.stdout)["problems"]


def _load_all(pack: Path, world: int) -> bool:
    """Open and map every rank with the default verified load; True if some rank was refused."""
    refused = False
    for r in range(world):
        try:
            rp = open_rank(pack, r, world)
            rp.dense(), rp.banks()
        except (IntegrityError, RuntimeLoadError, ShardsmithError) as e:
            assert isinstance(e, ShardsmithError)
            refused = True
    return refused


def test_random_faults(packs, tmp_path: Path) -> None:
    rng = random.Random(20260117)
    seen: dict[str, int] = {}
    for trial in range(TRIALS):
        name = "deepseek-v4" if rng.random() < 0.25 else "mixtral"  # v4 (FP8, FP4 banks) costs 4x the CPU
        src, tp2, tp4 = packs[name]
        kind = KINDS[trial % len(KINDS)] if trial < 2 * len(KINDS) else rng.choice(KINDS)
        base = tmp_path / f"t{trial}"
        pack, outside = base / "pack", base / "outside"
        outside.mkdir(parents=True)
        shutil.copytree(tp2, pack, symlinks=True)
        needles, must_refuse = kind(rng, pack, {"tp4": tp4, "outside": outside})
        mode = rng.choice([[], ["--deep"], ["--against", str(src)], ["--expect", root_digest((tp2 / "pack.yaml").read_bytes())]])
        problems = _verify(pack, mode)
        text = "\n".join(problems)
        needles += ["root digest expected"] if mode[:1] == ["--expect"] else []
        assert problems and any(n in text for n in needles), (trial, kind.__name__, mode, needles, text[:3000])
        refused = _load_all(pack, 2)
        assert refused or not must_refuse, (trial, kind.__name__, "loaded a damaged pack", text[:2000])
        seen[kind.__name__] = seen.get(kind.__name__, 0) + 1
        shutil.rmtree(base)
    assert len(seen) == len(KINDS) and sum(seen.values()) >= 300
