"""What structured output costs per decode step: llguidance's masks for B constrained sequences
(on the host) and applying them to a ``[B, V]`` logits tensor on the device, without a model.

Each of B matchers follows a JSON schema (a list of people with names, ages and tags: strings,
numbers, enums and nesting) and advances by a token drawn from its own allowed set each step, so
the masks are those of a real answer in progress. Per step: ``fill_ms`` (every row's bitmask
filled on the host), ``apply_ms`` (the bitmask copied to the device and applied, synchronised),
and their sum; medians over ``--steps``. The vocabulary is the tokenizer's, the logits ``--vocab``
wide (129,280: DeepSeek-V4's; tokens past the tokenizer's are refused).

Rows: ``batch``, ``vocab``, ``tokenizer_tokens``, ``fill_ms``, ``apply_ms``, ``mask_ms``; saved as
``benchmarks/results/structured-<date>-<host>.json``.

    python benchmarks/structured.py TOKENIZER_JSON --device cuda --batch 1 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardsmith.runtime.engine.constraints import allow_all, apply_bitmask  # noqa: E402
from shardsmith.runtime.serve.structured import Grammars  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "object", "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"enum": ["painter", "sailor", "teacher", "engineer"]}}}}}


def allowed_token(row: torch.Tensor, gen: torch.Generator) -> int:
    """A token whose bit is set in bitmask ``row`` (int32 ``[W]``), drawn at random."""
    bits = ((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1).nonzero().flatten()
    return int(bits[torch.randint(len(bits), (1,), generator=gen)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokenizer", type=Path, help="a tokenizer.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from _results import save_results

    from tokenizers import Tokenizer

    text = a.tokenizer.read_text()
    tokenizer_tokens = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
    grammars = Grammars(text, a.vocab, (0,))
    grammar = grammars.compile(SCHEMA)
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen, rows = torch.Generator().manual_seed(0), []
    for b in a.batch:
        logits = torch.randn(b, a.vocab, device=device)
        matchers = [grammars.matcher(grammar) for _ in range(b)]
        fill, apply = [], []
        for step in range(a.steps + 5):
            mask = allow_all(b, a.vocab)
            t0 = time.perf_counter()
            for r, m in enumerate(matchers):
                m.fill_bitmask(mask, r)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            apply_bitmask(logits.clone(), mask)
            sync()
            t3 = time.perf_counter()
            for r, m in enumerate(matchers):
                m.advance(allowed_token(mask[r], gen))
                if m.failed or m.matcher.is_stopped():  # a whole document (or an error): start another
                    matchers[r] = grammars.matcher(grammar)
            if step >= 5:  # the first steps warm the caches and the device
                fill.append((t1 - t0) * 1e3)
                apply.append((t3 - t2) * 1e3)
        f, p = statistics.median(fill), statistics.median(apply)
        rows.append({"batch": b, "vocab": a.vocab, "tokenizer_tokens": tokenizer_tokens, "fill_ms": round(f, 4),
                     "apply_ms": round(p, 4), "mask_ms": round(f + p, 4)})
    print(f"{'batch':>5} {'vocab':>7} {'fill ms':>8} {'apply ms':>9} {'mask ms':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['vocab']:>7} {r['fill_ms']:>8.3f} {r['apply_ms']:>9.3f} {r['mask_ms']:>8.3f}")
    name = device.type if device.type != "cuda" else torch.cuda.get_device_name()
    save_results("structured", rows, extra={"tokenizer": a.tokenizer.parent.name, "device": name,
                                             "schema": "list of {name, age, tags}"}, path=a.out)


if __name__ == "__main__":
    main()
