"""Prometheus metrics for the server, written by hand in the text exposition format (version 0.0.4).

No ``prometheus_client`` dependency: a few counters, gauges and histograms behind one lock
(updates come from the engine thread, reads from the event loop). Names follow Prometheus'
conventions (``_total`` counters, ``_seconds`` units, cumulative ``le`` buckets with ``+Inf``).
Format reference: https://prometheus.io/docs/instrumenting/exposition_formats/

Exported (prefix ``shardsmith_``):

============================================  =========  ==========================================
name                                          type       meaning
============================================  =========  ==========================================
requests_total{endpoint,status}               counter    finished HTTP generation requests
prompt_tokens_total                           counter    prompt tokens of served requests
generation_tokens_total                       counter    tokens generated
time_to_first_token_seconds                   histogram  request arrival to first generated token
inter_token_latency_seconds                   histogram  gap between consecutive tokens
request_duration_seconds                      histogram  request arrival to last token
requests_running / requests_waiting           gauge      sequences in the batch now / queued for a slot
queue_time_seconds                            histogram  request arrival to its admission into a slot
batch_size                                    gauge      rows of the last batched decode step
decode_batch_size                             histogram  rows of every batched decode step
engine_step_seconds                           histogram  one engine step: prefill chunks, the batched
                                                         decode and token choice (rank 0's view)
step_output_seconds                           histogram  one step's text side: detokenising and stop
                                                         strings of every row
max_num_seqs / max_queue                      gauge      sequence slots / waiting requests allowed
sequence_state_bytes                          gauge      per-sequence state of every slot, rank 0, bytes
load_seconds                                  gauge      engine load time on rank 0 (weights)
ready_seconds                                 gauge      rank 0 job start to ready (load + warm-up)
start_seconds{phase}                          gauge      before the load, on rank 0: ``launcher``, ``rank_start``,
                                                         ``imports``, ``group`` (:mod:`.startup`)
command_to_ready_seconds                      gauge      the command's start to ready (0 where unknown)
ready                                         gauge      1 once every rank loaded and warmed up
decode_buckets_built / decode_buckets_pending gauge      batch buckets whose decode pieces exist / that
                                                         are still to build (``--defer-buckets``: when idle)
decode_lengths_pending                        gauge      DeepSeek-V4: (batch bucket, length bucket) decode
                                                         pieces still to build (when idle)
kv_cache_blocks / kv_cache_blocks_used        gauge      blocks of the KV pool / held by sequences and kept
                                                         prefixes (a family whose KV sits in blocks)
num_preemptions_total                         counter    sequences preempted for KV blocks (recomputed later)
============================================  =========  ==========================================
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram:
    """Cumulative histogram with fixed upper bounds (seconds)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, c in zip(self.buckets + (math.inf,), self.counts):
            running += c
            le = "+Inf" if math.isinf(bound) else repr(float(bound))
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return out


def _metric(name: str, kind: str, value: object, help_: str) -> list[str]:
    """One unlabelled metric in the exposition format: its HELP, TYPE and sample lines."""
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]


