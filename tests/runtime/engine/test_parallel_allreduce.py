"""``parallel.all_reduce`` on gloo: the gather + local sum path for small tensors gives every rank
the same result, bitwise gloo's ring at world size 2 and within one rounding at world size 4."""

from __future__ import annotations

import traceback

import pytest
import torch

from shardsmith.testing.ranks import run_ranks


def _rank(rank: int, world_size: int, port: int, _unused, queue) -> None:
    try:
        import torch.distributed as dist

        from shardsmith.runtime.engine.dist import init_distributed
        from shardsmith.runtime.layers import parallel

        init_distributed(rank, world_size, master_port=port)
        g = torch.Generator().manual_seed(100 + rank)
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(3, 576, generator=g) * 10).to(dtype)
            ring = x.clone()
            dist.all_reduce(ring)
            gathered = parallel.all_reduce(x.clone())
            every = [torch.empty_like(gathered) for _ in range(world_size)]
            dist.all_gather(every, gathered)
            out[str(dtype)] = (ring.float().numpy(), gathered.float().numpy(),
                               all(torch.equal(e, gathered) for e in every))
        if rank == 0:
            queue.put(("ok", out))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_reduce_matches_gloo_ring(world_size: int) -> None:
    for dtype, (ring, gathered, same_everywhere) in run_ranks(_rank, world_size, None, timeout=120).items():
        assert same_everywhere, dtype
        ring, gathered = torch.from_numpy(ring), torch.from_numpy(gathered)
        if world_size == 2:
            torch.testing.assert_close(gathered, ring, atol=0, rtol=0, msg=dtype)
        else:  # one rounding instead of one per ring step
            tol = 2 ** -7 if "bfloat16" in dtype else 1e-5
            torch.testing.assert_close(gathered, ring, atol=tol * 40, rtol=tol, msg=dtype)
