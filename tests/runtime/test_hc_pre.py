"""DeepSeek-V4's fused hyper-connection mixer (``hc_pre``) against its PyTorch reference.

CPU: under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton loads) on small shapes: m = 4
and m = 2 streams, hidden sizes 64, 48 and 40, T = 1, 3, 5 tokens (one and two token tiles, a partial
one), float32 and bf16 streams, split counts from 1 to many, including splits that do not divide K
and a last split past K. pre/post/comb land within float32 rounding of the reference, ``collapsed``
within one rounding of its dtype; three calls in a row give the same bits and leave the split-K
counters at zero; bad inputs raise one ``KernelError`` naming every problem. The reference is, bit for
bit, the maths ``HyperMixer.forward`` ran before the kernel (``F.linear`` of ``rms_unweighted``, then
``hc_mix``). GPU (``-m gpu``): V4's shapes (m = 4, D = 4096, bf16) for T = 1, 4, 16 against the
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
from shardsmith.runtime.layers.kernels.hc_mix import hc_mix
from shardsmith.runtime.layers.kernels.hc_pre import hc_pre, hc_pre_reference, splits_for

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
ITERS, EPS, NORM_EPS = 20, 1e-6, 1e-6


def _case(T: int, m: int, D: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    W = (2 + m) * m
    streams = torch.randn(T, m, D, generator=g, device=device).to(dtype)
    fn = torch.randn(W, m * D, generator=g, device=device) * (m * D) ** -0.5
    base = torch.randn(W, generator=g, device=device) * 0.5
    scale = torch.rand(3, generator=g, device=device) + 0.5
    return streams, fn, base, scale


def _close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], *, rel: float = 1e-5) -> None:
    """pre/post/comb within float32 rounding; collapsed within one rounding of its dtype (plus what the
    float32 pre's rounding moves it)."""
    x, *mix = got
    x_want, *mix_want = want
    for a, b in zip(mix, mix_want):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        assert (a.double() - b.double()).abs().max().item() <= rel * max(1.0, b.abs().max().item())
    assert x.shape == x_want.shape and x.dtype == x_want.dtype
    err = (x.double() - x_want.double()).abs()
    assert (err <= torch.finfo(x.dtype).eps * x_want.double().abs() + 1e-5).all(), err.max().item()


@needs_triton
@pytest.mark.parametrize(("T", "m", "D", "dtype", "split_k", "block_k"), [
    (1, 4, 64, torch.float32, None, 64),   # the default split: one K step of 64 per program
    (3, 4, 64, torch.bfloat16, None, 16),  # 16 splits of 16
    (5, 4, 64, torch.float32, 3, 16),      # two token tiles, 3 splits of 96 (the last one past K)
    (1, 2, 48, torch.bfloat16, 4, 16),     # m = 2: W = 8 logits; 3 splits of 32
    (3, 2, 48, torch.float32, 5, 32),      # K = 96 in 3 steps of 32 over 3 splits
    (5, 2, 40, torch.bfloat16, 2, 16),     # K = 80: 2 splits of 48, the last 32 of them
    (5, 4, 64, torch.bfloat16, 1, 64),     # one split: the counter is the program's own
])
def test_matches_reference(T, m, D, dtype, split_k, block_k):
    streams, fn, base, scale = _case(T, m, D, dtype, seed=T + m + D)
    want = hc_pre_reference(streams, fn, base, scale, ITERS, EPS, NORM_EPS)
    first = hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, split_k=split_k, block_k=block_k, backend="triton")
    _close(first, want)
    for _ in range(2):  # the counters were set back to 0: the next calls finish the same way
        again = hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, split_k=split_k, block_k=block_k,
                       backend="triton")
        assert all(torch.equal(a, b) for a, b in zip(again, first))
    assert not split_counters(streams.device, 1).any()


def test_splits_for():
    assert splits_for(1, 16384, sms=132) == (128, 2)  # V4, one token: 128 programs of 2 steps of 64
    assert splits_for(16, 16384, sms=132) == (32, 8)  # 4 token tiles x 32 splits
    assert splits_for(5, 80, sms=132, block_k=16, split_k=2) == (2, 3)
    assert splits_for(5000, 256, sms=132) == (1, 4)  # long prompts: tiles alone fill the device


