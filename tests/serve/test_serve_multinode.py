"""Several machines (issue 17, #17): two ``torchrun --nnodes 2`` nodes on loopback (gloo), each
holding only its own rank in its own directory (``export --rank R`` then ``import``), answer as
one node does; a node given another pack's rank, or none, is refused before any load, and every
node says which rank.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardsmith.runtime.serve.launch import free_port

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")

PROMPT = "The capital of France is"
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``pack``: a tiny Mixtral at TP=2; ``node0``/``node1``: its ranks moved one per directory with
    export/import; ``other``: the same checkpoint split again with tied embeddings (another pack)."""
    from shardsmith.testing import tiny_mixtral
    from shardsmith.testing.tokenizer import deepseek_tokenizer
    from shardsmith.writer.split import split_checkpoint
    from shardsmith.writer.transport import export_rank, import_rank

    root = tmp_path_factory.mktemp("multinode")
    out = {"pack": root / "pack", "other": root / "other"}
    split_checkpoint(deepseek_tokenizer(tiny_mixtral(root / "ckpt"), vocab_size=320), out["pack"], world_size=2)
    split_checkpoint(deepseek_tokenizer(tiny_mixtral(root / "ckpt-tied", tie_embeddings=True), vocab_size=320),
                     out["other"], world_size=2)
    for r in (0, 1):
        export_rank(out["pack"], r, root / f"rank-{r}.tar.zst")
        import_rank(root / f"rank-{r}.tar.zst", root / f"node{r}")
        out[f"node{r}"] = root / f"node{r}"
    return out


def _env() -> dict[str, str]:
    return os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _generate(*extra: str) -> list[str]:
    return ["-m", "shardsmith.cli", "generate", *extra, "--prompt", PROMPT, "--max-tokens", "12"]


def _nodes(dirs: list[Path]) -> list[subprocess.CompletedProcess]:
    """Start one ``torchrun --nnodes 2 --nproc-per-node 1`` per directory (node rank = position) and wait."""
    port = free_port()
    procs = [subprocess.Popen(["torchrun", "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "1",
                               "--master-addr", "127.0.0.1", "--master-port", str(port),
                               *_generate(str(d))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env())
             for i, d in enumerate(dirs)]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def test_each_node_holds_only_its_rank(packs) -> None:
    for r in (0, 1):
        assert sorted(x.name for x in packs[f"node{r}"].glob("rank-*")) == [f"rank-{r}-of-2"]


def test_two_nodes_answer_like_one(packs) -> None:
    one = subprocess.run([sys.executable, *_generate(str(packs["pack"]), "--dist-port", str(free_port()))],
                         capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())
    assert one.returncode == 0, one.stderr
    assert len(one.stdout.strip()) > 0
    node0, node1 = _nodes([packs["node0"], packs["node1"]])
    assert node0.returncode == 0 and node1.returncode == 0, node0.stderr + node1.stderr
    assert node0.stdout == one.stdout  # rank 0's node prints the answer, token for token the same
    assert node1.stdout == ""


@pytest.mark.parametrize("case", ["none", "another pack"])
def test_node_without_its_rank_is_refused_naming_it(packs, tmp_path: Path, case: str) -> None:
    bad = tmp_path / "node1"
    shutil.copytree(packs["node1"], bad)
    shutil.rmtree(bad / "rank-1-of-2")
    if case == "another pack":
        shutil.copytree(packs["other"] / "rank-1-of-2", bad / "rank-1-of-2")
    node0, node1 = _nodes([packs["node0"], bad])
    want = (f"rank 1 of 2: {bad / 'rank-1-of-2'} is missing" if case == "none"
            else f"rank 1 of 2: {bad / 'rank-1-of-2' / 'manifest.yaml'} belongs to another pack (pack_id expected")
    for node in (node0, node1):  # both nodes stop, and both say which rank
        assert node.returncode != 0
        assert want in node.stderr.replace("\n", " "), node.stderr
        assert "loaded in" not in node.stderr and "ready in" not in node.stderr  # refused before any load
