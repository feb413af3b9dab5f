"""Offloaded prefill chunks that stream their experts (``OffloadRuntime.run_chunk``) for gpt-oss's MXFP4
banks: the gate/up bias and the family's GLU ride with each expert, so a 40-token prompt on a 4-slot
cache gives the resident model's logits bit for bit, and every present expert but the cached ones is
copied once per layer. (DeepSeek-V4's FP4 chunks: ``test_offload_v4.py``; the in-place mode's:
``test_offload_inplace.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardsmith.runtime.layers import experts
from shardsmith.runtime.offload import OffloadConfig

PROMPT = [(5 * i + 1) % 200 + 2 for i in range(40)]


def test_gpt_oss_prefill_chunk_streams_its_experts(tmp_path: Path) -> None:
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss

    ckpt = tiny_gpt_oss(tmp_path / "gpt-oss")
    load = dict(rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True, max_seq_len=64)
    want = Engine.load(ckpt, **load).logits(PROMPT)
    eng = Engine.load(ckpt, **load, offload=OffloadConfig(backend="gpu", cache_slots=4, probe=False))
    rt = eng.offload
    assert "gate_up_bias" in rt.cache.pool
    got = eng.logits(PROMPT)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    st = rt.stats()
    experts = next(iter(rt.host.layers.values()))["gate_up"].shape[0]
    assert st["prefill_tokens"] == len(PROMPT) and st["misses"] == 0
    assert 0 < st["prefill_link_bytes"] <= len(rt.layers) * experts * rt.cache.slot_bytes
    assert st["prefill_link_bytes"] % rt.cache.slot_bytes == 0
    rt.close()


@pytest.mark.parametrize("tiles", [False, True], ids=["cpu-default", "tile-kernel"])
def test_fp8_prefill_chunks_stream_through_the_tile_kernel(tmp_path: Path, monkeypatch, tiles: bool) -> None:
    """An offloaded FP8 bank (Mixtral-FP8, 128x128 block scales): with the tile kernel (CUDA's default; forced
    here) a long chunk streams its missing experts once, FP8 bytes and scales as stored, and gives the
    resident model's logits; on the CPU's default (no grouped path for FP8) it runs through the cache and says why."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.testing import tiny_mixtral

    ckpt = tiny_mixtral(tmp_path / "mixtral-fp8", fp8=True, layers=2)
    load = dict(rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True, max_seq_len=64)
    prompt = [(11 * i + 5) % 300 for i in range(40)]
    want = Engine.load(ckpt, **load).logits(prompt)
    monkeypatch.setattr(experts, "TILE_KERNEL", tiles or None)
    eng = Engine.load(ckpt, **load, offload=OffloadConfig(backend="gpu", cache_slots=3, probe=False))
    rt = eng.offload
    assert rt.cache.pool["gate_up"].dtype == torch.float8_e4m3fn and rt.block == (128, 128)
    got = eng.logits(prompt)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    st = rt.stats()
    if tiles:
        assert st["prefill_tokens"] == len(prompt) and st["prefill_link_bytes"] % rt.cache.slot_bytes == 0
        assert 0 < st["prefill_link_bytes"] <= len(rt.layers) * 4 * rt.cache.slot_bytes
    else:
        assert st["prefill_tokens"] == 0 and rt.stream_refused.startswith("grouped matmuls off, or none runs fp8")
    rt.close()


def test_a_chunk_that_does_not_stream_says_why(tmp_path: Path, caplog, monkeypatch) -> None:
    """Each condition of ``streams_chunk`` named when it fails, and the first long prefill step that ran
    through the cache instead logs its reason once (what a benchmark row that did not stream prints)."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss

    ckpt = tiny_gpt_oss(tmp_path / "gpt-oss")
    load = dict(rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True, max_seq_len=64)
    eng = Engine.load(ckpt, **load, offload=OffloadConfig(backend="gpu", cache_slots=4, probe=False))
    rt = eng.offload
    x = torch.zeros(40, 8)  # [T, D]: the conditions read T, the dtype and the device
    assert rt.stream_refusal(x) == "not a prefill (decode steps keep the cache's path)"
    with rt.prefill():
        assert rt.stream_refusal(x) == "" and rt.streams_chunk(x)
        assert rt.stream_refusal(x[:16]) == "16 tokens, at most FUSED_TOKENS_MAX=16: the decode-sized path"
        assert rt.stream_refusal(x.double()) == (
            "grouped matmuls off, or none runs fp4 experts for torch.float64 activations on cpu (the tile kernel: "
            "CUDA; torch._grouped_mm: FP4 expanded, or dense on CUDA)")
        monkeypatch.setattr(experts, "GROUPED", False)  # what a benchmark's loop path sets
        assert rt.stream_refusal(x).startswith("grouped matmuls off")
        monkeypatch.setattr(experts, "GROUPED", True)
        monkeypatch.setattr(experts, "TILE_KERNEL", True)  # the tile kernel (CUDA's default) takes float32 too
        assert rt.stream_refusal(x) == ""
        rt.backend = "hybrid"
        assert rt.stream_refusal(x) == "moe backend 'hybrid'"
    with caplog.at_level("INFO", logger="shardsmith.runtime.offload"):
        eng.logits(PROMPT)
        eng.logits(PROMPT)
    assert rt.stats()["prefill_tokens"] == 0 and rt.stream_refused == "moe backend 'hybrid'"
    assert caplog.text.count("a 40-token prefill chunk runs its experts through the expert cache, not streamed: "
                             "moe backend 'hybrid'") == 1
    rt.close()
