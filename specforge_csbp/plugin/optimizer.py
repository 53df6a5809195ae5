"""SpecForge's BF16 optimizer with its per-tensor loops replaced by fused and multi-tensor kernels.

SpecForge 0.2.0 steps every draft model with `specforge.optimizer.BF16Optimizer`: AdamW over fp32 master
copies of the bf16 parameters, global-norm clipping, and a warm-up schedule. Its `step` walks the parameters
one by one (a norm, a new fp32 gradient, a scale, a copy back per tensor) and runs AdamW's foreach path; for a
1.9B-parameter drafter that is about 4,000 small kernels and a fresh 7.6 GB of fp32 gradients per step. Before
it, SpecForge's loop rescales every gradient by the global loss denominator (`backend.scale_gradients`: one
more pass over them).

`FusedBF16Optimizer` computes the same update with one pass per stage over the gradients:

    loss scale     `defer_gradient_scale` (what `connect` routes the backend's scale_gradients to): kept as
                   a factor, not applied - the norm scales with it and AdamW applies it (below)
    grad norm      one multi-tensor norm over the bf16 gradients; the per-tensor norms also feed the run's
                   non-finite check (`gradient_check`), so the gradients are read once for both
    fp32 grads     one multi-tensor copy (freed after the step, as SpecForge's)
    AdamW          torch's fused kernel (`fused=True`) where the masters' device supports it, with the loss
                   scale x clip coefficient as its `grad_scale` and the check's verdict as its `found_inf`
                   (a refused step changes no master, moment or step count); else foreach, scaled first
    write-back     one multi-tensor copy of the masters into the bf16 parameters
    verdict        read back once, after the update is queued (the GPU is not left idle waiting for it);
                   a bad step raises before the schedule moves

and keeps everything else of the parent: the masters, the schedule, `state_dict` / `load_state_dict` (a
checkpoint of either class resumes under the other). The update equals SpecForge's up to float rounding
(the same formulas, other reduction orders, the scale applied in fp32 instead of to the bf16 gradients);
`tests/plugin/test_fused_optimizer.py` compares them step by step. Used by the plugin's workers for the CSBP
strategies (`install`, `connect`); CPU-offloaded masters keep SpecForge's own step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from specforge.optimizer import BF16Optimizer

__all__ = ["FusedBF16Optimizer", "GradientCheck", "connect", "install"]


class GradientCheck(Protocol):
    """The run's non-finite check, split at its one host read (plugin/strategy.py)."""

    def device_verdict(self, norms: torch.Tensor) -> torch.Tensor | None:
        """Flags on the device (nonzero: refuse the step) from the per-tensor gradient norms; None: no check
        is due."""

    def settle(self, verdict: list[int]) -> None:
        """Raise the run's error for a refused step (the flags read back)."""


def _fused_supported(params: list[torch.Tensor]) -> bool:
    return bool(params) and all(p.device.type in ("cuda", "cpu") and p.dtype == torch.float32 for p in params)


