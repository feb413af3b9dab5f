"""DeepSeek-V4's fused hyper-connection expansion (``hc_post``) against its PyTorch reference.

CPU: under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton loads), with its float32 ->
bfloat16 casts rounding to nearest even as the GPU's do (``interpreter_rounds_bf16``; the interpreter
itself truncates): m = 4, 3 and 2 streams, hidden sizes 64, 40 and 4096 (V4's), T = 1, 3, 5 and 16
tokens, bf16, float16 and float32, full and partial ``block_d`` slices, strided inputs. The kernel
gives the reference's bits in bf16 and float16, and in float32 at m = 4 (the CPU matmul's FMA chain in
stream order; at m = 2, 3 it takes another path: within float32 rounding). The reference is, bit for bit,
``hyper.expand``; a mixer with ``post_kernel`` on launches ``hc_post`` up to 16 tokens and gives
``expand``'s bits; token counts compile one variant; bad inputs raise one ``KernelError`` naming every
problem; a tiny V4 with the kernels forced decodes through its pieces with its forward's bits.
GPU (``-m gpu``): V4's shapes (m = 4, D = 4096, bf16) for T = 1, 4, 16 within one bf16 rounding of
the reference (the count of differing elements printed), the same bits under CUDA-graph replay and
through ``torch.compile``.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.kernels import KernelError, triton_available
from shardsmith.runtime.layers.kernels.deepseek_v4.hc_post import hc_post, hc_post_reference
from shardsmith.runtime.layers.kernels.testing import interpreter_rounds_bf16

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.fixture
def gpu_rounding():
    """bf16 casts in the interpreter round as on the GPU (nothing to do on CUDA)."""
    with interpreter_rounds_bf16():
        yield


def _case(T: int, m: int, D: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """Streams and a sublayer output of unit size, ``post`` in (0, 2) and a column-stochastic ``comb``,
    as the mixer makes them."""
    g = torch.Generator(device=device).manual_seed(seed)
    streams = torch.randn(T, m, D, generator=g, device=device).to(dtype)
    out = torch.randn(T, D, generator=g, device=device).to(dtype)
    post = 2 * torch.rand(T, m, generator=g, device=device)
    comb = torch.rand(T, m, m, generator=g, device=device) + 1e-3
    return streams, out, post, comb / comb.sum(dim=1, keepdim=True)


def _within_rounding(got: torch.Tensor, want: torch.Tensor, streams: torch.Tensor, out: torch.Tensor,
                     post: torch.Tensor, comb: torch.Tensor) -> None:
    """Every element within one rounding of the dtype at the result (``eps * max(|got|, |want|)``: two
    roundings of nearly the same value may land one ulp apart at a power of two), plus one rounding of the
    dtype at the ``comb`` sum (the matmul's result is rounded before the add: adding its m float32 products
    in another order, as cuBLAS may, can move that rounding by one ulp of ``|comb.T @ streams|``, which
    cancellation can make larger than the result's own ulp), plus a few float32 ulps of the terms."""
    mixed = torch.matmul(comb.double().abs().transpose(-1, -2), streams.double().abs())
    terms = (post.double()[..., None] * out.double()[:, None, :]).abs() + mixed
    err = (got.double() - want.double()).abs()
    eps = torch.finfo(want.dtype).eps
    bound = (eps * torch.maximum(got.double().abs(), want.double().abs()) + (eps if want.dtype != torch.float32 else 0) * mixed
             + 4 * torch.finfo(torch.float32).eps * terms)
    assert (err <= bound).all(), f"{(err > bound).sum().item()} elements past one rounding, max {err.max().item()}"


@needs_triton
@pytest.mark.parametrize(("T", "m", "D", "dtype", "block_d"), [
    (1, 4, 64, torch.float32, 256),     # one program per token (the block clipped to D)
    (3, 4, 64, torch.bfloat16, 16),     # 4 slices per token
    (16, 4, 64, torch.float16, 32),     # the decode limit
    (5, 4, 40, torch.bfloat16, 16),     # D = 40: the last slice 8 of 16 wide
    (3, 3, 40, torch.bfloat16, 64),     # m = 3: streams padded to 4 in registers
    (3, 2, 48, torch.float32, 16),      # m = 2 (float32: within rounding, see below)
    (5, 3, 40, torch.float32, 32),
    (1, 4, 4096, torch.bfloat16, 256),  # V4's hidden size
    (3, 4, 4096, torch.float32, 256),
    (16, 4, 4096, torch.bfloat16, 256),
])
def test_matches_reference(gpu_rounding, T, m, D, dtype, block_d):
    streams, out, post, comb = _case(T, m, D, dtype, seed=T + m + D)
    want = hc_post_reference(streams, out, post, comb)
    got = hc_post(streams, out, post, comb, block_d=block_d, backend="triton")
    assert got.shape == want.shape == (T, m, D) and got.dtype == want.dtype == dtype and got.is_contiguous()
    if dtype != torch.float32 or m == 4:
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} differ"
    else:  # MKL adds 2 or 3 float32 products in another way than its m = 4 FMA chain
        _within_rounding(got, want, streams, out, post, comb)
    assert torch.equal(hc_post(streams, out, post, comb, block_d=block_d, backend="triton"), got)  # deterministic


