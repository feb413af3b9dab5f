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
    monkeypatch.delenv("SHARDSMITH_TUNING", raising=False)
    assert link_cap.cap_gb_per_s() is None
    monkeypatch.setenv("SHARDSMITH_TUNING", " ")
    assert link_cap.cap_gb_per_s() is None
    monkeypatch.setenv("SHARDSMITH_TUNING", "emulate_h2d_gbps=25")
    assert link_cap.cap_gb_per_s() == 25.0


@pytest.mark.parametrize("bad", ["0", "-3", "fast", "inf", "nan"])
def test_bad_cap_is_refused(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("SHARDSMITH_TUNING", f"emulate_h2d_gbps={bad}")
    with pytest.raises(UsageError, match=f"SHARDSMITH_TUNING: emulate_h2d_gbps='{bad}': expected a positive number"):
        link_cap.cap_gb_per_s()


def test_no_pad_on_a_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSMITH_TUNING", "emulate_h2d_gbps=1")
    assert link_cap.pad(1 << 30, torch.device("cpu")) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_probe_measures_the_capped_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    experts = torch.empty(16, 16 << 20, dtype=torch.uint8).pin_memory()  # 16 experts of 16 MiB
    host = SimpleNamespace(layers={"layers.0": {"gate_up": experts}})
    monkeypatch.delenv("SHARDSMITH_TUNING", raising=False)
    real = measure_h2d(host, dev)
    cap = real / 3
    monkeypatch.setenv("SHARDSMITH_TUNING", f"emulate_h2d_gbps={cap}")
    capped = measure_h2d(host, dev)
    assert 0.85 * cap <= capped <= 1.1 * cap, (real, cap, capped)
