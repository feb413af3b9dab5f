"""The AVX-512 path of the host expert kernel on a machine without AVX-512: its source compiled
against SIMDe's portable AVX-512 (``simde-py``'s headers, or ``$SIMDE_INCLUDE``), run beside the
native AVX2 path and compared with the scalar one (``host_kernel_emu/harness.cpp``).

The scalar path is itself checked against the dequantize-then-matmul reference in
``test_host_kernel.py``; on the GPU host that file also runs the real AVX-512 instructions. Skipped,
saying why, without g++ or SIMDe headers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shardsmith.runtime.offload import host_kernel

HERE = Path(__file__).with_name("host_kernel_emu")
SRC = host_kernel.SOURCES[0].parent


def _simde_include() -> str | None:
    if os.environ.get("SIMDE_INCLUDE"):
        return os.environ["SIMDE_INCLUDE"]
    try:
        import simde_py
    except ImportError:
        return None
    return simde_py.get_include()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.skipif(_simde_include() is None, reason="needs SIMDe headers: pip install simde-py, or set SIMDE_INCLUDE")
def test_avx512_path_emulated_equals_scalar(tmp_path: Path) -> None:
    text = (SRC / "host_kernel_avx512.cpp").read_text()
    assert "#include <immintrin.h>" in text and "avx512_kernels()" in text
    emulated = "\n".join(line for line in text.replace("#include <immintrin.h>", '#include "simde_shim.h"')
                         .replace("avx512_kernels()", "emulated_avx512_kernels()").splitlines()
                         if not line.startswith("#pragma GCC"))  # SIMDe, not the AVX-512 target
    (tmp_path / "emulated_avx512.cpp").write_text(emulated)
    exe = tmp_path / "harness"
    build = subprocess.run(["g++", "-std=c++17", "-O1", f"-I{_simde_include()}", f"-I{HERE}", f"-I{SRC}",
                            str(HERE / "harness.cpp"), str(tmp_path / "emulated_avx512.cpp"),
                            str(SRC / "host_kernel_scalar.cpp"), str(SRC / "host_kernel_avx2.cpp"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " 0 failures" in run.stdout
