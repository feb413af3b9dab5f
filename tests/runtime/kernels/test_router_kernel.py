"""A MoE layer's router in one launch (``route_topk``) against its PyTorch reference.

CPU: under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton loads): E = 24 (our test
packs) and 256 (V4-Flash) experts, also 200 and 20 (padded to a power of two), D = 4096 and smaller
(some not a multiple of the step), T = 1, 3, 5, 16 tokens (one to four token tiles), bf16 / f16 /
float32 ``x``, each score function, with and without the bias, top-K and both hash-routed forms,
split counts from 1 to many. The kernel's experts are the reference's (as sets; a difference is
allowed only where the reference's own ``scores + bias`` tie within float32 rounding at the K-th
place), in descending order, its weights within float32 rounding of the reference's for the same
experts; three calls give the same bits and leave the split-K counters at zero. Exact ties go to
the lower expert; NaN scores still give K distinct experts in range; scores of logits far below 0
keep their relative precision (the weights are their ratios). Bad inputs raise one ``KernelError``
naming every problem. The reference is, bit for bit, the maths ``MoE.route`` ran before the kernel,
and the tiny DeepSeek-V4's routers (hash-routed and top-K layers) run the kernel up to 16 tokens.
GPU (``-m gpu``): V4-Flash's router (bf16 x, E = 256, D = 4096, K = 6) for T = 1, 4, 16 against the
reference, the same bits under CUDA-graph capture and replay.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.kernels import KernelError, triton_available
from shardsmith.runtime.layers.kernels.fp8_linear import split_counters
from shardsmith.runtime.layers.kernels.router import route_topk, route_topk_reference, splits_for

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
SCALE = 1.5  # V4-Flash's routed_scaling_factor


def _case(T: int, E: int, D: int, dtype: torch.dtype = torch.bfloat16, *, bias: bool = True, device: str = "cpu",
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, D, generator=g, device=device).to(dtype)
    weight = torch.randn(E, D, generator=g, device=device) * D ** -0.5
    b = torch.randn(E, generator=g, device=device) * 0.1 if bias else None
    return x, weight, b


def _selection(x, weight, bias, score_func) -> torch.Tensor:
    """The reference's ``scores + bias`` ``[T, E]`` in float64 (what the top-K ranks)."""
    logits = F.linear(x.double(), weight.double())
    scores = {"sqrtsoftplus": lambda v: F.softplus(v).sqrt(), "sigmoid": torch.sigmoid,
              "softmax": lambda v: v.softmax(-1)}[score_func](logits)
    return scores if bias is None else scores + bias.double()


def _check_route(got, x, weight, bias, top_k, score_func, *, rel: float = 1e-5, scale: float = SCALE,
                 **table) -> None:
    """``got``'s experts are the reference's (module docstring), in descending order when chosen by
    top-K, and its weights the reference's for those experts within ``rel`` of the largest."""
    index, w = got
    T = x.shape[0]
    assert index.shape == w.shape == (T, top_k) and index.dtype == torch.int64 and w.dtype == torch.float32
    want_index, want_w = route_topk_reference(x, weight, bias, top_k, score_func, scale, **table)
    if table:  # hash-routed: the table's experts, in its order
        assert torch.equal(index, want_index)
    else:
        sel = _selection(x, weight, bias, score_func)
        tol = 1e-5 * sel.abs().max().item()
        for t in range(T):
            if not torch.equal(index[t].sort().values, want_index[t].sort().values):  # a near-tie only
                kth = sel[t].topk(top_k).values[-1]
                assert (sel[t, index[t]] >= kth - tol).all(), (t, index[t], want_index[t])
        assert all(len(set(r.tolist())) == top_k for r in index)
        picked = sel.gather(1, index)
        assert (picked[:, 1:] <= picked[:, :-1] + tol).all(), "experts not in descending order"
        _, want_w = route_topk_reference(x, weight, bias, top_k, score_func, scale, index=index)  # same experts
    err = (w.double() - want_w.double()).abs().max().item()
    assert err <= rel * max(1.0, want_w.abs().max().item()), err


