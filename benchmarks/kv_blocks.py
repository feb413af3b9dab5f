"""The KV cache in blocks (the Mixtral family), side by side in one run: what a scattered block table costs
a decode step, and how many sequences a pool admits against slots preallocated with the same bytes.

1. Step cost. One sequence of ``--context`` tokens decodes ``--steps`` one-token steps (the engine's batched
   step, one row: its pieces graphed on CUDA after the warm-up, attention eager between them). ``contiguous``: its blocks are one slice of the pool (a view, as when it was
   prefilled alone). ``scattered``: two slots prefilled in turns, a quarter of the context at a time, in a
   pool just large enough for both: the second one starts halfway along the free blocks, runs into the pool's end
   and goes on in the blocks left between them, so attention gathers its keys and values each step.
2. Running requests. ``--requests`` requests of ``--prompt`` random tokens generating ``--max-tokens`` each,
   all submitted at once, run to their end through the real scheduler (admitted whenever
   :meth:`~shardsmith.runtime.engine.scheduler.Scheduler.can_admit` says so, greedy): a pool of ``--pool``
   tokens under ``--max-num-seqs`` slots of ``--max-model-len`` (admitted on their prompts' blocks, the
   last arrived preempted and computed again when the pool runs out), against slots that each hold
   ``--max-model-len`` positions in the same bytes (``pool // max_model_len`` slots). Generated tokens per
   second, sequences per decode step, preemptions.

Rows (``benchmarks/results/kv_blocks-<date>-<host>.json``): ``part`` (``step`` / ``run``); step rows
``layout``, ``context_tokens``, ``step_ms`` (median), ``ratio_to_contiguous``; run rows ``layout``
(``blocks`` / ``per_slot``), ``kv_cache_tokens``, ``max_model_len_tokens``, ``slots``, ``requests``,
``prompt_tokens``, ``max_tokens``, ``wall_s``, ``generated_tokens_per_s``, ``mean_sequences_per_step``,
``most_sequences_at_once``, ``preemptions``, ``kv_bytes_per_rank``, ``ratio_to_per_slot``.

    python benchmarks/kv_blocks.py PACK [--device cuda] [--context 1024 4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardsmith.runtime.engine.engine import Engine, SamplingParams  # noqa: E402
from shardsmith.runtime.engine.scheduler import Scheduler, Sequence  # noqa: E402


PREFILL_CHUNK = 4096  # tokens per prefill call


def step_ms(engine: Engine, slot: int, context: int, steps: int, sync) -> float:
    """Median milliseconds of one-row decode steps of ``slot`` from position ``context`` on."""
    times = []
    for i in range(steps):
        sync()
        t0 = time.perf_counter()
        engine.decode([7], [context + i], [slot])
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:] if len(times) > 2 else times)


def step_rows(load, context: int, steps: int) -> tuple[list[dict], int]:
    """The step-cost rows at ``context`` on an engine of two slots (``load(max_seq_len, kv_cache_tokens)``) whose
    pool holds just the two sequences, and the engine's KV bytes per token."""
    longest = context + steps + 1
    engine = load(longest, longest + context)
    if engine.kv_blocks is None:
        raise SystemExit(f"{engine.family.name} keeps its state per slot: this benchmark needs a family in blocks")
    if engine.device.type == "cuda":
        engine.warmup()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    block = engine.kv_blocks.block_size
    prompt = torch.randint(3, engine.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    for lo in range(0, context, PREFILL_CHUNK):  # alone: its blocks follow one another
        engine.prefill(0, prompt[lo: lo + PREFILL_CHUNK], lo)
    assert isinstance(engine.kv_blocks.index(0, 0, context, engine.device), slice)
    contiguous = step_ms(engine, 0, context, steps, sync)
    engine.release(0)
    turn = max(block, context // 4 // block * block)  # in turns with slot 1: four pieces each
    for lo in range(0, context, turn):
        engine.prefill(0, prompt[lo: lo + turn], lo)
        engine.prefill(1, prompt[lo: lo + turn], lo)
    split = [s for s in (0, 1) if not isinstance(engine.kv_blocks.index(s, 0, context, engine.device), slice)]
    if not split:
        raise SystemExit(f"no slot's blocks are scattered after the interleaved prefills: {engine.kv_blocks.tables[:2]}")
    scattered = step_ms(engine, split[0], context, steps, sync)
    per_token = engine.state_bytes // engine.kv_blocks.tokens
    engine.shutdown()
    return [{"part": "step", "layout": layout, "context_tokens": context, "step_ms": round(ms, 4),
             "ratio_to_contiguous": round(ms / contiguous, 4)}
            for layout, ms in (("contiguous", contiguous), ("scattered", scattered))], per_token


def run_requests(engine: Engine, requests: int, prompt: int, max_tokens: int) -> dict:
    """``requests`` greedy requests of ``prompt`` random tokens and ``max_tokens`` each, all waiting at the start,
    through one scheduler to their end: wall seconds, generated tokens, sequences per decode step, preemptions."""
    sched = Scheduler(engine, decode_prompt_tokens=0, overlap=False)
    gen = torch.Generator().manual_seed(1)
    waiting = [Sequence(torch.randint(3, engine.vocab_size, (prompt,), generator=gen).tolist(),
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=()))
               for _ in range(requests)]
    generated, batches = 0, []
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while waiting or sched.running or sched.preempted:
        while waiting and sched.can_admit(waiting[0].prompt_ids):
            sched.admit(waiting.pop(0))
        generated += len(sched.step())
        if sched.last_batch:
            batches.append(sched.last_batch)
    sync()
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 3), "generated_tokens_per_s": round(generated / wall, 2),
            "mean_sequences_per_step": round(statistics.mean(batches), 2) if batches else 0.0,
            "most_sequences_at_once": max(batches, default=0), "preemptions": sched.preemptions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--pool", type=int, default=32768, help="--kv-cache-tokens of the running part")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--from-checkpoint", action="store_true", help="PACK is a checkpoint (loaded as TP=1)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from _results import save_results

    dtype = getattr(torch, a.dtype)

    def load(max_seq_len: int, kv_cache_tokens: int) -> Engine:
        return Engine.load(a.pack, rank=0, world_size=1, device=a.device, dtype=dtype, max_seq_len=max_seq_len,
                           max_num_seqs=2, from_checkpoint=a.from_checkpoint, cuda_graphs=a.device == "cuda",
                           kv_cache_tokens=kv_cache_tokens)

    name = a.device if a.device != "cuda" else torch.cuda.get_device_name()
    extra = {"pack": a.pack.name, "device": name, "dtype": a.dtype}
    rows = []
    for context in a.context:
        got, per_token = step_rows(load, context, a.steps)
        rows += got
        for r in got:  # as they come, and saved: a run cut short keeps them
            print(f"step {r['layout']:<11} {context:>8} {r['step_ms']:>9.3f} {r['ratio_to_contiguous']:>7.3f}", flush=True)
        save_results("kv_blocks", rows, extra=extra | {"kv_bytes_per_token_per_rank": per_token}, path=a.out)

    per_slot = max(1, a.pool // a.max_model_len)
    for layout, slots, pool in (("blocks", a.max_num_seqs, a.pool), ("per_slot", per_slot, None)):
        eng = Engine.load(a.pack, rank=0, world_size=1, device=a.device, dtype=dtype, max_seq_len=a.max_model_len,
                          max_num_seqs=slots, from_checkpoint=a.from_checkpoint, cuda_graphs=False,
                          kv_cache_tokens=pool)
        rows.append({"part": "run", "layout": layout, "kv_cache_tokens": eng.kv_blocks.tokens,
                     "max_model_len_tokens": a.max_model_len, "slots": slots, "requests": a.requests,
                     "prompt_tokens": a.prompt, "max_tokens": a.max_tokens,
                     **run_requests(eng, a.requests, a.prompt, a.max_tokens), "kv_bytes_per_rank": eng.state_bytes})
        eng.shutdown()
        del eng  # its pool is freed before the next one is allocated
    runs = {r["layout"]: r for r in rows if r["part"] == "run"}
    for r in runs.values():
        r["ratio_to_per_slot"] = round(r["generated_tokens_per_s"] / runs["per_slot"]["generated_tokens_per_s"], 3)

    print(f"{'layout':<11} {'context':>8} {'step ms':>9} {'ratio':>7}")
    for r in rows:
        if r["part"] == "step":
            print(f"{r['layout']:<11} {r['context_tokens']:>8} {r['step_ms']:>9.3f} {r['ratio_to_contiguous']:>7.3f}")
    print(f"\n{'layout':<9} {'pool tok':>9} {'slots':>6} {'tok/s':>8} {'ratio':>6} {'seqs/step':>9} {'most':>5} "
          f"{'preempt':>8} {'KV MiB':>8}")
    for r in runs.values():
        print(f"{r['layout']:<9} {r['kv_cache_tokens']:>9} {r['slots']:>6} {r['generated_tokens_per_s']:>8.1f} "
              f"{r['ratio_to_per_slot']:>6.2f} {r['mean_sequences_per_step']:>9.2f} {r['most_sequences_at_once']:>5} "
              f"{r['preemptions']:>8} {r['kv_bytes_per_rank'] / 2**20:>8.1f}")
    save_results("kv_blocks", rows, extra=extra | {"kv_bytes_per_token_per_rank": per_token}, path=a.out)


if __name__ == "__main__":
    main()
