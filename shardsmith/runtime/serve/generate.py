"""Rank 0's job for ``shardsmith generate`` and ``shardsmith demo``: answer fixed prompts, print them.

The same text path as the server (:func:`~.worker.stream_text`: incremental detokenization, EOS,
stop strings), without HTTP. Text goes to stdout as it is generated; nothing else does.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from shardsmith.errors import UsageError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenerateJob:
    """Generate one answer per prompt on an engine that rank 0 loads.

    Attributes:
        prompts: the prompts, in order.
        chat: render each prompt as one user message through the checkpoint's chat template (or,
            with ``trust_remote_code``, its DeepSeek ``encoding/`` module when it has no template).
        max_tokens, temperature, top_p, top_k, seed: sampling (temperature 0 is greedy).
        stop: stop strings.
        labelled: print ``Q: <prompt>`` / ``A: <answer>`` blocks (the demo) instead of bare text.
    """

    prompts: tuple[str, ...]
    chat: bool = False
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    labelled: bool = False
    trust_remote_code: bool = False

    def __call__(self, load) -> int:
        from shardsmith.runtime.engine.engine import SamplingParams
        from shardsmith.runtime.serve.tokenizer import Codec
        from shardsmith.runtime.serve.worker import stream_text

        engine = load()
        try:
            codec = Codec(engine.root)
            template = None
            if self.chat:
                from shardsmith.runtime.serve.chat import load_chat_format

                template = load_chat_format(engine.root, trust_remote_code=self.trust_remote_code)
            log.info("loaded in %.1f s", engine.load_seconds)
            encoded = [codec.encode(template.render([{"role": "user", "content": p}])) if template
                       else codec.encode_prompt(p) for p in self.prompts]
            for i, ids in enumerate(encoded, 1):  # every prompt checked before the first answer is printed
                if not ids:
                    raise UsageError(f"--prompt #{i} is empty after tokenization")
                if len(ids) + self.max_tokens > engine.max_seq_len:
                    raise UsageError(f"--prompt #{i} ({len(ids)} tokens) + --max-tokens {self.max_tokens} exceeds "
                                     f"the context of {engine.max_seq_len} tokens (--max-seq-len)")
            out = sys.stdout
            for prompt, ids in zip(self.prompts, encoded):
                params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                                        top_p=self.top_p, seed=self.seed, stop_token_ids=tuple(codec.eos_token_ids))
                if self.labelled:
                    out.write(f"Q: {prompt}\nA: ")
                t0, n = time.perf_counter(), 0
                for ev in stream_text(engine.generate(ids, params), codec, ids, stop=self.stop,
                                      eos_token_ids=codec.eos_token_ids):
                    n += 1
                    out.write(ev.text)
                    out.flush()
                out.write("\n\n" if self.labelled else "\n")
                out.flush()
                dt = time.perf_counter() - t0
                log.info("%d tokens in %.2f s (%.1f tokens/s)", n, dt, n / dt if dt else 0.0)
        finally:
            engine.shutdown()
        return 0
