"""Rank 0's job for ``shardsmith serve``, as the launcher hands it to the rank it starts.

Kept apart from :mod:`.server` so that the launcher, which only checks the command and starts the
ranks, imports neither torch nor the HTTP stack: the ranks import them, in parallel, once each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardsmith.runtime.serve.http_limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES, HTTPLimits


@dataclass(frozen=True, slots=True)
class ServeJob:
    """Rank 0's job for ``shardsmith serve``: the HTTP server while the engine loads beside it.

    Attributes:
        host, port: where uvicorn listens. model_name: the id in ``/v1/models`` and requests.
        trust_remote_code: run the checkpoint's own chat encoder (``encoding/``) when it has no template.
        chat_template: a Jinja chat template file used instead of the pack's (``--chat-template``).
        speculative: n-gram speculation (``SpeculativeConfig``), or None.
        max_request_bytes: larger request bodies get a 413 (:class:`~.server.BodyLimit`).
        max_queue: requests that may wait for a sequence slot (more get a 429).
        prefill_chunk: prompt tokens per engine step (a long prompt joins the batch in chunks); None: the
            scheduler's default (:func:`~shardsmith.runtime.engine.scheduler.default_prefill_chunk`).
        decode_prompt_tokens: prompts of at most this many tokens are fed through the batched decode
            step (None: measured at warm-up on CUDA, 0 on CPU: :func:`~shardsmith.runtime.engine.scheduler.default_decode_prompt_tokens`).
        max_model_len: the context each sequence gets (``--max-model-len``), shown by ``/v1/models``
            while the engine loads (then the engine's own figure).
        limits: header and body read timeouts, keep-alive and the open-connection bound
            (:class:`~shardsmith.runtime.serve.http_limits.HTTPLimits`).
        prefix_caching: finished requests' slots keep their state for prompts that share their
            tokens (:mod:`~shardsmith.runtime.engine.prefix_cache`).
        defer_buckets: say ready once the one-row decode step is built; build the other batch
            buckets while idle (``Engine.warmup(defer_buckets=True)``).
    """

    host: str
    port: int
    model_name: str
    trust_remote_code: bool = False
    chat_template: Path | None = None
    speculative: Any = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queue: int = DEFAULT_MAX_QUEUE
    prefill_chunk: int | None = None
    decode_prompt_tokens: int | None = None
    max_model_len: int | None = None
    limits: HTTPLimits = HTTPLimits()
    prefix_caching: bool = True
    defer_buckets: bool = False

    def __call__(self, load) -> int:
        """Serve until SIGINT/SIGTERM or an engine failure (:func:`~.server.run_server`); the exit code.

        The engine worker starts first, so the load and warm-up run while the HTTP stack is imported
        and the app built."""
        import threading

        from shardsmith.runtime.serve.metrics import Metrics
        from shardsmith.runtime.serve.worker import EngineWorker

        metrics, failed, holder = Metrics(), threading.Event(), {}

        def on_fatal(message: str) -> None:
            failed.set()
            if "server" in holder:
                holder["server"].should_exit = True

        worker = EngineWorker(load, metrics=metrics, on_fatal=on_fatal, max_queue=self.max_queue,
                              prefill_chunk=self.prefill_chunk, decode_prompt_tokens=self.decode_prompt_tokens,
                              prefix_caching=self.prefix_caching, speculative=self.speculative,
                              defer_buckets=self.defer_buckets)
        worker.start()
        from shardsmith.runtime.serve.server import run_server

        return run_server(self, worker, metrics, failed, holder)
