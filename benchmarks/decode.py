"""Decode tokens/s at TP 1 and 2 and time to ready, on the SmolLM2 MoE demo (or any checkpoint).

For each TP the checkpoint is split once into ``--pack-root/tp<N>`` (reused when present), then
``N`` fresh rank processes (spawned; gloo on CPU, NCCL with ``--device cuda``) load the pack, warm
up, and rank 0 decodes the chat prompt greedily for ``--tokens`` tokens (EOS ignored), ``--repeat``
times. Rows:

- ``seconds_to_ready``: wall time from spawning the ranks to rank 0 ready after the warm-up step
  (Python + torch import, process group, load, warm-up); ``load_seconds``: ``Engine.load`` alone;
- ``prefill_seconds``: time to the first token; ``tokens_per_s`` / ``ms_per_token``: the
  remaining tokens (median over repeats); ``bytes_per_rank``: the rank's pack bytes.

Usage: ``python benchmarks/decode.py [--tp 1 2] [--device cpu|cuda] [--tokens 32] [--checkpoint DIR]``
(``SHARDSMITH_HOST`` labels the results file; default the hostname).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from shardsmith.runtime.serve.launch import free_port  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
QUESTION = "What is the capital of France?"




def chat_ids(checkpoint: Path) -> list[int]:
    """The chat prompt's token ids (the checkpoint's own template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def rank_main(rank: int, world: int, port: int, job: dict, queue) -> None:
    """One rank: load ``job['path']``, warm up, and (rank 0) run ``job['mode']``."""
    try:
        import torch  # noqa: F401

        from shardsmith.runtime.engine.engine import Engine, SamplingParams
        from shardsmith.runtime.engine.dist import init_distributed

        if job["mode"] == "read-floor":  # plain sequential read of this rank's bytes
            t0 = time.perf_counter()
            n = sum(read_all(p) for p in job["files"][rank])
            queue.put((rank, {"ready_at": time.time(), "load_seconds": time.perf_counter() - t0, "bytes": n}))
            return
        init_distributed(rank, world, master_port=port, device=job["device"])
        eng = Engine.load(job["path"], rank=rank, world_size=world, device=job["device"],
                          from_checkpoint=job.get("from_checkpoint", False), max_seq_len=job.get("max_seq_len", 512),
                          verify_hashes=job.get("verify", True))
        if rank != 0:
            eng.follow()
            queue.put((rank, {"load_seconds": eng.load_seconds}))
            return
        eng.warmup()
        out = {"ready_at": time.time(), "load_seconds": eng.load_seconds, "threads": __import__("torch").get_num_threads()}
        if job["mode"] == "decode":
            runs = []
            for _ in range(job["repeat"]):
                t0 = time.perf_counter()
                gen = eng.generate(job["ids"], SamplingParams(max_tokens=job["tokens"]))
                first = next(gen)
                t1 = time.perf_counter()
                rest = list(gen)
                t2 = time.perf_counter()
                runs.append((t1 - t0, len(rest) / (t2 - t1), [first.token_id] + [s.token_id for s in rest]))
            out["prefill_seconds"] = statistics.median(r[0] for r in runs)
            out["tokens_per_s"] = statistics.median(r[1] for r in runs)
            out["tokens"] = runs[0][2]
        eng.shutdown()
        queue.put((rank, out))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))
        raise


def read_all(path: Path, chunk: int = 8 << 20) -> int:
    """Read ``path`` sequentially; bytes read."""
    n = 0
    with open(path, "rb", buffering=0) as f:
        while data := f.read(chunk):
            n += len(data)
    return n


