"""The fused decode kernels on an H200 at DeepSeek-V4-Flash's real shapes (``-m gpu``).

Hidden 4096, expert intermediate 2048 (TP=1) and 1024 (TP=2), 256 experts, top-6, batches of 1, 4
and 16 tokens; the dense FP8 projections of one V4 layer (``wq_a``, ``wq_b``, ``wo_b``, the shared
expert's ``w2``) plus a ragged one. Each kernel is compared with its reference run on float32
inputs (the truth) and with the bf16 reference; then both kernels are captured in one CUDA graph
and replayed on new inputs, and run twice for bitwise determinism. ``fp8_linear``'s split sum folded
into its launch gives the bits of the two-kernel sum, eager, captured and replayed, and under
``torch.compile`` as the decode pieces run it. Numbers: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import pytest
import torch

from shardsmith.runtime.layers.kernels import (fp8_linear, fp8_linear_reference, fused_experts,
                                               fused_experts_reference, triton_available)
from shardsmith.runtime.layers.kernels.testing import random_bank, random_fp8_linear, random_routing, rel_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not triton_available(), reason="triton is not installed")]
TOL = 1e-2
V4_DENSE = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wo_b": (4096, 8192), "shared_w2": (4096, 2048),
            "ragged": (4000, 3000)}


@pytest.fixture(scope="module")
def gen():
    return torch.Generator(device="cuda").manual_seed(12)


@pytest.mark.parametrize("name", sorted(V4_DENSE))
@pytest.mark.parametrize("ue8m0", [True, False])
def test_fp8_linear_v4_shapes(gen, name, ue8m0):
    n, k = V4_DENSE[name]
    w, scale = random_fp8_linear(n, k, (128, 128), ue8m0=ue8m0, gen=gen)
    for m in (1, 4, 16):
        x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        truth = fp8_linear_reference(x.float(), w, scale, (128, 128))
        ref = fp8_linear_reference(x, w, scale, (128, 128))
        for block_n in (32, 128):  # the default, and a wider tile (no split-K on wq_b)
            out = fp8_linear(x, w, scale, (128, 128), block_n=block_n, backend="triton")
            assert rel_error(out, truth) < TOL, (name, m, block_n, rel_error(out, truth), rel_error(ref, truth))


@pytest.fixture(scope="module", params=[(True, 2048), (True, 1024), (False, 1024)],
                ids=["fp4-tp1", "fp4-tp2", "bf16-tp2"])
def v4_bank(request, gen):
    fp4, inter = request.param
    return random_bank(256, 4096, inter, fp4=fp4, gen=gen)


def test_fused_experts_v4_shapes(gen, v4_bank):
    for tokens in (1, 4, 16):
        ids, weights = random_routing(tokens, 6, 256, gen=gen)
        x = torch.randn(tokens, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
        out = fused_experts(x, ids, weights, **v4_bank, limit=3.0, scaled_dot=False, backend="triton")
        truth = fused_experts_reference(x.float(), ids, weights, **v4_bank, limit=3.0)
        ref = fused_experts_reference(x, ids, weights, **v4_bank, limit=3.0)
        assert rel_error(out, truth) < TOL, (tokens, rel_error(out, truth), rel_error(ref, truth))
        if "gate_up_scale" in v4_bank:  # FP4 through Triton's microscaling dot as well
            scaled = fused_experts(x, ids, weights, **v4_bank, limit=3.0, scaled_dot=True, backend="triton")
            assert rel_error(scaled, truth) < TOL, (tokens, rel_error(scaled, truth))
        again = fused_experts(x, ids, weights, **v4_bank, limit=3.0, scaled_dot=False, backend="triton")
        assert torch.equal(out, again), "run-to-run differences: a race or an atomic"
        pairs = fused_experts(x, ids, weights, **v4_bank, limit=3.0, path="pairs", backend="triton")
        assert rel_error(pairs, truth) < TOL, (tokens, rel_error(pairs, truth))
        alone = fused_experts(x[:1], ids[:1], weights[:1], **v4_bank, limit=3.0, path="pairs", backend="triton")
        assert torch.equal(pairs[:1], alone), "the pair path's row 0 depends on the rest of the batch"


def test_kernels_capture_in_one_cuda_graph(gen):
    bank = random_bank(256, 4096, 1024, fp4=True, gen=gen)
    w, scale = random_fp8_linear(4096, 2048, (128, 128), ue8m0=True, gen=gen)
    x = torch.randn(4, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(4, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
    ids, weights = random_routing(4, 6, 256, gen=gen)
    step = lambda: (fused_experts(x, ids, weights, **bank, limit=3.0), fp8_linear(h, w, scale))  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):  # new inputs in the static buffers, replay, compare with eager calls
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        h.copy_(torch.randn(h.shape, generator=gen, device="cuda"))
        new_ids, new_weights = random_routing(4, 6, 256, gen=gen)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        eager = step()
        assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1])


SPLIT_SHAPES = [(4096, 4096), (8192, 4096), (32768, 1024), (4096, 1024), (1024, 4096), (4000, 3000)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _graphed(step):
    """``step()``'s outputs captured in a CUDA graph (warmed up on a side stream first) and the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return outs, graph


