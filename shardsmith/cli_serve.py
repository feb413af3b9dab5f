"""CLI commands ``serve``, ``generate`` and ``demo``: thin wrappers over :mod:`shardsmith.runtime.serve.launch`.

Every command starts one process per rank (or runs as one rank under ``torchrun``); rank 0 runs the
HTTP server (:class:`~shardsmith.runtime.serve.serve_job.ServeJob`) or prints answers
(:class:`~shardsmith.runtime.serve.generate.GenerateJob`). Imports stay inside the commands so that
``shardsmith --help`` does not import torch.

Pre-flight: every check that can fail without loading weights runs here, before any rank starts,
and raises :class:`~shardsmith.errors.UsageError` (exit 1) naming the option: option values and
ranges, the pack (``pack.yaml``, ``tokenizer.json``), the HTTP port (bound once and released;
another process could still take it before rank 0 listens), and the GPUs for ``--device cuda``.
"""

from __future__ import annotations

import dataclasses
import json

from pathlib import Path

import typer

from .errors import UsageError

MOE_BACKENDS = ("resident", "auto", "gpu", "cpu", "hybrid")

PATH_ARG = typer.Argument(..., metavar="PACK", help="Pack directory written by `shardsmith split` (or a checkpoint with --from-checkpoint).")
DEVICE = typer.Option("cpu", "--device", help="cpu (gloo) or cuda (NCCL, rank r on cuda:r; pick GPUs with CUDA_VISIBLE_DEVICES).")
DIST_PORT = typer.Option(None, "--dist-port", help="Rendezvous port on 127.0.0.1 (default: a free port).")
FROM_CKPT = typer.Option(False, "--from-checkpoint", help="Load an unsplit checkpoint, slicing at start-up (needs --tp).")
TP = typer.Option(None, "--tp", help="Ranks for --from-checkpoint (a pack's world_size is read from pack.yaml).")
VERIFY = typer.Option(True, "--verify-hashes/--no-verify",
                      help="Hash every pack file (XXH3-128) against its manifest as it is read; --no-verify skips it.")
DIGEST = typer.Option(None, "--expect-digest", help="Refuse the pack unless its root digest (printed by split) is this.")
MAX_SEQ = typer.Option(None, "--max-seq-len", "--max-model-len",
                       help="Context length in tokens (prompt + completion), per sequence; at most the model's "
                            "max_position_embeddings (default: 2048, or the model's length when shorter).")
DEFAULT_MAX_SEQ = 2048
EAGER = typer.Option(False, "--enforce-eager",
                     help="Launch every kernel eagerly: no CUDA graphs for decode steps (used on CUDA only).")
DTYPE = typer.Option("auto", "--dtype", help="Compute dtype: auto (the config's torch_dtype), bfloat16, float16 or float32.")
MOE_BACKEND = typer.Option("resident", "--moe-backend",
                           help="Routed experts: resident (all on the device), or kept in host RAM and run by "
                                "gpu (device expert cache), cpu (host), hybrid (share of misses on the host) or "
                                "auto (a start-up probe picks, never a slower one).")
CACHE_GB = typer.Option(None, "--expert-cache-gb",
                        help="Device expert cache per GPU in GiB (default: free memory; needs --moe-backend).")
POLICY = typer.Option(None, "--expert-policy",
                      help="Expert cache eviction: hot (default; LRU with a frequency-pinned hot set) or lru "
                           "(needs --moe-backend).")
TRUST = typer.Option(False, "--trust-remote-code",
                     help="Run the checkpoint's own chat encoder (DeepSeek's encoding/*.py) when it has no chat template.")


