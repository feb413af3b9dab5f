"""Shared fixtures: tiny real-format checkpoints and the real SmolLM2 MoE demo checkpoint.

Built once per test session. ``$SHARDSMITH_CACHE`` (set by ``.ci/run``) keeps the demo checkpoint
between runs, keyed by content, so CI builds it once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

# Triton reads TRITON_INTERPRET once, when it is first imported. Without CUDA the kernel tests run
# their kernels under Triton's CPU interpreter, so it is set here, before any test module (or a
# shardsmith module a test imports) imports triton: in whatever order the files are collected.
# Kernels stay off on a CPU unless a test forces them (``auto`` is CUDA only, interpreter or not).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"



@pytest.fixture(autouse=True)
def _library_caches_restored() -> Iterator[None]:
    """Opening a compile cache in-process points ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``
    at a test's temporary folder; undone after every test, so no later test (nor a server it starts,
    which would take them for the user's own and leave its cache unmanaged) sees them."""
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    before = {n: os.environ.get(n) for n in names}
    yield
    for n, v in before.items():
        if v is None:
            os.environ.pop(n, None)
        else:
            os.environ[n] = v


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Cache directory for downloaded wheels and built demo checkpoints."""
    env = os.environ.get("SHARDSMITH_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("shardsmith-cache")


@pytest.fixture(scope="session")
def smollm2_bf16(demo_cache: Path) -> Path:
    """The real SmolLM2-135M as an 8-expert Mixtral checkpoint, bf16."""
    from shardsmith.demo import build_demo_checkpoint

    return build_demo_checkpoint(demo_cache / "demo" / "smollm2-moe-bf16", cache_dir=demo_cache)


@pytest.fixture(scope="session")
def smollm2_fp8(demo_cache: Path) -> Path:
    """The same with block-FP8 attention and experts."""
    from shardsmith.demo import build_demo_checkpoint

    return build_demo_checkpoint(demo_cache / "demo" / "smollm2-moe-fp8", fp8=True, cache_dir=demo_cache)


@pytest.fixture(scope="session")
def smollm2_pack(smollm2_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``smollm2_pack(world_size)`` -> a pack of the bf16 SmolLM2 MoE, split once per session.

    Tests must not modify it: copy first.
    """
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("smollm2-packs")
    built: dict[int, Path] = {}

    def get(world_size: int) -> Path:
        if world_size not in built:
            out = root / f"tp{world_size}"
            split_checkpoint(smollm2_bf16, out, world_size=world_size)
            built[world_size] = out
        return built[world_size]

    return get


TINY = {
    "mixtral": ("tiny_mixtral", {}),
    "mixtral-fp8": ("tiny_mixtral", {"fp8": True}),
    "mixtral-tied": ("tiny_mixtral", {"tie_embeddings": True}),
    "qwen3-moe": ("tiny_qwen_moe", {}),
    "qwen2-moe": ("tiny_qwen_moe", {"qwen2": True, "dense_layers": (1,)}),
    "deepseek-v3": ("tiny_deepseek_v3", {}),
    "deepseek-v4": ("tiny_deepseek_v4", {}),
}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny(name)`` -> path of a tiny checkpoint of :data:`TINY` (built once per session).

    Tests must not modify these directories: copy first (``shutil.copytree``).
    """
    import shardsmith.testing as builders

    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            fn, kw = TINY[name]
            built[name] = getattr(builders, fn)(root / name, **kw)
        return built[name]

    return get


REAL_V4 = Path(__file__).resolve().parents[1].parent / "shared" / "real-inventories" / "deepseek-v4-flash-0731-reap160"


@pytest.fixture(scope="session")
def real_v4():
    """The real DeepSeek-V4-Flash inventory (config, index, 48 raw headers), opened header-only."""
    from shardsmith.checkpoint import open_checkpoint

    if not REAL_V4.is_dir():
        pytest.skip(f"needs the full 48-header DeepSeek-V4-Flash inventory at {REAL_V4} (a checkout with shared/ "
                    f"beside it); tests/checkpoint/test_real_sample.py checks the same shapes on the 3-header sample "
                    f"shipped in tests/fixtures/")
    return open_checkpoint(REAL_V4)


@pytest.fixture(scope="session")
def tiny_v4_packs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The tiny DeepSeek-V4 checkpoint split at world sizes 1, 2 and 4: ``{world_size: pack}``.

    Tests must not modify them.
    """
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("tiny-v4-packs")
    src = tiny_deepseek_v4(root / "src")
    out = {}
    for ws in (1, 2, 4):
        out[ws] = root / f"tp{ws}"
        split_checkpoint(src, out[ws], world_size=ws)
    return out


@pytest.fixture
def use_settings(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``use_settings(fused_experts="kernel", inplace_blocks="4x64")``: set :class:`shardsmith.settings.Settings`
    fields by their environment words for this test (in ``SHARDSMITH_KERNELS`` / ``SHARDSMITH_TUNING``
    or their own variable), keeping every other setting; later calls add to earlier ones, and rank
    processes the test starts inherit them."""
    from shardsmith import settings

    def use(**words: str) -> None:
        for name, value in settings.overrides(**words).items():
            monkeypatch.setenv(name, value)

    return use
