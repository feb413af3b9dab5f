"""No Triton compile while serving (issue 14): the kernels compile a bounded set of variants whatever
the prompt length, and the engine's warm-up launches every one the steps use.

A compile is a launch with a new key (:mod:`shardsmith.runtime.layers.kernels.compile_keys`
computes Triton 3.x's key with its own binder, on CPU). Launches are recorded without running
(``record_launches()``), so these tests take seconds; the kernels' numbers are checked in
``test_kernels.py``. Before the fix one ``[512, 4096]`` FP8 weight compiled 24 variants over prompt
lengths 1..2048 (the split-K, a constexpr, followed the row count).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: the kernels' wrappers take the Triton path under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.kernels import fp8_linear, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = range(1, 2049)


def _fp8_keys(n: int, k: int, rows) -> set[tuple]:
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches

    w = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=DEV)
    scale = torch.full((-(-n // 128), -(-k // 128)), 127, dtype=torch.uint8, device=DEV)  # V4's UE8M0
    with record_launches() as keys:
        for m in rows:
            fp8_linear(torch.empty(m, k, dtype=torch.bfloat16, device=DEV), w, scale, (128, 128), backend="triton")
    return set(keys)


@needs_triton
@pytest.mark.parametrize("n, k", [(512, 4096), (1024, 4096), (4096, 1024), (200, 300)])
def test_fp8_linear_compiles_a_bounded_set_over_prompt_lengths(n, k):
    """Over M = 1..2048 rows: at most 3 decode variants (M == 1, M % 16 == 0, other), one decode
    split-sum, two long variants (split or not) and one long split-sum; ``warmup_rows`` hits all."""
    every = _fp8_keys(n, k, LENGTHS)
    per_kernel = {name: sum(key[0] == name for key in every) for name in {key[0] for key in every}}
    assert len(every) <= 7, per_kernel
    assert per_kernel.get("_fp8_linear_long_kernel", 0) <= 2, per_kernel
    from shardsmith.runtime.layers.kernels.fp8_linear import warmup_rows

    assert _fp8_keys(n, k, warmup_rows(max(LENGTHS))) == every


def _tiny_v4(tiny, monkeypatch, **kw):
    from shardsmith.runtime.engine.engine import Engine

    monkeypatch.setenv("SHARDSMITH_FP8_DENSE", "kernel" if DEV == "cpu" else "auto")
    monkeypatch.setenv("SHARDSMITH_FUSED_EXPERTS", "kernel" if DEV == "cpu" else "auto")
    return Engine.load(tiny("deepseek-v4"), rank=0, world_size=1, device=DEV, dtype=torch.float32,
                       from_checkpoint=True, cuda_graphs=False, **kw)


@needs_triton
def test_warmup_launches_every_variant_serving_uses(tiny, monkeypatch):
    """Tiny DeepSeek-V4 (FP8 linears, FP4 experts) with the kernels on: the keys of prefills of
    1..17, 23 and 40 tokens, chunked prompts and batched decode steps of 1..4 rows are all among the keys the
    kernel warm-up launched (values unchecked: nothing runs)."""
    from shardsmith.runtime.engine.warmup import kernel_modules
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches

    eng = _tiny_v4(tiny, monkeypatch, max_seq_len=64, max_num_seqs=4)
    assert kernel_modules(eng.model)
    with record_launches() as warm:
        launches = eng._warm_kernels(eng.max_seq_len)
    assert launches > 0 and len(warm) >= launches
    with record_launches() as served:
        for n in (*range(1, 18), 23, 40):
            eng.prefill(0, [(7 * i) % 97 + 1 for i in range(n)], 0)
        eng.prefill(0, list(range(1, 19)), 40)  # a second chunk
        for rows in range(1, 5):
            for s in range(rows):
                eng.prefill(s, [5, 6, 7], 0)
            eng.decode([1] * rows, [3] * rows, list(range(rows)))
    names = {key[0] for key in served}
    assert {"_fp8_linear_kernel", "_fp8_linear_long_kernel", "_gate_up_kernel"} <= names
    missing = set(served) - set(warm)
    assert not missing, f"{len(missing)} variants compiled while serving: {sorted(k[0] for k in missing)}"


def test_warmup_leaves_every_slot_empty_and_outputs_unchanged(tiny):
    """CPU, kernels off (the default there): the warm-up runs its steps and releases what it used;
    a request after it gives the logits of an engine that never warmed up."""
    from shardsmith.runtime.engine.engine import Engine

    def load():
        return Engine.load(tiny("deepseek-v4"), rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True,
                           max_seq_len=32, max_num_seqs=2)

    prompt = [3, 17, 42, 99, 5]
    cold = load()
    ref = cold.prefill(1, prompt, 0, last_only=False)
    eng = load()
    eng.warmup()
    assert eng.warmup_launches == 0 and eng.warmup_seconds > 0
    assert eng._pos == [0, 0] and eng.model.positions == [0, 0]
    assert torch.equal(eng.prefill(1, prompt, 0, last_only=False), ref)