@needs_triton
@pytest.mark.parametrize(("T", "E", "D", "dtype", "score_func", "bias", "top_k", "split_k", "block_e"), [
    (1, 24, 4096, torch.bfloat16, "sqrtsoftplus", True, 6, None, 32),  # a test pack's gate, the default split
    (3, 24, 256, torch.float32, "sigmoid", False, 2, 3, 8),  # 3 row blocks; 4 steps over 2 splits
    (16, 256, 256, torch.bfloat16, "sqrtsoftplus", True, 6, None, 32),  # V4-Flash's E, four token tiles
    (5, 200, 200, torch.float16, "softmax", True, 8, 2, 64),  # E padded to 256, the last block short; D ragged
    (16, 256, 256, torch.float32, "sigmoid", True, 1, 1, 128),  # one split: each program's own partials
    (3, 20, 64, torch.bfloat16, "sqrtsoftplus", True, 20, None, 16),  # K = E: every expert, in order
])
def test_top_k_matches_reference(T, E, D, dtype, score_func, bias, top_k, split_k, block_e):
    x, weight, b = _case(T, E, D, dtype, bias=bias, seed=T + E + D)
    first = route_topk(x, weight, b, top_k, score_func, SCALE, split_k=split_k, block_e=block_e, backend="triton")
    _check_route(first, x, weight, b, top_k, score_func)
    for _ in range(2):  # the counters were set back to 0: the next calls finish the same way
        again = route_topk(x, weight, b, top_k, score_func, SCALE, split_k=split_k, block_e=block_e, backend="triton")
        assert all(torch.equal(a, c) for a, c in zip(again, first))
    assert not split_counters(x.device, 4).any()


@needs_triton
@pytest.mark.parametrize(("T", "E", "D", "dtype", "score_func", "form"), [
    (3, 24, 256, torch.bfloat16, "sqrtsoftplus", "index"),  # the experts given per token
    (16, 256, 256, torch.bfloat16, "sqrtsoftplus", "tid2eid"),  # V4's hash layers: tid2eid[ids] in the kernel
    (1, 24, 4096, torch.float32, "softmax", "tid2eid-int32"),
])
def test_hash_routed_matches_reference(T, E, D, dtype, score_func, form):
    x, weight, _ = _case(T, E, D, dtype, bias=False, seed=T + E)
    g = torch.Generator().manual_seed(E)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(50)])  # [V, K]
    ids = torch.randint(0, 50, (T,), generator=g)
    if form == "index":
        table = {"index": tid2eid[ids]}
    else:
        dt = torch.int32 if form.endswith("int32") else torch.int64
        table = {"tid2eid": tid2eid.to(dt), "ids": ids.to(dt)}
    got = route_topk(x, weight, None, 6, score_func, SCALE, backend="triton", **table)
    assert torch.equal(got[0], tid2eid[ids])
    _check_route(got, x, weight, None, 6, score_func, **table)
    assert torch.equal(route_topk(x, weight, None, 6, score_func, SCALE, backend="triton", **table)[1], got[1])


@needs_triton
def test_ties_go_to_the_lower_expert():
    """Equal gate rows give bitwise equal scores: the kernel takes the lowest experts first."""
    x, weight, _ = _case(2, 24, 128, torch.float32, seed=1)
    weight[:] = weight[3]  # every expert ties
    index, w = route_topk(x, weight, torch.zeros(24), 6, "sqrtsoftplus", SCALE, backend="triton")
    assert index.tolist() == [[0, 1, 2, 3, 4, 5]] * 2
    assert torch.allclose(w, torch.full_like(w, SCALE / 6))
    bias = torch.zeros(24)
    bias[[17, 9, 21]] = 1.0  # three tied leaders, then the rest tied
    index, _ = route_topk(x, weight, bias, 6, "sqrtsoftplus", SCALE, backend="triton")
    assert index.tolist() == [[9, 17, 21, 0, 1, 2]] * 2


@needs_triton
def test_nan_scores_still_give_distinct_experts_in_range():
    x, weight, b = _case(3, 24, 64, torch.float32, seed=2)
    x[1, 5] = float("nan")
    index, w = route_topk(x, weight, b, 6, "sqrtsoftplus", SCALE, backend="triton")
    assert ((index >= 0) & (index < 24)).all() and all(len(set(r.tolist())) == 6 for r in index)
    assert w[1].isnan().all() and not w[[0, 2]].isnan().any()
    _check_route((index[[0, 2]], w[[0, 2]]), x[[0, 2]], weight, b, 6, "sqrtsoftplus")


@needs_triton
def test_softplus_keeps_precision_far_from_zero():
    """Logits near -30 (scores ~3e-7: ``log(1 + exp(l))`` would round to 0) and past 20 (the logit
    itself): the weights, ratios of those scores, match the reference to float32 rounding."""
    x = torch.ones(2, 64)
    weight = torch.zeros(8, 64)
    weight[:, 0] = torch.tensor([-30.0, -31.0, -29.5, -33.0, 25.0, 21.0, -1.0, 0.5])
    bias = torch.tensor([9.0, 9.0, 9.0, 9.0, 0.0, 0.0, 0.0, 0.0])  # chooses the four tiny ones
    got = route_topk(x, weight, bias, 4, "sqrtsoftplus", SCALE, backend="triton")
    assert got[0].tolist() == [[0, 1, 2, 3]] * 2  # 9 + s rounds to 9 in float32: tied, in expert order
    _check_route(got, x, weight, bias, 4, "sqrtsoftplus", rel=2e-6)
    got = route_topk(x, weight, None, 3, "sqrtsoftplus", SCALE, backend="triton")
    assert got[0].tolist() == [[4, 5, 7]] * 2
    _check_route(got, x, weight, None, 3, "sqrtsoftplus", rel=2e-6)


