"""Runtime loading refusals, request validation, sampling, and a dead rank failing fast.

Refusals: a checkpoint or pack missing a tensor, a tensor of the wrong shape, an unexpected
tensor, a pack made for another world size: each a :class:`RuntimeLoadError` naming it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardsmith.errors import RuntimeLoadError, UsageError
from shardsmith.runtime.engine.engine import Engine, SamplingParams
from shardsmith.runtime.engine.sampling import SamplingParams as Params, choose, choose_rows, filter_logits, make_generator

K_PROJ = "model.layers.1.self_attn.k_proj.weight"


def edit_checkpoint(src: Path, dst: Path, edit) -> Path:
    """Copy checkpoint ``src`` to ``dst`` and apply ``edit(tensors) -> tensors`` to its weights."""
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    every = {}
    for f in files:
        every.update(load_file(f))
        f.unlink()
    every = edit(every)
    save_file(every, str(dst / "model-00001-of-00001.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in every}}))
    return dst


def load(path: Path, **kw) -> Engine:
    return Engine.load(path, rank=0, world_size=1, dtype=torch.float32, max_seq_len=32, **kw)


def test_checkpoint_missing_tensor_is_named(tiny, tmp_path):
    ckpt = edit_checkpoint(tiny("mixtral"), tmp_path / "c", lambda t: {k: v for k, v in t.items() if k != K_PROJ})
    with pytest.raises(RuntimeLoadError, match=f"missing tensor '{K_PROJ}'"):
        load(ckpt, from_checkpoint=True)


def test_checkpoint_wrong_shape_and_unexpected_tensor_are_named(tiny, tmp_path):
    def edit(t):
        t[K_PROJ] = t[K_PROJ][:64]  # one KV head short
        t["model.layers.5.input_layernorm.weight"] = t["model.norm.weight"].clone()  # a layer the config lacks
        return t

    ckpt = edit_checkpoint(tiny("mixtral"), tmp_path / "c", edit)
    with pytest.raises(RuntimeLoadError) as e:
        load(ckpt, from_checkpoint=True)
    msg = str(e.value)
    assert f"'{K_PROJ}': shape [64, 192]" in msg and "[192, 192]" in msg


def test_unexpected_tensor_is_named(tiny, tmp_path):
    def edit(t):
        # a tensor the plan accepts (an o_proj bias is replicated) but this model has no place for
        t["model.layers.0.self_attn.o_proj.bias"] = t["model.norm.weight"].clone()
        return t

    ckpt = edit_checkpoint(tiny("mixtral"), tmp_path / "c", edit)
    with pytest.raises(RuntimeLoadError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"):
        load(ckpt, from_checkpoint=True)


def test_tied_checkpoint_with_a_stray_lm_head_is_refused(tiny, tmp_path):
    def edit(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        return t

    ckpt = edit_checkpoint(tiny("mixtral-tied"), tmp_path / "c", edit)
    with pytest.raises(RuntimeLoadError, match="unexpected tensor 'lm_head.weight'"):
        load(ckpt, from_checkpoint=True)


def test_pack_for_another_world_size_is_refused(tiny, tmp_path):
    from shardsmith.writer.split import split_checkpoint

    split_checkpoint(tiny("mixtral"), tmp_path / "p2", world_size=2)
    with pytest.raises(RuntimeLoadError, match="world_size=2.*world_size=1"):
        load(tmp_path / "p2")


def test_pack_missing_a_tensor_is_named(tiny, tmp_path):
    """A rank manifest edited to drop a tensor (hash fixed up) fails the load, naming it."""
    from shardsmith.pack.format import dump_yaml, load_yaml, stamp
    from shardsmith.writer.split import split_checkpoint

    out = tmp_path / "p1"
    split_checkpoint(tiny("mixtral"), out, world_size=1)
    path = out / "rank-0-of-1" / "manifest.yaml"
    doc = load_yaml(path)
    for rec in doc["files"]:
        rec["tensors"] = [t for t in rec["tensors"] if t["name"] != K_PROJ]
    doc.pop("manifest_xxh3_128", None)
    path.write_text(dump_yaml(stamp(doc)))
    with pytest.raises(Exception, match=K_PROJ.replace(".", r"\.")) as e:
        load(out)
    assert isinstance(e.value, RuntimeLoadError) or e.value.exit_code == 2


def test_checkpoint_is_not_a_pack(tiny):
    with pytest.raises(RuntimeLoadError, match="--from-checkpoint"):
        load(tiny("mixtral"))


def test_request_validation(tiny):
    eng = load(tiny("mixtral"), from_checkpoint=True)
    for bad, what in ((SamplingParams(max_tokens=0), "max_tokens"), (SamplingParams(top_p=0.0), "top_p"),
                      (SamplingParams(temperature=-1.0), "temperature")):
        with pytest.raises(UsageError, match=what):
            next(eng.generate([1, 2], bad))
    with pytest.raises(UsageError, match="max_seq_len"):
        next(eng.generate(list(range(1, 40)), SamplingParams()))
    with pytest.raises(UsageError, match="token ids"):
        next(eng.generate([1, 10_000], SamplingParams()))
    steps = list(eng.generate([1, 2, 3], SamplingParams(max_tokens=5)))
    assert [s.finished for s in steps] == [False] * 4 + [True] and steps[-1].finish_reason == "length"
    stop = steps[1].token_id
    steps = list(eng.generate([1, 2, 3], SamplingParams(max_tokens=5, stop_token_ids=(stop,), logprobs=3)))
    assert steps[-1].token_id == stop and steps[-1].finish_reason == "stop"
    assert len(steps[0].top_logprobs) == 3 and steps[0].top_logprobs[0][0] == steps[0].token_id
    # the cache fills: finish "length" at max_seq_len
    steps = list(eng.generate(list(range(1, 30)), SamplingParams(max_tokens=100)))
    assert len(steps) == 32 - 29 + 1 and steps[-1].finish_reason == "length"
    # an abandoned generation does not disturb the next one
    first = eng.generate([1, 2, 3], SamplingParams(max_tokens=5))
    next(first)
    again = [s.token_id for s in eng.generate([1, 2, 3], SamplingParams(max_tokens=5))]
    assert again == [s.token_id for s in list(eng.generate([1, 2, 3], SamplingParams(max_tokens=5)))]
    with pytest.raises(UsageError, match="superseded"):
        next(first)


def test_sampling_filters_and_seed():
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, -1.0])
    assert choose(logits).token_id == 1
    x = filter_logits(logits, temperature=1.0, top_k=2, top_p=1.0)
    assert torch.isinf(x).tolist() == [True, False, False, True, True]
    p = torch.softmax(logits, -1)  # [0.03, 0.64, 0.23, 0.09, 0.01]
    x = filter_logits(logits, temperature=1.0, top_k=0, top_p=0.8)
    assert torch.isfinite(x).tolist() == [False, True, True, False, False] and p[1] < 0.8 < p[1] + p[2]
    x = filter_logits(logits, temperature=1.0, top_k=0, top_p=0.01)
    assert torch.isfinite(x).tolist() == [False, True, False, False, False]  # the best token is always kept
    draw = lambda seed: [choose(logits, temperature=1.0, generator=g).token_id for g in [make_generator(seed)] for _ in range(20)]
    assert draw(3) == draw(3) and draw(3) != draw(4)
    c = choose(logits, logprobs=2)
    assert c.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
    assert [t for t, _ in c.top_logprobs] == [1, 2]


def test_sampled_draws_follow_the_filtered_distribution():
    """Inverse transform sampling over the sorted, filtered row (and, without filters, over the row in
    vocabulary order): 20,000 seeded draws land on each token at its probability (within 4 standard
    deviations), never on a token top-k or top-p dropped, and a uniform of 0 or just under 1 picks
    the best or the last kept token."""
    from shardsmith.runtime.engine.sampling import draw_sorted, sorted_filtered

    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0, 2.0]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(11)
    u = torch.rand(20000, generator=g, dtype=torch.float64)
    for k, p in ((0, 1.0), (3, 1.0), (0, 0.8)):
        sx, order = sorted_filtered(logits, torch.full((20000,), 0.7), torch.full((20000,), k),
                                    torch.full((20000,), p, dtype=torch.float64))
        want = torch.softmax(torch.empty_like(sx).scatter_(1, order, sx)[0], -1)  # [6]
        got = torch.bincount(draw_sorted(sx, order, u), minlength=6).double() / 20000
        sd = (want * (1 - want) / 20000).sqrt()
        assert ((got - want).abs() <= 4 * sd + 1e-12).all(), (k, p, got, want)
        assert (got[want == 0] == 0).all()
    # rows with neither filter skip the sort (vocabulary order): the same distribution
    from shardsmith.runtime.engine.sampling import choose_on_device

    ids, _, _ = choose_on_device(logits, [Params(temperature=0.7)] * 20000, u.tolist())
    want = torch.softmax(logits[0] / 0.7, -1)
    got = torch.bincount(ids, minlength=6).double() / 20000
    assert ((got - want).abs() <= 4 * (want * (1 - want) / 20000).sqrt()).all(), (got, want)
    sx, order = sorted_filtered(logits[:2], torch.ones(2), torch.tensor([2, 2]), torch.ones(2, dtype=torch.float64))
    # top-2 of [0, 3, 2, 1, -1, 2]: 3, and both 2s (a tie with the 2nd best is kept; ids 2 then 5)
    assert draw_sorted(sx, order, torch.tensor([0.0, 1 - 1e-12])).tolist() == [1, 5]


def test_a_tiny_temperature_samples_the_best_token():
    """Temperatures whose division overflows float32 (1e-39) or that are 0 in float32 (1e-46) still
    pick the argmax, with and without filters (the logits are shifted and divided in float64)."""
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(2)) * 3
    for t in (1e-39, 1e-46):
        for extra in ({}, {"top_p": 0.9}, {"top_k": 5}):
            got = choose_rows(logits, [Params(temperature=t, **extra)] * 2, [make_generator(1), make_generator(2)])
            assert [c.token_id for c in got] == logits.argmax(-1).tolist(), (t, extra)


def test_choose_rows_equals_choose_per_row():
    """The batched choice (greedy rows reduced together, one host copy) is ``choose`` row by row,
    exactly on CPU: ties to the lowest id, each row's own number of top logprobs, sampled rows
    drawing from their own seeded generators whatever the other rows are."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g) * 4
    logits[2, [7, 900]] = 50.0  # a tie: the lowest id wins
    logits[5, 100:140] = 60.0  # more ties than top_logprobs' candidate window
    params = [Params(), Params(logprobs=3), Params(logprobs=1), Params(temperature=0.8, top_p=0.9, seed=5),
              Params(temperature=1.0, top_k=20, seed=6, logprobs=2), Params(logprobs=5)]
    gens = [make_generator(p.seed) for p in params]
    got = choose_rows(logits, params, gens)
    want = [choose(logits[b], temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, generator=make_generator(p.seed),
                   logprobs=p.logprobs) for b, p in enumerate(params)]
    assert got == want
    assert got[2].token_id == 7 and [len(c.top_logprobs) for c in got] == [0, 3, 1, 0, 2, 5]
    assert [t for t, _ in got[5].top_logprobs] == [100, 101, 102, 103, 104] and got[5].token_id == 100
    alone = choose_rows(logits[3:4], params[3:4], [make_generator(5)])  # the seeded row, alone in its batch
    assert alone[0] == got[3]
    assert choose_rows(logits.double()[:2], params[:2], gens[:2]) == want[:2]  # any float dtype, reduced in float32
    with pytest.raises(ValueError, match="6 rows of logits but 2 params"):
        choose_rows(logits, params[:2], gens)