def test_reference_is_the_mixers_former_maths_bitwise():
    """``HyperMixer.forward`` ran this before ``hc_pre`` (``git show 2e99657:shardsmith/runtime/models/
    deepseek_v4/hyper.py``); the reference and the mixer on CPU give the same bits."""
    from shardsmith.runtime.models.deepseek_v4.hyper import HyperMixer
    from shardsmith.runtime.models.deepseek_v4.ops import rms_unweighted

    for dtype in (torch.float32, torch.bfloat16):
        streams, fn, base, scale = _case(7, 4, 64, dtype, seed=3)
        f = F.linear(rms_unweighted(streams.flatten(1).float(), NORM_EPS), fn)
        pre, post, comb = hc_mix(f, base, scale, 4, ITERS, EPS, backend="reference")
        old = ((pre[..., None] * streams).sum(dim=1).to(streams.dtype), pre, post, comb)
        new = hc_pre_reference(streams, fn, base, scale, ITERS, EPS, NORM_EPS)
        assert all(torch.equal(a, b) for a, b in zip(new, old))
        mixer = HyperMixer(64, 4, ITERS, EPS, NORM_EPS)
        mixer.fn, mixer.base, mixer.scale = fn, base, scale
        got = mixer(streams)
        assert all(torch.equal(a, b) for a, b in zip(got, (old[0], post, comb)))


@needs_triton
def test_mixer_through_the_kernel():
    """A ``HyperMixer`` with ``kernel`` on runs ``hc_pre`` up to 16 tokens and its former path past them
    (on CPU the reference: the same bits as with ``kernel`` off)."""
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches
    from shardsmith.runtime.models.deepseek_v4.hyper import HyperMixer

    mixer = HyperMixer(64, 4, ITERS, EPS, NORM_EPS)
    streams, mixer.fn, mixer.base, mixer.scale = _case(17, 4, 64, torch.bfloat16, seed=5)
    for T in (3, 17):
        want = mixer(streams[:T])
        mixer.kernel = True
        with record_launches(run=True) as keys:
            got = mixer(streams[:T])
        mixer.kernel = False
        assert [k[0] for k in keys] == (["_hc_pre_kernel"] if T <= 16 else [])  # past 16: hc_mix's reference on CPU
        _close((got[0], want[1], got[1], got[2]), (want[0], want[1], want[1], want[2]))


@needs_triton
def test_one_variant_for_every_token_count():
    """Token and split counts are not specialised: T = 1..40 compile one variant per streams dtype."""
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches

    streams, fn, base, scale = _case(40, 4, 64)
    with record_launches() as keys:
        for T in range(1, 41):
            hc_pre(streams[:T], fn, base, scale, ITERS, EPS, NORM_EPS)
        hc_pre(streams[:3].bfloat16(), fn, base, scale, ITERS, EPS, NORM_EPS)
    assert len(keys) == 41 and len(set(keys)) == 2


def test_bad_inputs_raise_every_problem():
    streams, fn, base, scale = _case(2, 4, 64)
    with pytest.raises(KernelError, match=r"hc_pre: fn \(24, 255\) torch.float32: want \[24, 256\] float32; "
                                          r"base \(24,\) torch.float64: want \[24\] float32; iters=0 must be >= 1; "
                                          r"block_k=24: a power of two >= 16"):
        hc_pre(streams, fn[:, :255], base.double(), scale, 0, EPS, NORM_EPS, block_k=24)
    with pytest.raises(KernelError, match=r"streams \(2, 256\) torch.float32: want \[T, m, D\]"):
        hc_pre(streams.flatten(1), fn, base, scale, ITERS, EPS, NORM_EPS)
    with pytest.raises(KernelError, match="backend 'gpu'"):
        hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, backend="gpu")


# ------------------------------------------------------------------ GPU: V4 shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4, 16])
def test_v4_shapes_on_cuda_and_graphed(T):
    streams, fn, base, scale = _case(T, 4, 4096, torch.bfloat16, device="cuda", seed=T)
    got = hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS)
    want = hc_pre_reference(streams, fn, base, scale, ITERS, EPS, NORM_EPS)
    _close(got, want, rel=1e-4)  # K = 16384 float32 products in two orders
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, got))
