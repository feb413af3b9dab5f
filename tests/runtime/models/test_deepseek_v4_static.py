"""DeepSeek-V4's device-only decode core: static shapes per (rows, length bucket), a scratch slot for
padding rows, no host sync (so a whole decode step can be one CUDA graph).

The tiny release-format checkpoint (4 layers: sliding, CSA ratio 4 with the indexer, HCA ratio 128,
CSA; window 16), float32, one rank. Three sequences of 125, 29 and 6 prompt tokens sit in slots 2,
0 and 1 and decode 4 given tokens together, in a shuffled row order padded to 4 rows: positions
125..128 complete the first HCA window (127) and every sequence completes a CSA window. Each step
runs the layers as the lead's one-graph step will: ``step_rows`` -> ``as_tuple`` -> ``from_tuple``
-> per layer ``attn_static`` + ``ffn_block`` (the step at 127 also in the bucket 1024). The
reference is the unchanged prefill path: each whole sequence prefilled alone into a spare slot
(``Attention.core``, not the decode core).
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch

from shardsmith.runtime.models.deepseek_v4.rows import DecodeRows, length_bucket

PROMPT_LENS = (125, 29, 6)
SLOTS = (2, 0, 1)
SPARE = 3  # the reference prefills' slot
STEPS = 4
MAX_SEQ_LEN = 1024  # room for the buckets 512 and 1024
ATOL = 1e-4  # float32 logits (|logits| < 5): prefill and decode differ only by summation order


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SEQS = [tokens(n + STEPS, seed=n) for n in PROMPT_LENS]  # prompt, then the tokens the steps feed


@pytest.fixture(scope="module")
def model(tiny_v4_packs):
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4

    weights = load_rank_weights(tiny_v4_packs[1], rank=0, world_size=1)
    return DeepseekV4.from_weights(weights, dtype=torch.float32, max_seq_len=MAX_SEQ_LEN, max_num_seqs=4)


def compressors(model) -> list:
    """``(name, compressor)`` of every compressor (attention's and indexer's), ``name`` as in :func:`state`."""
    return [(f"{i}.c{j}.entries", mod) for i, layer in enumerate(model.layers)
            for j, mod in enumerate(layer.attn._compressors())]


def state(model) -> dict[str, torch.Tensor]:
    """Every per-slot state tensor ``[N + 1, ...]`` (base tensors: the key buffer holds the window
    and the attention compressor's entries), by name."""
    out = {f"{i}.keys": layer.attn.keys for i, layer in enumerate(model.layers)}
    for name, mod in compressors(model):
        out[name] = mod.entries
        for part in ("buf", "prev_kv", "prev_gate"):
            if getattr(mod, part) is not None:
                out[name.replace("entries", part)] = getattr(mod, part)
    return out


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in state(model).items()}


def restore(model, saved: dict[str, torch.Tensor]) -> None:
    for n, t in state(model).items():
        t.copy_(saved[n])


@torch.inference_mode()
def run_rows(model, ids: torch.Tensor, rows: DecodeRows) -> torch.Tensor:
    """One step through ``attn_static`` and ``ffn_block`` on rows rebuilt by ``from_tuple``; logits ``[B, V]``."""
    rows = DecodeRows.from_tuple(rows.as_tuple(), rows.key, model.scratch, model.rows_spec)
    (h,) = model.embed_ids(ids)
    for layer in model.decode_layers:
        (h,) = layer.ffn_block(h, *layer.attn_static(h, ids, rows))
    return model.logits(h)[0]


