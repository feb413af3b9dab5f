"""On one H200 (issue 12's offload design): can a kernel read pinned host memory in place at the
link's copy bandwidth? Page-locked host memory is mapped into the device's address space under
unified addressing (CUDA runtime API, ``cudaHostRegister``: "on a system with unified virtual
addressing, the memory will be both mapped and portable"), so a Triton kernel given a device
tensor's pointer plus the (host - device) address difference reads host bytes over PCIe/C2C.

Rows, GB/s (bytes / seconds, best of 5 after warm-up), for one buffer of ``--mb`` MB in 13 MB pieces (one
V4-Flash FP4 expert at TP=1 is ~12.6 MB + scales):
- ``copy``: ``dev.copy_(host, non_blocking=True)`` (cudaMemcpyAsync H2D from pinned memory);
- ``read``: a kernel sums ``BLOCK`` bytes per program straight from host memory (in place);
- ``read_write``: the same kernel also stores the bytes it read to a device buffer (write-through:
  the cache admitting the expert while the step uses it).
Both for memory from ``torch.empty(pin_memory=True)`` (cudaHostAlloc) and from ``cudaHostRegister``
of a plain host tensor (how ``offload/host_bank.py`` pins the host banks).
Saves ``benchmarks/results/zero_copy-<YYYYMMDD>-<host>.json``."""
import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import save_results  # noqa: E402


@triton.jit
def _read(base, delta, out, dst, n, WRITE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    off = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = off < n
    v = tl.load(base + delta + off, mask=ok, other=0)
    if WRITE:
        tl.store(dst + off, v, mask=ok)
    tl.store(out + pid, tl.sum(v.to(tl.int32), axis=0))


def best_s(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--blocks", default="4096,16384")
    args = ap.parse_args()
    n = args.mb << 20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    rows = []
    hosts = {"cudaHostAlloc": torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory()}
    plain = torch.randint(0, 255, (n,), dtype=torch.uint8)
    rc = torch.cuda.cudart().cudaHostRegister(plain.data_ptr(), n, 0)
    if int(rc) == 0:
        hosts["cudaHostRegister"] = plain
    else:
        print(f"cudaHostRegister failed: {rc}", flush=True)
    for kind, host in hosts.items():
        delta = host.data_ptr() - dev.data_ptr()
        s = best_s(lambda: dev.copy_(host, non_blocking=True))
        rows.append({"memory": kind, "mode": "copy", "block_bytes": None, "gb_per_s": n / s / 1e9})
        print(f"{kind:17s} copy                  {n / s / 1e9:7.1f} GB/s", flush=True)
        for block in (int(b) for b in args.blocks.split(",")):
            grid = triton.cdiv(n, block)
            out = torch.empty(grid, dtype=torch.int32, device="cuda")
            for write in (False, True):
                dst = torch.empty(n, dtype=torch.uint8, device="cuda")
                s = best_s(lambda: _read[(grid,)](dev, delta, out, dst, n, WRITE=write, BLOCK=block, num_warps=4))
                ok = torch.equal(dst, dev.copy_(host)) if write else None
                mode = "read_write" if write else "read"
                rows.append({"memory": kind, "mode": mode, "block_bytes": block, "gb_per_s": n / s / 1e9,
                             "bytes_equal": ok})
                print(f"{kind:17s} {mode:10s} block {block:6d} {n / s / 1e9:7.1f} GB/s"
                      + (f" (device copy == host: {ok})" if write else ""), flush=True)
    save_results("zero_copy", rows, extra={"buffer_bytes": n})


if __name__ == "__main__":
    main()