def _offload(moe_backend: str, expert_cache_gb: float | None, expert_policy: str | None):
    """The :class:`OffloadConfig` for the options, None for resident experts.

    Raises:
        UsageError: an unknown backend or policy, a bad cache size, or offload options with resident experts.
    """
    if moe_backend not in MOE_BACKENDS:
        raise UsageError(f"--moe-backend must be one of {', '.join(MOE_BACKENDS)}, got {moe_backend!r}")
    from .runtime.offload.slots import Policy

    policies = [p.value for p in Policy]
    if expert_policy is not None and expert_policy not in policies:  # the bad value first, then where it applies
        raise UsageError(f"--expert-policy must be one of {', '.join(policies)}, got {expert_policy!r}")
    if moe_backend == "cpu" and expert_cache_gb is not None:
        raise UsageError("--expert-cache-gb sizes the GPU expert cache, which --moe-backend cpu does not use "
                         "(it computes every routed expert on the host): drop it, or use gpu|hybrid|auto")
    if moe_backend == "resident":
        given = [name for name, value in (("--expert-cache-gb", expert_cache_gb), ("--expert-policy", expert_policy))
                 if value is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise UsageError(f"{' and '.join(given)} only {verb} to offloaded experts: add --moe-backend "
                             f"{'|'.join(MOE_BACKENDS[1:])} (experts are resident by default)")
        return None
    from .runtime.offload.config import OffloadConfig

    return OffloadConfig.from_cli(moe_backend=moe_backend, expert_cache_gb=expert_cache_gb,
                                  expert_policy=expert_policy or "hot")


def _check_device(device: str, world_size: int | None) -> None:
    """``--device`` is cpu or cuda; for cuda, torch sees a GPU per local rank (``world_size`` None: unknown yet)."""

    if device not in ("cpu", "cuda"):
        hint = " (rank r runs on cuda:r; choose the GPUs with CUDA_VISIBLE_DEVICES)" if device.startswith("cuda:") else ""
        raise UsageError(f"--device must be cpu or cuda, got {device!r}{hint}")
    if device != "cuda" or world_size is None:
        return
    import os

    from shardsmith.runtime.serve.launch import under_torchrun

    need = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size
    listed = _driver_gpus()
    if listed is not None and listed >= need:
        return  # enough GPUs, said without importing torch here (each rank checks again with torch)
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        why = "this torch build has no CUDA" if torch.version.cuda is None else f"torch sees {have} GPU(s)"
        raise UsageError(f"--device cuda needs one GPU per rank ({need}), but {why}; use --device cpu")


def _driver_gpus() -> int | None:
    """GPUs the NVIDIA driver lists (``/proc/driver/nvidia/gpus``), as many as ``CUDA_VISIBLE_DEVICES``
    keeps when it lists plain indices; None where the driver lists none or the variable names GPUs
    otherwise (UUIDs, MIG instances): then torch must say."""
    import os

    try:
        listed = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return listed or None
    picked = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(v.isdigit() for v in picked) or len(set(picked)) != len(picked):
        return None
    return sum(int(v) < listed for v in picked) or None


def _check_tokenizer(path: Path) -> None:

    if not (path / "tokenizer.json").is_file():
        raise UsageError(f"{path}: no tokenizer.json; serve and generate need the tokenizer next to the weights "
                         f"(copy tokenizer.json and tokenizer_config.json from the source checkpoint)")


def _check_port(host: str, port: int) -> None:
    """Bind ``host:port`` once as uvicorn will (``SO_REUSEADDR``, every address ``host`` resolves to), then release it.

    Only the process that will serve checks (under ``torchrun``, rank 0). Another process can
    still take the port before rank 0 listens; uvicorn's own error covers that race.
    """
    import errno
    import os
    import socket

    from shardsmith.runtime.serve.launch import under_torchrun

    if not 0 < port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {port}")
    if under_torchrun() and os.environ.get("RANK") != "0":
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r}: cannot resolve it ({e.strerror})") from e
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                why = {errno.EADDRINUSE: "already in use by another process; choose another --port",
                       errno.EACCES: "permission denied (ports below 1024 need privileges); choose another --port",
                       errno.EADDRNOTAVAIL: "--host is not an address of this machine"}
                raise UsageError(f"--port {port}: cannot listen on {host}:{port}: {why.get(e.errno, e.strerror)}") from e


