"""The benchmarks' no-communication control: the attention collectives replaced by local copies.

    with no_attention_communication():
        step()          # same buffers, same kernels, same memory; all-gather and reduce-scatter are copies

A step timed inside minus the same step timed outside is the communication the step leaves exposed
(`exposed_comm_ms`). `torch.distributed.all_gather_into_tensor` / `reduce_scatter_tensor` - the pair the
library's K/V gather and CP's partial-output merge use (distributed/collectives.py) - become a copy of the
local shard into every rank's segment and a local sum of the segments; every other collective (the gradient
all-reduce, metrics) still communicates. The control lives here, not in the library: the library always
communicates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["no_attention_communication"]


class _Done:
    """What an async collective returns, already finished."""

    def wait(self, timeout=None) -> bool:
        return True


def _gather_locally(output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    world = output.shape[0] // shard.shape[0]
    output.view(world, *shard.shape).copy_(shard.expand(world, *shard.shape))
    return _Done() if async_op else None


def _reduce_scatter_locally(output: torch.Tensor, full: torch.Tensor, op=None, group=None, async_op: bool = False):
    world = full.shape[0] // output.shape[0]
    torch.sum(full.view(world, *output.shape), dim=0, out=output)
    return _Done() if async_op else None


@contextlib.contextmanager
def no_attention_communication() -> Iterator[None]:
    """Inside the block, this process's all-gathers and reduce-scatters into tensors are local copies."""
    saved = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
    dist.all_gather_into_tensor, dist.reduce_scatter_tensor = _gather_locally, _reduce_scatter_locally
    try:
        yield
    finally:
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor = saved
