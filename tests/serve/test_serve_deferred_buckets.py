"""``serve`` says ready once the one-row decode bucket is built and builds the other batch buckets while
idle (``--defer-buckets``, the default where building one compiles): the ready line and ``/metrics`` say
which exist, concurrent requests meanwhile and after get the answers they get alone, and the idle build
is sealed into the compile cache. CPU, with the decode pieces compiled (``compile_pieces=kernel``: the
only CPU path where a bucket costs a compile)."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shardsmith.testing.server import Server, post

httpx = pytest.importorskip("httpx")

PROMPTS = [[3, 17, 42, 99, 5], [11, 12, 250, 7]]


def _gauge(srv: Server, name: str) -> float:
    m = re.search(rf"^shardsmith_{name} (\S+)$", httpx.get(f"{srv.url}/metrics", timeout=10).text, re.MULTILINE)
    assert m, name
    return float(m.group(1))


def test_ready_before_every_bucket_then_built_while_idle(tmp_path: Path, monkeypatch) -> None:
    from shardsmith.testing.tiny import tiny_mixtral
    from shardsmith.testing.tokenizer import deepseek_tokenizer
    from shardsmith.writer.split import split_checkpoint

    src = tiny_mixtral(tmp_path / "src", layers=1)
    deepseek_tokenizer(src, vocab_size=256)
    split_checkpoint(src, tmp_path / "tp1", world_size=1)
    for v in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):  # torch sets its default in this process
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("SHARDSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SHARDSMITH_KERNELS", "compile_pieces=kernel")

    def ask(srv: Server, prompt: list[int]) -> list[int]:
        body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
        r = post(srv, "/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    with Server(tmp_path / "tp1", tmp_path / "serve.log", "--dtype", "float32", "--max-num-seqs", "2",
                model="m") as srv:
        ready = next(ln for ln in srv.log().splitlines() if "ready: every rank" in ln)
        assert "decode buckets 1 built (2 to build when idle)" in ready
        with ThreadPoolExecutor(2) as pool:  # two at once, whichever buckets exist by then
            together = list(pool.map(lambda p: ask(srv, p), PROMPTS))
        deadline = time.monotonic() + 120
        while _gauge(srv, "decode_buckets_pending") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (_gauge(srv, "decode_buckets_built"), _gauge(srv, "decode_buckets_pending")) == (2, 0)
        assert _gauge(srv, "decode_lengths_pending") == 0  # a Mixtral-family step has no length buckets
        assert "decode bucket of 2 rows built in" in srv.log()
        alone = [ask(srv, p) for p in PROMPTS]
        with ThreadPoolExecutor(2) as pool:
            after = list(pool.map(lambda p: ask(srv, p), PROMPTS))
    assert together == alone == after
    record = json.loads(next((tmp_path / "cache" / "compile").glob("*/record.json")).read_text())
    sealed = re.findall(r"compile cache \S+: (\d+) files sealed", srv.log())
    assert len(sealed) == 2 and int(sealed[1]) > int(sealed[0]) > 0  # the idle build added files
    assert len(record["files"]) == int(sealed[1])


def test_a_stop_during_a_bucket_build_waits_for_it(tmp_path: Path, monkeypatch, caplog) -> None:
    """A stop that comes while the idle server builds a deferred bucket (not interruptible: a compile and
    a capture) waits for that build past the stop's own timeout and ends cleanly, saying why it waits."""
    import threading

    import torch

    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.serve.metrics import Metrics
    from shardsmith.runtime.serve.worker import EngineWorker, State
    from shardsmith.testing.tiny import tiny_mixtral
    from shardsmith.testing.tokenizer import deepseek_tokenizer

    src = tiny_mixtral(tmp_path / "src", layers=1)
    deepseek_tokenizer(src, vocab_size=256)
    monkeypatch.setattr(Engine, "bucket_builds_compile", property(lambda self: True))  # defer on the CPU too
    started, real = threading.Event(), Engine.build_bucket

    def slow_build(self, slot: int) -> int:  # a build that takes as long as a cold compile would
        started.set()
        time.sleep(2.0)
        return real(self, slot)

    monkeypatch.setattr(Engine, "build_bucket", slow_build)
    load = lambda: Engine.load(src, rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True,  # noqa: E731
                               max_seq_len=32, max_num_seqs=4)
    worker = EngineWorker(load, metrics=Metrics(), on_fatal=lambda msg: None, defer_buckets=True)
    worker.start()
    assert started.wait(60) and worker.state is State.READY
    with caplog.at_level("INFO", logger="shardsmith.runtime.serve.worker"):
        t0 = time.perf_counter()
        assert worker.stop(timeout=0.2)  # the build outlasts the timeout; the stop still ends cleanly
    assert time.perf_counter() - t0 < 30 and worker.state is State.STOPPED
    assert "stopping once the decode bucket being built is done" in caplog.text
    assert worker.engine.built_buckets() == [1, 4]  # the bucket under way was finished, no other begun
