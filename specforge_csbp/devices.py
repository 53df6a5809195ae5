"""Device plumbing shared by masks, the attention seam, the sharded executors and the step prefetcher.

`device_key`: a device as tensors on it report it ("cuda" -> "cuda:<current>"), the key under which a
mask or a staged index is cached and found again. `stage_index`: the one way an index tensor is copied
ahead of the step that reads it - from the host to a GPU through pinned memory with non_blocking, so the
copying thread never waits for the stream to drain (a pageable copy does). `compiled_once`: the one
torch.compile'd form of a function, shared by every caller (dynamo specialises on shapes and dtypes, not on
who calls).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["compiled_once", "device_key", "stage_index"]


@functools.cache
def compiled_once(fn: Callable) -> Callable:
    """`torch.compile(fn, dynamic=None)`, made once per function: static first, dynamic after a shape changes."""
    return torch.compile(fn, dynamic=None)


def device_key(device: torch.device | str) -> torch.device:
    """`device` as tensors on it report it: "cuda" becomes "cuda:<current device>"."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def stage_index(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of index tensor `t` on `device`, queued on the current stream; the pinned buffer is not reused
    before the copy ran (PyTorch's caching host allocator records the stream)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
