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
from shardsmith.runtime.engine.build import check_state_fits
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


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "deepseek_v4", "gpt_oss"])
def test_the_skeleton_has_the_models_sizes_and_reads_no_weight(models, tmp_path, name):
    """The meta model a builder makes before assigning: the same buffers (names, shapes, dtypes) and
    per-sequence state as the built model, with the rank's weights never asked for."""
    from shardsmith.runtime.models.registry import skeleton

    weights = load_rank_weights(_tiny(name, tmp_path), rank=1, world_size=2, from_checkpoint=True)

    def refuse(*_a, **_k):
        raise AssertionError("the skeleton read a weight")

    weights.dense = weights.banks = refuse
    meta = skeleton(family_for(weights.config), weights, rank=1, dtype=torch.float32)
    built = models[name, 2]
    assert all(b.device.type == "meta" for b in meta.buffers())
    shapes = {n: (tuple(b.shape), b.dtype) for n, b in meta.named_buffers()}
    assert shapes == {n: (tuple(b.shape), b.dtype) for n, b in built.named_buffers() if n in shapes}
    assert meta.state_bytes_for(300, 2, torch.bfloat16) == built.state_bytes_for(300, 2, torch.bfloat16)


def test_a_context_that_does_not_fit_is_refused_before_the_load(tmp_path):
    """``preflight_state`` (what ``build_model`` runs on CUDA before any weight reaches the device):
    the weights the device will hold, estimated from the skeleton, then the state; refused with the
    numbers and the estimate; offloaded experts' banks are not counted."""
    from shardsmith.runtime.engine.build import ACTIVATION_RESERVE_BYTES, preflight_state

    weights = load_rank_weights(_tiny("deepseek_v4", tmp_path), rank=0, world_size=1, from_checkpoint=True)
    family = family_for(weights.config)
    model, _ = family.build(weights, rank=0, dtype=torch.float32, device=torch.device("cpu"))
    resident = sum(b.nbytes for b in model.buffers()) + sum(p.nbytes for p in model.parameters())
    state = model.state_bytes_for(4096, 4, torch.float32)
    args = dict(rank=0, dtype=torch.float32, max_seq_len=4096, max_num_seqs=4, where="cuda:0")
    fits = resident + state + ACTIVATION_RESERVE_BYTES
    assert preflight_state(weights, family, offloaded=False, free_bytes=fits, **args) == resident
    with pytest.raises(UsageError) as e:
        preflight_state(weights, family, offloaded=False, free_bytes=fits - 1, **args)
    message = str(e.value)
    assert message.startswith("--max-model-len 4096 with 4 sequence slot(s) needs")
    assert f"checked before loading: the weights will take about {resident / 2**30:.2f} GiB" in message
    assert "--max-model-len" in message.split("activations: ")[1]
    offloaded = preflight_state(weights, family, offloaded=True, free_bytes=fits - 1, **args)
    banks = sum(b.nbytes for m in model.modules() if type(m).__name__ == "ExpertBank" for b in m.buffers())
    assert banks > 0 and offloaded == resident - banks
