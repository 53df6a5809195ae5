"""The DFlash / DFlash2 training objective: anchors, block targets, weights, vocabulary and selector loss.

    sequence      t0 t1 t2 t3 t4 t5 t6 t7 t8        loss_mask 0 0 1 1 1 1 1 1 0
    valid anchor  p with loss_mask[p] and loss_mask[p+1]          -> p in {2..6}
    block at a=3  slots  [t3, MASK, MASK, MASK]  (S = 4)
                  targets  -   t4    t5    t6    slot k predicts t[a+k]; slot 0 is never supervised
                  weight   0   w1    w2    w3    w_k = exp(-(k-1)/gamma) * loss_mask[a+k] (or D-PACE)

Anchors are drawn once per (seed, step, sample) - identically on every rank and before anyone decides which
rank owns which anchor, so the partition never changes what is sampled. `uniform` draws distinct valid
anchors uniformly; `locality` takes a uniformly rotated, strided run of the valid positions (every slot is
still uniform, but anchors cluster, so sliding-window context is shared by many blocks).

Fewer valid anchors than requested: `shortfall="use_all"` (default, SpecForge's behaviour) trains on all
valid anchors; `shortfall="error"` raises. A sample with no valid anchor is always an error.

Loss of one step (every rank computes numerators for the anchors it owns; denominators are global):

    vocab    = sum_rows w * CE(h W_head^T, y)              (linear_ce_topk: no [rows, vocab] logits)
    selector = sum_rows w * [y in top-k] * CE(selector scores over the top-k, index of y)    (DFlash2)
    loss     = (vocab + alpha(step) * selector) / D

with D = sum of all weights of the global batch ("dflash") or the number of sequences (D-PACE, as in
SpecForge). alpha(step) ramps linearly from alpha/warmup to alpha over `selector_warmup_steps` steps.

The loss reads its integer inputs through a `LossIndex` (supervised rows, their targets and predecessors):
found on the host (`loss_index`, no device sync) and, in a prepared step, copied to the device ahead of it
(models/dflash/prefetch.py), so the loss itself moves no index to the device.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..devices import stage_index
from .linear_ce_topk import linear_ce_topk

__all__ = [
    "LOSS_TYPES",
    "SAMPLINGS",
    "SHORTFALLS",
    "BlockTargets",
    "DFlashObjective",
    "LossIndex",
    "LossTerms",
    "acceptance_stats",
    "block_targets",
    "dpace_weights",
    "loss_index",
    "loss_terms",
    "position_weights",
    "sample_anchors",
    "valid_anchor_positions",
]

LOSS_TYPES = ("dflash", "dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only")
SAMPLINGS = ("uniform", "locality")
SHORTFALLS = ("use_all", "error")


@dataclass(frozen=True)
class DFlashObjective:
    num_anchors: int = 512
    sampling: str = "uniform"
    locality_stride: int | None = None  # default: block_size (blocks of a run do not overlap)
    shortfall: str = "use_all"
    loss_type: str = "dflash"
    gamma: float | None = 7.0  # exp(-(k-1)/gamma) decay; None = no decay
    dpace_alpha: float = 0.5
    selector_alpha: float = 1.0
    selector_warmup_steps: int = 0
    selector_stop_gradient: bool = False
    chunk_size: int = 2048  # rows per vocabulary chunk
    keep_logits_gib: float = 0.0  # keep the chunks' logits for backward up to this size (linear_ce_topk.py)
    seed: int = 0

    def __post_init__(self) -> None:
        choices = {"sampling": SAMPLINGS, "shortfall": SHORTFALLS, "loss_type": LOSS_TYPES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1; got {self.num_anchors}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"gamma must be > 0 or None; got {self.gamma}")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in [0, 1]; got {self.dpace_alpha}")
        if self.selector_alpha < 0 or self.selector_warmup_steps < 0:
            raise ValueError(
                f"selector_alpha and selector_warmup_steps must be >= 0; got "
                f"{self.selector_alpha}, {self.selector_warmup_steps}"
            )
        if not self.keep_logits_gib >= 0:
            raise ValueError(f"keep_logits_gib must be >= 0; got {self.keep_logits_gib}")
        if self.chunk_size < 1 or (self.locality_stride is not None and self.locality_stride < 1):
            raise ValueError(
                f"chunk_size and locality_stride must be >= 1; got {self.chunk_size}, {self.locality_stride}"
            )

    def selector_weight(self, step: int) -> float:
        if self.selector_warmup_steps == 0:
            return self.selector_alpha
        return self.selector_alpha * min(1.0, (step + 1) / self.selector_warmup_steps)


# -- anchors --------------------------------------------------------------------------------------------
def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p < L-1 whose token and next token are both supervised (sorted)."""
    m = loss_mask.reshape(-1).cpu() > 0.5
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def _generator(seed: int, step: int, sample_index: int) -> torch.Generator:
    digest = hashlib.sha256(f"dflash-anchors:{seed}:{step}:{sample_index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def sample_anchors(
    loss_mask: torch.Tensor,
    objective: DFlashObjective,
    *,
    block_size: int,
    step: int = 0,
    sample_index: int = 0,
) -> torch.Tensor:
    """Sorted anchor positions of one sample (CPU int64), a function of (seed, step, sample_index) only."""
    valid = valid_anchor_positions(loss_mask)
    n = valid.numel()
    if n == 0:
        raise ValueError(
            f"loss_mask: sample {sample_index} has no valid anchor (needs two consecutive supervised tokens)"
        )
    want = objective.num_anchors
    if n < want and objective.shortfall == "error":
        raise ValueError(
            f"num_anchors: requested {want} but sample {sample_index} has only {n} valid anchor positions "
            f"(p with loss_mask[p] and loss_mask[p+1]); lower num_anchors or use shortfall='use_all'"
        )
    count = min(want, n)
    g = _generator(objective.seed, step, sample_index)
    if objective.sampling == "uniform":
        picked = torch.randperm(n, generator=g)[:count]
    else:
        stride = objective.locality_stride or block_size
        while math.gcd(stride, n) != 1:  # coprime stride: one rotation of a permutation, no repeats
            stride += 1
        start = int(torch.randint(n, (1,), generator=g))
        picked = (start + torch.arange(count) * stride) % n
    return valid[picked].sort().values


