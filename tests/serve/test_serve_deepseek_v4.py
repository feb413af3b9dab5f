"""``shardsmith serve`` answering chat and completion requests for a tiny DeepSeek-V4 checkpoint.

The checkpoint is the release-format one of ``test_deepseek_v4.py`` plus a real tokenizer
(:mod:`shardsmith.testing.tokenizer`: byte-level BPE with DeepSeek's special tokens). Three servers
run as real subprocesses on 127.0.0.1 (CPU, gloo, float32), started together:

- ``template``: a TP=2 pack (``split``) whose ``tokenizer_config.json`` has a chat template;
- ``encoding``: a checkpoint with ``encoding/encoding_dsv4.py`` instead of a template (our stand-in
  for the release's module), ``--from-checkpoint --tp 2 --trust-remote-code``;
- ``untrusted``: the same checkpoint without ``--trust-remote-code`` (TP=1: only its refusal matters).

The weights are random, so answers are checked against transformers' ``DeepseekV4ForCausalLM``:
greedy tokens equal its greedy continuation of the same prompt ids (run on the dequantized copy,
as in ``test_deepseek_v4.py``), and a chat's ``usage.prompt_tokens`` is the length of the prompt
the template / encoding module must render.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")

from shardsmith.testing.reference import dequantized_copy  # noqa: E402
from shardsmith.testing.server import Server, sse_events

from shardsmith.testing.tokenizer import ASSISTANT, BOS, END_THINK, USER  # noqa: E402

MODEL = "tiny-v4"
MAX_TOKENS = 12
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
RENDERED = f"{BOS}Be brief.{USER}What is the capital of France?{ASSISTANT}{END_THINK}"
PROMPT = "The capital of France is"
SERVE = ("--dtype", "float32", "--max-seq-len", "256")


def greedy(model_dir: Path, prompts: list[list[int]], eos: tuple[int, ...]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt: ``MAX_TOKENS`` tokens, or up to an EOS included."""
    from transformers import DeepseekV4ForCausalLM

    from shardsmith.testing.reference import hf_greedy

    model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return hf_greedy(model, prompts, max_tokens=MAX_TOKENS, eos=eos)


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Checkpoints and pack, the three servers (ready), the tokenizer and transformers' answers."""
    from shardsmith.runtime.serve.tokenizer import Codec
    from shardsmith.testing.tiny_v4 import tiny_deepseek_v4
    from shardsmith.testing.tokenizer import deepseek_tokenizer
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("serve-v4")
    ckpt = deepseek_tokenizer(tiny_deepseek_v4(root / "ckpt-template"), vocab_size=512, chat="template")
    split_checkpoint(ckpt, root / "pack-tp2", world_size=2)
    enc = root / "ckpt-encoding"
    shutil.copytree(ckpt, enc, ignore=shutil.ignore_patterns("tokenizer*"))
    deepseek_tokenizer(enc, vocab_size=512, chat="encoding")
    servers = {
        "template": Server(root / "pack-tp2", root / "template.log", *SERVE, model=MODEL),
        "encoding": Server(enc, root / "encoding.log", *SERVE, "--from-checkpoint", "--tp", "2",
                           "--trust-remote-code", model=MODEL),
        "untrusted": Server(enc, root / "untrusted.log", *SERVE, "--from-checkpoint", "--tp", "1", model=MODEL),
    }
    try:
        codec = Codec(root / "pack-tp2")
        prompt_ids, chat_ids = codec.encode(PROMPT), codec.encode(RENDERED)
        completion, chat = greedy(dequantized_copy(ckpt, root / "dequantized"), [prompt_ids, chat_ids],
                                  codec.eos_token_ids)
        for srv in servers.values():
            srv.wait_ready()
        yield {"servers": servers, "codec": codec, "ckpt": ckpt, "pack": root / "pack-tp2", "prompt_ids": prompt_ids,
               "chat_ids": chat_ids, "completion": completion, "chat": chat}
    finally:
        codes = {name: srv.stop() for name, srv in servers.items()}
        assert codes == dict.fromkeys(servers, 0), {n: servers[n].log() for n, c in codes.items() if c}


