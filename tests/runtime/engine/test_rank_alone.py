"""Rank-alone runs (one rank of a TP world on a fake process group) issue exactly the collectives a
real gloo world's rank issues: same ops, same order, same sizes, for every family at world sizes 2 and 4.

The gloo ranks run with the small-tensor gather path off (``gloo_gather_max=0``), so an all-reduce is
an all-reduce, as on NCCL, the backend the rank-alone runs stand in for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardsmith.errors import UsageError
from shardsmith.runtime.engine.rank_alone import (LINKS, CollectiveCall, CollectiveLog, Link, collective_seconds,
                                                  init_rank_alone, is_rank_alone)
from shardsmith.testing.ranks import run_gloo

FAMILIES = ("mixtral", "qwen3-moe", "deepseek-v3", "deepseek-v4", "gpt-oss")
PROMPT = [3, 17, 42, 99, 5, 8, 61]


@pytest.fixture(scope="module")
def packs(tiny, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    """``{(family, world_size): pack}`` for every family at world sizes 2 and 4."""
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("rank-alone")
    sources = {name: tiny(name) for name in FAMILIES if name != "gpt-oss"}
    sources["gpt-oss"] = tiny_gpt_oss(root / "gpt-oss-src")
    out = {}
    for name, src in sources.items():
        for ws in (2, 4):
            out[name, ws] = root / f"{name}-tp{ws}"
            split_checkpoint(src, out[name, ws], world_size=ws)
    return out


def _steps(pack: str, rank: int, world_size: int) -> list[CollectiveCall]:
    """Build ``rank``'s model of ``pack`` and log the collectives of a prefill and two decode steps."""
    from shardsmith.runtime.engine.build import build_model
    from shardsmith.runtime.engine.loader import load_rank_weights

    weights = load_rank_weights(pack, rank=rank, world_size=world_size)
    model, *_ = build_model(weights, rank=rank, device=torch.device("cpu"), dtype=torch.float32, max_seq_len=32)
    with CollectiveLog() as log:
        logits = model(torch.tensor(PROMPT), 0)
        for pos in range(len(PROMPT), len(PROMPT) + 2):
            logits = model(logits[-1:].argmax(-1), pos)
    return log.calls


def _gloo_steps(packs: list[str], rank: int, world_size: int) -> list[list[CollectiveCall]]:
    return [_steps(p, rank, world_size) for p in packs]


def _alone(pack: Path, rank: int, world_size: int) -> list[CollectiveCall]:
    init_rank_alone(rank, world_size)
    try:
        assert is_rank_alone()
        return _steps(str(pack), rank, world_size)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_alone_issues_the_collectives_of_a_gloo_rank(packs, world_size: int, monkeypatch) -> None:
    monkeypatch.setenv("SHARDSMITH_TUNING", "gloo_gather_max=0")  # the spawned ranks read it at import
    ordered = [str(packs[name, world_size]) for name in FAMILIES]
    real = run_gloo(_gloo_steps, world_size, ordered, timeout=600)
    for name, gloo_calls in zip(FAMILIES, real):
        assert gloo_calls, name
        ops = {c.op for c in gloo_calls}
        assert ops == {"allreduce", "allgather"}, (name, ops)  # row-parallel sums; the LM head's vocabulary shares
        assert all(c.group_size == world_size for c in gloo_calls)
        for rank in (0, world_size - 1):
            assert _alone(packs[name, world_size], rank, world_size) == gloo_calls, (name, rank)


def test_engine_refuses_a_rank_alone_group(packs) -> None:
    """``serve`` builds its engine through Engine.load: a fake group cannot reach a user."""
    from shardsmith.runtime.engine.engine import Engine

    init_rank_alone(0, 2)
    try:
        with pytest.raises(UsageError, match="rank-alone"):
            Engine.load(packs["mixtral", 2], rank=0, world_size=2, max_seq_len=32)
        with pytest.raises(UsageError, match="already exists"):
            init_rank_alone(1, 2)
    finally:
        dist.destroy_process_group()
    assert not is_rank_alone()
    with pytest.raises(UsageError, match=r"rank 2 is not in \[0, 2\)"):
        init_rank_alone(2, 2)


def test_collective_seconds_prices_each_call_on_the_ring() -> None:
    link = Link("test", latency_s=10e-6, bytes_per_s=1e9, source="made up for the arithmetic")
    calls = [CollectiveCall("allreduce", 4000, (1, 1000), "float32", 4),    # 2 * 3/4 * 4000 = 6000 bytes
             CollectiveCall("allgather", 1000, (1, 250), "float32", 4),     # 3 * 1000
             CollectiveCall("broadcast", 500, (125,), "float32", 2)]        # 500
    assert collective_seconds(calls, link) == pytest.approx(3 * 10e-6 + (6000 + 3000 + 500) / 1e9)
    assert collective_seconds([], link) == 0.0
    with pytest.raises(UsageError, match="alltoall"):
        collective_seconds([CollectiveCall("alltoall", 8, (2,), "float32", 2)], link)
    # decode-sized messages are latency-bound on both links
    small = [CollectiveCall("allreduce", 2 * 4096, (1, 4096), "bfloat16", 2)]
    for link in LINKS.values():
        assert link.latency_s <= collective_seconds(small, link) < 1.5 * link.latency_s
