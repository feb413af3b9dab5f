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
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # CPU: the kernels' wrappers take the Triton path under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.kernels import fp8_linear, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# every row count below fp8_linear.DENSE_M (the Triton kernel's), then a stride over the cuBLAS range up to
# 2048 (each of those dequantizes and multiplies for real on CPU: the stride keeps the test in seconds)
LENGTHS = [*range(1, 300), *range(300, 2048, 97), 2048]


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
    """Over M = 1..2048 rows: at most 3 decode variants (M == 1, M % 16 == 0, other), 2 long
    variants (split or not) and, with the separate split sum, 2 decode split-sums (``M*N % 16``
    when N is ragged) and 1 long split-sum; ``warmup_rows`` hits every one."""
    every = _fp8_keys(n, k, LENGTHS)
    per_kernel = {name: sum(key[0] == name for key in every) for name in {key[0] for key in every}}
    assert len(every) <= 5, per_kernel
    assert per_kernel.get("_fp8_linear_long_kernel", 0) <= 2, per_kernel
    assert not any(name.startswith("_sum_splits") for name in per_kernel), per_kernel
    from shardsmith.runtime.layers.kernels.fp8_linear import warmup_rows

    assert _fp8_keys(n, k, warmup_rows(max(LENGTHS))) == every


def _tiny_v4(tiny, use_settings, **kw):
    from shardsmith.runtime.engine.engine import Engine

    mode = "kernel" if DEV == "cpu" else "auto"
    use_settings(**{k: mode for k in ("fp8_dense", "fused_experts", "decode_attention", "indexer_scores",
                                      "compressor_step", "hc_pre", "router_kernel", "hc_post")})
    return Engine.load(tiny("deepseek-v4"), rank=0, world_size=1, device=DEV, dtype=torch.float32,
                       from_checkpoint=True, cuda_graphs=False, **kw)


@pytest.fixture
def flush_denormals():
    """Recorded launches leave their outputs uninitialised; denormals in them make CPU matmuls crawl."""
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)  # PyTorch's default


@needs_triton
def test_warmup_launches_every_variant_serving_uses(tiny, use_settings, flush_denormals):
    """Tiny DeepSeek-V4 (FP8 linears, FP4 experts, decode attention) with the kernels on: the keys of
    prefills of 1..40 tokens (the fused experts' T classes and both long splits), a second chunk and
    batched decode steps of 2 and 4 rows are all among the keys the kernel warm-up launched (values
    unchecked: nothing runs)."""
    from shardsmith.runtime.engine.warmup import kernel_modules
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches

    eng = _tiny_v4(tiny, use_settings, max_seq_len=64, max_num_seqs=4)
    assert kernel_modules(eng.model)
    with record_launches() as warm:
        launches = eng._warm_kernels(eng.max_seq_len)
    assert launches > 0 and len(warm) >= launches
    with record_launches() as served:
        for n in (1, 2, 3, 5, 8, 11, 16, 17, 23, 40):
            eng.prefill(0, [(7 * i) % 97 + 1 for i in range(n)], 0)
        eng.prefill(0, list(range(1, 19)), 40)  # a second chunk
        for rows in (2, 4):  # buckets 2 and 4 (1 ran above: prefills of one token)
            for s in range(rows):
                eng.prefill(s, [5, 6, 7], 0)
            eng.decode([1] * rows, [3] * rows, list(range(rows)))
    names = {key[0] for key in served}
    assert {"_fp8_linear_kernel", "_fp8_linear_long_kernel", "_pair_gate_up_kernel",  # FP4: the pair path
            "_sink_split_kernel", "_sink_merge_kernel", "_indexer_scores_kernel",  # V4's decode attention
            "_compressor_step_kernel", "_hc_pre_kernel", "_hc_post_kernel", "_router_kernel"} <= names
    missing = set(served) - set(warm)
    assert not missing, f"{len(missing)} variants compiled while serving: {sorted(k[0] for k in missing)}"


