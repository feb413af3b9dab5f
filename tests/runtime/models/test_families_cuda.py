"""Every family on CUDA: graphed decode equals eager, and batched steps equal each sequence alone.

The GPU counterpart of the CPU batching tests (``test_batched_slots.py``, ``test_deepseek_v4_batch.py``):
on CUDA the engine runs one-token and batched steps through :class:`DecodeGraphs` (pieces captured per
batch bucket), which the CPU tests run eagerly. Tiny checkpoints of each family, float32, TP=1: the
greedy tokens of (a) an eager engine, (b) a graphed engine decoding one sequence at a time, and (c) the
graphed engine decoding three sequences together (prefilled into slots 0..2, rows in a batch padded to
the 4-row bucket) must all be the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

STEPS = 8


def _build(family: str, root: Path) -> Path:
    from shardsmith.writer.split import split_checkpoint

    src = root / "src"
    if family == "mixtral":
        from shardsmith.testing.tiny import tiny_mixtral as make
    elif family == "deepseek_v3":
        from shardsmith.testing.tiny_v3 import tiny_deepseek_v3_model as make
    elif family == "gpt_oss":
        from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss as make
    else:
        from shardsmith.testing.tiny_v4 import tiny_deepseek_v4 as make
    made = make(src)
    split_checkpoint(made if isinstance(made, Path) else src, root / "tp1", world_size=1)
    return root / "tp1"


def _greedy_alone(engine, prompt: list[int]) -> list[int]:
    from shardsmith.runtime.engine.engine import SamplingParams

    return [s.token_id for s in engine.generate(prompt, SamplingParams(max_tokens=STEPS))]


def _greedy_batched(engine, prompts: list[list[int]]) -> list[list[int]]:
    toks, pos = [], []
    for slot, p in enumerate(prompts):
        toks.append([int(engine.prefill(slot, p)[-1].argmax())])
        pos.append(len(p))
    slots = list(range(len(prompts)))
    for _ in range(STEPS - 1):
        logits = engine.decode([t[-1] for t in toks], pos, slots)
        for b in slots:
            toks[b].append(int(logits[b].argmax()))
            pos[b] += 1
    return toks


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss", "deepseek_v4"])
def test_graphed_and_batched_decode_on_cuda(family: str, tmp_path: Path) -> None:
    from shardsmith.runtime.engine.engine import Engine

    pack = _build(family, tmp_path)
    load = dict(rank=0, world_size=1, device="cuda", dtype="float32", max_seq_len=160, max_num_seqs=4)
    eager = Engine.load(pack, cuda_graphs=False, **load)
    vocab = eager.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 19, 71)]
    want = [_greedy_alone(eager, p) for p in prompts]
    del eager
    torch.cuda.empty_cache()
    graphed = Engine.load(pack, cuda_graphs=True, **load)
    assert graphed.graphs is not None
    assert [_greedy_alone(graphed, p) for p in prompts] == want
    assert _greedy_batched(graphed, prompts) == want
    assert graphed.graphs.pool.pieces > 0  # something was captured
    assert _scheduled(graphed, prompts, overlap=False) == want
    assert _scheduled(graphed, prompts, overlap=True) == want  # steps launched ahead of their tokens


def _scheduled(engine, prompts: list[list[int]], *, overlap: bool) -> list[list[int]]:
    """Greedy tokens of every prompt through one Scheduler (continuous batching), plain or overlapped."""
    from shardsmith.runtime.engine.engine import SamplingParams
    from shardsmith.runtime.engine.scheduler import Scheduler, Sequence

    sched = Scheduler(engine, decode_prompt_tokens=0, overlap=overlap)
    seqs = [Sequence(p, SamplingParams(max_tokens=STEPS)) for p in prompts]
    for seq in seqs:
        sched.admit(seq)
    out = {id(s): [] for s in seqs}
    while sched.running:
        for seq, step in sched.step():
            out[id(seq)].append(step.token_id)
    assert not overlap or sched.overlapped_steps > 0
    return [out[id(s)] for s in seqs]


def test_warmup_prices_prefill_against_a_decode_step(tmp_path: Path) -> None:
    """On CUDA, warm-up times an eager 32-token prefill and a one-row decode step; the scheduler's
    default feeds prompts through decode rows up to :func:`feed_limit` of the two (the prefill counted
    once per slot)."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.engine.scheduler import Scheduler, feed_limit

    eng = Engine.load(_build("mixtral", tmp_path), rank=0, world_size=1, device="cuda", dtype="bfloat16",
                      max_seq_len=160, max_num_seqs=2)
    eng.warmup()
    prefill, step = eng.prompt_costs
    assert prefill > step > 0
    assert Scheduler(eng).decode_prompt_tokens == feed_limit(prefill * 2, step, 160) > 0  # 2 slots


def check_offloaded_gpt_oss(root: Path, device: str) -> dict[str, dict]:
    """gpt-oss with offloaded MXFP4 experts on ``device`` (graphed on CUDA): the slot cache (4 slots for
    4 layers x 8 experts, so steps miss and copy on the copy stream), the host (``cpu``) and ``hybrid``
    each give the resident engine's prefill logits (within float32 rounding: another matmul layout
    may pick another kernel) and its greedy tokens, alone and batched. Returns each backend's stats."""
    from shardsmith.runtime.engine.engine import Engine
    from shardsmith.runtime.offload import OffloadConfig

    pack = _build("gpt_oss", root)
    load = dict(rank=0, world_size=1, device=device, dtype="float32", max_seq_len=160, max_num_seqs=4)
    resident = Engine.load(pack, **load)
    prompts = [torch.randint(2, resident.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (37, 19, 71)]
    want_logits = resident.logits(prompts[0])
    want = [_greedy_alone(resident, p) for p in prompts]
    del resident
    stats = {}
    for name, cfg in {"gpu": OffloadConfig(backend="gpu", cache_slots=4, probe=False),
                      "cpu": OffloadConfig(backend="cpu", probe=False),
                      "hybrid": OffloadConfig(backend="hybrid", cache_slots=4, hybrid_fraction=0.5, probe=False)}.items():
        eng = Engine.load(pack, offload=cfg, **load)
        try:
            torch.testing.assert_close(eng.logits(prompts[0]), want_logits, atol=1e-4, rtol=0, msg=name)
            assert [_greedy_alone(eng, p) for p in prompts] == want, name
            assert _greedy_batched(eng, prompts) == want, name
            stats[name] = eng.offload.stats()
            assert eng.offload.kernel == (device == "cuda"), name  # the fused kernel has gpt-oss's GLU
            if name != "cpu":
                assert eng.offload.cache.pool["gate_up"].dtype == torch.int8 and stats[name]["misses"] > 0, name
            if name != "gpu":
                assert stats[name]["host_experts"] > 0, name
        finally:
            eng.offload.close()
            eng.shutdown()
    return stats


def test_offloaded_gpt_oss_on_cuda(tmp_path: Path) -> None:
    """Offloaded gpt-oss on the GPU: pinned MXFP4 host banks, the slots run by the fused kernel with gpt-oss's
    GLU and cached in place (misses copied inside the graphed decode step)."""
    stats = check_offloaded_gpt_oss(tmp_path, "cuda")
    assert stats["gpu"]["mode"] == "inplace", stats["gpu"]
    assert stats["gpu"]["host_pinned"] and stats["gpu"]["bytes_copied"] == stats["gpu"]["misses"] * stats["gpu"]["slot_bytes"]
