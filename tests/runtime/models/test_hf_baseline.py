"""The transformers + accelerate baseline of ``benchmarks/decode_offload.py --hf-baseline`` (CPU).

Its greedy loop must decode what ``model.generate`` and our engine (TP=1) decode, in float32 (in
bf16 this random model has exact top-2 ties), and its placement must put every routed-experts
module, and nothing else, in host memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
try:  # benchmarks/ on sys.path only while these two import (tests/test_module_names.py checks its names)
    import _hf_baseline as hfb  # noqa: E402
    import decode_offload  # noqa: E402
finally:
    sys.path.pop(0)

SHAPE = dict(layers=2, experts=8, hidden=128, intermediate=256, top_k=2, heads=4, kv_heads=2, vocab=256)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny synthetic Mixtral checkpoints (bf16 and block-FP8 experts) with their TP=1 packs."""
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("hfb")
    out = {}
    for fmt in ("bf16", "fp8"):
        src = decode_offload.make_checkpoint(root / fmt / "src", fmt=fmt, **SHAPE)
        split_checkpoint(src, root / fmt / "tp1", world_size=1)
        out[fmt] = root / fmt
    return out


def test_experts_cpu_device_map_places_exactly_the_experts() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    dm = hfb.experts_cpu_device_map(model, gpu=0)
    assert sorted(k for k, v in dm.items() if v == "cpu") == [f"model.layers.{i}.mlp.experts" for i in range(3)]
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        owners = [k for k in dm if name.startswith(k + ".")]
        assert len(owners) == 1, (name, owners)
        assert (dm[owners[0]] == "cpu") == (".mlp.experts." in name), name


def test_input_device_follows_the_embedding() -> None:
    """On the H200s, ``device_map="auto"`` left the embedding on the CPU with no hook; the ids must follow it."""
    from types import SimpleNamespace

    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = MixtralForCausalLM(cfg)  # weights on the CPU, no accelerate hooks
    model.hf_device_map = hfb.experts_cpu_device_map(model, gpu=0)  # the map names GPU 0, the weight is here
    assert hfb.input_device(model, "cuda:0") == "cpu"
    emb = model.get_input_embeddings()
    emb._hf_hook = SimpleNamespace(execution_device=0)  # accelerate moves the inputs to GPU 0 itself
    assert hfb.input_device(model, "cpu") == "cuda:0"
    emb._hf_hook = SimpleNamespace(execution_device=None)
    with torch.device("meta"):
        meta = MixtralForCausalLM(cfg)
    assert hfb.input_device(meta, "cuda:0") == "cuda:0"  # no weight to follow: the run's device


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_greedy_loop_matches_generate_and_our_engine(checkpoints: dict[str, Path], fmt: str) -> None:
    from shardsmith.runtime.engine.engine import Engine, SamplingParams

    prompt = hfb.bench_prompt(seed=0, vocab=SHAPE["vocab"], tokens=8)
    model, _ = hfb.load_model(checkpoints[fmt] / "src", device_map="cpu", dtype=torch.float32,
                              fp8="dequantize" if fmt == "fp8" else None)
    tokens, decode_s = hfb.timed_greedy(model, prompt, tokens=12, device="cpu")
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert tokens == ref[0, len(prompt):].tolist()
    assert decode_s > 0

    eng = Engine.load(checkpoints[fmt] / "tp1", rank=0, world_size=1, dtype=torch.float32, max_seq_len=64)
    ours = [s.token_id for s in eng.generate(prompt, SamplingParams(max_tokens=12))]
    eng.shutdown()
    assert ours == tokens
    assert len(set(tokens)) > 2  # not a degenerate repeat


def test_hf_baseline_rows_and_ratio_on_cpu(checkpoints: dict[str, Path], capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what hf_offload_rows sets by default; undone after the test
    a = argparse.Namespace(device="cpu", tokens=4, hf_tokens=None, warmup_tokens=2, prompt_tokens=8, seed=0)
    ours = [{"run": "resident", "tp": 1, "tokens_per_s": 50.0}, {"run": "gpu", "tp": 1, "tokens_per_s": 40.0}]
    rows = decode_offload.hf_baseline(a, checkpoints["bf16"] / "src", ours, cache_bytes=1 << 20)
    assert [r["run"] for r in rows] == ["hf_cpu"]
    row = rows[0]
    assert row["tp"] == 1 and row["decode_tokens"] == 3 and row["tokens_per_s"] > 0 and "skipped" not in row
    assert row["device_map_modules"] == {"cpu": 1} and row["bytes_copied_per_token"] == 0
    assert "speedup_vs_hf" not in ours[0]
    assert ours[1]["speedup_vs_hf"] == pytest.approx(40.0 / row["tokens_per_s"])
    assert ours[1]["speedup_vs_hf_run"] == "hf_cpu"

    decode_offload.print_table([*ours, *rows])
    err = capsys.readouterr().err
    assert "hf_cpu" in err and "speedup_vs_hf" in err


def test_missing_checkpoint_is_a_skipped_row(tmp_path: Path) -> None:
    a = argparse.Namespace(device="cpu", tokens=4, hf_tokens=None, warmup_tokens=2, prompt_tokens=8, seed=0)
    rows = decode_offload.hf_baseline(a, tmp_path / "src", [], cache_bytes=0)
    assert len(rows) == 1 and "--make" in rows[0]["skipped"]


def test_checkpoint_bytes_splits_experts_from_dense(checkpoints: dict[str, Path]) -> None:
    got = hfb.checkpoint_bytes(checkpoints["bf16"] / "src")
    d, i, e, L, v = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["experts"], SHAPE["layers"], SHAPE["vocab"]
    assert got["experts"] == L * e * 3 * d * i * 2  # bf16
    assert got["dense"] > 2 * v * d * 2  # embeddings + LM head + attention, norms, routers
