"""Offloaded experts through the real CLI: `generate` with host banks and a device expert cache
answers exactly as with resident experts (greedy, TP=2, gloo), and `serve` reports cache metrics."""

from __future__ import annotations

import subprocess
import sys

import pytest

QUESTION = "What is the capital of France?"


def _generate(pack, *extra: str) -> tuple[str, str]:
    cmd = [sys.executable, "-m", "shardsmith.cli", "generate", str(pack), "--chat", "--prompt", QUESTION,
           "--max-tokens", "12", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip(), proc.stderr


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_offloaded_generate_matches_resident(smollm2_pack, backend: str) -> None:
    pack = smollm2_pack(2)
    resident, _ = _generate(pack)
    assert "Paris" in resident
    # 0.1 GiB holds about a sixth of this rank's 240 expert shards: misses and evictions happen
    cache = ("--expert-cache-gb", "0.1") if backend == "gpu" else ()  # the cpu backend has no device cache
    text, log = _generate(pack, "--moe-backend", backend, *cache)
    assert text == resident
    assert f"expert offload: backend {backend}" in log
    if backend == "gpu":
        assert "policy hot" in log and "GiB/GPU" in log
        assert "--moe-backend gpu on a CPU device" in log and "H2D" not in log  # said once, no bogus probe
    else:  # the ready line says how the host computes: the kernel with its instruction set and prefetch
        import re

        from shardsmith.runtime.offload import host_kernel

        want = r"host experts: kernel \w+, prefetch \d+ B" if host_kernel.available() else r"host experts: matmul"
        assert re.search(want, log), log[-2000:]


def test_unknown_backend_is_a_usage_error(smollm2_pack) -> None:
    proc = subprocess.run([sys.executable, "-m", "shardsmith.cli", "generate", str(smollm2_pack(2)), "--prompt", "x",
                           "--moe-backend", "tpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "--moe-backend must be one of" in proc.stderr


def test_metrics_render_offload_stats() -> None:
    from shardsmith.runtime.serve.metrics import Metrics

    class Stats:
        def stats(self) -> dict:
            return {"slots": 12, "hits": 30, "misses": 10, "hit_rate": 0.75, "bytes_per_token": 1e6,
                    "h2d_gb_per_s": 50.0, "host_bytes": 1 << 30, "prefill_tokens": 4096, "prefill_link_bytes": 1 << 33}

    m = Metrics()
    assert "expert_cache" not in m.render()
    m.offload = Stats()
    text = m.render()
    for line in ("expert_cache_slots 12.0", "expert_cache_hits_total 30.0", "expert_cache_hit_rate 0.75",
                 "expert_h2d_gb_per_s 50.0", "expert_host_bytes 1073741824.0", "expert_prefill_tokens_total 4096.0",
                 "expert_prefill_link_bytes_total 8589934592.0"):
        assert any(l.endswith(line) for l in text.splitlines()), line


def test_enforce_eager_turns_cuda_graphs_off_for_every_rank(smollm2_pack) -> None:
    from shardsmith.cli_serve import _spec

    common = dict(device="cpu", dist_port=None, from_checkpoint=False, tp=None, verify_hashes=False, max_seq_len=64)
    assert _spec(smollm2_pack(2), **common).cuda_graphs is True  # on by default (used on CUDA only)
    assert _spec(smollm2_pack(2), **common, enforce_eager=True).cuda_graphs is False
    proc = subprocess.run([sys.executable, "-m", "shardsmith.cli", "generate", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert "--enforce-eager" in proc.stdout


@pytest.mark.parametrize(("backend", "gb", "policy", "message"), [
    ("resident", None, "bogus", "--expert-policy must be one of lru, hot, got 'bogus'"),  # the value before where
    ("gpu", None, "bogus", "--expert-policy must be one of"),
    ("cpu", 1.0, None, "--expert-cache-gb sizes the GPU expert cache, which --moe-backend cpu does not use"),
    ("resident", 1.0, None, "--expert-cache-gb only applies to offloaded experts"),
])
def test_offload_options_name_the_bad_value(backend, gb, policy, message) -> None:
    from shardsmith.cli_serve import _offload
    from shardsmith.errors import UsageError

    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _offload(backend, gb, policy)
