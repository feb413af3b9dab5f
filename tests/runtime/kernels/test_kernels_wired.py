"""The decode kernels wired into the runtime (issue 12): FP8 linears stay FP8 and call ``fp8_linear``,
resident dense/FP4 expert banks call ``fused_experts`` for decode-sized steps, DeepSeek-V4's decode
core attends through ``sink_attention`` (``indexer_scores`` on CSA layers), its compressors step
through ``compressor_step``, its mixers run ``hc_pre`` (the block's norm folded) and its expansions ``hc_post``; its
routers run ``route_topk``.

CPU: each kernel's item of ``SHARDSMITH_KERNELS`` (``fp8_dense``, ``fused_experts``, ``decode_attention``,
``indexer_scores``, ``compressor_step``, ``hc_pre``, ``hc_post``, ``router``) is decided once at load, off on CPU unless forced; forced on under Triton's interpreter (``TRITON_INTERPRET=1``), the tiny
DeepSeek-V4 (FP8 dense, FP4 experts) and tiny Mixtral-FP8 (FP8 dense, FP8 experts dequantized at
load to a bf16 bank) give the dequantize path's logits within float32 / bf16 rounding, prefill and
one-token decode steps alike. GPU (``-m gpu``): the same models on CUDA, graphed, give the same
greedy tokens in float32 with the kernels as without, bf16 logits within tolerance, and the FP8
linears hold the pack's weight bytes on the GPU (printed; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: the kernels run in Triton's interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.errors import UsageError
from shardsmith.runtime.layers import experts as experts_mod
from shardsmith.runtime.layers.experts import ExpertBank
from shardsmith.runtime.layers.kernels import triton_available
from shardsmith.runtime.layers.parallel import _Linear, kernel_on

PROMPT = [3, 17, 42, 99, 5, 8, 61, 7]
STEPS = 3
ENV = ("fp8_dense", "fused_experts", "decode_attention", "indexer_scores", "compressor_step", "hc_pre", "hc_post",
       "router_kernel")  # the kernel settings a load decides
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _load(path, device: str, dtype: torch.dtype, kernels: bool, use_settings, *, graphs: bool = False):
    from shardsmith.runtime.engine.engine import Engine

    forced = "kernel" if device == "cpu" else "auto"
    use_settings(**dict.fromkeys(ENV, forced if kernels else "reference"))
    return Engine.load(path, rank=0, world_size=1, device=device, dtype=dtype, from_checkpoint=True, max_seq_len=64,
                       cuda_graphs=graphs)


def _decode(model, tokens: list[int] | None = None, steps: int = STEPS,
            prompt: list[int] = PROMPT) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill logits (every position) then ``steps`` one-token steps; greedy, or teacher-forced on ``tokens``."""
    dev = next(model.buffers()).device
    logits = [model(torch.tensor(prompt, device=dev), 0, last_only=False).float().cpu()]
    chosen, pos = [], len(prompt)
    for i in range(steps):
        chosen.append(int(logits[-1][-1].argmax()) if tokens is None else tokens[i])
        logits.append(model(torch.tensor(chosen[-1:], device=dev), pos).float().cpu())
        pos += 1
    return logits, chosen


def _kernel_modules(model) -> tuple[list[_Linear], list[ExpertBank]]:
    mods = list(model.modules())
    return ([m for m in mods if isinstance(m, _Linear) and m.kernel],
            [m for m in mods if isinstance(m, ExpertBank) and m.kernel])


def _linear_bytes(model, plan) -> dict:
    """Weight bytes of the FP8 linears (kept or dequantized) on the device vs in the pack, and all linears'."""
    out = {"fp8_device": 0, "fp8_pack": 0, "linear_device": 0, "linear_pack": 0}
    for name, m in model.named_modules():
        if not isinstance(m, _Linear) or name + ".weight" not in plan.tensors:
            continue
        tp = plan.tensors[name + ".weight"]
        dev_b = sum(b.nbytes for b in m.buffers())
        pack_b = sum(t.local_nbytes(0) for t in plan.tensors.values() if t.name == tp.name or t.scale_of == tp.name)
        out["linear_device"] += dev_b
        out["linear_pack"] += pack_b
        if tp.quant == "fp8-block":
            out["fp8_device"] += m.weight.nbytes
            out["fp8_pack"] += tp.local_nbytes(0)
    return out


# ------------------------------------------------------------------ the switch


