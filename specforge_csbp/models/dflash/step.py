"""One drafter training step (forward + backward) in mode reference, DP, CP or CSBP.

    every rank: sample anchors (seed, step, sample) -> plans (pure) -> global denominator (all-reduce)
    per sequence it works on:
        features of its context rows (store intervals) -> model(blocks, context, plan attention)
        -> loss numerators of its blocks (vocab through the frozen LM head, selector) -> backward
    gradients summed over the group (all-reduce), metrics all-reduced

DP gives whole sequences to ranks (sequence i on rank i % P); CP and CSBP run every sequence on all ranks
with its context zigzag-sharded (sharding.py). Every mode's loss and parameter gradients equal the
single-process reference (tests/models/dflash/test_modes_equal_reference.py).

One sample's work is the same code wherever it runs: `plan_sample` (anchors -> mode -> this rank's plan ->
block targets) and `sample_terms` (features -> model -> loss numerator, denominator share, stats) are what
`drafter_step` (benchmarks, tests) and the plugin's training module (plugin/training_model.py) both call, so a
benchmark times the step users train with:

    drafter_step:                   plan_sample per sequence -> global D -> sample_terms -> numerator / D, backward
    CSBPDrafterTrainingModel:       plan_sample (prefetch worker) -> sample_terms -> (sum numerators, sum D shares)
                                    -> SpecForge's TrainerCore divides by the all-reduced D and back-propagates
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...layout.plans import check_mode
from ...objectives.dflash import (
    BlockTargets,
    DFlashObjective,
    block_targets,
    denominator_part,
    loss_terms,
    sample_anchors,
)
from ...parallel.options import AttentionOptions
from .features import DrafterSample, load_context
from .modeling import DFlashDraftModel
from .prefetch import PreparedStep, StagedIndices, stage_indices
from .sharding import DRAFTER_MODES, DrafterPlan, drafter_plans, plan_attention

__all__ = [
    "STAT_KEYS",
    "DrafterSample",
    "SampleTerms",
    "StepResult",
    "drafter_step",
    "load_context",
    "plan_mode",
    "plan_sample",
    "prepare_step",
    "sample_terms",
    "step_metrics",
    "sync_gradients",
]

_DEFAULTS = AttentionOptions()


@dataclass
class StepResult:
    loss: float  # global loss of the step (identical on every rank)
    metrics: dict[str, float]  # global: acc, supervised, selector_coverage, selector_loss, ...
    plans: list[DrafterPlan] = field(default_factory=list)  # this rank's plans (one per sequence it ran)


def sync_gradients(params: Sequence[torch.nn.Parameter], group=None) -> None:
    """Sum gradients over the group (missing ones count as zero), one async all-reduce per tensor."""
    works = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        works.append(dist.all_reduce(p.grad, group=group, async_op=True))
    for w in works:
        w.wait()


def _world(mode: str, group) -> tuple[int, int]:
    if mode == "reference" or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


Work = list[tuple[DrafterSample, DrafterPlan, BlockTargets]]


def prepare_step(
    config,
    samples: Sequence[DrafterSample],
    *,
    objective: DFlashObjective,
    mode: str,
    step: int = 0,
    group: dist.ProcessGroup | None = None,
    bucket: int = 1,
) -> Work:
    """The device-free part of a step (anchors, plans, block targets) - pure, so it can run ahead of time,
    e.g. in a thread while the previous step runs on the GPU."""
    check_mode(mode, DRAFTER_MODES)
    world, rank = _world(mode, group)
    work: Work = []
    for i, sample in enumerate(samples):
        if mode == "dp" and i % world != rank:
            continue
        plan, blocks = plan_sample(
            config, sample, objective=objective, mode=mode, world=world, rank=rank, step=step, sample_index=i,
            bucket=bucket, vocab_size=config.vocab_size,
        )  # fmt: skip
        work.append((sample, plan, blocks))
    return work


def plan_mode(mode: str, world: int, num_anchors: int) -> str:
    """The mode one sample is planned in: whole on one rank ("reference") for DP or a one-rank group; CP when
    CSBP has fewer anchors than ranks (every rank computes all blocks, each counted 1/P: exact too)."""
    if mode in ("reference", "dp") or world == 1:
        return "reference"
    return "cp" if mode == "csbp" and num_anchors < world else mode


def plan_sample(
    config,
    sample: DrafterSample,
    *,
    objective: DFlashObjective,
    mode: str,
    world: int,
    rank: int,
    step: int,
    sample_index: int,
    bucket: int = 1,
    vocab_size: int | None = None,
) -> tuple[DrafterPlan, BlockTargets]:
    """One sample's device-free part on rank `rank` of `world`: anchors drawn from (seed, step, sample_index),
    the mode (`plan_mode`), this rank's plan, the block targets of the anchors it owns (token ids checked
    against `vocab_size` on the host)."""
    S = config.draft_block_size
    anchors = sample_anchors(sample.loss_mask, objective, block_size=S, step=step, sample_index=sample_index)
    chosen = plan_mode(mode, world, int(anchors.numel()))
    P = 1 if chosen == "reference" else world
    plan = drafter_plans(chosen, sample.seq_len, anchors, config, P, bucket=bucket)[0 if P == 1 else rank]
    blocks = block_targets(
        sample.input_ids.cpu(), sample.loss_mask.cpu(), plan.owned_anchors, S, config.mask_token_id,
        vocab_size=vocab_size,
    )
    return plan, blocks


def sample_denominator(plan: DrafterPlan, blocks: BlockTargets, objective: DFlashObjective) -> float:
    """This rank's share of the global denominator for one sample (host): its blocks' weights ("dflash", CP
    duplicates counted 1/P) or its share of one sequence (D-PACE normalises per sequence)."""
    if objective.loss_type == "dflash":
        return denominator_part(blocks, objective, plan.block_size) * plan.loss_scale
    return plan.sequence_share


@dataclass
class SampleTerms:
    """One sample's result on this rank: loss numerator (with grad; CP duplicates counted 1/P), its share of
    the global denominator (host float, known before the forward) and its stats (detached device sums)."""

    numerator: torch.Tensor
    denominator: float
    stats: dict[str, torch.Tensor]


def sample_terms(
    model: DFlashDraftModel,
    sample: DrafterSample,
    plan: DrafterPlan,
    blocks: BlockTargets,
    *,
    objective: DFlashObjective,
    head_weight: torch.Tensor,
    embed_weight: torch.Tensor,
    step: int,
    attention: dict,
    staged: StagedIndices | None = None,
    features: list[torch.Tensor] | None = None,
) -> SampleTerms:
    """Forward and loss of one planned sample - the per-sample step every caller runs. `attention`: the
    plan's layer attention (masks built or not); `staged` / `features`: its indices / context features
    already on the device (prefetch.py), else copied / read here. Nothing here waits for the device."""
    device, dtype = model.fc.weight.device, model.fc.weight.dtype
    if features is None:
        features = load_context(sample, plan.ctx_intervals, device, dtype, model.fc.in_features)
    if staged is None:
        staged = stage_indices(plan, blocks, device)
    emb = F.embedding(staged.draft_ids.reshape(1, -1), embed_weight).to(dtype)
    hidden = model(
        emb, staged.position_ids, features, staged.context_position_ids,
        attention=staged.with_context_rows(attention),
    )  # fmt: skip
    terms = loss_terms(
        hidden[0], head_weight, blocks, objective, selector=getattr(model, "candidate_selector", None),
        step=step, index=staged.loss,
    )  # fmt: skip
    scale = plan.loss_scale
    stats = {k: v.detach() * scale for k, v in terms.stats.items()}
    return SampleTerms(terms.numerator * scale, sample_denominator(plan, blocks, objective), stats)


#: the 0-d stats a step sums (then the [S] slot vectors), in the order of its one metrics reduction
STAT_KEYS = (
    "nll", "weight", "correct", "supervised", "covered", "selector_ce", "selector_weight", "accepted", "blocks"
)  # fmt: skip


def stat_vector(totals: dict[str, torch.Tensor], block_size: int, like: torch.Tensor) -> torch.Tensor:
    """Flat float64 vector of the summed stats (missing ones zero): STAT_KEYS, slot_correct, slot_supervised."""
    zero = like.new_zeros((), dtype=torch.float64)
    scalars = [totals[k].to(torch.float64) if k in totals else zero for k in STAT_KEYS]
    slots = [
        totals[k].to(torch.float64) if k in totals else like.new_zeros(block_size, dtype=torch.float64)
        for k in ("slot_correct", "slot_supervised")
    ]
    return torch.cat([torch.stack(scalars), *slots])


def step_metrics(values: list[float], block_size: int, denominator: float, selector: bool) -> dict[str, float]:
    """Metrics from a summed `stat_vector` (as host floats): loss parts, accuracy, per-slot accuracy
    (`slot_acc_k`, k = 1 .. S-1) and the acceptance estimate `est_tau` (objectives/dflash.py)."""
    n = len(STAT_KEYS)
    vals = dict(zip(STAT_KEYS, values[:n], strict=True))
    correct, supervised = values[n : n + block_size], values[n + block_size : n + 2 * block_size]
    sup = max(vals["supervised"], 1.0)
    metrics = {
        "vocab_loss": vals["nll"] / denominator,
        "acc": vals["correct"] / sup,
        "supervised": vals["supervised"],
        "denominator": denominator,
        "est_tau": vals["accepted"] / max(vals["blocks"], 1e-30),
        **{f"slot_acc_{k}": correct[k] / max(supervised[k], 1e-30) for k in range(1, block_size)},
    }
    if selector:
        metrics["selector_coverage"] = vals["covered"] / sup
        metrics["selector_loss"] = vals["selector_ce"] / max(vals["selector_weight"], 1e-30)
    return metrics


def _global_denominator(work: Work, objective: DFlashObjective, device, world: int, group) -> torch.Tensor:
    """The step's loss denominator: every rank adds its samples' shares on the host, then (world > 1) one
    all-reduce over `group`."""
    den = torch.zeros((), dtype=torch.float64)
    for _, plan, blocks in work:
        den += sample_denominator(plan, blocks, objective)
    den = torch.full((), float(den), dtype=torch.float64, device=device)  # a fill kernel, not a copy
    if world > 1:
        dist.all_reduce(den, group=group)
    return den


def drafter_step(
    model: DFlashDraftModel,
    samples: Sequence[DrafterSample],
    *,
    objective: DFlashObjective,
    mode: str,
    head_weight: torch.Tensor,
    embed_weight: torch.Tensor,
    step: int = 0,
    group: dist.ProcessGroup | None = None,
    options: AttentionOptions = _DEFAULTS,
    bucket: int = 1,
    sync_grads: bool = True,
    prepared: Work | PreparedStep | None = None,
) -> StepResult:
    """Forward + backward of one step; gradients land in model parameters (summed over the group).
    `options`: how the attention executors run (parallel/options.py; every choice gives the same result).
    `prepared`: this step's `prepare_step(...)` result, or a PreparedStep (prefetch.py: its attention
    masks built and its indices staged on the device ahead too), if computed ahead of time. Indices not
    staged ahead are copied here, once each (`stage_indices`)."""
    check_mode(mode, DRAFTER_MODES)
    if not samples:
        raise ValueError("samples: a step needs at least one sequence")
    world, _ = _world(mode, group)
    S, device = model.block_size, model.fc.weight.device
    selector = getattr(model, "candidate_selector", None)
    if isinstance(prepared, PreparedStep):
        prepared.check_for(options, group)
        prepared.wait()
    else:  # nothing built ahead: each item's executors are built, its indices copied, when it runs
        work = prepared if prepared is not None else prepare_step(
            model.config, samples, objective=objective, mode=mode, step=step, group=group, bucket=bucket
        )
        prepared = PreparedStep(work, options, [], group=group)
    work = prepared.work
    den = _global_denominator(work, objective, device, world, group)

    totals: dict[str, torch.Tensor] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for j, (sample, plan, blocks) in enumerate(work):
        out = sample_terms(
            model, sample, plan, blocks, objective=objective, head_weight=head_weight, embed_weight=embed_weight,
            step=step, staged=prepared.indices[j] if prepared.indices else None,
            attention=prepared.attention[j] if prepared.attention else plan_attention(plan, group=group, options=options),
            features=prepared.features[j] if prepared.features else None,
        )  # fmt: skip
        loss = out.numerator / den.to(out.numerator.dtype)
        loss.backward()
        loss_sum += loss.detach().to(torch.float64)
        for k, v in out.stats.items():
            totals[k] = totals[k] + v if k in totals else v

    vec = torch.cat([loss_sum[None], stat_vector(totals, S, loss_sum)])
    if world > 1:
        if sync_grads:
            sync_gradients([p for p in model.parameters() if p.requires_grad], group)
        dist.all_reduce(vec, group=group)
    loss_value, *values, denominator = torch.cat([vec, den[None]]).tolist()  # the step's one host sync
    metrics = {"loss": loss_value, **step_metrics(values, S, denominator, selector is not None)}
    return StepResult(loss_value, metrics, [p for _, p, _ in work])
