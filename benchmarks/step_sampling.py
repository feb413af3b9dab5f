"""Host time per batched decode step spent choosing the next tokens, side by side.

A serving step ends with rank 0 choosing one token per running sequence from the step's logits
``[B, V]``. Two ways, timed in the same run on the same logits:

- ``per_row_host``: the logits copied to the host, then :func:`~shardsmith.runtime.engine.sampling.choose`
  row by row (argmax and a ``log_softmax`` over V per row): what the scheduler did before
  :func:`~shardsmith.runtime.engine.sampling.choose_rows`;
- ``batched_on_device``: :func:`~shardsmith.runtime.engine.sampling.choose_rows`: greedy rows reduced
  where the logits are, one ``[B, 2 + 2n]`` copy to the host.

Every request greedy (the serving benchmarks' case) or, with ``--temperature T`` (several values
give side-by-side rows), sampled with top-p 0.95 and its own seeded generator (one uniform per
token; the host way then sorts each row on the host); ``--logprobs`` top logprobs per row. Rows:
``device``, ``rows`` (B), ``vocab`` (V), ``ms_per_step`` (median of ``--repeat``), ``speedup``
(per-row time over batched time). On CPU both read the same memory, so the gain there is only the
B separate passes; on a GPU the ``[B, V]`` device-to-host copy and B host passes go.

Usage::

    python benchmarks/step_sampling.py [--device cpu|cuda] [--vocab 129280 49152] [--rows 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardsmith.runtime.engine.sampling import SamplingParams, choose, choose_rows, make_generator  # noqa: E402


def per_row_host(logits: torch.Tensor, params: list[SamplingParams]) -> list:
    host = logits.cpu()
    return [choose(host[b], temperature=p.temperature, top_p=p.top_p, logprobs=p.logprobs, generator=make_generator(p.seed))
            for b, p in enumerate(params)]


def batched_on_device(logits: torch.Tensor, params: list[SamplingParams]) -> list:
    return choose_rows(logits, params, [make_generator(p.seed) for p in params])


def time_ms(fn, logits: torch.Tensor, params: list[SamplingParams], repeat: int) -> tuple[float, list]:
    out = fn(logits, params)  # warm
    times = []
    for _ in range(repeat):
        if logits.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(logits, params)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, nargs="+", default=[129280, 49152], help="V4-Flash's and SmolLM2's")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--logprobs", type=int, default=0)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="0: greedy; > 0: sampled, top-p 0.95")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    rows = []
    print(f"{'device':>6} {'temp':>5} {'rows':>4} {'vocab':>7} {'per-row host ms':>16} {'batched ms':>11} {'speedup':>8}")
    for T, V, B in [(T, V, B) for T in args.temperature for V in args.vocab for B in args.rows]:
        g = torch.Generator().manual_seed(B * V)
        logits = (torch.randn(B, V, generator=g) * 3).to(args.device)
        params = [SamplingParams(logprobs=args.logprobs, temperature=T, top_p=0.95 if T > 0 else 1.0, seed=b)
                  for b in range(B)]
        old_ms, old = time_ms(per_row_host, logits, params, args.repeat)
        new_ms, new = time_ms(batched_on_device, logits, params, args.repeat)
        if T == 0 or args.device == "cpu":  # a sampled draw may land across a boundary the GPU's softmax rounds apart
            assert [c.token_id for c in old] == [c.token_id for c in new], "the two ways chose different tokens"
        rows.append({"device": args.device, "temperature": T, "rows": B, "vocab": V, "logprobs": args.logprobs,
                     "per_row_host_ms_per_step": round(old_ms, 4), "batched_on_device_ms_per_step": round(new_ms, 4),
                     "speedup": round(old_ms / new_ms, 2)})
        print(f"{args.device:>6} {T:>5} {B:>4} {V:>7} {old_ms:>16.3f} {new_ms:>11.3f} {old_ms / new_ms:>7.2f}x")
    if not args.no_save:
        from _results import save_results

        save_results("step_sampling", rows, extra={"torch_threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
