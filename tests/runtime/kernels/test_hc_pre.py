"""DeepSeek-V4's fused hyper-connection mixer (``hc_pre``) against its PyTorch reference.

CPU: under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton loads) on small shapes: m = 4
and m = 2 streams, hidden sizes 64, 48 and 40, T = 1, 3, 5 tokens (one and two token tiles, a partial
one), float32 and bf16 streams, split counts from 1 to many, including splits that do not divide K
and a last split past K. pre/post/comb land within float32 rounding of the reference, ``collapsed``
within one rounding of its dtype; three calls in a row give the same bits and leave the split-K
counters at zero; bad inputs raise one ``KernelError`` naming every problem. The reference is, bit for
bit, the maths ``HyperMixer.forward`` ran before the kernel (``F.linear`` of ``rms_unweighted``, then
``hc_mix``). With the block's RMSNormF32 folded (``out_norm``; bf16 casts in the interpreter rounding to
nearest even, as the GPU's, ``interpreter_rounds_bf16``), also at V4's D = 4096 and T = 16: the normed
output is ``ops.RMSNormF32`` of the kernel's own collapse (bf16 / float16: the same bits but for rare ties,
within one rounding always; float32: within 8 ulps, the sum of squares adding in another order),
within the collapse's tolerance of the reference followed by ``ops.RMSNormF32``, and
pre/post/comb keep their bits; a mixer given its norm launches only ``hc_pre`` (and, kernel off, runs
the norm after the same ops as before). GPU (``-m gpu``): V4's shapes (m = 4, D = 4096, bf16) for
T = 1, 4, 16 against the reference, with and without the norm, the same bits under CUDA-graph capture
and replay (and the norm's through ``torch.compile``).
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
from shardsmith.runtime.layers.kernels.deepseek_v4.hc_mix import hc_mix
from shardsmith.runtime.layers.kernels.deepseek_v4.hc_pre import (BLOCK_D, hc_pre, hc_pre_op, hc_pre_reference, rms_norm_reference,
                                                   splits_for)
from shardsmith.runtime.layers.kernels.testing import interpreter_rounds_bf16
from shardsmith.runtime.models.common import RMSNormF32

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
ITERS, EPS, NORM_EPS = 20, 1e-6, 1e-6


@pytest.fixture
def gpu_rounding():
    """bf16 casts in the interpreter round as on the GPU (nothing to do on CUDA)."""
    with interpreter_rounds_bf16():
        yield


def _norm(D: int, eps: float, device: str = "cpu", seed: int = 0) -> RMSNormF32:
    """A V4 block norm (``ops.RMSNormF32``) with trained-like float32 weights around 1."""
    norm = RMSNormF32(D, eps)
    norm.weight = 1 + 0.5 * torch.randn(D, generator=torch.Generator(device=device).manual_seed(seed), device=device)
    return norm


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


def _check_normed(got: torch.Tensor, plain: tuple[torch.Tensor, ...], ref_collapsed: torch.Tensor,
                  norm: RMSNormF32, *, max_share: float = 1e-3) -> None:
    """``got``: hc_pre's normed output; ``plain``: hc_pre's outputs without the norm. Against ``ops.RMSNormF32``
    of the kernel's own collapse: the sum of squares adds in another order, which moves the float32
    ``rsqrt`` by an ulp or so: in float32 within 8 ulps; in bf16 / float16 within one rounding, and the
    same bits but for at most 0.1% of elements (a value near a tie rounds the other way). Against the
    reference's collapse through ``ops.RMSNormF32``: within ``_close``'s collapse tolerance carried by the
    norm (``|weight| * rsqrt(mean(c^2) + eps)`` per unit of collapse error)."""
    sep = norm(plain[0])
    assert got.shape == sep.shape and got.dtype == sep.dtype
    fi, f32 = torch.finfo(got.dtype), torch.finfo(torch.float32)
    err = (got.double() - sep.double()).abs()
    ulp_at = torch.maximum(got.double().abs(), sep.double().abs())  # one rounding apart may straddle a power of two
    assert (err <= (fi.eps if got.dtype != torch.float32 else 8 * f32.eps) * ulp_at + fi.tiny).all(), \
        err.max().item()
    if got.dtype != torch.float32:
        assert (got != sep).sum().item() <= max_share * got.numel(), f"{(got != sep).sum().item()} of {got.numel()} differ"
    want = norm(ref_collapsed).double()
    c = ref_collapsed.double()
    carry = norm.weight.double().abs() * torch.rsqrt(c.square().mean(-1, keepdim=True) + norm.eps)
    bound = 2 * fi.eps * want.abs() + carry * (fi.eps * c.abs() + 1e-5)
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() - bound).max().item()


@needs_triton
@pytest.mark.parametrize(("T", "m", "D", "dtype", "split_k", "rms_eps", "block_d"), [
    (1, 4, 64, torch.float32, None, 1e-6, BLOCK_D),
    (3, 4, 64, torch.bfloat16, None, 1e-6, BLOCK_D),
    (5, 2, 40, torch.bfloat16, 2, 0.25, BLOCK_D),  # D = 40 (BLOCK_D past D), two token tiles; an eps that shows
    (16, 4, 64, torch.float16, 3, 1e-6, 16),  # four token tiles, 3 splits; 4 collapse steps, the norm read back
    (5, 2, 40, torch.float32, 2, 1e-6, 16),   # m = 2 (the tensor Sinkhorn), 3 steps, the last one masked
    (1, 4, 4096, torch.bfloat16, None, 1e-6, BLOCK_D),  # V4's hidden size: 4 steps per pass (the default)
    (1, 4, 4096, torch.bfloat16, None, 1e-6, 4096),  # the whole row in one step, its norm from registers
    (3, 4, 4096, torch.float32, None, 1e-6, BLOCK_D),
    (16, 4, 4096, torch.bfloat16, None, 1e-6, BLOCK_D),
])
def test_norm_folded_matches_reference(gpu_rounding, T, m, D, dtype, split_k, rms_eps, block_d):
    streams, fn, base, scale = _case(T, m, D, dtype, seed=T + m + D)
    norm = _norm(D, rms_eps, seed=D)
    got = hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(norm.weight, rms_eps), split_k=split_k,
                 block_d=block_d, backend="triton")
    plain = hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, split_k=split_k, block_d=block_d, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got[1:], plain[1:]))  # pre/post/comb: the norm changes nothing
    want = hc_pre_reference(streams, fn, base, scale, ITERS, EPS, NORM_EPS)
    _check_normed(got[0], plain, want[0], norm)
    if block_d != BLOCK_D:  # the collapse is per channel: the same bits in steps or whole
        assert torch.equal(plain[0], hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, split_k=split_k,
                                                  backend="triton")[0])
    again = hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(norm.weight, rms_eps), split_k=split_k,
                   block_d=block_d, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(again, got))
    assert not split_counters(streams.device, 1).any()


def test_rms_norm_reference_is_ops_rmsnorm_bitwise():
    """``out_norm``'s reference is ``ops.RMSNormF32`` (transformers ``DeepseekV4RMSNorm``) op for op."""
    for dtype in (torch.float32, torch.bfloat16):
        streams, fn, base, scale = _case(7, 4, 64, dtype, seed=2)
        norm = _norm(64, 1e-6, seed=1)
        x = hc_pre_reference(streams, fn, base, scale, ITERS, EPS, NORM_EPS)[0]
        assert torch.equal(rms_norm_reference(x, norm.weight, norm.eps), norm(x))
        normed = hc_pre_reference(streams, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(norm.weight, norm.eps))
        assert torch.equal(normed[0], norm(x))


