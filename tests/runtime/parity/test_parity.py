"""``shardsmith parity``: a planted sharding defect is called a defect at the layer it is in; a
clean pack's bf16 divergences are near-ties; the verdict rules themselves on hand-made traces.

The ranks are real processes (gloo); one tiny Mixtral checkpoint (2 layers) serves every test.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner
from unittest.mock import patch

from shardsmith.cli import app, main
from shardsmith.parity.compare import Trace, compare, first_divergence
from shardsmith.parity.run import plan_configs
from shardsmith.errors import UsageError

PROMPTS = "ids: 3 17 42 99 5 8 61 7\nids: 11 12 13 14 15\nids: 200 100 50 25 9\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardsmith.testing.tiny import tiny_mixtral

    return tiny_mixtral(tmp_path_factory.mktemp("parity") / "ckpt")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text(PROMPTS)
    return path


def swap_experts(pack: Path, *, rank: int, layer: int, a: int = 0, b: int = 1) -> None:
    """Plant a defect: swap experts ``a`` and ``b``'s ``down`` shards in one rank's bank file of ``layer``.

    Only this rank's slices move (the other ranks keep the right order), and nothing is recomputed:
    the manifest's hashes no longer match, so the pack is loaded with hash checks off.
    """
    rank_dir = next(pack.glob(f"rank-{rank}-of-*"))
    manifest = yaml.safe_load((rank_dir / "manifest.yaml").read_text())
    f = next(f for f in manifest["files"] if f["kind"] == "bank" and f["layer"] == f"model.layers.{layer}")
    t = next(t for t in f["tensors"] if t["name"] == "down")
    per = t["bytes"] // t["shape"][0]
    with open(rank_dir / f["path"], "r+b") as fh:
        fh.seek(t["offset"] + a * per)
        xa = fh.read(per)
        fh.seek(t["offset"] + b * per)
        xb = fh.read(per)
        assert xa != xb
        fh.seek(t["offset"] + a * per)
        fh.write(xb)
        fh.seek(t["offset"] + b * per)
        fh.write(xa)


def run_cli(*args: str, capsys: pytest.CaptureFixture) -> tuple[int, dict]:
    """``shardsmith parity ARGS --json`` through the console entry point (its exit-code mapping)."""
    with pytest.raises(SystemExit) as exit_info, patch.object(sys, "argv", ["shardsmith", "parity", *args, "--json"]):
        main()
    out = capsys.readouterr()
    return exit_info.value.code or 0, json.loads(out.out) if out.out.strip() else {"stderr": out.err}


def test_planted_defect_is_a_defect_at_its_layer(ckpt: Path, prompts: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    from shardsmith.writer.split import split_checkpoint

    pack = tmp_path / "tp2"
    split_checkpoint(ckpt, pack, world_size=2)
    swap_experts(pack, rank=1, layer=1)
    code, rep = run_cli(str(pack), "--checkpoint", str(ckpt), "--tp", "1,2", "--prompts", str(prompts),
                        "--max-tokens", "6", "--layers", "--no-verify", capsys=capsys)
    assert code == 2, rep
    assert [c["name"] for c in rep["configs"]] == ["tp1", "tp2-pack"]
    assert {d["verdict"] for d in rep["divergences"]} == {"defect"}, rep["divergences"]  # every prompt
    layers = rep["layers"]["tp2-pack"]
    assert layers["first_departing"] == 1  # layer 0 is intact; the swap is in layer 1
    rows = layers["rows"]
    assert not rows[0]["departs"] and rows[1]["departs"]
    assert rows[1]["reference_rel_err"] > 1e4 * rows[0]["reference_rel_err"]  # float32 reruns: the jump is at layer 1
    assert rep["defects"] and any("decoder layer 1 departs" in d for d in rep["defects"])


def test_clean_pack_bf16_divergences_are_near_ties(ckpt: Path, prompts: Path, capsys: pytest.CaptureFixture) -> None:
    code, rep = run_cli(str(ckpt), "--tp", "1,2", "--prompts", str(prompts), "--max-tokens", "12", "--dtype", "bfloat16",
                        capsys=capsys)
    assert code == 0, rep["divergences"]
    assert {d["verdict"] for d in rep["divergences"]} <= {"near-tie", "agree"}
    assert any(d["verdict"] == "near-tie" for d in rep["divergences"])  # bf16 does flip near-ties here
    for d in rep["divergences"]:
        assert d["reference_diff"] < d["noise"] / 100  # float32 reruns agree far below the bf16 noise
        if d["verdict"] == "near-tie":
            assert d["flip_margin"] <= 2 * d["noise"]


def test_clean_pack_float32_and_transformers_have_no_defect(ckpt: Path, prompts: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    code, rep = run_cli(str(ckpt), "--tp", "1,2", "--reference", "transformers", "--prompts", str(prompts),
                        "--max-tokens", "8", "--dtype", "float32", "--layers", capsys=capsys)
    assert code == 0, rep["divergences"]
    assert rep["reference_dtype"] == "float64"
    assert [c["name"] for c in rep["configs"]] == ["tp1", "tp2", "transformers"]
    assert {d["verdict"] for d in rep["divergences"]} <= {"near-tie", "agree"}
    assert all(d["max_logprob_diff"] < 1e-4 for d in rep["divergences"])
    for name in ("tp2", "transformers"):
        assert rep["layers"][name]["first_departing"] is None
        assert all(r["reference_rel_err"] < 1e-9 for r in rep["layers"][name]["rows"])  # float64 reruns agree


def test_pack_alone_names_the_configs_it_can_run(ckpt: Path, tmp_path: Path) -> None:
    from shardsmith.writer.split import split_checkpoint

    split_checkpoint(ckpt, tmp_path / "tp2", world_size=2)
    with pytest.raises(UsageError, match=r"world_size=2: from it parity can run only --tp 2"):
        plan_configs(tmp_path / "tp2", [1, 2], checkpoint=None, reference=None)
    result = CliRunner().invoke(app, ["parity", str(tmp_path / "tp2"), "--tp", "1,2"])
    assert result.exit_code == 1
    assert plan_configs(ckpt, [2, 1], checkpoint=None, reference="transformers")[-1][0].kind == "transformers"
    assert [c.name for c, _ in plan_configs(tmp_path / "tp2", [1, 2], checkpoint=ckpt, reference=None)] == ["tp1", "tp2-pack"]
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 256}))
    with pytest.raises(UsageError, match=r"not the model of .*'hidden_size' \(256 vs the pack's 192\)"):
        plan_configs(tmp_path / "tp2", [1, 2], checkpoint=other, reference=None)
    with pytest.raises(UsageError, match=r"--tp must list distinct"):
        plan_configs(ckpt, [1, 1], checkpoint=None, reference=None)


def _trace(tokens: list[int], lps: list[list[float]], ref: list[list[float]], ids: list[list[int]]) -> Trace:
    lp, ids_t = torch.tensor(lps, dtype=torch.float64), torch.tensor(ids)
    return Trace(tokens, ids_t, lp, ids_t, lp, torch.tensor(ref, dtype=torch.float64))


def test_verdict_rules_on_hand_made_traces() -> None:
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    ids = torch.tensor([[5, 6, 7], [5, 6, 7]])
    a = Trace([5, 5], ids, f64([[-0.5, -0.6, -3.0], [-0.69, -0.70, -3.0]]), ids,
              f64([[-0.5, -0.6, -3.0], [-0.69, -0.70, -3.0]]), f64([[-0.51, -0.6, -3.0], [-0.70, -0.69, -3.0]]))
    # b takes token 6 at step 1 by 0.01 nats where a took 5 by 0.01: flip margin 0.02; noise there
    # is a's 0.01 + b's 0.005 = 0.015 (2 x 0.015 >= 0.02), and the reference runs agree within it
    b_lp = f64([[-0.5, -0.6, -3.0], [-0.70, -0.69, -3.0]])  # at a's top-K ids (5, 6, 7)
    b = Trace([5, 6], torch.tensor([[5, 6, 7], [6, 5, 7]]), f64([[-0.5, -0.6, -3.0], [-0.69, -0.70, -3.0]]), ids,
              b_lp, f64([[-0.51, -0.6, -3.0], [-0.695, -0.695, -3.0]]))
    (d,) = compare(0, ["tp1", "tp2"], [a, b])
    assert (d.step, d.first_token, d.other_token, d.verdict) == (1, 5, 6, "near-tie"), d.reason
    assert math.isclose(d.margin, 0.02, abs_tol=1e-12) and d.gaps == pytest.approx({"tp1": 0.01, "tp2": 0.01})
    assert math.isclose(d.noise, 0.015, abs_tol=1e-12)
    # the same flip, but at step 0 (same token) b computes log-probs 0.3 nats off, in both precisions
    shift = f64([[0.3, 0, 0], [0, 0, 0]])
    c = Trace(b.tokens, b.top_ids, b.top_lp, ids, b.probe_lp + shift, b.ref_lp + shift)
    (e,) = compare(0, ["tp1", "tp2"], [a, c])
    assert e.verdict == "defect" and "step 0" in e.reason
    # a flip by a wide margin is a defect even when the reference runs agree
    w = Trace([5, 6], b.top_ids, f64([[-0.5, -0.6, -3.0], [-0.1, -2.5, -3.0]]), ids,
              f64([[-0.5, -0.6, -3.0], [-2.5, -0.1, -3.0]]), b.ref_lp)
    assert compare(0, ["tp1", "tp2"], [a, w])[0].verdict == "defect"
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and first_divergence([1, 2], [1, 3]) == 1


def test_prompts_file_ids_text_and_defaults(tmp_path: Path) -> None:
    from shardsmith.cli_parity import parse_tp, read_prompts
    from shardsmith.testing.tokenizer import deepseek_tokenizer

    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"vocab_size": 320}))
    ids, codec = read_prompts(None, root)  # no tokenizer: fixed id prompts inside the vocabulary
    assert codec is None and len(ids) == 3 and all(0 <= t < 320 for p in ids for t in p)
    f = tmp_path / "p.txt"
    f.write_text("ids: 5 6 7\n\nThe capital of France is\n")
    with pytest.raises(UsageError, match=r"p.txt:3: a text prompt needs .*tokenizer.json"):
        read_prompts(f, root)
    deepseek_tokenizer(root)
    ids, codec = read_prompts(f, root)
    assert ids[0] == [5, 6, 7] and ids[1] and ids[1] == codec.encode_prompt("The capital of France is")
    f.write_text("ids: 5 x\n")
    with pytest.raises(UsageError, match=r"p.txt:1: 'ids:' must be followed by integers"):
        read_prompts(f, root)
    assert parse_tp("1,2,4") == [1, 2, 4]
    with pytest.raises(UsageError, match="--tp must be"):
        parse_tp("1,two")
