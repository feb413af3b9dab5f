"""DeepSeek-V3 served end to end: numerics against transformers at world sizes 1, 2 and 4, resident and
offloaded, the absorbed latent decode against the expanded path, and ``serve`` over HTTP.

Two tiny checkpoints (:func:`shardsmith.testing.tiny_v3.tiny_deepseek_v3_model`): ``fp8`` (FP8 with
F32 ``weight_scale_inv`` on 128x128 blocks, ragged 192-row edges, a q latent, interleaved RoPE as
the release) and ``bf16`` (a plain ``q_proj``, ``rope_interleave: false``); both with YaRN
(``mscale`` != ``mscale_all_dim``), 4 expert groups of which 2 are eligible, a random correction
bias, a dense first layer, a shared expert and an MTP layer. Each is split at TP 1, 2 and 4. The
reference is transformers' ``DeepseekV3ForCausalLM`` in float32, loaded from the bf16 checkpoint as
it is and from a copy of the FP8 one dequantized here block by block (transformers' own FP8
dequantizer refuses the ragged edge blocks: "not divisible by scale grid").
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch

from shardsmith.runtime.engine.engine import SamplingParams
from shardsmith.runtime.offload import OffloadConfig
from shardsmith.testing.ranks import run_ranks
from shardsmith.testing.tokenizer import ASSISTANT, BOS, END_THINK, USER

PROMPT_LEN, STEPS, MAX_SEQ = 24, 8, 64
ATOL = 1e-4  # float32 logits (|logits| < 6); observed ~2e-6 at TP=1
VARIANTS = ("fp8", "bf16")
BACKENDS = {"resident": None, "cpu": OffloadConfig(backend="cpu", probe=False),
            "slots": OffloadConfig(backend="gpu", cache_slots=4, probe=False)}  # a 4-slot cache on a CPU pool
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
RENDERED = f"{BOS}Be brief.{USER}What is the capital of France?{ASSISTANT}{END_THINK}"  # the test tokenizer's template
PROMPT = "The capital of France is"


def dequantized_copy(src: Path, dst: Path) -> Path:
    """``src`` with each FP8 weight times its ``weight_scale_inv``, one 128x128 block at a time (float32)."""
    from safetensors import safe_open

    from shardsmith.testing.tiny import write_checkpoint

    raw: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            raw.update({k: h.get_tensor(k) for k in h.keys()})
    out = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        w, scale = t.float(), raw.get(name + "_scale_inv")
        if scale is not None:
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= scale[i, j]
        out[name] = w
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    return write_checkpoint(dst, out, config, max_shard_bytes=8 << 20)


def reference(model_dir: Path, prompts: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """transformers per prompt: prefill logits ``[T, V]``, :data:`STEPS` greedy tokens and their step logits."""
    from transformers import DeepseekV3ForCausalLM, DynamicCache

    model = DeepseekV3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            cache = DynamicCache(config=model.config)
            prefill = model(torch.tensor([ids]), cache=cache, use_cache=True).logits[0]
            tokens, steps = [], []
            tok = prefill[-1].argmax()
            for _ in range(STEPS):
                tokens.append(int(tok))
                steps.append(model(tok.view(1, 1), cache=cache, use_cache=True).logits[0, -1])
                tok = steps[-1].argmax()
            out.append({"prefill": prefill, "tokens": tokens, "steps": torch.stack(steps)})
    return out


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The checkpoints (the FP8 one with a tokenizer), their packs at TP 1, 2, 4, prompts and references."""
    from shardsmith.runtime.serve.tokenizer import Codec
    from shardsmith.testing.tiny_v3 import tiny_deepseek_v3_model
    from shardsmith.testing.tokenizer import deepseek_tokenizer
    from shardsmith.writer.split import split_checkpoint

    root = tmp_path_factory.mktemp("v3")
    ckpts = {"fp8": deepseek_tokenizer(tiny_deepseek_v3_model(root / "fp8", fp8=True), vocab_size=512),
             "bf16": tiny_deepseek_v3_model(root / "bf16", fp8=False, q_lora=None, rope_interleave=False, seed=1)}
    packs = {}
    for name, ckpt in ckpts.items():
        for ws in (1, 2, 4):
            packs[name, ws] = root / f"{name}-tp{ws}"
            split_checkpoint(ckpt, packs[name, ws], world_size=ws)
    ids = torch.randint(6, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    codec = Codec(ckpts["fp8"])
    served = {"completion": codec.encode(PROMPT), "chat": codec.encode(RENDERED)}
    ref = {"bf16": reference(ckpts["bf16"], [ids])[0]}
    ref["fp8"], *answers = reference(dequantized_copy(ckpts["fp8"], root / "fp8-dequantized"), [ids, *served.values()])
    return {"packs": packs, "ids": ids, "ref": ref, "codec": codec, "served": served,
            "answers": dict(zip(served, (a["tokens"] for a in answers)))}


def check_logits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")


def _load(path: Path, rank: int = 0, world_size: int = 1, offload: OffloadConfig | None = None):
    from shardsmith.runtime.engine.engine import Engine

    return Engine.load(path, rank=rank, world_size=world_size, dtype=torch.float32, max_seq_len=MAX_SEQ, offload=offload)


@pytest.mark.parametrize("variant", VARIANTS)
def test_world_size_1_matches_transformers(v3: dict, variant: str) -> None:
    """Prefill logits, and every absorbed decode step teacher-forced with transformers' greedy tokens."""
    ref = v3["ref"][variant]
    model = _load(v3["packs"][variant, 1]).model
    check_logits(model(torch.tensor(v3["ids"]), 0, last_only=False), ref["prefill"], "prefill")
    pos, steps = PROMPT_LEN, []
    for tok in ref["tokens"]:
        steps.append(model(torch.tensor([tok]), pos)[0])
        pos += 1
    check_logits(torch.stack(steps), ref["steps"], "decode steps")
    greedy = [int(ref["prefill"][-1].argmax()), *(int(s.argmax()) for s in steps[:-1])]
    assert greedy == ref["tokens"]


def test_absorbed_decode_gives_the_full_sequence_tokens(v3: dict) -> None:
    """Greedy decode through the latent cache with ``kv_b_proj`` absorbed equals re-running the whole
    sequence each step with expanded keys and values (5 steps: each re-runs the sequence); a chunked
    prefill with the absorbed maths equals one prefill."""
    model, steps = _load(v3["packs"]["fp8", 1]).model, 5
    ids = v3["ids"]
    model.set_absorb("decode")
    logits, absorbed = model(torch.tensor(ids), 0), []
    for _ in range(steps):
        absorbed.append(int(logits[-1].argmax()))
        logits = model(torch.tensor(absorbed[-1:]), len(ids) + len(absorbed) - 1)
        assert model.model.layers[0].self_attn.absorb == "decode"
    model.set_absorb("never")
    seq, full = list(ids), []
    for _ in range(steps):
        full.append(int(model(torch.tensor(seq), 0)[-1].argmax()))
        seq.append(full[-1])
    assert absorbed == full == v3["ref"]["fp8"]["tokens"][:steps]
    model.set_absorb("always")  # the absorbed maths on a prefill too, with a causal mask, in two chunks
    chunked = torch.cat((model(torch.tensor(ids[:10]), 0, last_only=False), model(torch.tensor(ids[10:]), 10, last_only=False)))
    check_logits(chunked, v3["ref"]["fp8"]["prefill"], "absorbed chunked prefill")


def test_fp8_on_the_fly_keeps_fp8_and_matches(v3: dict) -> None:
    """``fp8="on-the-fly"``: FP8 weights stay FP8 (``kv_b_proj`` dequantized per absorbed step) and the
    logits are transformers'."""
    from shardsmith.runtime.engine.engine import Engine

    eng = Engine.load(v3["packs"]["fp8", 1], rank=0, world_size=1, dtype=torch.float32, max_seq_len=MAX_SEQ,
                      fp8="on-the-fly")
    attn, ref = eng.model.model.layers[1].self_attn, v3["ref"]["fp8"]
    assert attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn and attn.kv_a_proj_with_mqa.weight_scale_inv.shape == (2, 2)
    assert eng.model.model.layers[1].mlp.experts.gate_up.dtype == torch.float8_e4m3fn
    check_logits(eng.logits(v3["ids"]), ref["prefill"], "prefill")
    assert [s.token_id for s in eng.generate(v3["ids"], SamplingParams(max_tokens=2))] == ref["tokens"][:2]


def _run(rank: int, world_size: int, paths: dict[str, str], ids: list[int], backends: tuple[str, ...]) -> dict:
    """Rank 0's prefill logits, greedy tokens and their logprobs per (variant, backend); others follow."""
    out = {}
    for variant, path in paths.items():
        for name in backends:
            eng = _load(Path(path), rank, world_size, BACKENDS[name])
            if rank == 0:
                logits = eng.logits(ids)
                steps = list(eng.generate(ids, SamplingParams(max_tokens=STEPS, logprobs=1)))
                stats = eng.offload.stats() if eng.offload else {}
                if eng.offload:
                    stats["dtypes"] = sorted({str(a.dtype) for arr in eng.offload.host.layers.values() for a in arr.values()})
                    stats["layers"] = sorted(eng.offload.host.layers)
                    if eng.offload.cache:
                        stats["pool"] = str(eng.offload.cache.pool["gate_up"].dtype)
                # numpy, not tensors: a tensor in the queue is shared memory that dies with this process
                out[variant, name] = (logits.numpy(), [s.token_id for s in steps], [s.logprob for s in steps], stats)
                eng.shutdown()
            else:
                eng.follow()
            if eng.offload:
                eng.offload.close()
    return out


def _rank_main(rank: int, world_size: int, port: int, paths: dict[str, str], ids: list[int], backends: tuple[str, ...],
               queue) -> None:
    try:
        from shardsmith.runtime.engine.dist import init_distributed

        init_distributed(rank, world_size, master_port=port)
        out = _run(rank, world_size, paths, ids, backends)
        if rank == 0:
            queue.put(("ok", out))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_resident_and_offloaded_match_transformers(v3: dict, world_size: int) -> None:
    """Both variants at ``world_size`` real ranks (gloo), experts resident, on the host (``cpu``) and in
    a 4-slot cache: prefill logits, greedy tokens and each token's logprob as transformers'.

    To keep the CPU time down, world size 1 (run in this process) leaves the resident model to
    :func:`test_world_size_1_matches_transformers`, and world size 4 the slot cache to sizes 1 and 2.
    """
    paths = {variant: str(v3["packs"][variant, world_size]) for variant in VARIANTS}
    backends = {1: ("cpu", "slots"), 2: ("resident", "cpu", "slots"), 4: ("resident", "cpu")}[world_size]
    if world_size == 1:
        out = _run(0, 1, paths, v3["ids"], backends)
    else:
        out = run_ranks(_rank_main, world_size, paths, v3["ids"], backends, timeout=300)
    assert sorted(out) == sorted((v, b) for v in VARIANTS for b in backends)
    for (variant, backend), (logits, tokens, logprobs, stats) in out.items():
        ref, what = v3["ref"][variant], f"{variant} {backend} at world_size={world_size}"
        check_logits(torch.from_numpy(logits), ref["prefill"], what)
        assert tokens == ref["tokens"], what
        want = torch.cat((ref["prefill"][-1:], ref["steps"][:-1])).log_softmax(-1)  # [STEPS, V]
        check_logits(torch.tensor(logprobs), want[torch.arange(STEPS), ref["tokens"]], what + " logprobs")
        if backend == "resident":
            continue
        assert stats["layers"] == ["model.layers.1", "model.layers.2"], what  # the MTP layer's bank is not read
        stored = ["torch.float32", "torch.float8_e4m3fn"] if variant == "fp8" else ["torch.bfloat16"]
        assert stats["dtypes"] == stored, what  # FP8 experts stay FP8 (with F32 scales) in host memory
        if backend == "slots":
            assert stats["pool"] == stored[-1] and stats["misses"] > 0, what
        else:
            assert stats["host_experts"] > 0, what


def test_serve_answers_over_http(v3: dict, tmp_path: Path) -> None:
    """``serve`` of the FP8 TP=2 pack, experts on the host (``--moe-backend cpu``): a token-id completion
    and a chat give transformers' greedy answers."""
    httpx = pytest.importorskip("httpx")
    from shardsmith.testing.server import Server

    codec, answers = v3["codec"], v3["answers"]
    srv = Server(v3["packs"]["fp8", 2], tmp_path / "serve.log", "--dtype", "float32", "--max-seq-len", "128",
                 "--moe-backend", "cpu", model="tiny-v3")
    try:
        srv.wait_ready()
        body = {"model": "tiny-v3", "temperature": 0, "max_tokens": STEPS}
        r = httpx.post(f"{srv.url}/v1/completions", json=body | {"prompt": v3["served"]["completion"], "logprobs": 1},
                       timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["logprobs"]["tokens"] == [codec.token_str(t) for t in answers["completion"]]
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body | {"messages": MESSAGES}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(v3["served"]["chat"])
        assert r.json()["choices"][0]["message"]["content"] == codec.decode(answers["chat"])
    finally:
        code = srv.stop()
    assert code == 0, srv.log()
