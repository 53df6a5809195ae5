"""Per-step throughput, MFU and peak memory (max over ranks)."""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist

__all__ = ["format_step", "max_over_ranks", "peak_device_tflops", "peak_memory_gib", "reset_peak_memory"]

# Dense bf16 tensor-core peaks (TFLOP/s per device) by device-name substring.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (GPU) or peak resident set size of this process (CPU), GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_device_tflops(device: torch.device, override: float | None = None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)


def max_over_ranks(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.cpu()[0])


def format_step(step: int, total: int, metrics: dict) -> str:
    mfu = metrics.get("mfu")
    return (
        f"step {step}/{total} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
        f"grad_norm {metrics['grad_norm']:.3f} | tok/s {metrics['tokens_per_s']:,.0f} | "
        f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | peak_mem {metrics['peak_mem_gib']:.2f} GiB | "
        f"{metrics['step_s']:.3f} s"
    )