def test_switch_is_off_on_cpu_unless_forced(monkeypatch):
    """Each kernel switch as the environment sets it (:mod:`shardsmith.settings`) and as a load reads it."""
    from shardsmith import settings

    cpu = torch.device("cpu")
    for field in ENV:
        key = next(i.key for i in settings.ITEMS if i.field == field)

        def on() -> bool:
            return kernel_on(field, cpu)

        monkeypatch.delenv("SHARDSMITH_KERNELS", raising=False)
        assert on() is False  # auto: CUDA only, even under the interpreter
        monkeypatch.setenv("SHARDSMITH_KERNELS", f"{key}=reference")
        assert on() is False
        monkeypatch.setenv("SHARDSMITH_KERNELS", f"all=kernel,{key}=sometimes")
        with pytest.raises(UsageError, match=f"SHARDSMITH_KERNELS: {key}='sometimes': expected auto, kernel or reference"):
            on()
        monkeypatch.setenv("SHARDSMITH_KERNELS", f"all=reference,{key}=kernel")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(UsageError, match=f"SHARDSMITH_KERNELS={key}=kernel cannot run on cpu"):
            on()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert on() is triton_available()
        monkeypatch.delenv("SHARDSMITH_KERNELS")


def test_cpu_load_keeps_the_dequantize_path(tiny, monkeypatch):
    """Auto on CPU: no kernel module, every FP8 linear dequantized at load, as before."""
    from shardsmith.runtime.engine.engine import Engine

    monkeypatch.delenv("SHARDSMITH_KERNELS", raising=False)
    eng = Engine.load(tiny("mixtral-fp8"), rank=0, world_size=1, device="cpu", dtype=torch.float32,
                      from_checkpoint=True, max_seq_len=32)
    assert _kernel_modules(eng.model) == ([], [])
    assert not [n for n, b in eng.model.named_buffers() if b.dtype == torch.float8_e4m3fn]


# ------------------------------------------------------------------ kernels vs dequantize (interpreter)