def post(srv: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json={"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS} | body,
                      timeout=120)


def test_prompt_and_reference_are_meaningful(v4: dict) -> None:
    """The rendered chat prompt uses DeepSeek's special tokens; the reference answers are real tokens."""
    assert v4["chat_ids"][0] == 0 and v4["codec"].decode(v4["chat_ids"], skip_special_tokens=False) == RENDERED
    assert [len(t) for t in (v4["completion"], v4["chat"])] == [MAX_TOKENS] * 2  # no early EOS: 12 tokens compared


def test_completion_matches_transformers_greedy(v4: dict) -> None:
    codec, expected = v4["codec"], v4["completion"]
    r = post(v4["servers"]["template"], "/v1/completions", {"prompt": PROMPT, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [codec.token_str(t) for t in expected]
    assert choice["text"] == codec.decode(expected)
    assert body["usage"]["prompt_tokens"] == len(v4["prompt_ids"]) and body["usage"]["completion_tokens"] == len(expected)
    ids = post(v4["servers"]["template"], "/v1/completions", {"prompt": v4["prompt_ids"]}).json()  # token-id prompt
    assert ids["choices"][0]["text"] == choice["text"]


@pytest.mark.parametrize("server", ["template", "encoding"])
def test_chat_renders_the_checkpoint_format_and_matches_transformers(v4: dict, server: str) -> None:
    """The template pack and the encoding-module checkpoint render the same prompt and answer alike."""
    r = post(v4["servers"][server], "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(v4["chat_ids"])
    content = body["choices"][0]["logprobs"]["content"]
    assert [bytes(c["bytes"]) for c in content] == [v4["codec"].token_bytes(t) for t in v4["chat"]]
    assert body["choices"][0]["message"]["content"] == v4["codec"].decode(v4["chat"])


def test_streaming_equals_the_whole_answer(v4: dict) -> None:
    srv = v4["servers"]["template"]
    whole = post(srv, "/v1/completions", {"prompt": PROMPT}).json()
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == whole["choices"][0]["text"]
    assert chunks[-1]["usage"] == whole["usage"]
    chat = post(srv, "/v1/chat/completions", {"messages": MESSAGES}).json()["choices"][0]["message"]["content"]
    chunks = [json.loads(e) for e in sse_events(post(srv, "/v1/chat/completions", {"messages": MESSAGES, "stream": True}))[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == chat == v4["codec"].decode(v4["chat"])


def test_encoding_without_trust_remote_code_is_refused(v4: dict) -> None:
    srv = v4["servers"]["untrusted"]
    r = post(srv, "/v1/chat/completions", {"messages": MESSAGES})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "trust_remote_code_required" and err["param"] == "messages"
    assert "encoding/encoding_dsv4.py" in err["message"] and "--trust-remote-code" in err["message"]
    ok = post(srv, "/v1/completions", {"prompt": PROMPT})  # completions need no chat format
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == v4["codec"].decode(v4["completion"])


def test_generate_with_offloaded_experts_gives_transformers_answer(v4: dict) -> None:
    """``generate --moe-backend hybrid`` at TP=2: FP4 experts in host banks, a 4-slot cache, a share on the host."""
    import subprocess
    import sys

    from shardsmith.runtime.serve.launch import free_port

    out = subprocess.run([sys.executable, "-m", "shardsmith.cli", "generate", str(v4["pack"]), *SERVE,
                          "--moe-backend", "hybrid", "--expert-cache-gb", str((4 * 104448 + 1024) / 2**30),
                          "--max-tokens", str(MAX_TOKENS), "--prompt", PROMPT, "--dist-port", str(free_port())],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == v4["codec"].decode(v4["completion"]) + "\n"
    assert "expert offload: backend hybrid" in out.stderr and "cache 4/32 experts" in out.stderr


def test_engine_restarts_each_request_and_refuses_a_rewind(v4: dict) -> None:
    """Every request starts at position 0 (the V4 state resets); a step elsewhere is refused before it runs."""
    from shardsmith.errors import UsageError
    from shardsmith.runtime.engine.engine import Engine, SamplingParams

    eng = Engine.load(v4["ckpt"], rank=0, world_size=1, from_checkpoint=True, dtype=torch.float32, max_seq_len=64)
    eng.warmup()
    run = lambda: [s.token_id for s in eng.generate(v4["prompt_ids"], SamplingParams(max_tokens=MAX_TOKENS))]  # noqa: E731
    assert run() == run() == v4["completion"]
    with pytest.raises(UsageError, match=r"start at 0 \(a new sequence\) or at position \d+.*cannot rewind\); got start=3"):
        eng._step([5], 3)
    assert run() == v4["completion"]


def test_thinking_goes_to_reasoning_content(v4: dict) -> None:
    """DeepSeek's thinking mode (``chat_template_kwargs: {"thinking": true}``) opens ``<think>`` in the
    prompt, so the answer up to ``</think>`` is ``reasoning_content`` and no marker reaches
    ``content``; streamed deltas give the same split; an earlier answer's ``reasoning_content`` is
    accepted back in the history."""
    srv = v4["servers"]["encoding"]
    body = {"messages": MESSAGES, "chat_template_kwargs": {"thinking": True}, "max_tokens": 24}
    whole = post(srv, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert whole["reasoning_content"], whole  # random weights rarely close the thought within 24 tokens
    assert END_THINK not in (whole["reasoning_content"] + (whole["content"] or ""))
    chunks = [json.loads(e) for e in sse_events(post(srv, "/v1/chat/completions", body | {"stream": True}))[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas).strip() == whole["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas).strip() == (whole["content"] or "").strip()
    plain = post(srv, "/v1/chat/completions", {"messages": MESSAGES}).json()["choices"][0]["message"]
    assert plain["reasoning_content"] is None and plain["content"] == v4["codec"].decode(v4["chat"])
    history = MESSAGES + [{"role": "assistant", "content": whole["content"] or "Paris.",
                           "reasoning_content": whole["reasoning_content"]}, {"role": "user", "content": "And Spain?"}]
    r = post(srv, "/v1/chat/completions", {"messages": history})
    assert r.status_code == 200, r.text