@pytest.mark.parametrize("n, k", SPLIT_SHAPES)
def test_fp8_linear_fused_split_sum_is_the_two_kernel_sum_v4_shapes(gen, n, k):
    """M = 1, 4, 16 with the default split and with 8 and 32 forced: fused == two-kernel bit for
    bit, eager, repeated 20 times (a race or a stale counter would show), and captured in one
    CUDA graph replayed twice on new inputs; the counters are zero after."""
    from shardsmith.runtime.layers.kernels.fp8_linear import split_counters

    w, scale = random_fp8_linear(n, k, (128, 128), ue8m0=True, gen=gen)
    xs = [torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) for m in (1, 4, 16)]

    def step():
        return [fp8_linear(x, w, scale, split_k=s, fused_sum=fused) for x in xs for s in (None, 8, 32)
                for fused in (True, False)]

    first = step()
    for _ in range(20):
        outs = step()
        for i in range(0, len(outs), 2):
            assert torch.equal(_bits(outs[i]), _bits(outs[i + 1])) and torch.equal(_bits(outs[i]), _bits(first[i]))
    assert rel_error(first[0], fp8_linear_reference(xs[0].float(), w, scale, (128, 128))) < TOL
    outs, graph = _graphed(step)
    for _ in range(2):
        for x in xs:
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        graph.replay()
        eager = step()
        for i in range(0, len(outs), 2):
            assert torch.equal(_bits(outs[i]), _bits(outs[i + 1])) and torch.equal(_bits(outs[i]), _bits(eager[i]))
    torch.cuda.synchronize()
    assert not split_counters(xs[0].device, 0).any()


def test_fp8_linear_split_sum_under_capture_without_counters(gen, monkeypatch):
    """Counters that would have to grow during capture are not allocated there: the captured call
    sums with the second kernel, same bits, and the counters stay unallocated."""
    import sys

    mod = sys.modules["shardsmith.runtime.layers.kernels.fp8_linear"]
    w, scale = random_fp8_linear(4096, 4096, (128, 128), ue8m0=True, gen=gen)
    x = torch.randn(4, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    want = fp8_linear(x, w, scale, split_k=8, fused_sum=False)  # compiles the two-kernel variant
    monkeypatch.setattr(mod, "_COUNTERS", {})
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fp8_linear(x, w, scale, split_k=8, fused_sum=True)
    assert mod._COUNTERS == {}
    graph.replay()
    assert torch.equal(_bits(out), _bits(want))


def test_fp8_linear_fused_split_sum_under_torch_compile(gen):
    """As the decode pieces run it (``torch.compile``, the kernel traced as a user kernel): the
    bits of the eager two-kernel path, captured and replayed too."""
    w, scale = random_fp8_linear(4096, 4096, (128, 128), ue8m0=True, gen=gen)
    x = torch.randn(4, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    want = fp8_linear(x, w, scale, split_k=8, fused_sum=False)
    fn = torch.compile(lambda x: fp8_linear(x, w, scale, split_k=8) * 1.0, dynamic=False)
    assert torch.equal(_bits(fn(x)), _bits(want))
    assert torch.equal(_bits(fn(x)), _bits(want))
    outs, graph = _graphed(lambda: fn(x))
    x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
    graph.replay()
    assert torch.equal(_bits(outs), _bits(fp8_linear(x, w, scale, split_k=8, fused_sum=False)))


@pytest.mark.parametrize("name", sorted(V4_DENSE) + ["wo_a"])
def test_fp8_gemv_v4_shapes_eager_and_replayed(gen, name):
    """One token through the GEMV kernel at V4's shapes (and the grouped ``wo_a``, 8 x [1024, 4096]):
    within bf16's spread of the float32 truth like the dot kernel, and a CUDA graph's replay on new
    inputs gives the eager call's bits."""
    n, k, groups = (8192, 4096, 8) if name == "wo_a" else (*V4_DENSE[name], 1)
    w, scale = random_fp8_linear(n, k, (128, 128), ue8m0=True, gen=gen)
    shape = (1, groups, k) if groups > 1 else (1, k)
    x = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    truth = fp8_linear_reference(x.float(), w, scale, (128, 128), groups)
    out = fp8_linear(x, w, scale, (128, 128), groups=groups, gemv=True, backend="triton")
    dot = fp8_linear(x, w, scale, (128, 128), groups=groups, gemv=False, backend="triton")
    assert rel_error(out, truth) < TOL and rel_error(dot, truth) < TOL, (rel_error(out, truth), rel_error(dot, truth))
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fp8_linear(static, w, scale, (128, 128), groups=groups, gemv=True, backend="triton")
    fresh = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    static.copy_(fresh)
    graph.replay()
    eager = fp8_linear(fresh, w, scale, (128, 128), groups=groups, gemv=True, backend="triton")
    assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16))