# -- per-block targets and weights --------------------------------------------------------------------
@dataclass(frozen=True)
class BlockTargets:
    """Per anchor block (rows = anchors, columns = slots)."""

    anchors: torch.Tensor  # [N] positions
    draft_ids: torch.Tensor  # [N, S] anchor token then mask tokens
    targets: torch.Tensor  # [N, S] token at anchor + k (clamped; meaningful where supervised)
    supervised: torch.Tensor  # [N, S] bool
    predecessors: torch.Tensor  # [N, S] token at anchor + k - 1 (the selector's previous token)
    vocab_checked: int | None = None  # every token id was checked (on the host) to lie in [0, this)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    vocab_size: int | None = None,
) -> BlockTargets:
    ids, mask = input_ids.reshape(-1), loss_mask.reshape(-1)
    if vocab_size is not None and ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
        # checked here, on the host tokens, so the loss need not check its targets on the device (a sync)
        raise ValueError(
            f"input_ids: token ids must be in [0, vocab_size) = [0, {vocab_size}); got {int(ids.min())}..{int(ids.max())}"
        )
    L, dev = ids.numel(), ids.device
    a = anchors.to(dev)
    pos = a[:, None] + torch.arange(block_size, device=dev)
    safe = pos.clamp(max=L - 1)
    supervised = (pos < L) & (mask[safe] > 0.5)
    supervised[:, 0] = False
    draft = torch.full_like(safe, mask_token_id)
    draft[:, 0] = ids[a]
    return BlockTargets(a, draft, ids[safe], supervised, ids[(pos - 1).clamp(0, L - 1)], vocab_size)