class FusedBF16Optimizer(BF16Optimizer):
    """`BF16Optimizer` with a fused / multi-tensor `step` (module docstring)."""

    def __init__(self, model, lr, weight_decay=0.0, *, total_steps=800_000, warmup_ratio=0.015,
                 lr_scheduler="cosine", **kwargs) -> None:  # fmt: skip
        super().__init__(model, lr, weight_decay, total_steps=total_steps, warmup_ratio=warmup_ratio,
                         lr_scheduler=lr_scheduler, **kwargs)  # fmt: skip
        self.fused = False
        self.gradient_check: GradientCheck | None = None
        self._gradient_scale: torch.Tensor | None = None
        if not self.offload_master:
            # the same AdamW and schedule as the parent built, with the fused kernel
            self.fused = _fused_supported(self.fp32_params)
            self.optimizer = torch.optim.AdamW(
                self.fp32_params, lr=lr, weight_decay=weight_decay, fused=self.fused or None
            )
            self.scheduler = type(self.scheduler)(
                self.optimizer, total_steps=total_steps, warmup_steps=int(warmup_ratio * total_steps)
            )

    def defer_gradient_scale(self, factor: torch.Tensor | float) -> None:
        """Scale the gradients by `factor` in the next step (SpecForge's `backend.scale_gradients`, without
        its pass over them)."""
        if self.offload_master:  # SpecForge's own step reads the gradients as they are
            with torch.no_grad():
                for p in self.model_params:
                    if p.grad is not None:
                        p.grad.mul_(factor)
            return
        factor = torch.as_tensor(factor, dtype=torch.float32)
        self._gradient_scale = factor if self._gradient_scale is None else self._gradient_scale * factor

    def step(self):
        if self.offload_master:
            return super().step()
        scale, self._gradient_scale = self._gradient_scale, None
        have = [(p, mp) for p, mp in zip(self.model_params, self.fp32_params) if p.grad is not None]
        for p, mp in zip(self.model_params, self.fp32_params):
            if p.grad is None:
                mp.grad = None
        if not have:  # the parent's zero norm
            return self._finish(*self._grad_norm_and_clip_coefficient(), verdict=None)
        grads = [p.grad.detach() for p, _ in have]
        norms = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
        verdict = self.gradient_check.device_verdict(norms) if self.gradient_check is not None else None
        if scale is not None:
            scale = scale.to(norms.device)
        total_sq = (norms if scale is None else norms * scale).square().sum()  # each norm scaled: no overflow
        grad_norm, clip_coefficient = self._reduce_grad_norm(total_sq)
        multiplier = clip_coefficient if scale is None else clip_coefficient * scale
        with torch.no_grad():
            master_grads = [torch.empty_like(mp) for _, mp in have]
            torch._foreach_copy_(master_grads, grads)
            for (_, mp), g in zip(have, master_grads):
                mp.grad = g
            if self.fused:  # the fused kernel divides by grad_scale and skips the update where found_inf is 1
                self.optimizer.grad_scale = multiplier.to(torch.float32).reciprocal()
                self.optimizer.found_inf = None if verdict is None else verdict.amax().clamp(max=1).to(torch.float32)
            else:
                if verdict is not None:  # foreach AdamW has no found_inf: decide before it runs
                    self.gradient_check.settle(verdict.tolist())
                    verdict = None
                torch._foreach_mul_(master_grads, multiplier)
        return self._finish(grad_norm, clip_coefficient, verdict=verdict, stepped=True)

    def _finish(self, grad_norm, clip_coefficient, *, verdict: torch.Tensor | None, stepped: bool = False):
        """AdamW (fp32 gradients in place), the bf16 write-back, the verdict, then the schedule."""
        self.last_grad_norm = grad_norm.detach()
        try:
            self.optimizer.step()
        finally:
            self.optimizer.grad_scale = self.optimizer.found_inf = None
        self.optimizer.zero_grad()  # the fp32 gradients are not kept between steps
        if stepped:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.model_params], [mp.data for mp in self.fp32_params])
        if verdict is not None:  # the one host read, after the update was queued; a refused step changed nothing
            self.gradient_check.settle(verdict.tolist())  # (its message reads the bf16 gradients: still here)
        for p in self.model_params:
            p.grad = None
        self.scheduler.step()
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


def connect(run: Any) -> FusedBF16Optimizer | None:
    """Route a built run's gradient scaling and non-finite check into its `FusedBF16Optimizer`: SpecForge's
    loop calls `backend.scale_gradients(factor)` just before `backend.step()`, so the factor is folded into
    that step; the strategy's check reads the optimizer's norms. Returns the optimizer, or None (changing
    nothing) when this run steps another optimizer or SpecForge keeps its loop elsewhere than 0.2.0 does."""
    core = getattr(getattr(run, "trainer", None), "core", None)
    backend = getattr(core, "backend", None)
    opt = getattr(backend, "optimizer", None)
    if not isinstance(opt, FusedBF16Optimizer) or opt.offload_master:
        return None
    backend.scale_gradients = opt.defer_gradient_scale
    check = getattr(core, "strategy", None)
    if callable(getattr(check, "device_verdict", None)) and callable(getattr(check, "settle", None)):
        opt.gradient_check = check
    return opt