@needs_triton
def test_mixer_folds_the_norm(gpu_rounding):
    """A ``HyperMixer`` given its block's norm: kernel off, the norm runs after the same ops as before (the
    same bits as ``norm(mixer(streams)[0])``); kernel on, the one ``hc_pre`` launch returns the normed
    collapse (no other kernel)."""
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches
    from shardsmith.runtime.models.deepseek_v4.hyper import HyperMixer

    mixer = HyperMixer(64, 4, ITERS, EPS, NORM_EPS)
    streams, mixer.fn, mixer.base, mixer.scale = _case(3, 4, 64, torch.bfloat16, seed=6)
    norm = _norm(64, 1e-6, seed=2)
    x, post, comb = mixer(streams)
    off = mixer(streams, norm)
    assert torch.equal(off[0], norm(x)) and torch.equal(off[1], post) and torch.equal(off[2], comb)
    mixer.kernel = True
    with record_launches(run=True) as keys:
        on = mixer(streams, norm)
    assert [k[0] for k in keys] == ["_hc_pre_kernel"]
    plain = hc_pre(streams, mixer.fn, mixer.base, mixer.scale, ITERS, EPS, NORM_EPS)
    _check_normed(on[0], plain, x, norm)


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
    """A ``HyperMixer`` with ``kernel`` on runs ``hc_pre`` up to 16 tokens (decode rows) and its former
    path past them (on CPU the reference: the same bits as with ``kernel`` off)."""
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
        weight = torch.ones(64)
        for T in range(1, 41):  # the norm folded: one more variant, whatever T and eps
            hc_pre(streams[:T], fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(weight, 1e-6 * T))
    assert len(keys) == 81 and len(set(keys)) == 3


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
    with pytest.raises(KernelError, match=r"hc_pre: out_norm weight \(65,\) torch.float64: want \[64\] float32; "
                                          r"out_norm eps=-1e-06 must be >= 0$"):
        hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(torch.ones(65, dtype=torch.float64), -1e-6))
    with pytest.raises(KernelError, match="out_norm eps=nan must be >= 0"):
        hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(torch.ones(64), float("nan")))
    with pytest.raises(KernelError, match=r"streams, fn, base, scale, out_norm weight on cpu, cpu, cpu, cpu, meta: one device"):
        hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(torch.ones(64, device="meta"), 1e-6))


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4, 16])
def test_v4_shapes_with_the_norm_on_cuda_graphed_and_compiled(T):
    """The folded norm at V4's shapes: as on CPU against the references (the count of elements that
    differ from the separate norm's printed), the same bits replayed, within rounding (the count printed)
    through ``torch.compile``."""
    streams, fn, base, scale = _case(T, 4, 4096, torch.bfloat16, device="cuda", seed=T)
    norm = _norm(4096, 1e-6, device="cuda", seed=T)
    call = lambda: hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(norm.weight, norm.eps))  # noqa: E731
    got = call()
    plain = hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS)
    want = hc_pre_reference(streams, fn, base, scale, ITERS, EPS, NORM_EPS)
    _close((plain[0], *got[1:]), want, rel=1e-4)
    _check_normed(got[0], plain, want[0], norm)
    print(f"\nhc_pre+norm T={T}: {(got[0] != norm(plain[0])).sum().item()} of {got[0].numel()} elements differ "
          "from the separate norm of the kernel's collapse")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, got))
    # what the model runs: hc_pre_op, an opaque custom op inside torch.compile (Triton launches the kernel
    # itself), so the eager launch's bits at the block it picks (traced as a user kernel, inductor's own
    # compile differed by more than a rounding at T = 16 on an H200, h200x1ai)
    compiled = torch.compile(lambda x, w: hc_pre_op(x, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(w, 1e-6))[0]
                             + 0, dynamic=False)
    eager = hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(norm.weight, 1e-6),
                   block_d=4096 if T == 1 else BLOCK_D)[0]
    assert torch.equal(compiled(streams, norm.weight), eager + 0)


