"""Collectives with autograd and byte accounting; process launch for gloo (CPU) and NCCL (GPU)."""

from .collectives import COMM_STATS, CommStats, KVGather
from .launch import spawn

__all__ = ["COMM_STATS", "CommStats", "KVGather", "spawn"]
