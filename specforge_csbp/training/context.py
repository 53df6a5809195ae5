"""Where this rank stands: the DP x CP device mesh, its device and precision.

    world ranks 0..W-1 laid out as a (dp, cp) mesh, cp fastest:     dp\\cp   0   1
                                                                     0      r0  r1    <- one CSBP group
                                                                     1      r2  r3

Ranks of one CP group hold shards of the same sequences (they build identical batches and each keeps its
rows); DP replicas see different sequences. Parameters are replicated on every rank, and gradients are
summed over the whole world (every rank's loss is already divided by the global denominator).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from .config import ParallelConfig, TrainConfig

__all__ = ["TrainContext", "build_context"]


@dataclass
class TrainContext:
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    mode: str  # the CP-group mode actually run ("reference" when cp_size == 1)
    mesh: DeviceMesh | None
    cp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    device: torch.device
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    attention_backend: str
    seed: int
    micro_batch_size: int
    grad_accum: int
    attention_schedule: str | None = None  # ShardedAttention's schedule (None: its default, fused)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over the whole job."""
        return self.dp_size * self.micro_batch_size * self.grad_accum

    def sequence_index(self, step: int, micro: int, item: int) -> int:
        """Global id of item `item` of micro batch `micro` on this DP replica at `step` (partition-free:
        the same sequence gets the same id for any dp / micro batch / accumulation split)."""
        per_replica = self.micro_batch_size * self.grad_accum
        return step * self.global_batch + self.dp_rank * per_replica + micro * self.micro_batch_size + item

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def _precision(precision: str, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    if precision == "auto":
        precision = "bfloat16" if device.type == "cuda" else "float32"
    if precision == "float64":
        return torch.float64, None
    if precision == "bfloat16":
        return torch.float32, torch.bfloat16
    return torch.float32, None


def build_context(train: TrainConfig, parallel: ParallelConfig) -> TrainContext:
    """Needs an initialised default process group (gloo on CPU, NCCL on GPU)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, cp = parallel.degrees(world)
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    param_dtype, autocast_dtype = _precision(train.precision, device)
    return TrainContext(
        rank=rank, world_size=world, dp_rank=mesh.get_local_rank("dp"), dp_size=dp,
        cp_rank=mesh.get_local_rank("cp"), cp_size=cp, mode=parallel.mode if cp > 1 else "reference",
        mesh=mesh, cp_group=mesh.get_group("cp"), dp_group=mesh.get_group("dp"), device=device,
        param_dtype=param_dtype, autocast_dtype=autocast_dtype, attention_backend=parallel.attention_backend,
        attention_schedule=parallel.attention_schedule,
        seed=train.seed, micro_batch_size=train.micro_batch_size, grad_accum=train.grad_accum,
    )  # fmt: skip