def _spec(path: Path, *, device: str, dist_port: int | None, from_checkpoint: bool, tp: int | None,
          verify_hashes: bool, max_seq_len: int, offload=None, dtype: str = "auto", enforce_eager: bool = False,
          expect_digest: str | None = None, max_num_seqs: int = 1, mtp_layers: int = 0, compile_cache: bool = False,
          kv_cache_tokens: int | None = None):
    from shardsmith.runtime.serve.launch import LaunchSpec, under_torchrun
    from shardsmith.runtime.serve.placement import check_local_ranks, pack_world_size

    _check_device(device, None)
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory")
    if expect_digest is not None:
        if from_checkpoint:
            raise UsageError("--expect-digest pins a pack; it does not apply with --from-checkpoint")
        from shardsmith.pack.format import parse_digest
        from shardsmith.pack.reader import open_pack

        open_pack(path, expect_digest=parse_digest(expect_digest, "--expect-digest"))  # ManifestError (exit 2) naming both digests
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise UsageError(f"--dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
    if max_seq_len < 2:
        raise UsageError(f"--max-model-len (--max-seq-len) must be at least 2, got {max_seq_len}")
    if max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be at least 1, got {max_num_seqs}")
    if kv_cache_tokens is not None:
        _check_kv_cache_tokens(path, kv_cache_tokens, max_seq_len)
    if dist_port is not None and not 0 < dist_port < 65536:
        raise UsageError(f"--dist-port must be in 1..65535, got {dist_port}")
    ws = pack_world_size(path, tp=tp, from_checkpoint=from_checkpoint)
    _check_tokenizer(path)
    if under_torchrun() and dist_port is not None:
        raise UsageError("--dist-port is not used under torchrun (torchrun owns the rendezvous: --master-port)")
    if not from_checkpoint and not under_torchrun():  # every rank here and of this pack (torchrun: each
        check_local_ranks(path, list(range(ws)), ws)    # node checks its own, all agree: launch.run_rank)
    _check_device(device, ws)
    return LaunchSpec(path=path.resolve(), world_size=ws, device=device, dist_port=dist_port,
                      from_checkpoint=from_checkpoint, verify_hashes=verify_hashes, max_seq_len=max_seq_len,
                      offload=offload, dtype=None if dtype == "auto" else dtype, cuda_graphs=not enforce_eager,
                      max_num_seqs=max_num_seqs, mtp_layers=mtp_layers,
                      compile_cache=_compile_root() if compile_cache else None, kv_cache_tokens=kv_cache_tokens)


def _check_kv_cache_tokens(path: Path, tokens: int, max_seq_len: int) -> None:
    """``--kv-cache-tokens``: at least one ``--max-model-len`` sequence, for a family whose KV cache sits in
    blocks (read from ``path/config.json``; an unreadable config is left to the load's own error).

    Raises:
        UsageError: fewer tokens than ``max_seq_len``, or a family that keeps its state per slot.
    """
    from shardsmith import families

    if tokens < max_seq_len:
        raise UsageError(f"--kv-cache-tokens {tokens} is less than one --max-model-len {max_seq_len} sequence; "
                         f"at least {max_seq_len}")
    try:
        arch = families.lookup(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError):
        return
    if arch is not None and not arch.family.kv_blocks:
        raise UsageError(f"--kv-cache-tokens: {arch.family.label} keeps each slot's state for --max-model-len "
                         f"positions (the KV caches of the Mixtral family, DeepSeek-V3 and gpt-oss are in blocks); leave it out")


def _compile_root() -> Path | None:
    """``$SHARDSMITH_CACHE/compile``, where serve and warmup keep each rank's compile caches; None (said
    on stderr) when the user set ``TRITON_CACHE_DIR`` or ``TORCHINDUCTOR_CACHE_DIR``: those are used as set."""
    from shardsmith import settings

    if own := settings.library_cache_folders():
        typer.echo(f"compile cache: {' and '.join(f'{k}={v}' for k, v in own.items())} set, so the libraries' "
                   f"caches stay there (not kept per pack under $SHARDSMITH_CACHE/compile)", err=True)
        return None
    return settings.current().cache_dir / "compile"


def _check_sampling(*, prompts: list[str], chat: bool, max_tokens: int, max_seq_len: int, temperature: float,
                    top_p: float, top_k: int, seed: int | None) -> None:
    """``generate``'s sampling options, with the rules the engine would apply after loading."""
    import math


    bad = []
    if max_tokens < 1:
        bad.append(f"--max-tokens must be at least 1, got {max_tokens}")
    elif max_tokens >= max_seq_len >= 2:
        bad.append(f"--max-tokens {max_tokens} leaves no room for the prompt in --max-seq-len {max_seq_len} "
                   f"(prompt + completion; --max-tokens at most {max_seq_len - 1})")
    if not (math.isfinite(temperature) and temperature >= 0):
        bad.append(f"--temperature must be a number >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        bad.append(f"--top-p must be in (0, 1] (1 = off), got {top_p}")
    if top_k < 0:
        bad.append(f"--top-k must be >= 0 (0 = off), got {top_k}")
    if seed is not None and not -(2**63) <= seed < 2**64:
        bad.append(f"--seed must be in [-2**63, 2**64), got {seed}")
    if not chat and any(p == "" for p in prompts):
        bad.append("--prompt must not be empty (without --chat the prompt is the whole input)")
    if bad:
        raise UsageError("; ".join(bad))


def serve(
    path: Path = PATH_ARG,
    host: str = typer.Option("127.0.0.1", "--host", help="HTTP listen address."),
    port: int = typer.Option(8000, "--port", help="HTTP port."),
    device: str = DEVICE, dist_port: int | None = DIST_PORT, from_checkpoint: bool = FROM_CKPT,
    tp: int | None = TP, verify_hashes: bool = VERIFY, expect_digest: str | None = DIGEST, max_seq_len: int | None = MAX_SEQ,
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="Model id for clients (default: the directory name)."),
    max_request_bytes: int = typer.Option(4 << 20, "--max-request-bytes",
                                          help="Larger request bodies get HTTP 413 (default 4 MiB)."),
    moe_backend: str = MOE_BACKEND, expert_cache_gb: float | None = CACHE_GB, expert_policy: str = POLICY,
    dtype: str = DTYPE, trust_remote_code: bool = TRUST, enforce_eager: bool = EAGER,
    max_num_seqs: int = typer.Option(8, "--max-num-seqs",
                                     help="Sequences decoded together (continuous batching): slots of per-sequence state."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for a slot; more get HTTP 429."),
    kv_cache_tokens: int | None = typer.Option(
        None, "--kv-cache-tokens",
        help="Token positions of the KV cache all sequences share (every family but DeepSeek-V4: KV in blocks, taken as a "
             "sequence grows); a request waits until its prompt + max_tokens fit beside the running ones. Default: "
             "--max-num-seqs x --max-model-len. At least --max-model-len."),
    prefill_chunk: int | None = typer.Option(
        None, "--prefill-chunk",
        help="Prompt tokens per engine step (default on a GPU: 8192 for DeepSeek-V4 with resident experts, else "
             "2048; 512 on a CPU); while other sequences decode at most 2048, so a long prompt does not stall them."),
    decode_prompt_tokens: int | None = typer.Option(
        None, "--decode-prompt-tokens",
        help="Prompts of at most this many tokens are fed one token per step through the batched decode step "
             "instead of a prefill forward of their own (default on CUDA: measured at warm-up, the largest power "
             "of two of decode steps that cost no more than one eager prefill, at most 256; 0 on CPU)."),
    speculative: str | None = typer.Option(
        None, "--speculative", help="Speculative decoding, drafts checked in one chunk (greedy: the same tokens; sampled: the same "
                                    "distribution, by speculative sampling): 'ngram' "
                                    "(drafts looked up in the sequence's own text; families whose state rewinds) "
                                    "or 'mtp' (the checkpoint's MTP layer drafts; DeepSeek-V3, its experts offloaded with the rest)."),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens",
                                               help="Draft tokens per step with --speculative (1-16)."),
    chat_template: Path | None = typer.Option(
        None, "--chat-template", help="A Jinja chat template file to use instead of the pack's (e.g. one that "
                                      "lists tools)."),
    defer_buckets: bool = typer.Option(
        True, "--defer-buckets/--no-defer-buckets",
        help="Say ready once the one-row decode step is built, and build the larger batch buckets while idle "
             "(a batch meanwhile runs through the nearest built one); --no-defer-buckets builds all before ready."),
    prefix_caching: bool = typer.Option(
        True, "--prefix-caching/--no-prefix-caching",
        help="Keep a finished request's state in its slot; a later prompt that starts with the same tokens (a "
             "conversation's next turn) computes only the rest."),
    header_timeout: float = typer.Option(10.0, "--header-timeout",
                                         help="Seconds a client has to send a request's headers; then HTTP 408 and close."),
    body_timeout: float = typer.Option(30.0, "--body-timeout",
                                       help="Longest pause in seconds inside a request body; then HTTP 408 and close "
                                            "(a body cut short by the client closing its side gets HTTP 400)."),
    keep_alive_timeout: float = typer.Option(5.0, "--keep-alive-timeout",
                                             help="Seconds an idle kept-alive connection stays open."),
    max_connections: int = typer.Option(512, "--max-connections",
                                        help="Open client connections; one more is answered HTTP 503 and closed."),
) -> None:
    """Serve a pack over an OpenAI-compatible HTTP API (rank 0), one process per rank."""
    from shardsmith.runtime.serve.launch import free_port, launch, under_torchrun
    from shardsmith.runtime.serve.serve_job import ServeJob

    if max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes must be at least 1, got {max_request_bytes}")
    if served_model_name is not None and not served_model_name.strip():
        raise UsageError("--served-model-name must not be empty")
    if max_queue < 0:
        raise UsageError(f"--max-queue must be at least 0, got {max_queue}")
    if dist_port is not None and dist_port == port:
        raise UsageError(f"--dist-port {dist_port} is also --port: the ranks' rendezvous and the HTTP server "
                         "need a port each")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be at least 1 token, got {prefill_chunk}")
    from shardsmith.runtime.serve.http_limits import HTTPLimits

    limits = HTTPLimits(header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                        keep_alive_s=keep_alive_timeout, max_connections=max_connections)
    if bad := limits.problems():
        raise UsageError("; ".join(bad))
    _check_serving_environment()
    _check_chat_template(chat_template)
    max_seq_len = _context_length(path, max_seq_len)
    spec_decode = _speculative(speculative, num_speculative_tokens)
    if decode_prompt_tokens is not None and not 0 <= decode_prompt_tokens <= max_seq_len:
        raise UsageError(f"--decode-prompt-tokens must be between 0 and --max-model-len ({max_seq_len}), "
                         f"got {decode_prompt_tokens}")
    spec = _spec(path, device=device, dist_port=dist_port, from_checkpoint=from_checkpoint, tp=tp,
                 verify_hashes=verify_hashes, expect_digest=expect_digest, max_seq_len=max_seq_len,
                 offload=_offload(moe_backend, expert_cache_gb, expert_policy), dtype=dtype,
                 enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                 mtp_layers=int(spec_decode is not None and spec_decode.method == "mtp"), compile_cache=True,
                 kv_cache_tokens=kv_cache_tokens)
    _check_port(host, port)
    if spec.dist_port is None and not under_torchrun():  # not the HTTP port, which is still free now
        spec = dataclasses.replace(spec, dist_port=free_port(avoid={port}))
    raise typer.Exit(launch(spec, ServeJob(host=host, port=port, model_name=served_model_name or spec.path.name,
                                           trust_remote_code=trust_remote_code, max_request_bytes=max_request_bytes,
                                           max_queue=max_queue, prefill_chunk=prefill_chunk,
                                           decode_prompt_tokens=decode_prompt_tokens, max_model_len=max_seq_len,
                                           limits=limits, prefix_caching=prefix_caching,
                                           chat_template=chat_template, speculative=spec_decode,
                                           defer_buckets=defer_buckets)))


def generate(
    path: Path = PATH_ARG,
    prompt: list[str] = typer.Option(..., "--prompt", help="Prompt text (repeat for several)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens to generate at most."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the chat template."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"), top_k: int = typer.Option(0, "--top-k"),
    seed: int | None = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    device: str = DEVICE, dist_port: int | None = DIST_PORT, from_checkpoint: bool = FROM_CKPT,
    tp: int | None = TP, verify_hashes: bool = VERIFY, expect_digest: str | None = DIGEST, max_seq_len: int | None = MAX_SEQ,
    moe_backend: str = MOE_BACKEND, expert_cache_gb: float | None = CACHE_GB, expert_policy: str = POLICY,
    dtype: str = DTYPE, trust_remote_code: bool = TRUST, enforce_eager: bool = EAGER,
    max_num_seqs: int = typer.Option(1, "--max-num-seqs",
                                     help="Sequence slots to allocate (generate answers one prompt at a time: 1)."),
) -> None:
    """Generate text for one-off prompts and print it on stdout."""
    from shardsmith.runtime.serve.generate import GenerateJob
    from shardsmith.runtime.serve.launch import launch

    max_seq_len = _context_length(path, max_seq_len)
    _check_sampling(prompts=prompt, chat=chat, max_tokens=max_tokens, max_seq_len=max_seq_len,
                    temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    _check_serving_environment()
    spec = _spec(path, device=device, dist_port=dist_port, from_checkpoint=from_checkpoint, tp=tp,
                 verify_hashes=verify_hashes, expect_digest=expect_digest, max_seq_len=max_seq_len,
                 offload=_offload(moe_backend, expert_cache_gb, expert_policy), dtype=dtype,
                 enforce_eager=enforce_eager, max_num_seqs=max_num_seqs)
    if chat and not trust_remote_code:  # a missing template, or one that is checkpoint code, fails before ranks start
        from shardsmith.runtime.serve.chat import load_chat_format

        load_chat_format(path)
    job = GenerateJob(prompts=tuple(prompt), chat=chat, max_tokens=max_tokens, temperature=temperature,
                      top_p=top_p, top_k=top_k, seed=seed, stop=tuple(stop), trust_remote_code=trust_remote_code)
    raise typer.Exit(launch(spec, job))


DEMO_PROMPTS = (
    "What is the capital of France?",
    "What is the boiling point of water in Celsius?",
    "Name the three primary colors.",
)


def demo(
    device: str = typer.Option("auto", "--device", help="auto (cuda with 2+ GPUs, else cpu), cpu or cuda."),
    max_tokens: int = typer.Option(48, "--max-tokens", help="Tokens per answer at most."),
    out: Path | None = typer.Option(None, "--out", help="Where to write the TP=2 pack (default: next to the demo checkpoint)."),
    dtype: str = typer.Option("float32", "--dtype",
                              help="Compute dtype. float32 by default: this 135M model's first answer token wins by "
                                   "only ~0.1 nat, within bf16 rounding noise (bf16 on two GPUs answers the France "
                                   "question in French)."),
) -> None:
    """Build the SmolLM2 MoE checkpoint if missing, split it at TP=2, verify it, answer a few prompts."""
    from .demo.smollm2 import build_demo_checkpoint, default_demo_dir
    from shardsmith.runtime.serve.generate import GenerateJob
    from shardsmith.runtime.serve.launch import LaunchSpec, launch
    from .ui import err_console
    from .writer.split import split_checkpoint
    from .writer.verify import verify_pack

    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, got {device!r}")
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise UsageError(f"--dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {max_tokens}")
    con = err_console()
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
    _check_device(device, 2)
    _check_serving_environment()
    con.print("[bold]1/4[/] SmolLM2-135M MoE checkpoint (built once, then cached)")
    from .ui import step_lines

    with step_lines(con) as say:
        ckpt = build_demo_checkpoint(default_demo_dir(False), progress=say)
    pack = out or ckpt.parent / f"{ckpt.name}-tp2"
    con.print(f"    {ckpt}\n[bold]2/4[/] split at TP=2 -> {pack}")
    if not (pack / "pack.yaml").is_file():
        split_checkpoint(ckpt, pack, world_size=2)
    else:
        con.print("    (pack exists; verifying it instead of splitting again)")
    con.print("[bold]3/4[/] verify")
    report = verify_pack(pack)
    if not report.ok:
        from .errors import IntegrityError, format_problems

        raise IntegrityError(format_problems(f"{pack}: pack is damaged or incomplete (delete it to split again)",
                                             list(report.problems)), list(report.problems))
    con.print(f"    ok: {report.files_checked} files, {report.bytes_hashed / 2**20:.0f} MiB read in {report.seconds:.1f} s")
    con.print(f"[bold]4/4[/] run on {device} ({'NCCL' if device == 'cuda' else 'gloo'}), 2 ranks, greedy, {dtype}")
    job = GenerateJob(prompts=DEMO_PROMPTS, chat=True, max_tokens=max_tokens, labelled=True)
    spec = LaunchSpec(path=pack.resolve(), world_size=2, device=device, dtype=None if dtype == "auto" else dtype)
    raise typer.Exit(launch(spec, job))


def warmup(
    path: Path = PATH_ARG,
    device: str = DEVICE, dist_port: int | None = DIST_PORT, from_checkpoint: bool = FROM_CKPT,
    tp: int | None = TP, verify_hashes: bool = VERIFY, expect_digest: str | None = DIGEST, max_seq_len: int | None = MAX_SEQ,
    moe_backend: str = MOE_BACKEND, expert_cache_gb: float | None = CACHE_GB, expert_policy: str = POLICY,
    dtype: str = DTYPE, enforce_eager: bool = EAGER,
    max_num_seqs: int = typer.Option(8, "--max-num-seqs", help="Sequence slots, as serve will be given (its batch buckets)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Load a pack and run serve's warm-up once, filling the compile cache a later serve with the same
    options reuses ($SHARDSMITH_CACHE/compile); say how long it took."""
    from shardsmith.runtime.serve.launch import launch
    from shardsmith.runtime.serve.warmup_job import WarmupJob

    _check_serving_environment()
    max_seq_len = _context_length(path, max_seq_len)
    spec = _spec(path, device=device, dist_port=dist_port, from_checkpoint=from_checkpoint, tp=tp,
                 verify_hashes=verify_hashes, expect_digest=expect_digest, max_seq_len=max_seq_len,
                 offload=_offload(moe_backend, expert_cache_gb, expert_policy), dtype=dtype,
                 enforce_eager=enforce_eager, max_num_seqs=max_num_seqs, compile_cache=True)
    raise typer.Exit(launch(spec, WarmupJob(as_json=as_json)))


def register(app: typer.Typer) -> None:
    """Add ``serve``, ``generate``, ``warmup`` and ``demo`` to ``app``."""
    app.command("serve")(serve)
    app.command("generate")(generate)
    app.command("warmup")(warmup)
    app.command("demo")(demo)


def _context_length(path: Path, asked: int | None) -> int:
    """``--max-model-len``: ``asked``, or by default :data:`DEFAULT_MAX_SEQ` or the model's length when
    that is shorter; the model's length is ``max_position_embeddings`` of ``path/config.json`` (none
    when it is missing or the file cannot be read here: later checks name that).

    Raises:
        UsageError: ``asked`` is below 2 or past the model's length.
    """
    limit = None
    try:
        limit = int(json.loads((path / "config.json").read_text()).get("max_position_embeddings") or 0) or None
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    if asked is None:
        return min(DEFAULT_MAX_SEQ, limit or DEFAULT_MAX_SEQ)
    if asked < 2:
        raise UsageError(f"--max-model-len (--max-seq-len) must be at least 2, got {asked}")
    if limit is not None and asked > limit:
        raise UsageError(f"--max-model-len {asked} is longer than the model's context, {limit} tokens "
                         f"(max_position_embeddings in {path / 'config.json'}); at most {limit}")
    return asked


def _speculative(method: str | None, k: int):
    """The scheduler's speculation config of ``--speculative`` / ``--num-speculative-tokens``.

    Raises:
        UsageError: a method other than ``ngram`` or ``mtp``, or ``k`` outside 1..16.
    """
    if method is None:
        return None
    from shardsmith.runtime.engine.speculative import SpeculativeConfig

    cfg = SpeculativeConfig(k=k, method=method)
    if bad := cfg.problems():
        raise UsageError("--" + "; ".join(bad).replace("num_speculative_tokens", "num-speculative-tokens"))
    return cfg


def _check_chat_template(path: Path | None) -> None:
    """Refuse a ``--chat-template`` file that cannot be read or does not compile, before ranks start.

    Raises:
        UsageError: naming the file and the reason.
    """
    if path is None:
        return
    from shardsmith.runtime.serve.chat import ChatTemplate, ChatTemplateError

    try:
        ChatTemplate(path.read_text(encoding="utf-8"), source=str(path), special_tokens={})
    except OSError as e:
        raise UsageError(f"--chat-template {path}: cannot read it ({e.strerror})") from e
    except ChatTemplateError as e:
        raise UsageError(str(e)) from e


def _check_serving_environment() -> None:
    """The environment's settings, checked before any rank starts (serve, generate, demo).

    Raises:
        UsageError: any ``SHARDSMITH_*`` variable holding a value it does not take (every one listed,
            :mod:`shardsmith.settings`), ``SHARDSMITH_TUNING=host_isa`` naming a set this CPU lacks, or
            ``SHARDSMITH_STEP_TRACE`` naming a file that cannot be appended to.
    """
    from shardsmith import settings
    from shardsmith.runtime.offload.cpu_flags import check_settings
    from shardsmith.runtime.serve.step_trace import open_step_trace

    settings.check()
    check_settings()
    trace = open_step_trace()
    if trace is not None:
        trace.close()