def _die_or_drive(rank: int, port: int, path: str, who_dies: int, queue) -> None:
    import os

    from shardsmith.runtime.engine.engine import RankLostError
    from shardsmith.runtime.engine.dist import init_distributed

    init_distributed(rank, 2, master_port=port)
    eng = Engine.load(path, rank=rank, world_size=2, from_checkpoint=True, max_seq_len=32)
    if rank == who_dies:
        time.sleep(0.5)
        os._exit(3)
    t0 = time.time()
    try:
        if rank == 0:
            list(eng.generate([1, 2, 3], SamplingParams(max_tokens=4)))
        else:
            eng.follow()
        queue.put((rank, "no error", time.time() - t0))
    except RankLostError as e:
        queue.put((rank, str(e), time.time() - t0))


@pytest.mark.parametrize("who_dies", [1, 0])
def test_a_dead_rank_fails_the_others_fast(tiny, who_dies):
    from shardsmith.runtime.serve.launch import free_port
    from shardsmith.testing.ranks import rank_context, rank_process

    ctx = rank_context()
    queue, port = ctx.Queue(), free_port()
    procs = [rank_process(ctx, _die_or_drive, r, port, str(tiny("mixtral")), who_dies, queue) for r in range(2)]
    for p in procs:
        p.start()
    rank, msg, seconds = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert rank == 1 - who_dies and "another rank died" in msg and seconds < 30, (rank, msg, seconds)
