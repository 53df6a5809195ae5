"""Start P ranks on this machine (gloo on CPU) or join a torchrun launch (NCCL on GPU).

`spawn` is what tests and `specforge-csbp verify` use on CPU: if any rank raises, the others are
terminated and the error is re-raised in the parent naming the failed rank (torch.multiprocessing).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "init_from_env", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, timeout_s: float, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # P ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> None:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; fn must be importable (picklable)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    mp.spawn(_entry, args=(fn, world_size, free_port(), timeout_s, args), nprocs=world_size, join=True)


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join a torchrun launch (RANK/WORLD_SIZE/MASTER_* set); NCCL when CUDA is available."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
