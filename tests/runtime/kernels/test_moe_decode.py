"""A decode step of the resident models (Mixtral family, DeepSeek-V4) runs without a host sync, and the
Mixtral decode path computes bitwise what the general path computes.

No host sync is shown on ``meta`` tensors: they have shapes but no data, so anything that reads
values on the host (``tolist``, ``.cpu()``, ``nonzero``) fails, while device-side gathers and
matmuls go through. The general (prefill) path must fail there, or the check proves nothing.
"""

from __future__ import annotations


import pytest
import torch

from shardsmith.runtime.layers.parallel import Shards
from shardsmith.runtime.engine.loader import load_rank_weights


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """The tiny Mixtral and DeepSeek-V4 built on ``meta`` from their TP=1 packs, and the loaded ones."""
    from shardsmith.runtime.models import deepseek_v4
    from shardsmith.runtime.models.mixtral.config import ModelArgs
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.models.mixtral.model import Transformer
    from shardsmith.testing import tiny_mixtral
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("moe-decode")
    out = {}
    for name, make in (("mixtral", lambda p: tiny_mixtral(p, experts=8)), ("v4", tiny_deepseek_v4)):
        pack = root / f"{name}-tp1"
        split_checkpoint(make(root / name), pack, world_size=1)
        w = load_rank_weights(pack, rank=0, world_size=1)
        shards = Shards(w.plan, 0, torch.float32)
        meta = (Transformer(ModelArgs.from_config(w.config), shards) if name == "mixtral"
                else deepseek_v4.DeepseekV4(deepseek_v4.V4Args.from_config(w.config), shards))
        out[name] = {"meta": meta, "engine": Engine.load(pack, rank=0, world_size=1, dtype=torch.float32)}
    return out


def _bank(model, cls):
    return next(m for m in model.modules() if isinstance(m, cls))


@pytest.mark.parametrize("name", ["mixtral", "v4"])
def test_decode_step_has_no_host_sync(models, name: str) -> None:
    """A whole decode step (embedding, attention with its cache, router, experts, head) on ``meta``."""
    model = models[name]["meta"]
    model.setup_cache(64, torch.device("meta"), torch.float32)
    for pos in (0, 1):
        logits = model(torch.empty(1, dtype=torch.int64, device="meta"), pos)
        assert logits.shape == (1, model.args.vocab_size)
    model.setup_cache(64, torch.device("meta"), torch.float32)
    with pytest.raises((NotImplementedError, RuntimeError)):  # a prefill reads the expert ids on the host
        model(torch.empty(16, dtype=torch.int64, device="meta"), 0)


def test_mixtral_decode_path_is_bitwise_the_general_path(models) -> None:
    """Row 0 of a 2-row call (general path; the rows use disjoint experts) equals the 1-row call."""
    from shardsmith.runtime.layers.experts import ExpertBank

    bank = _bank(models["mixtral"]["engine"].model, ExpertBank)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        bank.to(dtype)
        x = torch.randn(2, bank.down.shape[1], generator=g).to(dtype)
        index = torch.tensor([[5, 1], [0, 7]])
        weight = torch.softmax(torch.randn(2, 2, generator=g), dim=-1)  # float32, as Mixtral routes
        both = bank(x, index, weight)
        one = bank(x[:1], index[:1], weight[:1])
        torch.testing.assert_close(one, both[:1], atol=0, rtol=0)
    bank.to(torch.float32)


def test_mixtral_experts_past_the_gather_budget_take_the_synced_path(models, monkeypatch) -> None:
    """Gathering copies the experts: past ``DECODE_GATHER_MAX_BYTES`` the decode step reads the ids instead."""
    from shardsmith.runtime.layers import experts as moe

    model = models["mixtral"]["meta"]
    model.setup_cache(64, torch.device("meta"), torch.float32)
    monkeypatch.setattr(moe, "DECODE_GATHER_MAX_BYTES", 0)
    with pytest.raises((NotImplementedError, RuntimeError)):
        model(torch.empty(1, dtype=torch.int64, device="meta"), 0)