class Metrics:
    """All server metrics; every method is thread-safe."""

    PREFIX = "shardsmith_"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.duration = Histogram()
        self.queue_time = Histogram()
        self.batch_sizes = Histogram(BATCH_BUCKETS)
        self.engine_step = Histogram(STEP_BUCKETS)
        self.step_output = Histogram(STEP_BUCKETS)
        self.running = 0
        self.waiting = 0
        self.batch_size = 0
        self.max_num_seqs = 0
        self.max_queue = 0
        self.state_bytes = 0
        self.load_seconds = 0.0
        self.ready_seconds = 0.0
        self.start_phases: dict[str, float] = {}  # startup.PHASES -> seconds (rank 0's StartClock)
        self.command_to_ready = 0.0
        self.ready = False
        self.offload = None  # the engine's OffloadRuntime (``stats()``), when experts are offloaded
        self.prefix = None  # the scheduler's PrefixCache (``stats``, ``held_positions()``), once ready
        self.bytes_per_position = 0.0  # per-sequence state of one position of one slot, bytes (rank 0)
        self.kv = None  # the engine's KVBlocks (``n_blocks``, ``blocks_free()``) where its KV sits in blocks
        self.spec = None  # the scheduler's SpecStats when speculation is on
        self.buckets: tuple[int, int] = (0, 0)  # decode batch buckets built, still to build
        self.lengths_pending = 0  # (batch, length) bucket pieces still to build (a static-core model)
        self.preemptions = 0  # sequences the scheduler preempted for KV blocks

    def request_done(self, endpoint: str, status: int | str) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1

    def queued(self, delta: int) -> None:
        with self._lock:
            self.waiting += delta

    def started(self, prompt_tokens: int, *, queue_seconds: float = 0.0) -> None:
        """A request left the queue for a slot after ``queue_seconds`` (seconds) of waiting."""
        with self._lock:
            self.waiting -= 1
            self.running += 1
            self.prompt_tokens += prompt_tokens
            self.queue_time.observe(queue_seconds)

    def batch(self, rows: int, running: int) -> None:
        """One engine step: ``rows`` sequences decoded together (0: a prefill-only step)."""
        with self._lock:
            self.batch_size = rows
            if rows:
                self.batch_sizes.observe(rows)

    def step_time(self, *, engine_seconds: float, output_seconds: float) -> None:
        """One engine step took ``engine_seconds`` (model and token choice) and its text side
        ``output_seconds`` (seconds): where a step's time goes, engine or server."""
        with self._lock:
            self.engine_step.observe(engine_seconds)
            self.step_output.observe(output_seconds)

    def set_capacity(self, *, max_num_seqs: int, state_bytes: int, max_queue: int) -> None:
        """Slots, the per-sequence state they take on rank 0 (bytes) and the queue limit, at ready."""
        with self._lock:
            self.max_num_seqs, self.state_bytes, self.max_queue = max_num_seqs, state_bytes, max_queue

    def mean_duration(self) -> float:
        """Mean request duration so far, seconds (0 before the first one ends)."""
        with self._lock:
            return self.duration.sum / self.duration.count if self.duration.count else 0.0

    def token(self, *, first: bool, since: float) -> None:
        """One generated token; ``since`` is seconds from arrival (first) or from the previous token."""
        with self._lock:
            self.generation_tokens += 1
            (self.ttft if first else self.itl).observe(since)

    def finished(self, duration: float) -> None:
        with self._lock:
            self.running -= 1
            self.duration.observe(duration)

    def set_ready(self, ready: bool, *, load_seconds: float | None = None, ready_seconds: float | None = None,
                  start_phases: dict[str, float] | None = None, command_to_ready: float | None = None) -> None:
        """Ready (or not), with what the start took: seconds, ``start_phases`` by phase (:mod:`.startup`)."""
        with self._lock:
            self.ready = ready
            if load_seconds is not None:
                self.load_seconds = load_seconds
            if ready_seconds is not None:
                self.ready_seconds = ready_seconds
            if start_phases is not None:
                self.start_phases = dict(start_phases)
            if command_to_ready is not None:
                self.command_to_ready = command_to_ready

    OFFLOAD = (  # stats() key, metric name, kind, help
        ("slots", "expert_cache_slots", "gauge", "Expert slots in the device cache (per GPU)."),
        ("hits", "expert_cache_hits_total", "counter", "Routed-expert lookups served from the device cache."),
        ("misses", "expert_cache_misses_total", "counter", "Routed-expert lookups copied from host memory."),
        ("hit_rate", "expert_cache_hit_rate", "gauge", "Hits over lookups since start."),
        ("bytes_per_token", "expert_bytes_per_token", "gauge", "Host-to-device expert bytes per generated token (per rank)."),
        ("h2d_gb_per_s", "expert_h2d_gb_per_s", "gauge", "Achieved host-to-device GB/s during miss copies."),
        ("host_bytes", "expert_host_bytes", "gauge", "Expert bank bytes held in host memory by this rank."),
        ("prefill_tokens", "expert_prefill_tokens_total", "counter",
         "Prompt tokens of prefill chunks that streamed their experts (each missing expert copied once a chunk)."),
        ("prefill_link_bytes", "expert_prefill_link_bytes_total", "counter",
         "Host-to-device expert bytes those prefill chunks copied (per rank)."),
    )

    def _prefix_lines(self) -> list[str]:
        if self.prefix is None:
            return []
        st, p, out = self.prefix.stats, self.PREFIX, []
        held = self.prefix.held_positions()
        for name, kind, value, help_ in (
            ("prefix_cache_queries_total", "counter", st.queries, "Prompts looked up in the prefix cache."),
            ("prefix_cache_hits_total", "counter", st.hits, "Prompts that resumed a prefix a finished request left."),
            ("prefix_cache_query_tokens_total", "counter", st.query_tokens, "Prompt tokens looked up."),
            ("prefix_cache_hit_tokens_total", "counter", st.hit_tokens, "Prompt tokens served from kept state (not computed)."),
            ("prefix_cache_preempted_queries_total", "counter", st.preempted_queries,
             "Preempted sequences that resumed, looked up in the prefix cache (not in queries_total)."),
            ("prefix_cache_preempted_query_tokens_total", "counter", st.preempted_query_tokens,
             "Their prompt and fed tokens looked up."),
            ("prefix_cache_preempted_hit_tokens_total", "counter", st.preempted_hit_tokens,
             "Of those, tokens served from kept state (not computed again)."),
            ("prefix_cache_tokens", "gauge", held, "Positions free slots keep for reuse."),
            ("prefix_cache_bytes", "gauge", int(held * self.bytes_per_position),
             "Per-sequence state those positions hold on rank 0, bytes."),
        ):
            out += _metric(p + name, kind, value, help_)
        return out

    def _kv_lines(self) -> list[str]:
        if self.kv is None:
            return []
        out: list[str] = []
        for name, value, help_ in (
            ("kv_cache_blocks", self.kv.n_blocks, f"Blocks of {self.kv.block_size} positions in the KV pool (--kv-cache-tokens)."),
            ("kv_cache_blocks_used", self.kv.n_blocks - self.kv.blocks_free(),
             "KV blocks running sequences and kept prefixes hold."),
        ):
            out += _metric(self.PREFIX + name, "gauge", value, help_)
        return out + _metric(self.PREFIX + "num_preemptions_total", "counter", self.preemptions,
                             "Sequences preempted for KV blocks (their tokens computed again when they resume).")

    def _spec_lines(self) -> list[str]:
        if self.spec is None:
            return []
        st, p, out = self.spec, self.PREFIX, []
        for name, kind, value, help_ in (
            ("spec_decode_steps_total", "counter", st.steps, "Verify chunks run (one per speculating sequence and step)."),
            ("spec_decode_draft_tokens_total", "counter", st.drafted, "Draft tokens checked."),
            ("spec_decode_accepted_tokens_total", "counter", st.accepted, "Draft tokens the model agreed with."),
            ("spec_decode_emitted_tokens_total", "counter", st.emitted, "Tokens the verify chunks gave."),
            ("spec_decode_acceptance_rate", "gauge", st.acceptance_rate, "Accepted over drafted since start."),
        ):
            out += _metric(p + name, kind, value, help_)
        return out

    def _offload_lines(self) -> list[str]:
        if self.offload is None:
            return []
        stats, p, out = self.offload.stats(), self.PREFIX, []
        for key, name, kind, help_ in self.OFFLOAD:
            if key in stats:
                out += _metric(p + name, kind, float(stats[key]), help_)
        return out

    def render(self) -> str:
        """The exposition text (``text/plain; version=0.0.4``)."""
        p = self.PREFIX
        with self._lock:
            out = [f"# HELP {p}requests_total Finished generation requests by endpoint and HTTP status.",
                   f"# TYPE {p}requests_total counter"]
            out += [f'{p}requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())]
            for name, kind, value, help_ in (
                ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of served requests."),
                ("generation_tokens_total", "counter", self.generation_tokens, "Generated tokens."),
                ("requests_running", "gauge", self.running, "Sequences in the running batch now."),
                ("requests_waiting", "gauge", self.waiting, "Requests waiting for a sequence slot."),
                ("batch_size", "gauge", self.batch_size, "Rows of the last batched decode step."),
                ("max_num_seqs", "gauge", self.max_num_seqs, "Sequence slots (sequences decoded together at most)."),
                ("max_queue", "gauge", self.max_queue, "Requests allowed to wait for a slot (more get HTTP 429)."),
                ("sequence_state_bytes", "gauge", self.state_bytes,
                 "Per-sequence state (KV caches ...) of every slot on rank 0, bytes."),
                ("load_seconds", "gauge", self.load_seconds, "Engine load time on rank 0, seconds."),
                ("ready_seconds", "gauge", self.ready_seconds, "Rank 0 job start to ready (load and warm-up), seconds."),
                ("command_to_ready_seconds", "gauge", round(self.command_to_ready, 3),
                 "The command's start to ready, seconds (0: unknown)."),
                ("ready", "gauge", int(self.ready), "1 once every rank has loaded and warmed up."),
                ("decode_buckets_built", "gauge", self.buckets[0], "Batch buckets whose decode pieces exist."),
                ("decode_buckets_pending", "gauge", self.buckets[1],
                 "Batch buckets still to build (built when the server is idle)."),
                ("decode_lengths_pending", "gauge", self.lengths_pending,
                 "(batch bucket, length bucket) decode pieces still to build (built when the server is idle)."),
            ):
                out += _metric(p + name, kind, value, help_)
            out += [f"# HELP {p}start_seconds Before the load on rank 0, by phase: launcher, rank_start, imports, "
                    "group (seconds).", f"# TYPE {p}start_seconds gauge"]
            out += [f'{p}start_seconds{{phase="{k}"}} {round(v, 3)}' for k, v in self.start_phases.items()]
            out += self._offload_lines()
            out += self._prefix_lines()
            out += self._kv_lines()
            out += self._spec_lines()
            for name, hist, help_ in (
                ("time_to_first_token_seconds", self.ttft, "Request arrival to first generated token."),
                ("inter_token_latency_seconds", self.itl, "Gap between consecutive generated tokens."),
                ("request_duration_seconds", self.duration, "Request arrival to last generated token."),
                ("queue_time_seconds", self.queue_time, "Request arrival to its admission into a sequence slot."),
                ("decode_batch_size", self.batch_sizes, "Rows of each batched decode step."),
                ("engine_step_seconds", self.engine_step, "One engine step (prefill chunks, batched decode, token choice)."),
                ("step_output_seconds", self.step_output, "One step's text side (detokenise, stop strings)."),
            ):
                out += [f"# HELP {p}{name} {help_}", f"# TYPE {p}{name} histogram"] + hist.lines(p + name)
        return "\n".join(out) + "\n"
