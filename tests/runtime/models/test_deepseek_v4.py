"""DeepSeek-V4 runtime numerics at world sizes 1, 2 and 4 (real processes, gloo) against transformers.

The checkpoint is the tiny release-format one (FP8 UE8M0 dense, FP4 experts, a hash layer, layer
kinds sliding / CSA / HCA / CSA, window 16, ``index_topk`` 16, an MTP layer). The reference is
transformers' ``DeepseekV4ForCausalLM`` loaded by ``from_pretrained`` (its release-name conversion)
from a copy of that checkpoint dequantized with transformers' own ``Fp8Dequantize`` (FP8 and FP4
``x * 2^e`` is exact in float32, so both sides compute from the same values; a unit test checks
the copy equals what transformers' FP8 loader makes when ``accelerate`` is installed).

The prompt (250 tokens) passes the window, fills 62 CSA entries (the indexer keeps 16 per query)
and one HCA entry; the 32 greedy decode steps cross position 256, so the HCA compressor emits its
second entry from the state carried across decode steps. Decoding is teacher-forced with the
reference's greedy tokens, and every step's argmax must be the reference's next token.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from shardsmith.runtime.serve.launch import free_port

PROMPT_LEN, STEPS = 250, 32
ATOL = 1e-4  # float32 logits (|logits| < 5); observed: 0 at TP=1 prefill, ~5e-6 elsewhere




def reference_run(model_dir: Path, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers: prefill logits ``[T, V]``, greedy tokens ``[STEPS]`` and their step logits ``[STEPS, V]``."""
    from transformers import DeepseekV4ForCausalLM, DynamicCache

    model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens, steps = [], []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        prefill = model(ids[None], cache=cache, use_cache=True).logits[0]
        tok = prefill[-1].argmax()
        for _ in range(STEPS):
            tokens.append(int(tok))
            steps.append(model(tok.view(1, 1), cache=cache, use_cache=True).logits[0, -1])
            tok = steps[-1].argmax()
    return {"prefill": prefill, "tokens": torch.tensor(tokens), "steps": torch.stack(steps)}


