"""`CSBPDraftTrainStrategy`: SpecForge's per-step seam for the plugin's strategies.

SpecForge builds it after wrapping `CSBPDrafterTrainingModel` (DDP), so the forward runs through the
wrapper. It returns the step's loss as `loss_terms = (numerator, denominator)`; SpecForge's TrainerCore
back-propagates the numerator, all-reduces the denominators over every rank and rescales the summed
gradients - the global denominator, exactly. Accuracy, per-slot accuracy (`slot_acc_k`), the acceptance
estimate `est_tau` and the tokens per micro-step go out as ratio metrics (summed over ranks, then divided), so
the logged numbers are global too. In eval forwards (SpecForge's Evaluator) the loss and "acc" go through the
evaluator; est_tau and the per-slot sums are kept here and finished by `eval_extras` (plugin/reporting.py).

Non-finite guard (SpecForge's loop has none): each rank keeps its loss numerators (forward_loss) and, in a
DDP communication hook, flags on the device which of its own gradients are non-finite before the all-reduce
mixes the ranks' gradients in - nothing is read back during backward, so the host never waits for the GPU
there. Backward still runs (the other ranks' attention collectives need this rank's part). One rank has
nothing to mix: its hook passes the gradients through (no all-reduce, no division by 1) and the summed check
below covers them. At the optimizer boundary the verdict (`device_verdict`: every rank's flags with one MAX
all-reduce, and whether the gradients the optimizer reads are finite) is read back once (`settle`): by the
plugin's optimizer, from its own gradient norms, after it queued an update that the verdict skips on the
device (plugin/optimizer.py), or else by a step pre-hook on the inner AdamW (before any weight, moment or
schedule changes). Only on a failure are the details gathered, and `NonFiniteError` is raised on every rank,
naming the rank and the tensor (loss before gradient, then the lowest rank; an overflow that only appears
after the sum is named too). SpecForge saves no checkpoint on an exception, so the last checkpoint stays the
last good step's.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from specforge.runtime.contracts import TrainBatch
from specforge.training.strategies.base import DraftTrainStrategy, StepContext, StepOutput
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..training.step import NonFiniteError, first_offender
from . import groups as csbp_groups
from ..training.validate import first_nonfinite
from .data import FEATURE

__all__ = ["CSBPDraftTrainStrategy"]

_GUARD_HANDLE = None  # the optimizer step pre-hook of the newest strategy


class CSBPDraftTrainStrategy(DraftTrainStrategy):
    required_features = frozenset({FEATURE})

    def __init__(self, wrapped_model: torch.nn.Module, *, name: str) -> None:
        self.model = wrapped_model
        self.name = name
        inner = getattr(wrapped_model, "module", wrapped_model)  # DDP / FSDP keep the module here
        # the metric keys must be the same on every rank (SpecForge packs them into one all-reduce)
        self.has_selector = getattr(inner.draft_model, "candidate_selector", None) is not None
        self.block_size = int(inner.draft_model.block_size)
        self._eval_sums: torch.Tensor | None = None  # est_tau / per-slot sums of the running eval pass
        self._install_nonfinite_guard(inner)

    # -- non-finite guard -------------------------------------------------------------------------------
    def _install_nonfinite_guard(self, inner: torch.nn.Module) -> None:
        self._named = [(n, p) for n, p in inner.draft_model.named_parameters() if p.requires_grad]
        self._order = {id(p): (i, f"draft_model.{n}.grad") for i, (n, p) in enumerate(self._named)}
        # this optimizer step's loss numerators, checked when it is due: a check in forward_loss would make
        # the host wait for the forward pass before it launches backward
        self._numerators: list[torch.Tensor] = []
        # per DDP bucket this micro-step: (parameter indices, their non-finite flags on the device)
        self._grad_flags: list[tuple[list[int], torch.Tensor]] = []
        self._pending: tuple[list[torch.Tensor], torch.Tensor] | None = None  # (numerators, local flag) to settle
        self._step = 0
        self._armed = False
        self._group = getattr(self.model, "process_group", None) if dist.is_initialized() else None
        # one rank: the gradients the optimizer reads are this rank's own, so its check names them directly
        self._one_rank = not dist.is_initialized() or dist.get_world_size(self._group) == 1
        if isinstance(self.model, DistributedDataParallel):
            hook = self._keep_bucket if self._one_rank else self._check_then_allreduce
            self.model.register_comm_hook(self.model.process_group, hook)
        global _GUARD_HANDLE
        if _GUARD_HANDLE is not None:  # one strategy per process trains; the newest one guards
            _GUARD_HANDLE.remove()
        ref = weakref.ref(self)

        def before_step(optimizer, args, kwargs) -> None:
            strategy = ref()
            if strategy is not None:
                strategy._before_optimizer_step()

        _GUARD_HANDLE = register_optimizer_step_pre_hook(before_step)

    def _note_grads(self, params, grads) -> None:
        """Record, on the device, which of these parameters' gradients are non-finite on this rank (one
        fused norm per bucket; nothing is read back here, so backward is never stalled)."""
        items = [(self._order[id(p)][0], g) for p, g in zip(params, grads) if id(p) in self._order and g is not None]
        if items:
            norms = torch._foreach_norm([g.detach() for _, g in items])
            self._grad_flags.append(([i for i, _ in items], ~torch.isfinite(torch.stack(norms))))

    def _check_then_allreduce(self, process_group, bucket):
        """DDP comm hook: this rank's own gradients, then DDP's default averaging all-reduce."""
        self._note_grads(bucket.parameters(), bucket.gradients())
        return allreduce_hook(process_group, bucket)

    @staticmethod
    def _keep_bucket(process_group, bucket):
        """DDP comm hook of a one-rank group: nothing to sum or average (DDP's default would divide every
        gradient by 1 and all-reduce it with itself), and the step's check reads these gradients themselves."""
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def _local_finding(self, numerators: list[torch.Tensor]) -> tuple[int, str] | None:
        """(phase, what) of this rank's first non-finite loss numerator, else gradient (slow path: reads back)."""
        for n in numerators:
            if not bool(torch.isfinite(n).all()):
                return (0, f"loss numerator ({float(n)})")
        if not self._grad_flags:
            return None
        index = torch.cat([torch.as_tensor(i) for i, _ in self._grad_flags])
        bad = torch.cat([f for _, f in self._grad_flags]).cpu()
        if not bool(bad.any()):
            return None
        first = int(index[bad].min())
        name, param = self._named[first]
        # the counts are of the gradient as it reaches the optimizer (after the ranks' all-reduce)
        return (1, first_nonfinite([(f"draft_model.{name}.grad", param.grad)]) or f"draft_model.{name}.grad")

    def device_verdict(self, norms: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's check up to its host read (plugin/optimizer.GradientCheck): [a loss numerator or a
        pre-all-reduce gradient was non-finite on some rank (one MAX all-reduce), the gradients the optimizer
        reads are non-finite] as int32 flags on the device. `norms`: the per-tensor norms of those gradients
        when the optimizer has them (they are not read twice); None when no training step is due."""
        if not self._armed:
            return None
        self._armed = False
        if not isinstance(self.model, DistributedDataParallel) and not self._one_rank:
            self._note_grads([p for _, p in self._named], [p.grad for _, p in self._named])  # no comm hook
        numerators, self._numerators = self._numerators, []
        if norms is None:
            grads = [p.grad.detach() for _, p in self._named if p.grad is not None]
            norms = torch.stack(torch._foreach_norm(grads)) if grads else None
        device = norms.device if norms is not None else (numerators[0].device if numerators else torch.device("cpu"))
        local_bad = torch.zeros((), dtype=torch.int32, device=device)
        for n in numerators:
            local_bad = local_bad | (~torch.isfinite(n)).any().to(device, torch.int32)
        for _, flags in self._grad_flags:
            local_bad = local_bad | flags.any().to(device, torch.int32)
        any_bad = local_bad.clone()
        if not self._one_rank:
            dist.all_reduce(any_bad, op=dist.ReduceOp.MAX, group=self._group)
        summed_bad = (
            (~torch.isfinite(norms)).any().to(device, torch.int32)
            if norms is not None else torch.zeros((), dtype=torch.int32, device=device)
        )  # fmt: skip
        self._pending = (numerators, local_bad)
        return torch.stack([any_bad, summed_bad])

    def settle(self, verdict: list[int]) -> None:
        """Raise `NonFiniteError` on every rank for a refused step, naming the rank and the tensor (loss before
        gradient, then the lowest rank; an overflow that only appears in the ranks' sum is named too)."""
        numerators, local_bad = self._pending or ([], None)
        self._pending = None
        try:
            if verdict[0]:
                local = self._local_finding(numerators) if local_bad is not None and int(local_bad) else None
                raise NonFiniteError(first_offender(self._step, local, self._group))
            if verdict[1]:
                where = first_nonfinite((f"draft_model.{n}.grad", p.grad) for n, p in self._named)
                if self._one_rank:  # this rank's own gradients
                    raise NonFiniteError(first_offender(self._step, (1, where), self._group))
                # finite on every rank, yet the averaged gradients overflow (the same on every rank)
                raise NonFiniteError(
                    f"step {self._step + 1}: non-finite gradient after the all-reduce over ranks (overflow): first "
                    f"offending tensor {where}; the step was not applied (weights, optimizer state and "
                    f"checkpoints are those of step {self._step})"
                )
        finally:
            self._grad_flags = []

    def _before_optimizer_step(self) -> None:
        """The check as an optimizer pre-hook, for an optimizer that does not run it itself (`connect` makes
        the plugin's own run it, on its norms, after queueing the update): one host read per step."""
        verdict = self.device_verdict()
        if verdict is not None:
            self.settle(verdict.tolist())

    def trainable_module(self) -> torch.nn.Module:
        return self.model

    def forward_loss(self, batch: TrainBatch, ctx: StepContext | None = None) -> StepOutput:
        self.validate_batch(batch)
        step = ctx.global_step if ctx is not None else 0
        training = self.model.training
        inner = getattr(self.model, "module", self.model)
        tokens_before = inner.tokens_trained
        # the store indices as host ints: a tensor would be moved to the GPU by DDP and read back by the module,
        # two host syncs that drain the GPU's queue before every forward
        indices = batch.tensors[FEATURE].reshape(-1).tolist()
        numerator, denominator, stats = self.model(sample_index=indices, global_step=step)
        if training:
            self._step, self._armed = step, True
            self._numerators.append(numerator.detach())  # checked before the optimizer step

        # counts in at least float32 (a bf16 numerator would round a block count of 8K); float64 stays
        dtype = torch.promote_types(numerator.dtype, torch.float32)

        def t(v):  # the module's sums stay on the device: no host sync between forward and backward
            return v.detach().to(dtype) if torch.is_tensor(v) else numerator.new_full((), float(v), dtype=dtype)

        ratios: dict[str, Any] = {
            "acc": (t(stats["correct"]), t(stats["supervised"])),
            "est_tau": (t(stats["accepted"]), t(stats["blocks"])),  # objectives/dflash.acceptance_stats
        }
        slot_correct, slot_supervised = t(stats["slot_correct"]), t(stats["slot_supervised"])
        for k in range(1, self.block_size):
            ratios[f"slot_acc_{k}"] = (slot_correct[k], slot_supervised[k])
        if self.has_selector:
            ratios["selector_coverage"] = (t(stats["covered"]), t(stats["supervised"]))
        if training:
            # this rank's share of the group's tokens over 1 / world: SpecForge's sum over ranks and the
            # window's micro-steps gives the global tokens per micro-step (plugin/reporting.py: tokens/s)
            world = dist.get_world_size() if dist.is_initialized() else 1
            share = (inner.tokens_trained - tokens_before) / csbp_groups.current().cp_size
            ratios["tokens_per_micro_step"] = (t(share), t(1.0 / world))
        else:
            self._add_eval_sums(stats, t)
        return StepOutput(
            loss=numerator,
            metrics={},
            ratio_metrics=ratios,
            loss_terms=(numerator, denominator),
        )

    # -- eval extras -------------------------------------------------------------------------------------
    def _add_eval_sums(self, stats, t) -> None:
        """SpecForge's Evaluator aggregates loss and "acc" only; the acceptance estimate and per-slot
        accuracy of an eval pass are summed here (device tensors) and finished by `eval_extras`."""
        vec = torch.cat(
            [torch.stack([t(stats["accepted"]), t(stats["blocks"])]), t(stats["slot_correct"]),
             t(stats["slot_supervised"])]
        ).to(torch.float64)  # fmt: skip
        self._eval_sums = vec if self._eval_sums is None else self._eval_sums + vec

    def reset_eval(self) -> None:
        self._eval_sums = None

    def eval_extras(self, device: torch.device) -> dict[str, float]:
        """`eval/est_tau` and `eval/slot_acc_k` of the pass since `reset_eval`, summed over every rank
        (one all-reduce on `device`, the evaluator's communication device; every rank must call it)."""
        S = self.block_size
        vec = torch.zeros(2 + 2 * S, dtype=torch.float64) if self._eval_sums is None else self._eval_sums
        vec = vec.to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec)
        values = vec.tolist()
        self._eval_sums = None
        if values[1] <= 0:
            return {}
        correct, supervised = values[2 : 2 + S], values[2 + S :]
        return {
            "eval/est_tau": values[0] / values[1],
            **{f"eval/slot_acc_{k}": correct[k] / max(supervised[k], 1e-30) for k in range(1, S)},
        }

    def checkpoint_state_filter(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Drafter weights only, under the drafter's own (= SGLang's) parameter names."""
        return {k[len("draft_model.") :]: v for k, v in state_dict.items() if k.startswith("draft_model.")}
