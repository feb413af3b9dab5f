"""A prefill chunk's row-wise maths compiled (``runtime/layers/fused.py``) against the same functions run as
PyTorch ops: each fused function within float rounding of its reference, one graph for chunks of every
length, fewer rows than ``CHUNK_ROWS`` not compiled. CPU: Inductor's C++ code at small shapes; GPU
(``-m gpu``): Triton at DeepSeek-V4-Flash's shapes in bf16."""

from __future__ import annotations

import pytest
import torch

from shardsmith.runtime.layers import fused
from shardsmith.runtime.layers.kernels.testing import rel_error
from shardsmith.runtime.models.deepseek_v4.attention import unrope
from shardsmith.testing.fused_cases import V4_FLASH, compiled_graphs, fused_chunk_cases


def _check(lengths: tuple[int, ...], tol: float, monkeypatch, **shapes) -> None:
    monkeypatch.setattr(fused, "ENABLED", True)
    gen = torch.Generator(device=shapes["device"]).manual_seed(0)
    held = None
    for T in lengths:
        cases = fused_chunk_cases(T, gen=gen, **shapes)
        before = [compiled_graphs(fn) for fn, _ in cases]
        for fn, args in cases:
            got, want = fn(*args), fn.reference(*args)
            assert got.dtype == want.dtype and got.shape == want.shape, fn.__name__
            assert rel_error(got.float(), want.float()) <= tol, (fn.__name__, T, rel_error(got.float(), want.float()))
        after = [compiled_graphs(fn) for fn, _ in cases]
        assert all(n >= 1 for n in after)  # each ran compiled
        assert all(a - b <= 1 for a, b in zip(after, before))  # at most one graph each for these inputs
        if held is not None:
            assert after == held, [fn.__name__ for fn, _ in cases]  # a new length compiled nothing
        held = after


def test_each_fused_function_is_its_reference_with_one_graph_for_every_length(monkeypatch) -> None:
    _check((40, 17, 301), 1e-6, monkeypatch, m=4, D=64, n=4, d=32, r=16, h=3, c=24, K=3, I=48, dtype=torch.float32,
           device="cpu")


def test_decode_rows_are_not_compiled(monkeypatch) -> None:
    monkeypatch.setattr(fused, "ENABLED", True)
    before = compiled_graphs(unrope)
    x = torch.randn(fused.CHUNK_ROWS - 1, 8, 2).half()  # a dtype no other test compiles it for
    assert torch.equal(unrope(x, torch.ones(len(x), 1), torch.zeros(len(x), 1)), x)
    assert compiled_graphs(unrope) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v4_flash_shapes_on_cuda_within_bf16(monkeypatch) -> None:
    _check((8192, 333), 1e-2, monkeypatch, **V4_FLASH, dtype=torch.bfloat16, device="cuda")
