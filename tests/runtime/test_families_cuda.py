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
