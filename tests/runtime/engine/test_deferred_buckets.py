"""Deferred batch buckets: a warm-up that builds only the one-row decode bucket, steps that meanwhile run
through the nearest built bucket (or as several one-row steps), and ``build_bucket`` building the rest,
at world sizes 1 and 2 (every rank chooses the same buckets). Logits equal an engine that built every
bucket first (float32, CPU: the pieces run eagerly)."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from shardsmith.errors import UsageError
from shardsmith.testing.ranks import run_ranks

PROMPTS = [[3, 17, 42, 99, 5], [11, 12, 250], [4, 9, 77]]
SLOTS = 4  # buckets 1, 2, 4


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[int, Path]:
    from shardsmith.testing.tiny import tiny_mixtral
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("deferred")
    src = tiny_mixtral(root / "src", layers=1)
    out = {}
    for ws in (1, 2):
        out[ws] = root / f"tp{ws}"
        split_checkpoint(src, out[ws], world_size=ws)
    return out


def _steps(eng, slots: list[int]) -> torch.Tensor:
    """Prefill ``PROMPTS`` into ``slots`` and run two batched greedy steps; the steps' logits [2, B, V]."""
    last = [eng.prefill(s, p)[-1] for s, p in zip(slots, PROMPTS)]
    out = []
    for i in range(2):
        logits = eng.decode([int(x.argmax()) for x in last], [len(p) + i for p in PROMPTS], slots)
        out.append(logits)
        last = list(logits)
    for s in slots:
        eng.release(s)
    return torch.stack(out)


def _run(rank: int, world_size: int, port: int, pack: str, queue) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        from shardsmith.runtime.engine.engine import Engine

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        eng = Engine.load(pack, rank=rank, world_size=world_size, dtype=torch.float32, max_seq_len=32,
                          max_num_seqs=SLOTS)
        if rank != 0:
            eng.follow()
            return
        eng.warmup(defer_buckets=True)
        report = {"after_warmup": (eng.built_buckets(), eng.pending_buckets)}
        split = _steps(eng, [1, 2, 3])  # only bucket 1 built: each 3-row step runs as three one-row steps
        report["after_split"] = (eng.built_buckets(), eng.pending_buckets, eng.runner.last_rows)
        report["built"] = [eng.build_bucket(slot=3)]
        padded = _steps(eng, [3, 0, 1])  # bucket 4 built (bucket 2 not yet): one step, one padding row
        report["padded_rows"] = eng.runner.last_rows
        report["built"].append(eng.build_bucket(slot=0))
        eng.decode([5, 6], [0, 0], [0, 1])
        report["two_rows"] = eng.runner.last_rows
        for s in (0, 1):
            eng.release(s)
        try:
            eng.build_bucket(slot=0)
        except UsageError as e:
            report["nothing_left"] = str(e)
        report["diff"] = float((split - padded).abs().max())
        eng.shutdown()
        queue.put(("ok", report))
    except Exception:  # noqa: BLE001 - reported to the test
        queue.put(("error", traceback.format_exc()))


@pytest.mark.parametrize("world_size", [1, 2])
def test_deferred_buckets_run_through_built_ones_and_build_on_demand(packs, world_size: int) -> None:
    r = run_ranks(_run, world_size, str(packs[world_size]))
    assert r["after_warmup"] == ([1], [4, 2])  # the warm-up built the one-row bucket; the rest wait, largest first
    assert r["after_split"] == ([1], [4, 2], 1)  # a step the built buckets cannot hold whole builds nothing
    assert r["built"] == [4, 2] and r["padded_rows"] == 4 and r["two_rows"] == 2
    assert r["nothing_left"] == "no decode bucket is waiting to be built"
    assert r["diff"] < 1e-4, r["diff"]  # split into one-row steps or padded to 4: the same logits


# --- a static-core model (DeepSeek-V4): its length buckets built while idle ----------------------------

V4_LEN = 1100  # length buckets 512, 1024, 1100
V4_PROMPT = [(7 * i + 3) % 500 + 2 for i in range(1019)]


@pytest.fixture(scope="module")
def v4_packs(tmp_path_factory) -> dict[int, Path]:
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("deferred-v4")
    src = tiny_deepseek_v4(root / "src", layers=2, mtp_layers=0)
    out = {}
    for ws in (1, 2):
        out[ws] = root / f"tp{ws}"
        split_checkpoint(src, out[ws], world_size=ws)
    return out


