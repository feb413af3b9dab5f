"""The engine thread's waiting queue: ``--max-queue`` bounds the requests that wait, free slots included
when the oldest waiting request waits for KV cache blocks (a free slot takes no one then)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from shardsmith.runtime.engine.engine import Engine
from shardsmith.runtime.engine.sampling import SamplingParams
from shardsmith.runtime.engine.scheduler import Scheduler
from shardsmith.runtime.serve.metrics import Metrics
from shardsmith.runtime.serve.worker import EngineWorker, Job, QueueFull, State


def _finish(job: Job, loop: asyncio.AbstractEventLoop) -> str:
    """The job's finish reason, once its events end (raises what it failed with)."""
    async def drain() -> str:
        reason = None
        while (ev := await job.events.get()) is not None:
            if isinstance(ev, Exception):
                raise ev
            reason = ev.finish_reason or reason
        return reason
    return asyncio.run_coroutine_threadsafe(drain(), loop).result(120)


def test_free_slots_take_no_request_past_max_queue_while_the_oldest_waits_for_blocks(tmp_path: Path, monkeypatch) -> None:
    from shardsmith.testing.tiny import tiny_mixtral
    from shardsmith.testing.tokenizer import deepseek_tokenizer

    src = tiny_mixtral(tmp_path / "src", layers=1)
    deepseek_tokenizer(src, vocab_size=256)
    # the scheduler's steps wait on the test in turn, so each submit lands where the test says
    gates, blocked = [threading.Event(), threading.Event()], threading.Event()
    real_step, real_can_admit = Scheduler.step, Scheduler.can_admit

    def step(self):
        for gate in gates:
            if not gate.is_set():
                assert gate.wait(60)
                break
        return real_step(self)

    def can_admit(self, prompt_ids):
        ok = real_can_admit(self, prompt_ids)
        if not ok:
            blocked.set()
        return ok

    monkeypatch.setattr(Scheduler, "step", step)
    monkeypatch.setattr(Scheduler, "can_admit", can_admit)
    # 4 slots of 32 positions over a pool of 32 (two blocks of 16): one 20 + 12-token request fills it
    load = lambda: Engine.load(src, rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True,  # noqa: E731
                               max_seq_len=32, max_num_seqs=4, kv_cache_tokens=32)
    worker = EngineWorker(load, metrics=Metrics(), on_fatal=lambda msg: None, max_queue=1)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    worker.start()
    try:
        deadline = 120
        while worker.state is State.LOADING and deadline > 0:
            threading.Event().wait(0.1)
            deadline -= 0.1
        assert worker.state is State.READY, worker.error
        params = SamplingParams(max_tokens=12)  # no stop token: each runs to its 12th
        job = lambda first: Job([first + i for i in range(20)], params, (), loop)  # noqa: E731
        a, b, c = job(3), job(40), job(80)
        worker.submit(a)
        worker.submit(b)  # A is admitted (3 slots free): B waits only for the next step boundary
        gates[0].set()
        assert blocked.wait(60)  # B found the pool full
        with pytest.raises(QueueFull, match=r"1 requests are waiting for KV cache blocks \(3 of 4 sequence slots "
                                            r"free\) \(--max-queue 1\)"):
            worker.submit(c)
        gates[1].set()
        assert _finish(a, loop) == _finish(b, loop) == "length"  # B ran once A gave its blocks back
        worker.submit(c)  # nothing waits now: accepted, and it runs
        assert _finish(c, loop) == "length"
    finally:
        for gate in gates:
            gate.set()
        worker.stop(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
