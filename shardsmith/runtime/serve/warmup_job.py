"""Rank 0's job for ``shardsmith warmup``: load, run serve's warm-up once, report, exit.

The warm-up fills each rank's compile cache (:mod:`~shardsmith.runtime.engine.compile_cache`) as
``serve`` with the same options would, so a server started later on this machine (or an image
built with the cache folder) compiles nothing. The report goes to stdout: one line, or JSON.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from shardsmith.runtime.serve.startup import CLOCK


@dataclass(frozen=True, slots=True)
class WarmupJob:
    """Load and warm up; print what it took. Attributes: as_json: print a JSON object instead of a line."""

    as_json: bool = False

    def __call__(self, load) -> int:
        t0 = time.perf_counter()
        engine = load()
        try:
            engine.warmup()
            cache = engine.compile_cache
            files = cache.count() if cache is not None else None
            doc = {"pack": str(engine.root), "world_size": engine.world_size, "device": str(engine.device),
                   "dtype": str(engine.dtype).removeprefix("torch."), "max_num_seqs": engine.max_num_seqs,
                   "max_model_len": engine.max_seq_len, "load_s": round(engine.load_seconds, 3),
                   "warmup_s": round(engine.warmup_seconds, 3), "total_s": round(time.perf_counter() - t0, 3),
                   "warmup_phases_s": {k: round(v, 3) for k, v in engine.warmup_phases.items()},
                   "warmup_compile_s": {k: round(v, 3) for k, v in engine.warmup_compile.items()},
                   "start_phases_s": {k: round(v, 3) for k, v in CLOCK.phases.items()},
                   "kernel_launches": engine.warmup_launches,
                   "compile_cache": None if cache is None else {
                       "folder": str(cache.folder), "state": cache.state, "why": cache.why,
                       "files": files if cache.folder.exists() else 0, "files_at_start": cache.files_at_open}}
        finally:
            engine.shutdown()
        if self.as_json:
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
            return 0
        c = doc["compile_cache"]
        where = ("the compile cache is not managed (TRITON_CACHE_DIR or TORCHINDUCTOR_CACHE_DIR is set)" if c is None
                 else f"compile cache {c['folder']}: {c['state']}{' (' + c['why'] + ')' if c['why'] else ''}, "
                      f"{c['files']} files ({c['files'] - c['files_at_start']:+d})")
        sys.stdout.write(f"warmed up {doc['pack']} in {doc['total_s']:.1f} s (load {doc['load_s']:.1f} s, warm-up "
                         f"{doc['warmup_s']:.1f} s); {where}\n")
        return 0
