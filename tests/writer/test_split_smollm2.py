"""The real trained SmolLM2-135M MoE (Mixtral format, 8 experts; bf16 and block FP8): split at
TP 1-4 and verify every shard against the source, byte for byte.

The checkpoints come from the session fixtures in ``conftest.py`` (built once, cached under
``$SHARDSMITH_CACHE``). At TP=3 the FP8 plan replicates attention (64-row heads would cut 128x128
blocks); at TP=4 the bf16 plan copies KV heads (3 KV heads < 4 ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardsmith.pack.reader import open_rank
from shardsmith.writer.split import split_checkpoint
from shardsmith.writer.verify import verify_pack

pytest.importorskip("gguf")


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_smollm2_split_verify_against(request, tmp_path: Path, variant: str, tp: int) -> None:
    src = request.getfixturevalue(f"smollm2_{variant}")
    out = tmp_path / "pack"
    res = split_checkpoint(src, out, world_size=tp)
    assert res.ranks == tuple(range(tp))
    rep = verify_pack(out, against=src)
    assert rep.ok, rep.problems[:20]
    assert rep.tensors_compared == len(open_rank(out, tp - 1, tp).plan.tensors)
    rp = open_rank(out, 0, tp)
    bank = rp.banks()["model.layers.0"]
    assert bank["gate_up"].shape[0] == 8 and bank["gate_up"].shape[1] == 2 * bank["down"].shape[2]
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