@needs_triton
@pytest.mark.parametrize("name, dtype", [
    pytest.param("deepseek-v4", torch.float32, id="f32-deepseek-v4"),
    # ~110 s under the interpreter on 2 cores; the f32 case checks the same path more strictly
    pytest.param("deepseek-v4", torch.bfloat16, id="bf16-deepseek-v4", marks=pytest.mark.slow),
    pytest.param("mixtral-fp8", torch.float32, id="f32-mixtral-fp8"),
    pytest.param("mixtral-fp8", torch.bfloat16, id="bf16-mixtral-fp8"),
])
def test_kernel_path_matches_dequantize_path(tiny, monkeypatch, use_settings, name, dtype):
    """Same logits (prefill, then decode steps teacher-forced on the dequantize path's greedy tokens);
    the FP8 linears stay FP8 and the decode steps' experts run ``fused_experts``; V4's compressors step
    through ``compressor_step``'s kernel (one step after a 3-token prompt: it completes a ratio-4 window)
    with the attention's projections of x and the shared expert's w1 | w3 merged, and every mixer (the
    prefill, one-token steps) runs ``hc_pre`` with the block's norm and every expansion ``hc_post``, every router
    ``route_topk``."""
    from shardsmith.runtime.models.deepseek_v4 import compressor as v4_compressor
    from shardsmith.runtime.models.deepseek_v4 import hyper as v4_hyper
    from shardsmith.runtime.models.deepseek_v4 import moe as v4_moe

    calls, steps_by, mixes, posts, routes = [], [], [], [], []
    real, real_step, real_mix = experts_mod.fused_experts, v4_compressor.compressor_step, v4_hyper.hc_pre
    real_post = v4_hyper.hc_post
    monkeypatch.setattr(v4_hyper, "hc_pre", lambda *a, **k: mixes.append(k["out_norm"]) or real_mix(*a, **k))
    monkeypatch.setattr(v4_hyper, "hc_post", lambda *a, **k: posts.append(1) or real_post(*a, **k))
    real_route = v4_moe.route_topk
    monkeypatch.setattr(v4_moe, "route_topk", lambda *a, **k: routes.append(1) or real_route(*a, **k))
    monkeypatch.setattr(experts_mod, "fused_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(v4_compressor, "compressor_step",
                        lambda *a, **k: steps_by.append((k["backend"], bool(a[7].any()))) or real_step(*a, **k))
    # V4 under the interpreter costs ~6 s a prompt token and ~8 s a step: a 3-token prompt, then one step at
    # position 3, which completes a ratio-4 window
    steps, prompt = (1, PROMPT[:3]) if name == "deepseek-v4" else (STEPS, PROMPT)
    ref, tokens = _decode(_load(tiny(name), "cpu", dtype, False, use_settings).model, steps=steps, prompt=prompt)
    assert not calls and not mixes and not posts and not routes and all(backend == "reference" for backend, _ in steps_by)
    steps_by.clear()
    eng = _load(tiny(name), "cpu", dtype, True, use_settings)
    linears, banks = _kernel_modules(eng.model)
    assert linears and banks and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    got, _ = _decode(eng.model, tokens, steps=steps, prompt=prompt)
    assert len(calls) == (steps + 1) * len(banks)  # the prefill (16 pairs, V4's 6) and every decode step
    if name == "deepseek-v4":  # every compressor step through the kernel, some completing a window
        assert steps_by and all(backend == "auto" for backend, _ in steps_by) and any(done for _, done in steps_by)
        assert len(mixes) == len(posts) == (steps + 1) * 2 * len(eng.model.layers)
        norms = [n for layer in eng.model.layers for n in (layer.attn_norm, layer.ffn_norm)]
        assert [(w.data_ptr(), eps) for w, eps in mixes] == [(n.weight.data_ptr(), n.eps) for n in norms] * (steps + 1)
        assert len(routes) == (steps + 1) * len(eng.model.layers)
        for layer in eng.model.layers:  # x's projections merged (wq_a | wkv; the compressors'), the linears views
            attn = layer.attn
            assert attn.x_fp8 is not None and attn.wkv.weight.data_ptr() == attn.x_fp8[0][-attn.head_dim:].data_ptr()
            assert (attn.x_dense is not None) == (attn.compressor is not None)
            w13 = layer.ffn.shared_w13  # the shared expert's w1 | w3
            assert w13 is not None and layer.ffn.shared_experts.w3.weight.data_ptr() == w13[0][-w13[0].shape[0] // 2:].data_ptr()
    tol = 2e-5 if dtype == torch.float32 else 4e-2
    for r, g in zip(ref, got):
        err = ((g - r).abs().max() / r.abs().max()).item()
        assert err < tol, f"{name} {dtype}: relative error {err:.2e} >= {tol}"


@needs_triton
@pytest.mark.parametrize("name", ["qwen3-moe", "deepseek-v3"])  # bf16, FP8 128x128 (Mixtral-FP8's: the offload tests)
def test_a_prefill_chunk_runs_fp8_and_dense_banks_through_the_tile_kernel(tiny, monkeypatch, use_settings, name):
    """A 17-token prompt (past the decode-sized steps) with the tile kernel on (CUDA's default; forced here
    under the interpreter): the MoE banks (FP8 kept FP8 by the kernel setting, or bf16-family dense) run
    ``grouped_experts`` and give the expert-by-expert loop's logits within float32 rounding."""
    from shardsmith.runtime.engine.engine import Engine

    prompt = [(7 * i + 3) % 300 for i in range(17)]
    use_settings(**(dict.fromkeys(ENV, "reference") | {"fused_experts": "kernel"}))  # FP8 banks kept FP8, linears dequantized
    eng = Engine.load(tiny(name), rank=0, world_size=1, device="cpu", dtype=torch.float32, from_checkpoint=True,
                      max_seq_len=64)
    banks = [m for m in eng.model.modules() if isinstance(m, ExpertBank)]
    want = eng.model(torch.tensor(prompt), 0, last_only=False).float()
    calls = []
    real = experts_mod.grouped_experts
    monkeypatch.setattr(experts_mod, "grouped_experts", lambda *a, **k: calls.append(k.get("block")) or real(*a, **k))
    monkeypatch.setattr(experts_mod, "TILE_KERNEL", True)
    got = eng.model(torch.tensor(prompt), 0, last_only=False).float()
    assert {b.format for b in banks} == {"dense" if name == "qwen3-moe" else "fp8"}
    assert calls == [b.block for b in banks] and all((blk is not None) == (b.format == "fp8")
                                                     for blk, b in zip(calls, banks))
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 2e-5, f"{name}: relative error {err:.2e}"


@needs_triton
def test_deepseek_v4_verify_runs_through_the_kernels(tiny, monkeypatch, use_settings):
    """A verify run of 4 rows in V4's batched decode step with every kernel on (the interpreter): each
    compressor takes the run in one launch (the run's first row's program, its rows in order) and the
    sink attention reads the grown window ring; the run's logits are a reference prefill chunk's. Two of
    its rows are then taken back (the compressors retake the kept ones through the kernel) and the
    next step's logits are those of the reference that took its chunk back."""
    from shardsmith.runtime.models.deepseek_v4 import compressor as v4_compressor

    from shardsmith.runtime.engine.engine import Engine

    ref = _load(tiny("deepseek-v4"), "cpu", torch.float32, False, use_settings).model
    # the kernels a run changes: the compressor step, the sink attention over the ring, the index scores
    use_settings(**{**dict.fromkeys(ENV, "reference"),
                    **dict.fromkeys(("compressor_step", "decode_attention", "indexer_scores"), "kernel")})
    eng = Engine.load(tiny("deepseek-v4"), rank=0, world_size=1, dtype=torch.float32, from_checkpoint=True,
                      max_seq_len=64, max_num_seqs=1, cuda_graphs=False)
    eng.reserve_rows(1 + 3)  # runs of up to 4 rows
    backends = []
    real_step = v4_compressor.compressor_step
    monkeypatch.setattr(v4_compressor, "compressor_step",
                        lambda *a, **k: backends.append((k["backend"], k.get("run") is not None)) or real_step(*a, **k))
    draft = [11, 12, 13, 14]
    logits = ref(torch.tensor(PROMPT), 0)
    eng.prefill(0, PROMPT)
    ref.speculate(0, 4)
    want = ref(torch.tensor(draft), len(PROMPT), last_only=False)
    got = eng.decode(draft, list(range(8, 12)), [0] * 4)
    compressors = sum(1 for layer in eng.model.layers for _ in layer.attn._compressors()
                      if layer.attn.compressor.entries.shape[1])
    assert backends == [("triton", True)] * compressors  # one launch each, the run's rows in one program
    backends.clear()
    tol = 2e-5
    assert ((got - want).abs().max() / want.abs().max()).item() < tol
    ref.restore(0, 10)
    eng.restore(0, 10)
    assert backends == [("auto", False)] * 2 * compressors  # the rollback retakes the 2 kept rows, one launch each
    want = ref(torch.tensor([21]), 10)
    got = eng.decode([21], [10], [0])
    assert logits.shape == want.shape and ((got - want).abs().max() / want.abs().max()).item() < tol


# ------------------------------------------------------------------ GPU


gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), needs_triton]