@needs_triton
@pytest.mark.parametrize(("T", "D"), [(1, 64), (1, 40), (3, 64)])
def test_custom_op_is_the_kernel_at_its_block(gpu_rounding, T, D):
    """``hc_pre_op`` (the ``shardsmith::hc_pre`` custom op the mixers call) returns :func:`hc_pre`'s bits
    at the block it picks (the whole row at one token, ``BLOCK_D`` steps past it), eagerly and inside
    ``torch.compile`` (an opaque extern there: inductor does not re-trace the kernel)."""
    streams, fn, base, scale = _case(T, 4, D, torch.bfloat16)
    norm = _norm(D, 1e-6)
    whole = max(16, 1 << (D - 1).bit_length())
    want = hc_pre(streams, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(norm.weight, norm.eps),
                  block_d=whole if T == 1 else BLOCK_D, backend="triton")
    got = hc_pre_op(streams, fn, base, scale, ITERS, EPS, NORM_EPS, out_norm=(norm.weight, norm.eps))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    compiled = torch.compile(lambda s: hc_pre_op(s, fn, base, scale, ITERS, EPS, NORM_EPS,
                                                 out_norm=(norm.weight, norm.eps)), dynamic=False)
    assert torch.equal(compiled(streams)[0], want[0])
    plain = hc_pre_op(streams, fn, base, scale, ITERS, EPS, NORM_EPS)  # no norm: the collapse alone
    assert torch.equal(plain[1], want[1])
    with pytest.raises(KernelError, match="iters=0"):
        hc_pre_op(streams, fn, base, scale, 0, EPS, NORM_EPS)
