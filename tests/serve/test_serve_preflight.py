"""Validation that must happen before any rank starts, errors reported once with their own exit
code, and the HTTP server's request limits.

- CLI (real ``python -m shardsmith.cli`` subprocesses): bad options exit 1 with ``error:`` naming
  the option and start no rank. The tiny pack's ``tokenizer.json`` is a placeholder: every check
  here fails before it would be read.
- Integrity failures at load (a flipped byte with ``--verify-hashes``, a rank directory from
  another split) exit 2 and print the error once, not once per rank.
- HTTP without an engine (in-process client): body-size limit (413), strict JSON types, null
  ``content``, a body sent without a JSON content type.
- HTTP with the real SmolLM2 pack (the ``Server`` of ``test_serve_e2e``): a prompt that takes
  seconds to tokenize does not stall ``/health``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from shardsmith.testing.server import Server

from shardsmith.runtime.serve.launch import free_port, free_ports  # noqa: E402
from shardsmith.runtime.serve.metrics import Metrics  # noqa: E402
from shardsmith.runtime.serve.server import create_app  # noqa: E402
from shardsmith.runtime.serve.worker import EngineWorker  # noqa: E402
from shardsmith.writer.split import split_checkpoint  # noqa: E402


def _cli(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardsmith.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}))


@pytest.fixture(scope="module")
def packs(tiny, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """TP=2 packs of two different tiny Mixtrals (so their pack_ids differ), each with a placeholder tokenizer.json."""
    root = tmp_path_factory.mktemp("preflight")
    out = {}
    for name in ("mixtral", "mixtral-tied"):
        out[name] = root / name
        split_checkpoint(tiny(name), out[name], world_size=2)
        (out[name] / "tokenizer.json").write_text("{}")
    return out


@pytest.fixture()
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _refused(proc: subprocess.CompletedProcess, match: str) -> None:
    assert proc.returncode == 1, proc.stderr
    assert f"error: {match}" in proc.stderr.replace("\n", " "), proc.stderr
    assert "starting" not in proc.stderr and "[rank" not in proc.stderr  # no rank was started


@pytest.mark.parametrize("args,match", [
    (("serve", "{pack}", "--port", "99999"), "--port must be in 1..65535, got 99999"),
    (("serve", "{pack}", "--max-model-len", "100000"),
     "--max-model-len 100000 is longer than the model's context, 512 tokens (max_position_embeddings in"),
    (("serve", "{pack}", "--speculative", "eagle"), "--speculative must be one of ngram, mtp, got 'eagle'"),
    (("serve", "{pack}", "--speculative", "ngram", "--num-speculative-tokens", "0"),
     "--num-speculative-tokens must be in 1..16, got 0"),
    (("serve", "{pack}", "--chat-template", "/nonexistent/t.jinja"),
     "--chat-template /nonexistent/t.jinja: cannot read it (No such file or directory)"),
    (("serve", "{pack}", "--port", "-5"), "--port must be in 1..65535, got -5"),
    (("serve", "{pack}", "--max-request-bytes", "0"), "--max-request-bytes must be at least 1"),
    (("serve", "{pack}", "--device", "cuda:1"), "--device must be cpu or cuda, got 'cuda:1'"),
    (("generate", "{pack}", "--prompt", "x", "--temperature", "-1"), "--temperature must be a number >= 0"),
    (("generate", "{pack}", "--prompt", "x", "--top-p", "0"), "--top-p must be in (0, 1]"),
    (("generate", "{pack}", "--prompt", "x", "--top-k", "-1"), "--top-k must be >= 0"),
    (("generate", "{pack}", "--prompt", "x", "--max-seq-len", "3", "--max-tokens", "8"),
     "--max-tokens 8 leaves no room for the prompt in --max-seq-len 3"),
    (("generate", "{pack}", "--prompt", "x", "--from-checkpoint", "--tp", "2"),
     "{pack} is a pack (it has pack.yaml), not a checkpoint; drop --from-checkpoint"),
    (("generate", "{pack}", "--prompt", "x", "--expert-policy", "lru"),
     "--expert-policy only applies to offloaded experts: add --moe-backend"),
    (("generate", "{pack}", "--prompt", "x", "--expert-cache-gb", "-1"),
     "--expert-cache-gb only applies to offloaded experts"),
    (("generate", "{pack}", "--prompt", "x", "--moe-backend", "gpu", "--expert-policy", "bogus"),
     "--expert-policy must be one of"),
    (("generate", "{pack}", "--prompt", "x", "--moe-backend", "gpu", "--expert-cache-gb", "-1"),
     "--expert-cache-gb must be a number >= 0"),
    (("generate", "{pack}", "--prompt", "x", "--moe-backend", "tpu"),
     "--moe-backend must be one of resident, auto, gpu, cpu, hybrid, got 'tpu'"),
    (("demo", "--device", "bogus"), "--device must be auto, cpu or cuda, got 'bogus'"),
])
def test_bad_options_fail_before_ranks_start(packs, args, match: str) -> None:
    pack = packs["mixtral"]
    _refused(_cli(*(a.format(pack=pack) for a in args), timeout=60), match.format(pack=pack))


@pytest.mark.parametrize("env,match", [
    ({"SHARDSMITH_TUNING": "overlap_steps=2"}, "SHARDSMITH_TUNING: overlap_steps='2': expected 0 or 1"),
    ({"SHARDSMITH_TUNING": "host_prefetch=-5"},
     "SHARDSMITH_TUNING: host_prefetch='-5': expected a whole number in 0 .. 1048576"),
    ({"SHARDSMITH_PIN_CORES": "yes"}, "SHARDSMITH_PIN_CORES='yes': expected 0 or 1"),
    ({"SHARDSMITH_KERNELS": "decode_attention=maybe,router=on", "SHARDSMITH_MOE_PATH": "x"},
     "SHARDSMITH_KERNELS: decode_attention='maybe': expected auto, kernel or reference; SHARDSMITH_KERNELS: "
     "router='on': expected auto, kernel or reference; SHARDSMITH_MOE_PATH was removed: the expert kernel's path "
     "is chosen by batch and format"),
    ({"SHARDSMITH_KERNELS": "moe_path=x"}, "SHARDSMITH_KERNELS: unknown key 'moe_path' (known: compile_pieces, "
     "compressor_step, decode_attention, fp8_dense, fused_experts, hc_post, hc_pre, host_experts, indexer_scores, "
     "merge_projections, offload_inplace, prefill_attention, router, all)"),
    ({"SHARDSMITH_HC_POST": "off"}, "SHARDSMITH_HC_POST was removed: write SHARDSMITH_KERNELS=hc_post=<auto|kernel|reference>"),
    ({"SHARDSMITH_FP8_GEMV": "always"}, "SHARDSMITH_FP8_GEMV was removed: one-token FP8 linears always take the GEMV"),
    ({"SHARDSMITH_TUNING": "host_isa=avx9000", "SHARDSMITH_KERNELS": "host_experts=yes"},
     "SHARDSMITH_KERNELS: host_experts='yes': expected on or reference; SHARDSMITH_TUNING: host_isa='avx9000': "
     "expected scalar, avx2 or avx512"),
    ({"SHARDSMITH_TUNING": "switch_interval_ms=0, emulate_h2d_gbps=fast"},
     "SHARDSMITH_TUNING: switch_interval_ms='0': expected a positive number; SHARDSMITH_TUNING: "
     "emulate_h2d_gbps='fast': expected a positive number"),
    ({"SHARDSMITH_STEP_TRACE": "/nonexistent/dir/steps.jsonl"},
     "SHARDSMITH_STEP_TRACE='/nonexistent/dir/steps.jsonl': cannot append to it (No such file or directory)"),
])
def test_bad_serving_environment_fails_before_ranks_start(packs, env: dict[str, str], match: str) -> None:
    _refused(_cli("serve", str(packs["mixtral"]), timeout=60, env=env), match)


def test_demo_checks_the_environment_before_building_anything() -> None:
    _refused(_cli("demo", timeout=60, env={"SHARDSMITH_PIN_CORES": "yes"}), "SHARDSMITH_PIN_CORES='yes': expected 0 or 1")


def test_port_in_use_fails_before_ranks_start(packs, busy_port: int) -> None:
    _refused(_cli("serve", str(packs["mixtral"]), "--port", str(busy_port), timeout=60),
             f"--port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: already in use")


@pytest.mark.parametrize("command,job", [("serve", "ServeJob"), ("generate --prompt hi", "GenerateJob"),
                                         ("warmup", "WarmupJob")])
def test_the_launcher_imports_neither_torch_nor_the_http_stack(packs, command: str, job: str) -> None:
    """The launcher checks the command and starts the ranks; torch and the HTTP stack are the ranks' to
    import (in parallel, once each), so none of them is in the launcher when it spawns."""
    name, *rest = command.split()
    probe = ("import sys\n"
             "import shardsmith.runtime.serve.launch as launch\n"
             "def spawn(spec, job, level):\n"
             "    heavy = sorted(m for m in ('torch', 'fastapi', 'starlette', 'transformers', 'triton') if m in sys.modules)\n"
             "    print('SPAWN', spec.world_size, type(job).__name__, ','.join(heavy) or '-')\n"
             "    return 0\n"
             "launch._spawn_and_supervise = spawn\n"
             "from shardsmith.cli import app\n"
             f"app({[name, str(packs['mixtral']), *rest, *(['--port', str(free_port())] if name == 'serve' else [])]!r})\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert f"SPAWN 2 {job} -" in proc.stdout, (proc.stdout, proc.stderr)


def test_cuda_without_gpus_fails_before_ranks_start(packs) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    _refused(_cli("serve", str(packs["mixtral"]), "--device", "cuda", timeout=60), "--device cuda needs one GPU per rank (2)")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_pack_without_tokenizer_fails_before_ranks_start(packs, tmp_path: Path, command: str) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(packs["mixtral"], pack)
    (pack / "tokenizer.json").unlink()
    _refused(_cli(command, str(pack), "--prompt", "x") if command == "generate" else _cli(command, str(pack)),
             f"{pack}: no tokenizer.json")


def _load_failure(proc: subprocess.CompletedProcess, match: str) -> None:
    assert proc.returncode == 2, proc.stderr  # IntegrityError's code, though each rank saw a RuntimeLoadError
    assert proc.stderr.count(match) == 1, proc.stderr  # once, not once per rank
    assert "error: load of" in proc.stderr and "failed: RuntimeLoadError" not in proc.stderr
    assert "ERROR [rank" not in proc.stderr, proc.stderr  # the ranks leave reporting to the launcher


def test_hash_mismatch_exits_2_and_prints_once(packs, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(packs["mixtral"], pack)
    victim = sorted((pack / "rank-1-of-2").glob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    _load_failure(_cli("generate", str(pack), "--prompt", "x", "--max-tokens", "1", "--verify-hashes"),
                  "xxh3_128 expected")


def test_serve_of_a_truncated_rank_0_file_exits_2_like_verify(packs, tmp_path: Path) -> None:
    """Rank 0 loads beside its HTTP server; its integrity failure still sets the exit code (was 1)."""
    pack = tmp_path / "pack"
    shutil.copytree(packs["mixtral"], pack)
    victim = sorted((pack / "rank-0-of-2").glob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:-100])
    http_port, dist_port = free_ports(2)
    _load_failure(_cli("serve", str(pack), "--port", str(http_port), "--dist-port", str(dist_port)), "(truncated)")


def test_rank_from_another_split_exits_2_before_ranks_start(packs, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(packs["mixtral"], pack)
    shutil.rmtree(pack / "rank-1-of-2")
    shutil.copytree(packs["mixtral-tied"] / "rank-1-of-2", pack / "rank-1-of-2")
    proc = _cli("generate", str(pack), "--prompt", "x", "--max-tokens", "1")
    assert proc.returncode == 2, proc.stderr
    assert f"error: rank 1 of 2: {pack / 'rank-1-of-2' / 'manifest.yaml'} belongs to another pack (pack_id expected" \
        in proc.stderr.replace("\n", " "), proc.stderr
    assert proc.stderr.count("pack_id expected") == 1 and "starting" not in proc.stderr, proc.stderr


def test_missing_rank_is_refused_before_ranks_start(packs, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(packs["mixtral"], pack)
    shutil.rmtree(pack / "rank-1-of-2")
    _refused(_cli("serve", str(pack)), f"rank 1 of 2: {pack / 'rank-1-of-2'} is missing (this directory holds rank-0-of-2)")


# HTTP without an engine -------------------------------------------------------------------------

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture()
def client():
    metrics = Metrics()
    worker = EngineWorker(lambda: None, metrics=metrics, on_fatal=lambda msg: None)  # never started: loading
    with TestClient(create_app(worker, model_name=MODEL, metrics=metrics, max_request_bytes=1000)) as c:
        yield c


def _error(resp, status: int, match: str, *, code: str | None = None, param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert match in err["message"], err["message"]
    assert err["code"] == code and err["param"] == param


def test_body_over_the_limit_is_413(client) -> None:
    big = CHAT | {"messages": [{"role": "user", "content": "a" * 2000}]}
    _error(client.post("/v1/chat/completions", json=big), 413,
           "is 2055 bytes; this server accepts at most 1000 bytes", code="request_too_large")

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "m", "prompt": "'
        for _ in range(20):
            yield b"a" * 100
        yield b'"}'

    _error(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413,
           "exceeds 1000 bytes", code="request_too_large")
    assert 'shardsmith_requests_total{endpoint="/v1/completions",status="413"} 1' in client.get("/metrics").text
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 503  # under the limit: on to the engine (loading)


@pytest.mark.parametrize("body,param,match", [
    (CHAT | {"max_tokens": "3"}, "max_tokens", "valid integer"),
    (CHAT | {"max_tokens": 3.0}, "max_tokens", "valid integer"),
    (CHAT | {"temperature": "0.5"}, "temperature", "valid number"),
    (CHAT | {"stream": "true"}, "stream", "valid boolean"),
    (CHAT | {"seed": 2**64}, "seed", "less than"),
    (CHAT | {"messages": [{"role": "user", "content": None}]}, "messages.0", "a 'user' message needs 'content'"),
    (CHAT | {"messages": [{"role": "system"}]}, "messages.0", "a 'system' message needs 'content'"),
    (CHAT | {"stop": 5}, "stop", "'stop' must be a string or a list of strings"),  # a union's branches, said once
    (CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0", "content part 0 has type 'image_url': only text parts"),
])
def test_wrong_json_types_and_null_content_are_400(client, body, param: str, match: str) -> None:
    _error(client.post("/v1/chat/completions", json=body), 400, match, param=param)


def test_wrong_prompt_type_and_an_empty_body_are_named_plainly(client) -> None:
    _error(client.post("/v1/completions", json={"model": "m", "prompt": 5}), 400,
           "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists", param="prompt")
    _error(client.post("/v1/completions", headers={"content-type": "application/json"}), 400,
           "the request body is empty: send a JSON object", param="body")


def test_openai_fields_without_effect_here_are_accepted(client) -> None:
    body = CHAT | {"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u"}
    assert client.post("/v1/chat/completions", json=body).status_code == 503  # valid; the model is loading


def test_integers_are_valid_numbers_and_null_content_with_tool_calls_is_allowed(client) -> None:
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}
    body = CHAT | {"temperature": 1, "messages": [CHAT["messages"][0], tool_turn, {"role": "user", "content": "x"}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 503  # valid; the model is loading


@pytest.mark.parametrize("headers,match", [
    ({"content-type": "text/plain"}, "must be JSON sent with Content-Type: application/json, got Content-Type 'text/plain'"),
    ({}, "must be JSON sent with Content-Type: application/json, got no Content-Type"),
    ({"content-type": "application/json"}, "the request body must be a JSON object"),
])
def test_body_that_is_not_a_json_object(client, headers, match: str) -> None:
    content = b"[1, 2]" if headers.get("content-type") == "application/json" else json.dumps(CHAT).encode()
    _error(client.post("/v1/chat/completions", content=content, headers=headers), 400, match, code="invalid_json")


# HTTP with the real model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(smollm2_pack, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(smollm2_pack(2), tmp_path_factory.mktemp("log") / "serve.log", model="m")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 90_000  # ~4.05 MB, seconds to tokenize


def _post_long_prompt(server: Server) -> tuple[httpx.Response, float, float]:
    """POST the long prompt while polling /health; returns (response, its seconds, slowest /health seconds)."""
    body = json.dumps({"model": "m", "prompt": LONG_PROMPT, "max_tokens": 1}).encode()
    assert len(body) < 4 << 20  # under the default --max-request-bytes
    result: dict = {}

    def big() -> None:
        t0 = time.monotonic()
        result["resp"] = httpx.post(f"{server.url}/v1/completions", content=body,
                                    headers={"content-type": "application/json"}, timeout=120)
        result["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.3)  # the body is on its way, then tokenized
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    return result["resp"], result["seconds"], worst


def test_long_prompt_is_refused_and_an_oversized_body_is_413(server: Server) -> None:
    resp, _, _ = _post_long_prompt(server)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    over = httpx.post(f"{server.url}/v1/completions", content=b"x" * ((4 << 20) + 1),
                      headers={"content-type": "application/json"}, timeout=30)
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_health_answers_while_a_long_prompt_is_tokenized(server: Server) -> None:
    """The server tokenizes in a worker thread; /health must not wait for it."""
    _, seconds, worst = _post_long_prompt(server)
    assert worst < 0.5 < seconds, (worst, seconds)


def test_the_context_length_defaults_to_the_models_when_shorter(tmp_path: Path) -> None:
    from shardsmith.cli_serve import DEFAULT_MAX_SEQ, _context_length
    from shardsmith.errors import UsageError

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert _context_length(tmp_path, None) == 512 and _context_length(tmp_path, 512) == 512
    with pytest.raises(UsageError, match="--max-model-len 513 is longer than the model's context, 512 tokens"):
        _context_length(tmp_path, 513)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 131072}))
    assert _context_length(tmp_path, None) == DEFAULT_MAX_SEQ == 2048 and _context_length(tmp_path, 131072) == 131072
    (tmp_path / "config.json").unlink()  # no config here: the load names that; no limit to apply
    assert _context_length(tmp_path, None) == 2048 and _context_length(tmp_path, 9999) == 9999