@pytest.mark.parametrize("name", ["deepseek-v4", "mixtral-fp8"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_gpu_kernels_keep_greedy_tokens_and_pack_bytes(tiny, use_settings, name, graphs):
    """float32: the kernel path decodes the dequantize path's greedy tokens; bf16: logits within
    tolerance; the FP8 linears' weight bytes on the GPU are the pack's (printed with the rest)."""
    from shardsmith.runtime.engine.loader import load_rank_weights

    plan = load_rank_weights(tiny(name), rank=0, world_size=1, from_checkpoint=True).plan
    for dtype in (torch.float32, torch.bfloat16):
        ref_eng = _load(tiny(name), "cuda", dtype, False, use_settings, graphs=graphs)
        ref, ref_tokens = _decode(ref_eng.model, steps=8)
        ref_bytes = _linear_bytes(ref_eng.model, plan)
        del ref_eng
        eng = _load(tiny(name), "cuda", dtype, True, use_settings, graphs=graphs)
        linears, banks = _kernel_modules(eng.model)
        assert linears and banks
        got, tokens = _decode(eng.model, steps=8)
        got_bytes = _linear_bytes(eng.model, plan)
        print(f"\n{name} {dtype} graphs={graphs}: linear bytes on the GPU, kernels {got_bytes} / "
              f"dequantize {ref_bytes}")
        assert got_bytes["fp8_device"] == got_bytes["fp8_pack"] > 0
        assert ref_bytes["fp8_device"] == 2 * ref_bytes["fp8_pack"] if dtype == torch.bfloat16 else True
        if dtype == torch.float32:
            assert tokens == ref_tokens
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        got, _ = _decode(eng.model, ref_tokens, steps=8)
        for r, g in zip(ref, got):
            err = ((g - r).abs().max() / r.abs().max()).item()
            assert err < tol, f"{name} {dtype}: relative error {err:.2e} >= {tol}"


for _mark in gpu:
    test_gpu_kernels_keep_greedy_tokens_and_pack_bytes = _mark(test_gpu_kernels_keep_greedy_tokens_and_pack_bytes)