@torch.inference_mode()
def test_static_steps_match_prefill_and_ignore_padding_and_bucket(model) -> None:
    for seq, n, slot in zip(SEQS, PROMPT_LENS, SLOTS):
        model(torch.tensor(seq[:n]), 0, slot=slot)
    order = random.Random(0)
    got = {i: [] for i in range(3)}
    for k in range(STEPS):
        seqs = order.sample(range(3), 3)
        ids = [SEQS[i][PROMPT_LENS[i] + k] for i in seqs]
        starts, slots = [PROMPT_LENS[i] + k for i in seqs], [SLOTS[i] for i in seqs]
        before, positions = snapshot(model), list(model.positions)
        # the same step without padding (3 rows), then padded to 4 rows, from the same state
        step = model.decode_step(torch.tensor(ids), starts, slots)
        unpadded, after = run_rows(model, step.ids, step.rows), snapshot(model)
        restore(model, before)
        model.positions = positions
        step = model.decode_step(torch.tensor(ids + ids[:1]), starts + starts[:1], slots + slots[:1], real=3)
        assert step.key == length_bucket(max(starts), MAX_SEQ_LEN) == 512
        assert step.index.tolist() == slots + [model.scratch]
        assert step.positions.tolist() == starts + starts[:1]
        logits = run_rows(model, step.ids, step.rows)
        torch.testing.assert_close(logits[3], logits[0], atol=0, rtol=0)  # the padding row is row 0's copy
        torch.testing.assert_close(logits[:3], unpadded, atol=ATOL, rtol=0)
        padded = snapshot(model)
        for name, t in padded.items():  # the padding row wrote the scratch slot only
            torch.testing.assert_close(t[:-1], after[name][:-1], atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
            assert torch.equal(t[SPARE], before[name][SPARE]), name  # a slot outside the step: untouched
        assert torch.isfinite(padded["0.keys"][model.scratch]).all()
        assert not torch.equal(padded["0.keys"][model.scratch], before["0.keys"][model.scratch])
        if starts[seqs.index(0)] == 127:  # the step completing HCA and CSA windows, in the next bucket too:
            restore(model, before)  # the same logits and state, within float32 rounding
            twice = run_rows(model, step.ids, model.step_rows(*step.tensors, 2 * step.key))
            torch.testing.assert_close(twice, logits, atol=ATOL, rtol=0)
            for name, t in snapshot(model).items():
                torch.testing.assert_close(t[:-1], padded[name][:-1], atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
        for row, i in enumerate(seqs):
            got[i].append(logits[row])
    for i, (seq, n, slot) in enumerate(zip(SEQS, PROMPT_LENS, SLOTS)):
        decoded = snapshot(model)
        want = model(torch.tensor(seq), 0, slot=SPARE, last_only=False)[n:]  # the prefill core, alone
        torch.testing.assert_close(torch.stack(got[i]), want, atol=ATOL, rtol=0, msg=lambda m: f"seq {i}: {m}")
        for name, mod in compressors(model):  # every complete entry the decode steps pooled
            live = (n + STEPS) // mod.ratio
            torch.testing.assert_close(decoded[name][slot, :live], mod.entries[SPARE, :live], atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"seq {i} {name}: {m}")
    assert sum(mod.ratio == 128 for _, mod in compressors(model)) and (PROMPT_LENS[0] + STEPS) // 128 == 1


@contextmanager
def no_host_sync():
    """Every way a tensor's value reaches the host raises (a CUDA graph capture forbids them all)."""
    names = ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__", "cpu", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name}")
        return call

    try:
        for n in names:
            setattr(torch.Tensor, n, refuse(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@torch.inference_mode()
def test_step_rows_and_attn_static_need_no_host_value(model) -> None:
    """``step_rows``, ``as_tuple`` and every layer's ``attn_static`` with host reads refused, on rows
    that complete CSA and HCA windows and a padding row; the eager ``attn_core`` gives the same bits."""
    for slot, n in ((0, 127), (1, 3)):
        model(torch.tensor(tokens(n, seed=n)), 0, slot=slot)
    before = snapshot(model)
    step = model.decode_step(torch.tensor([5, 7, 5]), [127, 3, 127], [0, 1, 0], real=2)
    (h0,) = model.embed_ids(step.ids)
    h, mids = h0, []
    for layer in model.decode_layers:
        with no_host_sync():
            rows = model.step_rows(*step.tensors, step.key)
            rows.as_tuple()
            mid = layer.attn_static(h, step.ids, rows)
        mids.append(mid)
        (h,) = layer.ffn_block(h, *mid)
    restore(model, before)
    h = h0
    for layer, mid in zip(model.decode_layers, mids):  # the eager pieces on the same inputs
        a = layer.attn_in(h, *layer.attn_in_args(step))
        eager = layer.attn_core(a, step)
        for x, y in zip(eager, mid):
            assert torch.equal(x, y)
        (h,) = layer.ffn_block(h, *eager)
    with pytest.raises(ValueError, match=r"from_tuple: 3 tensors"):
        DecodeRows.from_tuple(rows.as_tuple()[:3], step.key, model.scratch, model.rows_spec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_a_whole_decode_step_is_one_cuda_graph(tiny_v4_packs) -> None:
    """``step_rows`` + ``as_tuple`` + every layer's ``attn_static`` and ``ffn_block`` + logits captured
    in ONE CUDA graph (bucket ``B = 4``: 2 real rows and 2 padding rows, ``key = 512``), replayed for 4
    steps that cross CSA and HCA window completions: the eager steps' logits and state, bit for bit.
    (``bash benchmarks/gpu/run.sh tests`` runs it.)"""
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4

    weights = load_rank_weights(tiny_v4_packs[1], rank=0, world_size=1)
    model = DeepseekV4.from_weights(weights, device="cuda", dtype=torch.float32, max_seq_len=MAX_SEQ_LEN,
                                    max_num_seqs=3)
    for seq, n, slot in zip(SEQS[:2], PROMPT_LENS[:2], (2, 0)):
        model(torch.tensor(seq[:n], device="cuda"), 0, slot=slot)
    ids, positions, index = (torch.zeros(4, dtype=torch.int64, device="cuda") for _ in range(3))
    key = 512

    def step() -> torch.Tensor:
        rows = model.step_rows(positions, index, key)
        rows = DecodeRows.from_tuple(rows.as_tuple(), key, model.scratch, model.rows_spec)
        (h,) = model.embed_ids(ids)
        for layer in model.decode_layers:
            (h,) = layer.ffn_block(h, *layer.attn_static(h, ids, rows))
        return model.logits(h)[0]

    def inputs(k: int) -> None:  # the engine's host work: checks, bookkeeping, one copy, then into the graph's inputs
        starts = [PROMPT_LENS[0] + k, PROMPT_LENS[1] + k]
        toks = [SEQS[0][starts[0]], SEQS[1][starts[1]]]
        s = model.decode_step(torch.tensor(toks + toks[:1] * 2, device="cuda"), starts + starts[:1] * 2, [2, 0, 2, 2], real=2)
        assert s.key == key
        ids.copy_(s.ids), positions.copy_(s.tensors[0]), index.copy_(s.tensors[1])

    start, pos0 = snapshot(model), list(model.positions)
    eager, eager_state = [], []
    for k in range(STEPS):
        inputs(k)
        eager.append(step().clone())
        eager_state.append(snapshot(model))
    restore(model, start)
    model.positions = list(pos0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (it changes the state: restored below)
        inputs(0)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    restore(model, start)
    model.positions = list(pos0)
    for k in range(STEPS):
        inputs(k)
        graph.replay()
        torch.testing.assert_close(out, eager[k], atol=0, rtol=0)
        for name, t in snapshot(model).items():
            assert torch.equal(t[:-1], eager_state[k][name][:-1]), (k, name)