def test_splits_for():
    assert splits_for(4096, 16, sms=132) == (16, 1)  # V4-Flash, 16-row blocks: 16 x 16 programs of one step of 256
    assert splits_for(4096, 8, sms=132, block_k=64) == (32, 2)  # 32-row blocks: 8 x 32 programs of 2 steps of 64
    assert splits_for(4096, 2, sms=132) == (16, 1)  # E = 24: 2 row blocks, a split per step
    assert splits_for(200, 4, sms=132, block_k=64, split_k=2) == (2, 2)  # 4 steps of 64 (the last short)
    assert splits_for(200, 4, sms=132, block_k=64, split_k=3) == (2, 2)  # 3 splits would leave one empty


def test_reference_is_the_routers_former_maths_bitwise():
    """``MoE.route`` ran this before ``route_topk`` (``git show 2741883:shardsmith/runtime/models/
    deepseek_v4/moe.py``); the reference gives its bits, for each score function and both routings."""
    x, weight, bias = _case(7, 24, 256, torch.bfloat16, seed=3)
    tid2eid = torch.stack([torch.randperm(24, generator=torch.Generator().manual_seed(i))[:6] for i in range(30)])
    ids = torch.tensor([0, 29, 3, 3, 17, 8, 11])
    for score_func in ("sqrtsoftplus", "sigmoid", "softmax"):
        for hashed in (False, True):
            logits = F.linear(x.float(), weight)
            if score_func == "sqrtsoftplus":
                scores = F.softplus(logits).sqrt()
            elif score_func == "sigmoid":
                scores = logits.sigmoid()
            else:
                scores = logits.softmax(dim=-1)
            if hashed:
                index = tid2eid[ids].long()
            else:
                index = torch.topk(scores + bias, 6, dim=-1, sorted=False).indices
            w = scores.gather(1, index)
            old = (index, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * SCALE)
            table = {"tid2eid": tid2eid, "ids": ids} if hashed else {}
            new = route_topk_reference(x, weight, None if hashed else bias, 6, score_func, SCALE, **table)
            assert all(torch.equal(a, b) for a, b in zip(new, old))
            assert all(torch.equal(a, b) for a, b in zip(route_topk(x, weight, None if hashed else bias, 6, score_func,
                                                                    SCALE, backend="reference", **table), old))


