"""The Mixtral family's prefill attention without a mask (:func:`causal_chunk_attention`: SDPA's causal
flag from position 0, its lower-right causal bias after) against SDPA over an explicit ``[T, S]``
causal mask, for grouped-query and plain heads, from the start and mid-sequence, float32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardsmith.runtime.models.common import causal_chunk_attention


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("start,T", [(0, 13), (21, 6), (5, 1 + 16)])
def test_causal_chunk_attention_equals_the_masked_reference(dtype, tol, heads, kv_heads, start, T):
    g = torch.Generator().manual_seed(start * 31 + T)
    S, d = start + T, 16
    q = torch.randn(heads, T, d, generator=g).to(dtype)
    k = torch.randn(kv_heads, S, d, generator=g).to(dtype)
    v = torch.randn(kv_heads, S, d, generator=g).to(dtype)
    mask = torch.arange(S)[None, :] <= torch.arange(start, S)[:, None]  # [T, S]
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                          enable_gqa=kv_heads != heads)
    got = causal_chunk_attention(q, k, v, start, gqa=kv_heads != heads)
    assert got.shape == (heads, T, d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_long_chunk_runs_in_the_fused_kernels_on_cuda():
    """An 8k chunk at the end of 32k positions, 32 query and 4 KV heads of 128 (a Qwen3-30B-A3B layer),
    bf16: the scores a masked math call would hold (``[32, 8192, 32768]`` float32, 34 GB) are never made;
    the call's peak is a small multiple of its keys and values; a slice of it equals the masked reference."""
    dev, H, K, d, start, T = torch.device("cuda"), 32, 4, 128, 24576, 8192
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(H, T, d, generator=g, device=dev, dtype=torch.bfloat16)
    k = torch.randn(K, start + T, d, generator=g, device=dev, dtype=torch.bfloat16)
    v = torch.randn(K, start + T, d, generator=g, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = causal_chunk_attention(q, k, v, start, gqa=True)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 2 * 2**30
    rows = slice(T - 64, T)  # the last 64 queries against the masked reference, in float32
    S = start + T
    mask = torch.arange(S, device=dev)[None, :] <= torch.arange(start + T - 64, S, device=dev)[:, None]
    want = F.scaled_dot_product_attention(q[:, rows].float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got[:, rows].float(), want, atol=2e-2, rtol=2e-2)
