"""Why a ``TORCH_CHECK`` in the host expert kernel killed pytest on the GPU host (issue 15, finding 4).

Prints the toolchain (g++, torch's compiler and C++ ABI), builds a minimal extension that only
raises ``TORCH_CHECK(false, ...)`` with the flags :func:`shardsmith.runtime.offload.host_kernel.available`
uses (``-O3 -fopenmp``, ``-fopenmp`` at link), and one built without OpenMP as the control, then runs
each case below in its own child process (``-X faulthandler``) and reports ``caught`` (the
RuntimeError reached Python), ``crash (signal N)`` or ``rc N``:

* ``mini`` / ``mini_noomp``: the minimal extension's check, with and without OpenMP in the build;
* ``mini_after_parallel``: the same after one ``at::parallel_for`` region has started the threads;
* ``real_isa``: the real kernel's instruction-set check (passed on the GPU host in the suite);
* ``real_columns``: its column check in a fresh process (the one that crashed);
* ``real_columns_after_kernel``: the column check after a kernel ran (the order of the test file).

It also lists the shared objects each build links (``ldd``: one libgomp or two?) and those mapped
in a process that loaded torch and the kernel. With gdb on the host, a crashing case is rerun under
it for the native backtrace. Writes ``$OUT/host_kernel_diag.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

MINI = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
namespace {
at::Tensor boom(const at::Tensor& x, int64_t parallel_first) {
  if (parallel_first) {
    float* p = x.data_ptr<float>();
    at::parallel_for(0, x.numel(), 1, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) p[i] += 1.f; });
  }
  TORCH_CHECK(false, "x has ", x.size(0), " columns, the weight ", 32);
  return x;
}
}  // namespace
TORCH_LIBRARY(NAMESPACE, m) { m.def("boom(Tensor x, int parallel_first) -> Tensor", &boom); }
"""

CHILD = {
    "mini": "torch.ops.load_library({lib!r}); torch.ops.{ns}.boom(torch.zeros(64), 0)",
    "mini_noomp": "torch.ops.load_library({lib!r}); torch.ops.{ns}.boom(torch.zeros(64), 0)",
    "mini_after_parallel": "torch.ops.load_library({lib!r}); torch.ops.{ns}.boom(torch.zeros(1 << 16), 1)",
    "real_isa": "hk.available(); torch.ops.shardsmith_host.fp4_linear(torch.randn(1, 32), "
                "torch.zeros(1, 16, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8), 'avx1024')",
    "real_columns": "hk.available(); torch.ops.shardsmith_host.fp4_linear(torch.randn(1, 64), "
                    "torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.uint8), '')",
    "real_columns_after_kernel": "hk.available(); torch.ops.shardsmith_host.fp4_linear(torch.randn(4, 4096), "
                                 "torch.zeros(64, 2048, dtype=torch.uint8), torch.zeros(64, 128, dtype=torch.uint8), ''); "
                                 "torch.ops.shardsmith_host.fp4_linear(torch.randn(1, 64), "
                                 "torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.uint8), '')",
}

WRAP = """
import sys, torch
from shardsmith.runtime.offload import host_kernel as hk
try:
    {body}
except RuntimeError as e:
    print("caught:", str(e).splitlines()[0]); sys.exit(0)
print("no exception"); sys.exit(4)
"""


def sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"({type(e).__name__}: {e})"


def build(name: str, openmp: bool, work: Path) -> str:
    from torch.utils.cpp_extension import load

    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    src = d / f"{name}.cpp"
    src.write_text(MINI.replace("NAMESPACE", name))
    flags = ["-O3", "-fopenmp"] if openmp else ["-O3"]
    load(name=name, sources=[str(src)], build_directory=str(d), is_python_module=False, extra_cflags=flags,
         extra_ldflags=["-fopenmp"] if openmp else [], verbose=False)
    return str(d / f"{name}.so")


def run_case(case: str, body: str, env: dict) -> dict:
    code = WRAP.format(body=body)
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    verdict = "caught" if p.returncode == 0 else (f"crash (signal {-p.returncode})" if p.returncode < 0 else f"rc {p.returncode}")
    out = {"case": case, "verdict": verdict, "stdout": p.stdout[-500:], "stderr": p.stderr[-4000:]}
    if p.returncode < 0 and shutil.which("gdb"):
        g = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=300, env=env)
        out["gdb"] = g.stdout[-6000:]
    print(f"{case:28s} {verdict}   {p.stdout.strip()[:160]}", flush=True)
    return out


def main() -> None:
    import torch

    from shardsmith.runtime.offload import host_kernel as hk

    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    work = Path(os.environ.get("SHARDSMITH_CACHE", "/tmp/sscache")) / "diag"
    report = {"gxx": sh(["g++", "--version"]).splitlines()[:1], "python": sys.version,
              "torch": torch.__version__, "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
              "torch_config": torch.__config__.show(), "torch_parallel": torch.__config__.parallel_info()}
    print(f"g++: {report['gxx']}\ntorch {report['torch']}, _GLIBCXX_USE_CXX11_ABI={report['cxx11_abi']}")
    print(textwrap.indent(report["torch_config"], "  "))
    print(textwrap.indent(report["torch_parallel"], "  "))
    libs = {}
    for name, omp in (("ssdiag_mini", True), ("ssdiag_mini_noomp", False)):
        try:
            libs[name] = build(name, omp, work)
        except Exception as e:  # noqa: BLE001 - reported
            print(f"build {name} failed: {type(e).__name__}: {str(e)[:2000]}")
    real = hk.available()
    report["real_available"] = real
    so = sorted(Path(os.environ.get("SHARDSMITH_CACHE", "/tmp/sscache"), "host_kernel").glob("*/*.so"))
    report["ldd"] = {str(p): sh(["ldd", str(p)]) for p in [*map(Path, libs.values()), *so[-1:]]}
    maps = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if any(k in ln for k in ("gomp", "stdc++", "omp"))})
    report["mapped"] = maps
    print("mapped OpenMP / libstdc++ objects in this process:", *maps, sep="\n  ")
    for p, text in report["ldd"].items():
        print(f"ldd {Path(p).name}:", *[ln for ln in text.splitlines() if any(k in ln for k in ("gomp", "stdc++", "c10", "gcc_s"))],
              sep="\n  ")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    cases = []
    for case, body in CHILD.items():
        if case.startswith("mini"):
            name = "ssdiag_mini_noomp" if case == "mini_noomp" else "ssdiag_mini"
            if name not in libs:
                continue
            body = body.format(lib=libs[name], ns=name)
        elif not real:
            continue
        cases.append(run_case(case, body, env))
    report["cases"] = cases
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "host_kernel_diag.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