@dataclass(frozen=True)
class LossIndex:
    """The integer inputs of `loss_terms` for one block set, all on one device.

        supervised [N, S]  0 1 1 0 | 0 1 0 0      rows = flat (block * S + slot) indices of the 1s: 1 2 5
        targets / predecessors [N * S]    ->      their values at those rows
    """

    rows: torch.Tensor  # [M] supervised rows, block-major
    targets: torch.Tensor  # [M] token each row predicts
    predecessors: torch.Tensor  # [M] the token before it (the selector's previous token)
    supervised: torch.Tensor  # [N, S] bool (D-PACE weights run over whole blocks)

    def to(self, device: torch.device | str) -> LossIndex:
        """A copy on `device` (`devices.stage_index`: pinned, non_blocking from the host to a GPU)."""
        parts = (self.rows, self.targets, self.predecessors, self.supervised)
        return LossIndex(*(stage_index(t, device) for t in parts))


def loss_index(blocks: BlockTargets) -> LossIndex:
    """`LossIndex` of `blocks`, on their device (the host for `block_targets` of host tokens: no sync)."""
    rows = torch.nonzero(blocks.supervised.reshape(-1)).flatten()
    targets, predecessors = (
        t.reshape(-1).index_select(0, rows) for t in (blocks.targets, blocks.predecessors)
    )
    return LossIndex(rows, targets, predecessors, blocks.supervised)


def position_weights(
    block_size: int, gamma: float | None, *, dtype=torch.float32, device=None
) -> torch.Tensor:
    """[S]: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1 (1 without decay)."""
    k = torch.arange(block_size, dtype=dtype, device=device)
    w = torch.ones_like(k) if gamma is None else torch.exp(-(k - 1).clamp(min=0) / gamma)
    return w * (k > 0)  # slot 0 zeroed on the device (an element assignment would copy from the host)


def dpace_weights(prob: torch.Tensor, supervised: torch.Tensor, alpha: float, kind: str) -> torch.Tensor:
    """D-PACE position weights per block from the (detached) draft probability of each target.

    prefix_k = prod_{j<=k} ((1-alpha) p_j + alpha) over supervised slots; "dpace" = suffix sums of
    prefix * mask, "cumulative-confidence-only" = prefix, "continuation-value-only" = suffix / prefix.
    """
    m = supervised.to(prob.dtype)
    smooth = torch.where(supervised, (1.0 - alpha) * prob + alpha, torch.ones_like(prob))
    prefix = torch.cumprod(smooth, dim=-1)
    if kind == "dpace-cumulative-confidence-only":
        return prefix
    suffix = (prefix * m).flip(-1).cumsum(-1).flip(-1)
    if kind == "dpace":
        return suffix
    return suffix / prefix.clamp_min(torch.finfo(prefix.dtype).tiny)


# -- loss ----------------------------------------------------------------------------------------------
@dataclass
class LossTerms:
    numerator: torch.Tensor  # vocab + alpha * selector (with grad)
    denominator_part: float  # this call's share of the global denominator (not used to divide here)
    # detached sums: 0-d nll, weight, correct, supervised, accepted, blocks, covered, selector_*; [S] slot_*
    stats: dict[str, torch.Tensor]


def denominator_part(blocks: BlockTargets, objective: DFlashObjective, block_size: int) -> float:
    """This block set's contribution to D ("dflash": its weights; D-PACE: one sequence, added by the caller)."""
    if objective.loss_type != "dflash":
        return 0.0
    w = position_weights(block_size, objective.gamma, dtype=torch.float64)
    return float((blocks.supervised.cpu().to(torch.float64) * w).sum())


