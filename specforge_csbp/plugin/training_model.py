"""The module SpecForge wraps (DDP) and steps: the drafter plus the target's frozen embedding and LM head.

One `forward` is one micro-step of one rank. The CP group's ranks each bring `batch_size` sample indices
(SpecForge's sampler gave every rank its own); the group gathers them and trains every gathered sample
together, each one context-sharded over the group:

    cp group {r0, r1}      r0 brought sample 12, r1 brought sample 40
    both ranks:            sample 12 -> plan(P=2)[cp_rank]: zigzag context rows + owned anchor blocks
                           sample 40 -> plan(P=2)[cp_rank]: ...
    returns                (sum of this rank's loss numerators, this rank's share of the denominator)

So a step trains on exactly the samples SpecForge's data-parallel sampler hands out (world x batch_size), and
the losses equal a data-parallel run of the same config: CSBP changes who computes what, never what is
trained. SpecForge's TrainerCore sums numerators (DDP), all-reduces the denominators over the world and
divides - the global denominator of the design, with no change to SpecForge.

Anchors come from (training.seed, global step, store index of the sample) - the same on every rank and in
every layout. A sample with fewer valid anchors than the CP size runs in mode `cp` (every rank computes
its blocks, each counted 1/P), which is exact too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import groups as csbp_groups

__all__ = ["BACKENDS", "CSBPDrafterTrainingModel", "SampleStats"]

#: training.attention_backend -> the attention seam's backend
BACKENDS = {"flex_attention": "flex", "sdpa": "auto", "eager": "dense"}
_STAT_KEYS = ("nll", "weight", "correct", "supervised", "covered", "selector_ce", "selector_weight")


@dataclass
class SampleStats:
    numerator: torch.Tensor
    denominator: float
    stats: dict[str, float]


class CSBPDrafterTrainingModel(nn.Module):
    def __init__(
        self,
        draft_model: nn.Module,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
        *,
        store_path: str,
        objective,
        mode: str,
        max_len: int,
        attention_backend: str = "sdpa",
        bucket: int = 1,
        schedule: str | None = None,
        regather: bool = False,
    ) -> None:
        super().__init__()
        self.draft_model = draft_model
        # frozen target pieces; SpecForge's backend keeps `embed_tokens` / `lm_head` replicated and frozen
        self.embed_tokens = embed_tokens.requires_grad_(False)
        self.lm_head = lm_head.requires_grad_(False)
        self.store_path, self.objective, self.mode, self.max_len = store_path, objective, mode, int(max_len)
        self.backend = BACKENDS.get(attention_backend, "auto")
        self.bucket = int(bucket)
        self.schedule, self.regather = schedule, bool(regather)  # ShardedAttention's (None: fused)
        self._store = None
        self._inflight: list = []  # this micro-step's prepared masks (kept until the next one starts)
        self.last_stats: dict[str, float] = {}

    # -- data -----------------------------------------------------------------------------------------
    @property
    def store(self):
        if self._store is None:
            from ..data.store import FeatureStore

            self._store = FeatureStore(self.store_path, verify="trust")
        return self._store

    def _gather_indices(self, sample_index: torch.Tensor, groups: csbp_groups.CSBPGroups) -> list[int]:
        local = sample_index.reshape(-1).to("cpu", torch.long)
        if groups.cp_group is None:
            return local.tolist()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(groups.cp_group) == "nccl"
            else None
        )
        send = local.to(device) if device is not None else local
        out = [torch.empty_like(send) for _ in range(groups.cp_size)]
        dist.all_gather(out, send, group=groups.cp_group)
        return torch.cat(out).cpu().tolist()

    # -- one sample -------------------------------------------------------------------------------------
    def _prepare(self, index: int, step: int, groups: csbp_groups.CSBPGroups) -> list:
        """Sample `index`'s device-free part (tokens, anchors, this rank's plan, block targets) as the
        one-item work list StepPrefetcher builds attention for (runs in its worker thread)."""
        from ..models.dflash.sharding import drafter_plans
        from ..models.dflash.step import DrafterSample
        from ..objectives.dflash import block_targets, sample_anchors

        draft, config = self.draft_model, self.draft_model.config
        entry = self.store.manifest.samples[index]
        input_ids, loss_mask = self.store.read_tokens(entry.id)
        length = min(entry.length, self.max_len)
        input_ids, loss_mask = input_ids[:length], loss_mask[:length]
        S = int(draft.block_size)
        anchors = sample_anchors(loss_mask, self.objective, block_size=S, step=step, sample_index=index)
        P = groups.cp_size
        mode = "dp" if P == 1 else (self.mode if anchors.numel() >= P else "cp")
        plan = drafter_plans(mode, length, anchors, config, P, bucket=self.bucket)[groups.cp_rank]
        # only this rank's rows, one piece per interval (never concatenated: the widest tensor of the step)
        sample = DrafterSample(
            input_ids, loss_mask, lambda lo, hi: self.store.read_intervals(entry.id, [(lo, hi)])
        )
        blocks = block_targets(input_ids, loss_mask, plan.owned_anchors, S, int(draft.mask_token_id))
        return [(sample, plan, blocks)]

    def _sample(self, prepared, step: int) -> SampleStats:
        from ..models.dflash.step import load_context
        from ..objectives.dflash import loss_terms

        prepared.wait()
        (sample, plan, blocks), attention = prepared.work[0], prepared.attention[0]
        draft = self.draft_model
        S = int(draft.block_size)
        device, dtype = self.lm_head.weight.device, draft.fc.weight.dtype
        features = load_context(sample, plan.ctx_intervals, device, dtype, draft.fc.in_features)
        owned = plan.owned_anchors
        noise = self.embed_tokens(blocks.draft_ids.reshape(-1).to(device)).to(dtype)[None]
        positions = (owned[:, None] + torch.arange(S)).reshape(-1)
        hidden = draft(noise, positions, features, plan.ctx_positions, attention)
        selector = getattr(draft, "candidate_selector", None)
        terms = loss_terms(
            hidden[0], self.lm_head.weight, blocks, self.objective, selector=selector, step=step
        )
        if self.objective.loss_type == "dflash":
            denominator = terms.denominator_part * plan.loss_scale
        else:  # D-PACE normalises per sequence; each rank holds its share of one sequence
            denominator = plan.sequence_share
        stats = {k: float(v) * plan.loss_scale for k, v in terms.stats.items()}
        return SampleStats(terms.numerator * plan.loss_scale, denominator, stats)

    # -- one micro-step ---------------------------------------------------------------------------------
    def forward(self, sample_index: torch.Tensor, global_step: int = 0):
        from ..models.dflash.prefetch import AttentionOptions, StepPrefetcher

        groups = csbp_groups.current()
        indices = [int(i) for i in self._gather_indices(sample_index, groups)]
        step = int(global_step)
        _ = self.store  # opened here, not first in the worker thread
        # The previous micro-step's masks: its backward has been launched by now, and no build is running,
        # so they may go (prefetch.py, "Lifetime"). This micro-step's stay until the next one starts.
        self._inflight = []
        config = self.draft_model.config
        options = AttentionOptions(
            group=groups.cp_group, backend=self.backend, regather=self.regather, schedule=self.schedule
        )
        numerator, denominator = None, 0.0
        totals = dict.fromkeys(_STAT_KEYS, 0.0)
        # sample j + 1's plan and masks are built in a worker (side stream on GPU) while sample j runs
        with StepPrefetcher(
            lambda j: self._prepare(indices[j], step, groups) if j < len(indices) else [],
            options,
            device=self.lm_head.weight.device,
            groups=config.num_attention_heads // config.num_key_value_heads,
        ) as prefetcher:
            for j in range(len(indices)):
                prepared = prefetcher.take(j)
                self._inflight.append(prepared)
                out = self._sample(prepared, step)
                numerator = out.numerator if numerator is None else numerator + out.numerator
                denominator += out.denominator
                for k, v in out.stats.items():
                    totals[k] = totals.get(k, 0.0) + v
        # every trainable parameter takes part in the graph (DDP expects each one to get a gradient)
        params = [p for p in self.draft_model.parameters() if p.requires_grad]
        tie = torch.stack([p.reshape(-1)[0].to(numerator.dtype) for p in params]).sum() * 0.0
        numerator = numerator + tie
        self.last_stats = totals
        return numerator, numerator.new_tensor(denominator).detach(), totals
