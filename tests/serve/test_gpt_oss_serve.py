"""``shardsmith serve`` answering completion and chat requests for a TP=2 pack of the tiny gpt-oss,
experts resident and offloaded (``--moe-backend cpu``: MXFP4 host banks, computed on the host).

The checkpoint is :func:`~shardsmith.testing.tiny_gpt_oss.tiny_gpt_oss` (MXFP4 experts, sinks,
sliding window) with the test tokenizer of :mod:`shardsmith.testing.tokenizer` (a byte-level BPE
with a Jinja chat template; the release's o200k harmony tokenizer is not needed to test serving).
One server per placement runs as a real subprocess on 127.0.0.1 (CPU, gloo, float32, two ranks). The weights
are random, so answers are checked against transformers' ``GptOssForCausalLM`` reading the same
checkpoint: greedy tokens equal its greedy continuation of the same prompt ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")

from shardsmith.testing.server import Server

MODEL = "tiny-gpt-oss"
MAX_TOKENS = 10
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


def greedy(ckpt: Path, prompts: list[list[int]], eos: tuple[int, ...]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt: ``MAX_TOKENS`` tokens, or up to an EOS included."""
    from transformers import GptOssForCausalLM

    from shardsmith.parity.reference import plain_pytorch_kwargs
    from shardsmith.testing.reference import hf_greedy

    model = GptOssForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, **plain_pytorch_kwargs(ckpt)).eval()
    return hf_greedy(model, prompts, max_tokens=MAX_TOKENS, eos=eos)


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The pack, the tokenizer, the prompts' ids and transformers' answers (shared by both servers)."""
    from transformers import AutoTokenizer

    from shardsmith.runtime.serve.tokenizer import Codec
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss
    from shardsmith.testing.tokenizer import deepseek_tokenizer
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("serve-gpt-oss")
    ckpt = deepseek_tokenizer(tiny_gpt_oss(root / "ckpt"), vocab_size=512, chat="template")
    split_checkpoint(ckpt, root / "pack-tp2", world_size=2)
    codec = Codec(root / "pack-tp2")
    prompt_ids = codec.encode(PROMPT)
    chat_ids = AutoTokenizer.from_pretrained(str(ckpt)).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    completion, chat = greedy(ckpt, [prompt_ids, list(chat_ids)], codec.eos_token_ids)
    return {"root": root, "pack": root / "pack-tp2", "codec": codec, "prompt_ids": prompt_ids,
            "completion": completion, "chat_ids": list(chat_ids), "chat": chat}


PLACEMENTS = {"resident": (), "offloaded": ("--moe-backend", "cpu")}


@pytest.fixture(scope="module", params=list(PLACEMENTS))
def served(answers: dict, request: pytest.FixtureRequest) -> dict:
    """:func:`answers` and a server of the pack (ready), its experts resident or offloaded."""
    log = answers["root"] / f"serve-{request.param}.log"
    server = Server(answers["pack"], log, "--dtype", "float32", "--max-seq-len", "128", *PLACEMENTS[request.param],
                    model=MODEL)
    try:
        server.wait_ready()
        yield answers | {"server": server, "placement": request.param}
    finally:
        assert server.stop() == 0, server.log()


def post(srv: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json={"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS} | body,
                      timeout=120)


def test_completion_matches_transformers_greedy(served: dict) -> None:
    codec, expected = served["codec"], served["completion"]
    assert len(expected) == MAX_TOKENS  # no early EOS: every token is compared
    r = post(served["server"], "/v1/completions", {"prompt": PROMPT, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [codec.token_str(t) for t in expected]
    assert choice["text"] == codec.decode(expected)
    assert body["usage"]["prompt_tokens"] == len(served["prompt_ids"])
    by_ids = post(served["server"], "/v1/completions", {"prompt": served["prompt_ids"]}).json()  # token-id prompt
    assert by_ids["choices"][0]["text"] == choice["text"]


def test_chat_answers_as_transformers_on_the_rendered_prompt(served: dict) -> None:
    """A chat's ``usage.prompt_tokens`` is the length transformers' ``apply_chat_template`` renders, and
    its answer is transformers' greedy continuation of those ids."""
    r = post(served["server"], "/v1/chat/completions", {"messages": MESSAGES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(served["chat_ids"])
    assert len(served["chat"]) == MAX_TOKENS  # no early EOS: every token is compared
    assert body["choices"][0]["message"]["content"] == served["codec"].decode(served["chat"])


def test_offloaded_experts_are_mxfp4_in_host_memory(served: dict) -> None:
    """``/metrics``: offloaded, each rank holds its MXFP4 shard of every expert in host memory (4 layers
    x 8 experts x 26624 bytes at TP=2: int8 codes, E8M0 scales and the bf16 gate/up bias, nothing
    expanded); resident, no expert offload numbers at all."""
    text = httpx.get(f"{served['server'].url}/metrics", timeout=120).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    if served["placement"] == "resident":
        assert "shardsmith_expert_host_bytes" not in values
    else:
        i_r = 256 // 2  # the rank's intermediate channels (tiny: I = 256, D = 128)
        expert = 2 * i_r * (128 // 2 + 128 // 32 + 2) + 128 * (i_r // 2 + i_r // 32)
        assert float(values["shardsmith_expert_host_bytes"]) == 4 * 8 * expert == 851968