def runtime_run(model, ids: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The runtime: prefill logits, then one decode step per reference token (teacher-forced)."""
    prefill = model(ids, 0, last_only=False)
    pos, steps = ids.shape[0], []
    for tok in tokens.tolist():
        steps.append(model(torch.tensor([tok]), pos)[0])
        pos += 1
    return {"prefill": prefill, "steps": torch.stack(steps)}


def _rank_main(rank: int, world_size: int, port: int, path: str, from_checkpoint: bool, io: str) -> None:
    """One rank process: load, run the prompt and the reference tokens; rank 0 saves its logits."""
    import torch.distributed as dist

    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4
    from shardsmith.runtime.engine.loader import load_rank_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        data = torch.load(Path(io) / "inputs.pt")
        weights = load_rank_weights(path, rank=rank, world_size=world_size, from_checkpoint=from_checkpoint)
        model = DeepseekV4.from_weights(weights, dtype=torch.float32, max_seq_len=PROMPT_LEN + STEPS)
        out = runtime_run(model, data["ids"], data["tokens"])
        if rank == 0:
            torch.save(out, Path(io) / "outputs.pt")
    except Exception:
        (Path(io) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny checkpoint, a TP=2 pack of it, the prompt and transformers' results."""
    from shardsmith.testing.reference import dequantized_copy
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("v4")
    ckpt = tiny_deepseek_v4(root / "ckpt")
    split_checkpoint(ckpt, root / "pack-tp2", world_size=2)
    ids = torch.randint(2, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    ref = reference_run(dequantized_copy(ckpt, root / "dequantized"), ids)
    return {"root": root, "ckpt": ckpt, "pack2": root / "pack-tp2", "ids": ids, "ref": ref}


def check(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """Logits within :data:`ATOL`, and the greedy next token of every step equal to the reference's."""
    torch.testing.assert_close(out["prefill"], ref["prefill"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["steps"], ref["steps"], atol=ATOL, rtol=0)
    greedy = torch.cat((out["prefill"][-1:].argmax(-1), out["steps"][:-1].argmax(-1)))
    assert greedy.tolist() == ref["tokens"].tolist()


def test_world_size_1_matches_transformers(v4: dict) -> None:
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4
    from shardsmith.runtime.engine.loader import load_rank_weights

    weights = load_rank_weights(v4["ckpt"], rank=0, world_size=1, from_checkpoint=True)
    model = DeepseekV4.from_weights(weights, dtype=torch.float32, max_seq_len=PROMPT_LEN + STEPS)
    check(runtime_run(model, v4["ids"], v4["ref"]["tokens"]), v4["ref"])


@pytest.mark.parametrize("world_size, source", [(2, "pack"), (4, "checkpoint")])
def test_tensor_parallel_matches_transformers(v4: dict, world_size: int, source: str, tmp_path: Path) -> None:
    """Real rank processes over gloo: TP=2 from a pack (``split``), TP=4 sliced from the checkpoint."""
    from shardsmith.testing.ranks import spawn_ranks

    torch.save({"ids": v4["ids"], "tokens": v4["ref"]["tokens"]}, tmp_path / "inputs.pt")
    path = v4["pack2"] if source == "pack" else v4["ckpt"]
    try:
        spawn_ranks(_rank_main, (world_size, free_port(), str(path), source == "checkpoint", str(tmp_path)), world_size)
    except Exception:
        errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("error-*.txt")))
        pytest.fail(f"rank processes failed:\n{errors}")
    check(torch.load(tmp_path / "outputs.pt"), v4["ref"])


def test_prefill_kernels_match_transformers_and_the_reference_in_chunks(v4: dict, use_settings) -> None:
    """The prefill attention and index-score kernels (Triton's interpreter on CPU): the one-pass prefill
    gives transformers' logits, and the prompt fed in three chunks, each starting mid-window and
    mid-compressor-window, gives the PyTorch reference's logits for the same chunks. (Chunks against one
    pass differ where index scores tie exactly: the tiny model's relu leaves several entries at score 0,
    and ``topk`` breaks such ties by the row's length.)"""
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.runtime.layers.parallel import use_kernels_
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4

    def run(kernel: bool, chunks: tuple[int, ...]) -> torch.Tensor:
        use_settings(prefill_attention="kernel" if kernel else "reference")
        model = DeepseekV4.from_weights(load_rank_weights(v4["ckpt"], rank=0, world_size=1, from_checkpoint=True),
                                        dtype=torch.float32, max_seq_len=PROMPT_LEN + STEPS)
        use_kernels_(model, torch.device("cpu"))  # as the engine's load does
        assert {a.prefill_kernel for a in model.modules() if hasattr(a, "prefill_kernel")} == {kernel}
        logits, pos = [], 0
        for n in chunks:
            logits.append(model(v4["ids"][pos:pos + n], pos, last_only=False))
            pos += n
        return torch.cat(logits)

    torch.testing.assert_close(run(True, (PROMPT_LEN,)), v4["ref"]["prefill"], atol=ATOL, rtol=0)
    chunks = (101, 78, PROMPT_LEN - 179)
    torch.testing.assert_close(run(True, chunks), run(False, chunks), atol=ATOL, rtol=0)


def test_fused_chunk_maths_match_transformers_and_the_eager_chunks(v4: dict, use_settings) -> None:
    """The row-wise maths of a prefill chunk compiled (``compile_pieces=kernel``: Inductor's C++ code on the
    CPU): every layer and every chunk length shares one graph per fused function (the mixer's scores and
    collapse with the block's norm, the query heads' norm and RoPE, the KV rows' norm and RoPE, the index
    queries' RoPE, the output's inverse RoPE, the routed experts' SwiGLU and per-token combine), and the
    logits are transformers' in one pass and the eager chunks' in three."""
    from shardsmith.runtime.engine.loader import load_rank_weights
    from shardsmith.runtime.layers.experts import combine_pairs, glu_rows
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4
    from shardsmith.runtime.models.deepseek_v4.attention import kv_rows, query_heads, unrope
    from shardsmith.runtime.models.deepseek_v4.compressor import index_query
    from shardsmith.runtime.models.deepseek_v4.hyper import collapse_norm, mixer_scores
    from shardsmith.testing.fused_cases import compiled_graphs as graphs

    def run(compiled: bool, chunks: tuple[int, ...]) -> torch.Tensor:
        use_settings(compile_pieces="kernel" if compiled else "reference")
        model = DeepseekV4.from_weights(load_rank_weights(v4["ckpt"], rank=0, world_size=1, from_checkpoint=True),
                                        dtype=torch.float32, max_seq_len=PROMPT_LEN + STEPS)
        logits, pos = [], 0
        for n in chunks:
            logits.append(model(v4["ids"][pos:pos + n], pos, last_only=False))
            pos += n
        return torch.cat(logits)

    functions = (mixer_scores, collapse_norm, query_heads, kv_rows, index_query, unrope, glu_rows, combine_pairs)
    chunks = (101, 78, PROMPT_LEN - 179)
    before = [graphs(fn) for fn in functions]
    fused = run(True, chunks)
    after = [graphs(fn) for fn in functions]
    # 4 layers of 3 kinds, chunks of 3 lengths: at most one graph each (none where an earlier test's fits)
    assert all(n >= 1 for n in after) and all(a - b <= 1 for a, b in zip(after, before))
    torch.testing.assert_close(fused, run(False, chunks), atol=ATOL, rtol=0)
    torch.testing.assert_close(run(True, (PROMPT_LEN,)), v4["ref"]["prefill"], atol=ATOL, rtol=0)
    assert [graphs(fn) for fn in functions] == after


def test_start_must_continue_the_sequence(v4: dict) -> None:
    from shardsmith.errors import UsageError
    from shardsmith.runtime.models.deepseek_v4 import DeepseekV4
    from shardsmith.runtime.engine.loader import load_rank_weights

    model = DeepseekV4.from_weights(load_rank_weights(v4["ckpt"], rank=0, world_size=1, from_checkpoint=True),
                                    dtype=torch.float32, max_seq_len=64)
    model(v4["ids"][:8], 0)
    with pytest.raises(UsageError, match="position 8"):
        model(v4["ids"][:1], 5)
    with pytest.raises(UsageError, match="max_seq_len=64"):
        model(v4["ids"][:60], 8)
    chunked = torch.cat((model(v4["ids"][:8], 0, last_only=False), model(v4["ids"][8:20], 8, last_only=False)))
    torch.testing.assert_close(chunked, v4["ref"]["prefill"][:20], atol=ATOL, rtol=0)
