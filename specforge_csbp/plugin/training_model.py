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

Plans and masks are built ahead by one worker thread (a side CUDA stream on GPU; models/dflash/prefetch.py)
kept across micro-steps: sample j + 1 while sample j runs, and the next micro-step's samples (as one build)
while this micro-step runs, when plugin/lookahead.py announces the next batch and its global step:

    micro-step i:    [sample 0][sample 1] ... [last] | backward, optimizer   | micro-step i + 1: [0][1] ... [last]
    worker:           build i+1's samples 0..k-1 -----------------------------^ used if (samples, step) match
                      (k: every sample while their tokens fit AHEAD_TOKENS, at least one; the rest are built
                      one ahead of the sample that runs, as sample j + 1 while sample j runs)

A batch of short samples is thus built whole while the previous one trains, instead of one sample at a
time between its samples' forwards; a long sample (k = 1) is built as it always was. The look-ahead holds
at most max(AHEAD_TOKENS, one sample) tokens of features and masks beyond the micro-step that runs.

What runs is never taken on trust: the first k samples' (store indices, global step) must equal what was
built, else that build is waited for, dropped, and the first sample is built on the forward's own thread
(as is every first sample nobody announced: no wrapper installed, the first batch of an epoch).

Every sample runs the shared per-sample step (models/dflash/step.py: `plan_sample`, `sample_terms`), the
one `drafter_step` and the benchmarks run. Eval forwards (SpecForge's Evaluator; `self.training` False)
read the eval store (`eval_store_path`, data.eval_hidden_states_path), build each sample on their own thread
and leave the worker, its jobs and the look-ahead's build untouched, so an eval pass between two micro-steps
changes nothing the next micro-step uses. The jobs' numbering and when a micro-step's
prepared masks may be freed are plugin/prefetch_jobs.py's (`PrefetchJobs`, which enforces the lifetime rules).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..data.store import FeatureStore
from ..models.dflash.features import DrafterSample
from ..models.dflash.prefetch import FeatureLoad, PreparedStep, StepPrefetcher, build_work
from ..models.dflash.step import STAT_KEYS, plan_sample, sample_terms
from ..parallel.options import AttentionOptions
from . import groups as csbp_groups
from . import lookahead
from .prefetch_jobs import AHEAD_TOKENS, PrefetchJobs

__all__ = ["AHEAD_TOKENS", "EVAL_ANCHOR_STEP", "CSBPDrafterTrainingModel", "unreached_parameters"]
#: eval forwards draw their anchors as at this step, whatever the global step: every eval pass scores the
#: same blocks, so successive evals compare (the loss weights still follow the global step)
EVAL_ANCHOR_STEP = 0


def unreached_parameters(root: torch.Tensor, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters of `params` that `root`'s autograd graph does not reach (they would get no gradient
    from its backward). A walk over the graph's nodes on the host: no device work, no sync."""
    reached: set[int] = set()
    seen: set[object] = set()
    todo = [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad: the leaf it writes the gradient of
        if leaf is not None:
            reached.add(id(leaf))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return [p for p in params if id(p) not in reached]


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
        attention: AttentionOptions | None = None,
        bucket: int = 1,
        prefetch_features: bool = True,
        eval_store_path: str | None = None,
        store_verify: str = "lazy",
    ) -> None:
        super().__init__()
        self.draft_model = draft_model
        # frozen target pieces; SpecForge's backend keeps `embed_tokens` / `lm_head` replicated and frozen
        self.embed_tokens = embed_tokens.requires_grad_(False)
        self.lm_head = lm_head.requires_grad_(False)
        self.store_path, self.objective, self.mode, self.max_len = store_path, objective, mode, int(max_len)
        # how the executors run (parallel/options.py; from the csbp section: plugin/options.attention_options)
        self.attention = AttentionOptions() if attention is None else attention
        self.bucket = int(bucket)
        # the prefetch worker also reads a sample's features from the store and copies them (side stream)
        self.prefetch_features = bool(prefetch_features)
        self._store, self.store_verify = None, store_verify
        self.eval_store_path, self._eval_store = eval_store_path or None, None
        self.tokens_trained = 0  # tokens of the samples this rank's CP group trained (host count)
        self._prefetch: StepPrefetcher | None = None  # one worker across micro-steps
        self._jobs = PrefetchJobs()  # its numbered jobs and the lifetime of what they built

    # -- data -----------------------------------------------------------------------------------------
    @property
    def store(self):
        if self._store is None:
            self._store = FeatureStore(self.store_path, verify=self.store_verify)
        return self._store

    @property
    def eval_store(self):
        """The store eval forwards read (data.eval_hidden_states_path; the training store when unset)."""
        if self.eval_store_path is None:
            return self.store
        if self._eval_store is None:
            self._eval_store = FeatureStore(self.eval_store_path, verify="trust")
        return self._eval_store

    def _gather_indices(
        self,
        sample_index: torch.Tensor | list[int],
        groups: csbp_groups.CSBPGroups,
        next_index: torch.Tensor | list[int] | None = None,
    ) -> tuple[list[int], list[int] | None]:
        """(the CP group's sample indices, the group's next micro-step's indices or None when any rank does
        not know its next batch) - one all-gather of [this batch; next batch or -1] per rank."""
        local = torch.as_tensor(sample_index, dtype=torch.long, device="cpu").reshape(-1)
        ahead = None if next_index is None else torch.as_tensor(next_index, dtype=torch.long, device="cpu").reshape(-1)
        if ahead is None or ahead.shape != local.shape:
            ahead = torch.full_like(local, -1)
        send = torch.stack([local, ahead])
        if groups.cp_group is None:
            gathered = [send]
        else:
            # the gloo twin keeps this host metadata on the host (over NCCL: a copy to the GPU and back, i.e. a
            # host-GPU sync at every micro-step); groups made without one fall back to the CP group itself
            group = groups.cp_host_group if groups.cp_host_group is not None else groups.cp_group
            if dist.get_backend(group) == "nccl":
                send = send.to(torch.device("cuda", torch.cuda.current_device()))
            gathered = [torch.empty_like(send) for _ in range(groups.cp_size)]
            dist.all_gather(gathered, send, group=group)
        both = torch.cat([g.cpu() for g in gathered], dim=1)
        following = both[1].tolist()
        return both[0].tolist(), None if min(following) < 0 else following

    # -- one sample -------------------------------------------------------------------------------------
    def _prepare(self, index: int, step: int, groups: csbp_groups.CSBPGroups, *, store=None) -> list:
        """Sample `index`'s device-free part (tokens, anchors, this rank's plan, block targets: the shared
        `plan_sample`) as the one-item work list StepPrefetcher builds attention for (in its worker thread,
        or `_build_here`). `store`: the eval store for eval forwards (default: the training store)."""
        store = self.store if store is None else store
        entry = store.manifest.samples[index]
        input_ids, loss_mask = store.read_tokens(entry.id)
        length = min(entry.length, self.max_len)
        # only this rank's rows, one read per interval (never concatenated: the widest tensor of the step)
        sample = DrafterSample(input_ids[:length], loss_mask[:length], store.rows(entry.id))
        plan, blocks = plan_sample(
            self.draft_model.config, sample, objective=self.objective, mode=self.mode, world=groups.cp_size,
            rank=groups.cp_rank, step=step, sample_index=index, bucket=self.bucket,
            vocab_size=int(self.lm_head.weight.shape[0]),
        )  # fmt: skip
        return [(sample, plan, blocks)]

    def _sample(self, prepared, step: int, item: int = 0):
        """Work item `item` of a prepared build through the shared per-sample step
        (`models/dflash/step.sample_terms`)."""
        prepared.wait()  # masks and staged indices (prefetch.py build_work): the step copies no index
        (sample, plan, blocks) = prepared.work[item]
        return sample_terms(
            self.draft_model, sample, plan, blocks, objective=self.objective, head_weight=self.lm_head.weight,
            embed_weight=self.embed_tokens.weight, step=step, attention=prepared.attention[item],
            staged=prepared.indices[item], features=prepared.features[item] if prepared.features else None,
        )  # fmt: skip

    # -- one micro-step ---------------------------------------------------------------------------------
    def _prefetcher_for(self, groups, heads_per_kv: int):
        """The one worker (and side stream) of this module, kept across micro-steps."""
        if self._prefetch is not None and self._prefetch.group is not groups.cp_group:
            self.close()  # waits for a running build before its masks' memory could be reused
        if self._prefetch is None:
            draft = self.draft_model
            features = FeatureLoad(draft.fc.weight.dtype, draft.fc.in_features) if self.prefetch_features else None
            self._prefetch = StepPrefetcher(
                self._prepare_job, self.attention, device=self.lm_head.weight.device, groups=heads_per_kv,
                group=groups.cp_group, features=features,
            )  # fmt: skip
        return self._prefetch

    def _prepare_job(self, job: int) -> list:
        """Prefetch job `job`'s work list (worker thread); a job never registered builds nothing."""
        registered = self._jobs.job(job)
        if registered is None:
            return []
        indices, step, groups = registered
        return [item for index in indices for item in self._prepare(index, step, groups)]

    def _ahead(self, indices: list[int]) -> tuple[int, ...]:
        """The next micro-step's samples its look-ahead builds: the first, then more while their tokens
        (manifest lengths capped at max_len) stay within AHEAD_TOKENS."""
        out, tokens = [], 0
        for index in indices:
            tokens += self._tokens(self.store, [index])
            if out and tokens > AHEAD_TOKENS:
                break
            out.append(index)
        return tuple(out)

    def _build_here(self, key: tuple, heads_per_kv: int, *, store=None) -> PreparedStep:
        """Samples `key` = (store indices, step, groups) built on this thread and the current stream."""
        indices, step, groups = key
        work = [item for index in indices for item in self._prepare(index, step, groups, store=store)]
        attention, indices, _ = build_work(
            work, self.attention, self.lm_head.weight.device, heads_per_kv, group=groups.cp_group
        )
        return PreparedStep(work, self.attention, attention, indices=indices, group=groups.cp_group)

    def forward(self, sample_index: torch.Tensor | list[int], global_step: int = 0):
        """One micro-step: the CP group's samples, built ahead by the worker where they could be
        (plugin/prefetch_jobs.py: the look-ahead built the first ones, up to AHEAD_TOKENS, during the previous
        micro-step when plugin/lookahead.py announced them; later ones are built while the one before runs)."""
        if not self.training:
            return self._eval_forward(sample_index, int(global_step))
        groups, step = csbp_groups.current(), int(global_step)
        source = lookahead.current()
        announced = source.next_batch(step) if source is not None else None
        indices, next_indices = self._gather_indices(
            sample_index, groups, None if announced is None else announced[0]
        )
        _ = self.store  # opened here, not first in the worker thread
        self.tokens_trained += self._tokens(self.store, indices)
        heads_per_kv = self._heads_per_kv()
        prefetcher = self._prefetcher_for(groups, heads_per_kv)
        look_ahead = None if next_indices is None else (self._ahead(next_indices), announced[1], groups)
        built = self._jobs.micro_step(
            prefetcher, indices, (step, groups), look_ahead, lambda key: self._build_here(key, heads_per_kv)
        )
        return self._sum([self._sample(prepared, step, item) for prepared, item in built])

    def _eval_forward(self, sample_index: torch.Tensor, step: int):
        """One eval micro-step over the eval store: the same per-sample step, built on this thread; the
        prefetch worker, its jobs and the look-ahead's build are left as they are (eval changes no training
        state), and anchors are drawn as at `EVAL_ANCHOR_STEP` (every eval pass scores the same blocks)."""
        groups = csbp_groups.current()
        indices, _ = self._gather_indices(sample_index, groups)
        heads_per_kv = self._heads_per_kv()
        built = (
            self._build_here(((index,), EVAL_ANCHOR_STEP, groups), heads_per_kv, store=self.eval_store)
            for index in indices
        )
        return self._sum([self._sample(prepared, step) for prepared in built])

    def _heads_per_kv(self) -> int:
        config = self.draft_model.config
        return config.num_attention_heads // config.num_key_value_heads

    def _tokens(self, store, indices: list[int]) -> int:
        """Tokens of the group's samples (host manifest lengths, capped at max_len: no device sync)."""
        return sum(min(store.manifest.samples[i].length, self.max_len) for i in indices)

    def _sum(self, outs: list) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(sum of numerators, sum of denominator shares, summed stats) of a micro-step's samples."""
        numerator, denominator = None, 0.0
        totals: dict = dict.fromkeys(STAT_KEYS, 0.0)
        for out in outs:
            numerator = out.numerator if numerator is None else numerator + out.numerator
            denominator += out.denominator
            for k, v in out.stats.items():
                totals[k] = totals.get(k, 0.0) + v
        # every trainable parameter takes part in the graph (DDP expects each one to get a gradient); a zero
        # term ties in only those the step left out, since each tied one gets a gradient-sized zero tensor
        # added to its real gradient in backward (two passes over every gradient of the drafter)
        params = [p for p in self.draft_model.parameters() if p.requires_grad]
        missing = unreached_parameters(numerator, params) if torch.is_grad_enabled() else []  # eval: no backward
        if missing:
            numerator = numerator + torch.stack([p.reshape(-1)[0].to(numerator.dtype) for p in missing]).sum() * 0.0
        # a fill kernel: a host-to-device copy of the scalar would wait for the stream (pageable memory)
        return numerator, numerator.new_full((), float(denominator)).detach(), totals

    @property
    def prefetch_stats(self) -> dict[str, int]:
        """Micro-steps whose first sample the look-ahead built (`ahead_used`), and look-ahead builds for
        another sample, waited for and dropped (`ahead_discarded`)."""
        return {"ahead_used": self._jobs.ahead_used, "ahead_discarded": self._jobs.ahead_discarded}

    def close(self) -> None:
        """Stop the prefetch worker (waits for a running build); the next forward starts a new one."""
        if self._prefetch is not None:
            self._prefetch.close()
        self._prefetch = None
        self._jobs.reset()