@needs_triton
def test_tiny_v4_routers_through_the_kernel(tiny):
    """The tiny DeepSeek-V4's routers (layer 0 hash-routed, the others top-K, sqrt-softplus) with
    ``kernel`` on run ``route_topk``'s launch up to 16 tokens and the reference past them (the same
    bits as with ``kernel`` off: the load leaves it off on CPU); ``warm_kernel`` launches once per variant."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches

    eng = Engine.load(tiny("deepseek-v4"), rank=0, world_size=1, device="cpu", dtype=torch.float32,
                      from_checkpoint=True, max_seq_len=32)
    layers = eng.model.layers
    assert layers[0].ffn.hashed and not layers[1].ffn.hashed and not any(layer.ffn.kernel for layer in layers)
    g = torch.Generator().manual_seed(4)
    D = layers[0].ffn.gate.weight.shape[1]
    x, ids = torch.randn(17, D, generator=g), torch.randint(0, 512, (17,), generator=g)
    for moe in (layers[0].ffn, layers[1].ffn):
        for T in (3, 17):
            want = moe.route(x[:T], ids[:T])
            moe.kernel = True
            with record_launches(run=True) as keys:
                got = moe.route(x[:T], ids[:T])
            moe.kernel = False
            assert [k[0] for k in keys] == (["_router_kernel"] if T <= 16 else [])
            if T > 16:
                assert all(torch.equal(a, b) for a, b in zip(got, want))
            gate = moe.gate
            table = {"tid2eid": gate.tid2eid, "ids": ids[:T]} if moe.hashed else {}
            _check_route(got, x[:T], gate.weight, None if moe.hashed else gate.bias, moe.top_k, moe.score_func,
                         scale=moe.scale, **table)
    seen: set = set()
    for layer in layers:
        layer.ffn.kernel = True
    with record_launches() as keys:
        launches = sum(layer.ffn.warm_kernel(seen, dtype=torch.float32) for layer in layers)
    assert launches == len(keys) == 2 and len(set(keys)) == 2  # the hash-routed variant and the top-K one


@needs_triton
def test_one_variant_for_every_token_count():
    """Token and split counts are not specialised: T = 1..40 compile one variant per x dtype."""
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches

    x, weight, bias = _case(40, 24, 256, torch.float32)
    with record_launches() as keys:
        for T in range(1, 41):
            route_topk(x[:T], weight, bias, 6, "sqrtsoftplus", SCALE)
        route_topk(x[:3].bfloat16(), weight, bias, 6, "sqrtsoftplus", SCALE)
    assert len(keys) == 41 and len(set(keys)) == 2


def test_bad_inputs_raise_every_problem():
    x, weight, bias = _case(2, 24, 64)
    with pytest.raises(KernelError, match=r"route_topk: weight \(24, 63\) torch.float32: want \[E, D=64\] float32; "
                                          r"bias \(24,\) torch.float64: want \[24\] float32; "
                                          r"top_k=25: want 1 <= top_k <= E=24; "
                                          r"score_func 'relu': want one of sqrtsoftplus, sigmoid, softmax; "
                                          r"block_e=24: a power of two in 4..256; block_k=8: a power of two >= 16"):
        route_topk(x, weight[:, :63], bias.double(), 25, "relu", SCALE, block_e=24, block_k=8)
    with pytest.raises(KernelError, match=r"x \(2, 4, 16\) torch.bfloat16: want \[T, D\]"):
        route_topk(x.view(2, 4, 16), weight, bias, 6, "sigmoid", SCALE)
    with pytest.raises(KernelError, match=r"index \(2, 5\) torch.float32: want \[2, 6\] int64 or int32$"):
        route_topk(x, weight, None, 6, "sigmoid", SCALE, index=torch.zeros(2, 5))
    with pytest.raises(KernelError, match=r"tid2eid and ids: pass both or neither; tid2eid \(9, 6\) torch.int64: "
                                          r"want \[V, 6\] int64 or int32, rows contiguous$"):
        route_topk(x, weight, None, 6, "sigmoid", SCALE, tid2eid=torch.zeros(6, 9, dtype=torch.long).t())
    with pytest.raises(KernelError, match=r"index with tid2eid / ids: pass the experts or the table, not both; "
                                          r"ids \(3,\) torch.int64: want \[2\] int64 or int32$"):
        route_topk(x, weight, None, 6, "sigmoid", SCALE, index=torch.zeros(2, 6, dtype=torch.long),
                   tid2eid=torch.zeros(9, 6, dtype=torch.long), ids=torch.zeros(3, dtype=torch.long))
    with pytest.raises(KernelError, match=r"x, weight, bias on cpu, meta, cpu: one device$"):
        route_topk(x, weight.to("meta"), bias, 6, "sigmoid", SCALE)
    with pytest.raises(KernelError, match="backend 'gpu'"):
        route_topk(x, weight, bias, 6, "sigmoid", SCALE, backend="gpu")
    if triton_available():
        with pytest.raises(KernelError, match="route_topk: weight has E=1100 experts: the kernel takes up to 1024"):
            route_topk(x, torch.zeros(1100, 64), None, 6, "sigmoid", SCALE, backend="triton")


# ------------------------------------------------------------------ GPU: V4 shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4, 16])
def test_v4_shapes_on_cuda_and_graphed(T):
    x, weight, bias = _case(T, 256, 4096, torch.bfloat16, device="cuda", seed=T)
    got = route_topk(x, weight, bias, 6, "sqrtsoftplus", SCALE)
    _check_route(tuple(t.cpu() for t in got), x.cpu(), weight.cpu(), bias.cpu(), 6, "sqrtsoftplus", rel=1e-4)
    ids = torch.randint(0, 1000, (T,), device="cuda")
    tid2eid = torch.stack([torch.randperm(256, device="cuda")[:6] for _ in range(1000)])
    hashed = route_topk(x, weight, None, 6, "sqrtsoftplus", SCALE, tid2eid=tid2eid, ids=ids)
    assert torch.equal(hashed[0], tid2eid[ids])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route_topk(x, weight, bias, 6, "sqrtsoftplus", SCALE)
        out_hashed = route_topk(x, weight, None, 6, "sqrtsoftplus", SCALE, tid2eid=tid2eid, ids=ids)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip((*out, *out_hashed), (*got, *hashed)))