def spawn(world: int, job: dict, timeout: float = 1800.0) -> dict:
    """Run ``world`` rank processes on ``job``; rank 0's report plus ``seconds_to_ready``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    t0 = time.time()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, job, queue)) for r in range(world)]
    for p in procs:
        p.start()
    reports = {}
    try:
        while len(reports) < world:
            rank, rep = queue.get(timeout=timeout)
            if "error" in rep:
                raise RuntimeError(f"rank {rank} failed:\n{rep['error']}")
            reports[rank] = rep
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    out = dict(reports[0])
    ready = [r["ready_at"] for r in reports.values() if "ready_at" in r]
    out["seconds_to_ready"] = max(ready) - t0
    out["load_seconds_max"] = max(r["load_seconds"] for r in reports.values())
    return out


def ensure_pack(checkpoint: Path, root: Path, tp: int) -> Path:
    """Split ``checkpoint`` at ``tp`` into ``root/tp<tp>`` unless a finished pack is there."""
    from shardsmith.writer.split import split_checkpoint

    out = root / f"tp{tp}"
    if not (out / "pack.yaml").is_file():
        split_checkpoint(checkpoint, out, world_size=tp, force=True)
    return out


def pack_bytes(pack: Path, rank: int, tp: int) -> int:
    """Bytes of rank ``rank``'s weight files in ``pack``."""
    return sum(f.stat().st_size for f in (pack / f"rank-{rank}-of-{tp}").glob("*.safetensors"))


def default_checkpoint(fp8: bool) -> Path:
    from shardsmith.demo import build_demo_checkpoint, default_demo_dir

    return build_demo_checkpoint(default_demo_dir(fp8=fp8), fp8=fp8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the SmolLM2 MoE demo (built if missing)")
    ap.add_argument("--fp8", action="store_true", help="the block-FP8 demo build")
    ap.add_argument("--pack-root", type=Path, default=Path("/tmp/shardsmith-bench-decode"))
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gloo-gather-max", type=int, nargs="+", default=None,
                    help="run each TP > 1 once per value of the gloo_gather_max setting (0: gloo's ring "
                         "all-reduce for every size) to compare the CPU all-reduce paths side by side")
    a = ap.parse_args()
    from _results import environment, save_results

    from shardsmith import settings

    ckpt = a.checkpoint or default_checkpoint(a.fp8)
    root = a.pack_root / ckpt.name
    ids = chat_ids(ckpt)
    rows = []
    variants = [(tp, g) for tp in a.tp for g in (a.gloo_gather_max if a.gloo_gather_max and tp > 1 else [None])]
    for tp, gather_max in variants:
        pack = ensure_pack(ckpt, root, tp)
        # inherited by the spawned ranks, read when they import the runtime
        extra = settings.overrides(gloo_gather_max=str(gather_max)) if gather_max is not None else {}
        with environment(extra):
            rep = spawn(tp, {"mode": "decode", "path": str(pack), "device": a.device, "ids": ids,
                             "tokens": a.tokens, "repeat": a.repeat})
        row = {"tp": tp, "device": a.device, "source": "pack", "checkpoint": ckpt.name,
               **({"gloo_gather_max_elements": gather_max} if gather_max is not None else {}),
               "prompt_tokens": len(ids), "new_tokens": a.tokens,
               "seconds_to_ready": round(rep["seconds_to_ready"], 3), "load_seconds": round(rep["load_seconds_max"], 3),
               "prefill_seconds": round(rep["prefill_seconds"], 3), "tokens_per_s": round(rep["tokens_per_s"], 3),
               "ms_per_token": round(1000 / rep["tokens_per_s"], 1), "bytes_per_rank": pack_bytes(pack, 0, tp),
               "threads_per_rank": rep["threads"], "first_tokens": rep["tokens"][:8]}
        print(row, flush=True)
        rows.append(row)
    base = rows[0]["tokens_per_s"]
    print(f"{'tp':>3} {'gloo gather max':>16} {'tokens/s':>9} {'ms/token':>9} {'vs first':>9}")
    for r in rows:
        print(f"{r['tp']:>3} {str(r.get('gloo_gather_max_elements', '-')):>16} {r['tokens_per_s']:>9.2f} "
              f"{r['ms_per_token']:>9.1f} {r['tokens_per_s'] / base:>8.2f}x")
    save_results("decode", rows, extra={"load_average": os.getloadavg()})


if __name__ == "__main__":
    main()