@needs_triton
def test_strided_inputs(gpu_rounding):
    """Streams viewed out of a wider tensor (copied first) and an output with a row stride (read in
    place): the bits of the contiguous call."""
    streams, out, post, comb = _case(3, 4, 64, torch.bfloat16, seed=11)
    wide = torch.randn(3, 4, 96).to(torch.bfloat16)
    wide[..., :64] = streams
    rows = torch.randn(3, 2 * 64).to(torch.bfloat16)
    rows[:, 32:96] = out
    got = hc_post(wide[..., :64], rows[:, 32:96], post, comb.transpose(1, 2).contiguous().transpose(1, 2),
                  block_d=32, backend="triton")
    assert torch.equal(got, hc_post_reference(streams, out, post, comb))


def test_reference_is_expand_bitwise():
    """``hc_post_reference`` is ``hyper.expand`` (the decoder layer's maths in transformers), bit for bit."""
    from shardsmith.runtime.models.deepseek_v4.hyper import expand

    for dtype in (torch.float32, torch.bfloat16):
        streams, out, post, comb = _case(7, 4, 64, dtype, seed=3)
        assert torch.equal(hc_post_reference(streams, out, post, comb), expand(streams, out, post, comb))


@needs_triton
def test_mixer_expands_through_the_kernel(gpu_rounding):
    """A ``HyperMixer`` with ``post_kernel`` on runs ``hc_post`` at any token count (decode rows and
    prefill chunks), with ``expand``'s bits (bf16); off, it launches nothing."""
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches
    from shardsmith.runtime.models.deepseek_v4.hyper import HyperMixer, expand

    mixer = HyperMixer(64, 4, 20, 1e-6, 1e-6)
    streams, out, post, comb = _case(17, 4, 64, torch.bfloat16, seed=5)
    for T in (3, 16, 17):
        args = (streams[:T], out[:T], post[:T], comb[:T])
        for on in (False, True):
            mixer.post_kernel = on
            with record_launches(run=True) as keys:
                got = mixer.expand(*args)
            assert [k[0] for k in keys] == (["_hc_post_kernel"] if on else [])
            assert torch.equal(got, expand(*args))


@needs_triton
def test_one_variant_for_every_token_count():
    """Token counts are not specialised: T = 1..20 compile one variant per dtype."""
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches

    streams, out, post, comb = _case(20, 4, 64)
    with record_launches() as keys:
        for T in range(1, 21):
            hc_post(streams[:T], out[:T], post[:T], comb[:T])
        hc_post(streams[:3].bfloat16(), out[:3].bfloat16(), post[:3], comb[:3])
    assert len(keys) == 21 and len(set(keys)) == 2