def _crossing(eng) -> tuple[torch.Tensor, list, list[int]]:
    """Slot 0 prefilled with ``V4_PROMPT``, then 8 greedy steps across 1024 (positions 1019..1026: length
    buckets 1024, then 1100): their logits, the piece sets those steps built, and the tokens."""
    sets = set(eng.runner.sets)
    last = eng.prefill(0, V4_PROMPT)[-1]
    ids, steps = list(V4_PROMPT), []
    for _ in range(8):
        ids.append(int(last.argmax()))
        last = eng.decode([ids[-1]], [len(ids) - 1], [0])[0]
        steps.append(last)
    eng.release(0)
    return torch.stack(steps), sorted(set(eng.runner.sets) - sets), ids


def _run_v4(rank: int, world_size: int, port: int, pack: str, queue) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        from shardsmith.runtime.engine.engine import Engine

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        eng = Engine.load(pack, rank=rank, world_size=world_size, dtype=torch.float32, max_seq_len=V4_LEN,
                          max_num_seqs=2)
        if rank != 0:
            eng.follow()
            return
        eng.warmup(defer_buckets=True)
        report = {"after_warmup": (eng.built_buckets(), eng.pending_buckets, eng.pending_lengths)}
        held = eng.prefill(1, V4_PROMPT[:9])[-1]  # a sequence in slot 1 while the pieces are built
        report["built"] = [eng.build_bucket(slot=0)]
        report["lengths_then"] = eng.pending_lengths
        while eng.pending_lengths:
            report["built"].append(eng.build_length())
        try:
            eng.build_length()
        except UsageError as e:
            report["nothing_left"] = str(e)
        nxt = int(held.argmax())
        report["held_diff"] = float((eng.decode([nxt], [9], [1])[0] - eng.prefill(0, V4_PROMPT[:9] + [nxt])[-1])
                                    .abs().max())  # slot 1 untouched by the builds: its step equals a prefill
        eng.release(0)
        eng.release(1)
        steps, report["new_sets"], ids = _crossing(eng)
        whole = eng.prefill(0, ids, last_only=False)[len(V4_PROMPT):]  # the same tokens in one prefill
        report["diff"] = float((steps - whole).abs().max())
        eng.shutdown()
        queue.put(("ok", report))
    except Exception:  # noqa: BLE001 - reported to the test
        queue.put(("error", traceback.format_exc()))


@pytest.mark.parametrize("world_size", [1, 2])
def test_v4_length_buckets_are_built_while_idle_without_a_slot(v4_packs, world_size: int) -> None:
    """Deferred, a DeepSeek-V4 engine builds its longer length buckets' decode pieces with steps of padding
    rows alone: no slot taken, a running sequence unchanged; a sequence then crosses 1024 and decodes
    through pieces that exist (none built mid-stream), with the logits of one prefill of its tokens."""
    r = run_ranks(_run_v4, world_size, str(v4_packs[world_size]))
    assert r["after_warmup"] == ([1], [2], [(1, 1024), (1, 1100)])
    assert r["lengths_then"] == [(1, 1024), (2, 1024), (1, 1100), (2, 1100)]  # batch bucket 2's too, once built
    assert r["built"] == [2, (1, 1024), (2, 1024), (1, 1100), (2, 1100)]
    assert r["nothing_left"] == "no decode length bucket is waiting to be built"
    assert r["held_diff"] < 1e-4, r["held_diff"]
    assert r["new_sets"] == [] and r["diff"] < 1e-4, (r["new_sets"], r["diff"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v4_length_buckets_captured_while_idle_replay_as_built_on_first_use(v4_packs) -> None:
    """On CUDA the pieces are captured graphs: those a padding-rows step captured while idle replay a real
    sequence's steps with the logits of pieces captured by that sequence's own first step there."""
    from shardsmith.runtime.engine.engine import Engine

    def load() -> Engine:
        return Engine.load(v4_packs[1], rank=0, world_size=1, device="cuda", dtype=torch.float32,
                           max_seq_len=V4_LEN, max_num_seqs=2)

    idle = load()
    idle.warmup(defer_buckets=True)
    while idle.pending_lengths:
        idle.build_length()
    built_idle, new_idle, _ = _crossing(idle)
    on_use = load()
    on_use.warmup()
    built_on_use, new_on_use, _ = _crossing(on_use)
    assert new_idle == [] and new_on_use == [(1, 1024), (1, 1100)]
    torch.testing.assert_close(built_idle, built_on_use, atol=1e-5, rtol=0)
