"""The emulated host-to-GPU link (``offload/link_cap.py``): off unless asked, checked, and on a GPU
the probe then measures the capped rate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardsmith.errors import UsageError
from shardsmith.runtime.offload import link_cap
from shardsmith.runtime.offload.probe import measure_h2d


def test_cap_is_off_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(link_cap.ENV, raising=False)
    assert link_cap.cap_gb_per_s() is None
    monkeypatch.setenv(link_cap.ENV, " ")
    assert link_cap.cap_gb_per_s() is None
    monkeypatch.setenv(link_cap.ENV, "25")
    assert link_cap.cap_gb_per_s() == 25.0


@pytest.mark.parametrize("bad", ["0", "-3", "fast", "inf", "nan"])
def test_bad_cap_is_refused(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(link_cap.ENV, bad)
    with pytest.raises(UsageError, match=link_cap.ENV):
        link_cap.cap_gb_per_s()


def test_no_pad_on_a_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(link_cap.ENV, "1")
    assert link_cap.pad(1 << 30, torch.device("cpu")) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_probe_measures_the_capped_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    experts = torch.empty(16, 16 << 20, dtype=torch.uint8).pin_memory()  # 16 experts of 16 MiB
    host = SimpleNamespace(layers={"layers.0": {"gate_up": experts}})
    monkeypatch.delenv(link_cap.ENV, raising=False)
    real = measure_h2d(host, dev)
    cap = real / 3
    monkeypatch.setenv(link_cap.ENV, str(cap))
    capped = measure_h2d(host, dev)
    assert 0.85 * cap <= capped <= 1.1 * cap, (real, cap, capped)
