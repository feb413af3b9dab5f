"""The per-sequence state a context needs, computed before it is allocated, and the refusal of one that
does not fit the device.

Every family (Mixtral, DeepSeek-V3, DeepSeek-V4, gpt-oss; tiny checkpoints, TP=1 and a TP=2 rank):
``state_bytes_for(L, N, dtype)`` equals what ``setup_cache(L, ..., dtype, N)`` then allocates
(``state_bytes``) for several lengths (V4: below, at and past its compression ratios), slot counts and
dtypes. ``check_state_fits`` passes what fits and refuses what does not with the numbers: what the
state needs, what is free, the longest ``--max-model-len`` and the most slots that fit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardsmith.errors import UsageError
from shardsmith.runtime.engine.engine import check_state_fits
from shardsmith.runtime.engine.loader import load_rank_weights
from shardsmith.runtime.models.registry import family_for


def _tiny(name: str, root: Path) -> Path:
    from shardsmith.testing import tiny_mixtral
    from shardsmith.testing.tiny import tiny_deepseek_v3
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4

    make = {"mixtral": tiny_mixtral, "deepseek_v3": tiny_deepseek_v3, "deepseek_v4": tiny_deepseek_v4,
            "gpt_oss": tiny_gpt_oss}[name]
    return make(root / name)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("state-budget")
    out = {}
    for name in ("mixtral", "deepseek_v3", "deepseek_v4", "gpt_oss"):
        ckpt = _tiny(name, root)
        for world_size in (1, 2):
            weights = load_rank_weights(ckpt, rank=world_size - 1, world_size=world_size, from_checkpoint=True)
            model, _ = family_for(weights.config).build(weights, rank=world_size - 1, dtype=torch.float32,
                                                        device=torch.device("cpu"))
            out[name, world_size] = model
    return out


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "deepseek_v4", "gpt_oss"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_state_bytes_for_is_what_setup_cache_allocates(models, name, world_size):
    model = models[name, world_size]
    batching = getattr(model, "SUPPORTS_BATCHING", False)
    for length, slots, dtype in ((2, 1, torch.float32), (130, 3, torch.bfloat16), (300, 2, torch.float32)):
        slots = slots if batching else 1
        want = model.state_bytes_for(length, slots, dtype)
        model.setup_cache(length, torch.device("cpu"), dtype, max_num_seqs=slots) if batching else \
            model.setup_cache(length, torch.device("cpu"), dtype)
        assert model.state_bytes() == want > 0, (name, length, slots, dtype)


def test_a_context_that_does_not_fit_is_refused_with_what_fits(models):
    model = models["deepseek_v4", 1]
    gib = 2 ** 30
    need = model.state_bytes_for(4096, 4, torch.bfloat16)
    check_state_fits(model, 4096, 4, torch.bfloat16, free_bytes=need + gib, where="cuda:0", reserve=gib)
    with pytest.raises(UsageError) as e:
        check_state_fits(model, 4096, 4, torch.bfloat16, free_bytes=need // 2 + gib, where="cuda:0", reserve=gib)
    message = str(e.value)
    assert message.startswith("--max-model-len 4096 with 4 sequence slot(s) needs") and "on cuda:0" in message
    length = int(message.split("--max-model-len ")[2].split()[0])
    slots = int(message.split("--max-num-seqs ")[1].split()[0])
    budget = need // 2
    assert model.state_bytes_for(length, 4, torch.bfloat16) <= budget < model.state_bytes_for(length + 1, 4,
                                                                                             torch.bfloat16)
    assert model.state_bytes_for(4096, slots, torch.bfloat16) <= budget < model.state_bytes_for(4096, slots + 1,
                                                                                               torch.bfloat16)
    with pytest.raises(UsageError, match="no context fits"):
        check_state_fits(model, 4096, 4, torch.bfloat16, free_bytes=gib, where="cuda:0", reserve=gib)
