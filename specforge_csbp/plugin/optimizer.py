"""SpecForge's BF16 optimizer with its per-tensor loops replaced by fused and multi-tensor kernels.

SpecForge 0.2.0 steps every draft model with `specforge.optimizer.BF16Optimizer`: AdamW over fp32 master
copies of the bf16 parameters, global-norm clipping, and a warm-up schedule. Its `step` walks the parameters
one by one (a norm, a new fp32 gradient, a scale, a copy back per tensor) and runs AdamW's foreach path; for a
1.9B-parameter drafter that is about 4,000 small kernels and a fresh 7.6 GB of fp32 gradients per step.

`FusedBF16Optimizer` computes the same update with

    grad norm      one multi-tensor norm over the bf16 gradients (as SpecForge: before the fp32 copy)
    fp32 grads     one multi-tensor copy and one multi-tensor scale (freed after the step, as SpecForge's)
    AdamW          torch's fused kernel (`fused=True`) where the masters' device supports it, else foreach
    write-back     one multi-tensor copy of the masters into the bf16 parameters

and keeps everything else of the parent: the masters, the schedule, `state_dict` / `load_state_dict` (a
checkpoint of either class resumes under the other). The update equals SpecForge's up to float rounding
(the same formulas, other reduction orders); `tests/plugin/test_fused_optimizer.py` compares them step by step.
Used by the plugin's workers for the CSBP strategies (`install`); CPU-offloaded masters keep SpecForge's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from specforge.optimizer import BF16Optimizer

__all__ = ["FusedBF16Optimizer", "install"]


def _fused_supported(params: list[torch.Tensor]) -> bool:
    return bool(params) and all(p.device.type in ("cuda", "cpu") and p.dtype == torch.float32 for p in params)


class FusedBF16Optimizer(BF16Optimizer):
    """`BF16Optimizer` with a fused / multi-tensor `step` (module docstring)."""

    def __init__(self, model, lr, weight_decay=0.0, *, total_steps=800_000, warmup_ratio=0.015,
                 lr_scheduler="cosine", **kwargs) -> None:  # fmt: skip
        super().__init__(model, lr, weight_decay, total_steps=total_steps, warmup_ratio=warmup_ratio,
                         lr_scheduler=lr_scheduler, **kwargs)  # fmt: skip
        if not self.offload_master:
            # the same AdamW and schedule as the parent built, with the fused kernel
            fused = _fused_supported(self.fp32_params)
            self.optimizer = torch.optim.AdamW(
                self.fp32_params, lr=lr, weight_decay=weight_decay, fused=fused or None
            )
            self.scheduler = type(self.scheduler)(
                self.optimizer, total_steps=total_steps, warmup_steps=int(warmup_ratio * total_steps)
            )

    def _grad_norm_and_clip_coefficient(self):
        grads = [p.grad.detach() for p in self.model_params if p.grad is not None]
        if not grads:
            return super()._grad_norm_and_clip_coefficient()
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        return self._reduce_grad_norm(torch.stack(norms).square().sum())

    def step(self):
        if self.offload_master:
            return super().step()
        grad_norm, clip_coefficient = self._grad_norm_and_clip_coefficient()
        with torch.no_grad():
            have = [(p, mp) for p, mp in zip(self.model_params, self.fp32_params) if p.grad is not None]
            for p, mp in zip(self.model_params, self.fp32_params):
                if p.grad is None:
                    mp.grad = None
            if have:
                master_grads = [torch.empty_like(mp) for _, mp in have]
                torch._foreach_copy_(master_grads, [p.grad.detach() for p, _ in have])
                torch._foreach_mul_(master_grads, clip_coefficient)
                for (_, mp), g in zip(have, master_grads):
                    mp.grad = g
        self.last_grad_norm = grad_norm.detach()
        self.optimizer.step()
        self.optimizer.zero_grad()  # the fp32 gradients are not kept between steps
        self.scheduler.step()
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.model_params], [mp.data for mp in self.fp32_params])
            for p in self.model_params:
                p.grad = None
        return self.last_grad_norm


@contextlib.contextmanager
def install() -> Iterator[None]:
    """While SpecForge assembles a run, its optimizer factory builds `FusedBF16Optimizer`s."""
    from specforge.training import assembly

    original = assembly._optimizer_factory

    class _Factory(assembly._ConfiguredOptimizerFactory):
        def __call__(self, draft_module):
            if self.total_steps is None:
                raise RuntimeError("optimizer total_steps was not resolved before assembly")
            t = self.cfg.training
            return FusedBF16Optimizer(
                draft_module, lr=t.learning_rate, max_grad_norm=t.max_grad_norm, warmup_ratio=t.warmup_ratio,
                lr_scheduler=t.lr_scheduler, total_steps=self.total_steps, offload_master=t.optimizer_cpu_offload,
            )  # fmt: skip

    assembly._optimizer_factory = _Factory
    try:
        yield
    finally:
        assembly._optimizer_factory = original