def acceptance_stats(
    hit: torch.Tensor, index: LossIndex, n: int, s: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Per-slot correctness and the training-time acceptance estimate of `n` blocks of `s` slots.

        slot             0   1   2   3   4        hit: draft argmax == target (supervised slots only)
        block b         [a]  ok  ok  no  ok       leading run of correct slots 1.. = 2 -> accepted 1 + 2 = 3
        block c         [a]  no  ok  ok  -        run 0 -> accepted 1 (an unsupervised slot ends a run too)

    `accepted` sums 1 + leading run over the blocks (what a verifier whose greedy tokens are the labels would
    accept, bonus token included), `blocks` counts them: est_tau = accepted / blocks. `slot_correct[k]` /
    `slot_supervised[k]` is slot k's accuracy (slot 0 is never supervised: 0 / 0). All sums, so ranks' shares
    add up to the single-process value exactly."""
    device = hit.device
    grid = torch.zeros(n * s, dtype=dtype, device=device).index_copy_(0, index.rows, hit.to(dtype)).view(n, s)
    return {
        "accepted": grid[:, 1:].cumprod(dim=1).sum() + n,
        "blocks": torch.full((), float(n), dtype=dtype, device=device),  # a fill, not a copy
        "slot_correct": grid.sum(dim=0),
        "slot_supervised": index.supervised.to(dtype).sum(dim=0),
    }


def loss_terms(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    blocks: BlockTargets,
    objective: DFlashObjective,
    *,
    selector=None,
    step: int = 0,
    index: LossIndex | None = None,
) -> LossTerms:
    """Numerators for the blocks whose hidden states [N*S, H] (block-major) this rank computed.
    `index`: `loss_index(blocks)` already on hidden's device (staged ahead); None copies it here."""
    n, s = blocks.supervised.shape
    hidden = hidden.reshape(n * s, -1)
    # targets checked on the host for this vocabulary (block_targets(vocab_size=...)) need no device check
    checked = blocks.vocab_checked == head_weight.shape[0]
    if index is None:
        index = loss_index(blocks).to(hidden.device)
    rows = index.rows
    h = hidden.index_select(0, rows)
    y = index.targets
    alpha = objective.selector_weight(step) if selector is not None else 0.0
    top_k = selector.top_k if alpha > 0 else 1
    nll, top_v, top_i = linear_ce_topk(
        h, head_weight, y, top_k=top_k, chunk_size=objective.chunk_size,
        keep_logits_bytes=int(objective.keep_logits_gib * 2**30), check_targets=not checked,
    )  # fmt: skip
    decay = position_weights(s, objective.gamma, dtype=nll.dtype, device=nll.device)
    if objective.loss_type == "dflash":
        w = decay.repeat(n).index_select(0, rows)
    else:
        with torch.no_grad():
            prob = torch.zeros(n * s, dtype=nll.dtype, device=nll.device)
            prob.index_copy_(0, rows, torch.exp(-nll.detach()))
            sup = index.supervised
            full = dpace_weights(prob.view(n, s), sup, objective.dpace_alpha, objective.loss_type) * sup
            w = full.reshape(-1).index_select(0, rows)
    vocab = (nll * w).sum()
    # zero-weight tie to the whole graph: backward (and its collectives) runs even with no supervised row
    numerator = vocab + hidden.sum().to(vocab.dtype) * 0.0
    acc = nll.dtype
    hit = top_i[:, 0] == y
    stats = {  # tensors, so nothing waits for the device before the step's single metrics reduction
        "nll": (nll.detach() * w).sum(),
        "weight": w.sum(),
        "correct": hit.sum().to(acc),
        "supervised": torch.full((), float(y.numel()), dtype=acc, device=nll.device),  # a fill, not a copy
        **acceptance_stats(hit, index, n, s, acc),
    }
    if alpha > 0:
        match = top_i == y[:, None]
        covered = match.any(dim=1)
        pred = index.predecessors
        h_sel, u_sel = (h.detach(), top_v.detach()) if objective.selector_stop_gradient else (h, top_v)
        scores = selector(h_sel, top_i, u_sel, pred)
        ce = F.cross_entropy(scores, match.long().argmax(dim=1), reduction="none")
        sw = w * covered.to(w.dtype)
        selector_num = (ce * sw).sum()
        numerator = numerator + alpha * selector_num
        stats.update(
            covered=covered.sum().to(acc), selector_ce=selector_num.detach(), selector_weight=sw.sum()
        )
    return LossTerms(numerator, denominator_part(blocks, objective, s), stats)
