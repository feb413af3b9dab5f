"""``shardsmith serve`` answering completion and chat requests for a TP=2 pack of the tiny gpt-oss.

The checkpoint is :func:`~shardsmith.testing.tiny_gpt_oss.tiny_gpt_oss` (MXFP4 experts, sinks,
sliding window) with the test tokenizer of :mod:`shardsmith.testing.tokenizer` (a byte-level BPE
with a Jinja chat template; the release's o200k harmony tokenizer is not needed to test serving).
One server runs as a real subprocess on 127.0.0.1 (CPU, gloo, float32, two ranks). The weights
are random, so answers are checked against transformers' ``GptOssForCausalLM`` reading the same
checkpoint: greedy tokens equal its greedy continuation of the same prompt ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")

from test_serve_e2e import Server  # noqa: E402  (same directory; pytest puts it on sys.path)

MODEL = "tiny-gpt-oss"
MAX_TOKENS = 10
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


def greedy(ckpt: Path, prompts: list[list[int]], eos: tuple[int, ...]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt: ``MAX_TOKENS`` tokens, or up to an EOS included."""
    from transformers import GptOssForCausalLM

    from shardsmith.testing.reference import hf_greedy

    model = GptOssForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    return hf_greedy(model, prompts, max_tokens=MAX_TOKENS, eos=eos)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The pack, its server (ready), the tokenizer, the prompts' ids and transformers' answers."""
    from shardsmith.runtime.serve.tokenizer import Codec
    from shardsmith.testing.tiny_gpt_oss import tiny_gpt_oss
    from shardsmith.testing.tokenizer import deepseek_tokenizer
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("serve-gpt-oss")
    ckpt = deepseek_tokenizer(tiny_gpt_oss(root / "ckpt"), vocab_size=512, chat="template")
    split_checkpoint(ckpt, root / "pack-tp2", world_size=2)
    server = Server(root / "pack-tp2", root / "serve.log", "--dtype", "float32", "--max-seq-len", "128", model=MODEL)
    try:
        from transformers import AutoTokenizer

        codec = Codec(root / "pack-tp2")
        prompt_ids = codec.encode(PROMPT)
        chat_ids = AutoTokenizer.from_pretrained(str(ckpt)).apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        completion, chat = greedy(ckpt, [prompt_ids, list(chat_ids)], codec.eos_token_ids)
        server.wait_ready()
        yield {"server": server, "codec": codec, "prompt_ids": prompt_ids, "completion": completion,
               "chat_ids": list(chat_ids), "chat": chat}
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