def test_warmup_launches_the_gpt_oss_experts_kernel(tmp_path, use_settings, flush_denormals):
    """gpt-oss's resident experts run decode-sized steps through the fused kernel (its GLU): the warm-up
    launches their variants too, so prompts of up to 3 tokens and batched decode steps of 1, 2 and 4 rows
    compile nothing new (values unchecked: nothing runs)."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.engine.warmup import kernel_modules
    from shardsmith.runtime.layers.kernels.compile_keys import record_launches
    from shardsmith.runtime.models.gpt_oss.moe import Experts
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss

    use_settings(fused_experts="kernel" if DEV == "cpu" else "auto")
    eng = Engine.load(tiny_gpt_oss(tmp_path / "ckpt"), rank=0, world_size=1, device=DEV, dtype=torch.float32,
                      from_checkpoint=True, cuda_graphs=False, max_seq_len=64, max_num_seqs=4)
    assert any(isinstance(m, Experts) for m in kernel_modules(eng.model))
    with record_launches() as warm:
        launches = eng._warm_kernels(eng.max_seq_len)
    assert launches >= 16 and len(warm) >= 1
    with record_launches() as served:
        for rows in (1, 2, 4):
            for s in range(rows):
                eng.prefill(s, [5, 6, 7], 0)
            eng.decode([1] * rows, [3] * rows, list(range(rows)))
    assert "_pair_gate_up_kernel" in {key[0] for key in served}
    missing = set(served) - set(warm)
    assert not missing, f"{len(missing)} variants compiled while serving: {sorted(k[0] for k in missing)}"


def test_warmup_leaves_every_slot_empty_and_outputs_unchanged(tiny):
    """CPU, kernels off (the default there): the warm-up runs its steps and releases every slot it
    used; a request in the slot it used gives, bit for bit, the logits it gave before the warm-up."""
    from shardsmith.runtime.engine.engine import Engine

    eng = Engine.load(tiny("deepseek-v4"), rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True,
                      max_seq_len=32, max_num_seqs=2)
    prompt = [3, 17, 42, 99, 5]

    def request() -> list[torch.Tensor]:
        out = [eng.prefill(0, prompt, 0, last_only=False), eng.decode([7, 8], [5, 0], [0, 1])]
        eng.release(0)
        eng.release(1)
        return out

    before = request()
    eng.warmup()
    assert eng.warmup_launches == 0 and eng.warmup_seconds > 0
    assert eng._pos == [0, 0] and eng.model.positions == [0, 0]
    after = request()
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def _rank_warm(rank: int, world_size: int, port: int, pack: str, out_dir: str, queue) -> None:
    """One rank of the TP=2 warm-up test: record every launch's key (nothing runs); rank 0 warms up,
    serves a few steps and shuts down; each rank writes its keys to ``out_dir/keys-{rank}.json``."""
    import json
    import traceback

    try:
        from shardsmith.runtime.engine.engine import Engine
        from shardsmith.runtime.layers.kernels.compile_keys import record_launches
        from shardsmith.runtime.engine.dist import init_distributed

        init_distributed(rank, world_size, master_port=port)
        eng = Engine.load(pack, rank=rank, world_size=world_size, dtype=torch.float32, max_seq_len=64,
                          max_num_seqs=2)
        torch.set_flush_denormal(True)
        warm = 0
        with record_launches() as keys:
            if rank != 0:
                eng.follow()
            else:
                eng.warmup()
                warm = len(keys)
                for n in (1, 5, 16, 17, 40):
                    eng.prefill(0, [(3 * i) % 89 + 1 for i in range(n)], 0)
                for s in (0, 1):
                    eng.prefill(s, [4, 5, 6], 0)
                eng.decode([1, 2], [3, 3], [0, 1])
                eng.shutdown()
        (Path(out_dir) / f"keys-{rank}.json").write_text(json.dumps({"warm": warm, "keys": [repr(k) for k in keys]}))
        if rank == 0:
            queue.put(("ok", None))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


@needs_triton
def test_every_rank_warms_up_at_tp2(tiny_v4_packs, monkeypatch, tmp_path, use_settings):
    """gloo, 2 ranks, kernels forced: rank 0's ``warmup`` sends ``WARMUP``, rank 1 launches the same
    variants in the same order, and neither rank meets a new variant while serving."""
    import json

    from shardsmith.testing.ranks import run_ranks

    use_settings(fp8_dense="kernel", fused_experts="kernel")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_rank_warm, 2, str(tiny_v4_packs[2]), str(tmp_path), timeout=240)
    r0, r1 = (json.loads((tmp_path / f"keys-{r}.json").read_text()) for r in (0, 1))
    n = r0["warm"]
    assert n > 0 and r1["keys"][:n] == r0["keys"][:n]
    for r in (r0, r1):
        assert set(r["keys"][n:]) <= set(r["keys"][:n]) and len(r["keys"]) > n