def test_bad_inputs_raise_every_problem():
    streams, out, post, comb = _case(2, 4, 64)
    with pytest.raises(KernelError, match=r"hc_post: out \(2, 64\) torch.bfloat16: want \[2, 64\] torch.float32 "
                                          r"\(the streams'\); post \(2, 3\) torch.float32: want \[2, 4\] float32; "
                                          r"comb \(2, 4, 4\) torch.bfloat16: want \[2, 4, 4\] float32; "
                                          r"block_d=48: a power of two >= 16"):
        hc_post(streams, out.bfloat16(), post[:, :3], comb.bfloat16(), block_d=48)
    with pytest.raises(KernelError, match=r"hc_post: streams \(2, 256\) torch.float32: want \[T, m, D\]"):
        hc_post(streams.flatten(1), out, post, comb)
    with pytest.raises(KernelError, match=r"streams \(2, 4, 64\) torch.int32: want \[T, m, D\] bfloat16"):
        hc_post(streams.int(), out, post, comb)
    with pytest.raises(KernelError, match=r"out \(3, 64\)"):
        hc_post(streams, torch.cat([out, out[:1]]), post, comb)
    with pytest.raises(KernelError, match="on cpu, meta, cpu, cpu: one device"):
        hc_post(streams, out.to("meta"), post, comb)
    with pytest.raises(KernelError, match="backend 'gpu'"):
        hc_post(streams, out, post, comb, backend="gpu")


@needs_triton
def test_tiny_v4_pieces_with_the_mixer_kernels_give_the_forward_bits(tmp_path, use_settings):
    """Tiny DeepSeek-V4 on CPU, float32, with the ``hc_pre`` and ``hc_post`` kernels forced (the
    other kernels off): every one-token step through the decode pieces (``attn_in``, core, ``ffn_block``,
    as graphed on CUDA) gives the logits of the plain forward bit for bit, and both ran the kernels
    (``hc_pre`` with the norm folded: no separate norm between mixer and projections)."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4
    from shardsmith.writer.split import split_checkpoint

    use_settings(hc_pre="kernel")
    use_settings(hc_post="kernel")
    split_checkpoint(tiny_deepseek_v4(tmp_path / "src", layers=2), tmp_path / "tp1", world_size=1)
    eng = Engine.load(tmp_path / "tp1", rank=0, world_size=1, dtype=torch.float32, max_seq_len=32, cuda_graphs=False)
    layers = len(eng.model.layers)
    assert all(m.kernel and m.post_kernel for layer in eng.model.layers for m in (layer.hc_attn, layer.hc_ffn))

    def run() -> tuple[list[torch.Tensor], list[str]]:
        with record_launches(run=True) as keys:
            logits = [eng.forward(torch.tensor([3, 17, 42, 99]), 0)]
            for i, token in enumerate((5, 8, 61)):
                logits.append(eng.forward(torch.tensor([token]), 4 + i))
        return logits, [k[0] for k in keys]

    eager, eager_keys = run()
    eng.use_decode_graphs()
    pieces, piece_keys = run()
    assert eng.graphs is not None and eng.graphs.pool is not None
    for keys in (eager_keys, piece_keys):  # prefill and 3 steps, 2 mixers and 2 expansions per layer
        assert keys.count("_hc_pre_kernel") == keys.count("_hc_post_kernel") == 4 * 2 * layers
    for want, have in zip(eager, pieces):
        assert torch.equal(have, want)


# ------------------------------------------------------------------ GPU: V4 shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4, 16])
def test_v4_shapes_on_cuda_graphed_and_compiled(T):
    streams, out, post, comb = _case(T, 4, 4096, torch.bfloat16, device="cuda", seed=T)
    got = hc_post(streams, out, post, comb)
    want = hc_post_reference(streams, out, post, comb)
    _within_rounding(got, want, streams, out, post, comb)
    print(f"\nhc_post T={T}: {(got != want).sum().item()} of {got.numel()} elements differ from cuBLAS's path")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = hc_post(streams, out, post, comb)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, got)
    compiled = torch.compile(lambda *a: hc_post(*a) + 0, dynamic=False)  # a user kernel in inductor's graph
    assert torch.equal(compiled(streams, out, post, comb), got)
