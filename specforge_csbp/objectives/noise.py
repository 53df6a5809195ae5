"""Noise for BDLM objectives, and the 2L batch every objective produces.

Noise is drawn per sequence from a generator seeded by (seed, step, global sequence index), on the CPU, by
every rank identically and before the sequence is partitioned - so no partition (DP, CP, BP, CSBP, grad
accumulation) can change what is sampled.

Per block b a noise level t_b in [eps, 1]; each eligible token of block b is masked with probability t_b:

    blocks      |   b0    |   b1    |   b2    |   b3    |
    t_b           0.81      0.07      0.55      0.33        stratified: one level per quarter of [eps, 1]
    x0          a b c d   e f g h   i j k l   m n o p
    xt          M M c M   e f g h   i M M l   m n M p      (M = mask token)

`MaskedObjective` is what SFT (sft.py) and AR -> BDLM conversion (convert.py) share: the fields, their
checks, and the validated draw of one batch; each objective only turns the draw into its 2L batch.

`BDLMBatch` holds the whole 2L layout (clean row p, corrupted row L + p) with per-row labels, loss weights
and denominator counts; `shard(plan)` keeps one rank's rows; `loss_numerator` runs the chunked linear CE
over the supervised rows only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .linear_ce import linear_cross_entropy

__all__ = [
    "IGNORE_INDEX",
    "NOISE_SCHEDULES",
    "BDLMBatch",
    "MaskedObjective",
    "NoiseDraw",
    "block_noise_levels",
    "check_noise_args",
    "check_tokens",
    "draw_token_masks",
    "sequence_seed",
]

IGNORE_INDEX = -100
NOISE_SCHEDULES = ("stratified", "antithetic", "uniform")


def sequence_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit seed for sequence `index` of optimizer step `step` (stable across processes and versions)."""
    digest = hashlib.sha256(f"{seed}:{step}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def block_noise_levels(gen: torch.Generator, num_blocks: int, *, eps: float, schedule: str) -> torch.Tensor:
    """Noise levels t [num_blocks] (float64) in [eps, 1].

    stratified: block k gets one level from each of num_blocks equal strata (strata shuffled over blocks);
    antithetic: one uniform u, levels u + k/num_blocks (mod 1), shuffled (MDLM's low-discrepancy sampler);
    uniform:    independent levels.
    """
    if schedule == "uniform":
        u = torch.rand(num_blocks, generator=gen, dtype=torch.float64)
    else:
        perm = torch.randperm(num_blocks, generator=gen).to(torch.float64)
        if schedule == "stratified":
            u = (perm + torch.rand(num_blocks, generator=gen, dtype=torch.float64)) / num_blocks
        elif schedule == "antithetic":
            u = torch.remainder(torch.rand(1, generator=gen, dtype=torch.float64) + perm / num_blocks, 1.0)
        else:
            raise ValueError(f"objective.noise must be one of {', '.join(NOISE_SCHEDULES)}; got {schedule!r}")
    return eps + (1.0 - eps) * u


def draw_token_masks(
    seeds: Sequence[int], length: int, block_size: int, *, eps: float, schedule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence (one generator per seed, so the draw never depends on how work is partitioned):
    token noise levels [N, L] (float64, the block's t) and which tokens the draw masks [N, L] (bool)."""
    levels = torch.empty(len(seeds), length, dtype=torch.float64)
    drawn = torch.empty(len(seeds), length, dtype=torch.bool)
    for i, seed in enumerate(seeds):
        gen = torch.Generator().manual_seed(int(seed))
        t = block_noise_levels(gen, length // block_size, eps=eps, schedule=schedule)
        levels[i] = t.repeat_interleave(block_size)
        drawn[i] = torch.rand(length, generator=gen, dtype=torch.float64) < levels[i]
    return levels, drawn


def check_noise_args(*, block_size: int, mask_token_id: int, vocab_size: int, eps: float, noise: str) -> None:
    if block_size < 1:
        raise ValueError(f"model.block_size must be >= 1, got {block_size}")
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(
            f"objective.mask_token_id must be in [0, {vocab_size}) (the vocab); got {mask_token_id}"
        )
    if not 0.0 < eps < 1.0:
        raise ValueError(f"objective.eps must be in (0, 1); got {eps}")
    if noise not in NOISE_SCHEDULES:
        raise ValueError(f"objective.noise must be one of {', '.join(NOISE_SCHEDULES)}; got {noise!r}")


def check_tokens(
    input_ids: torch.Tensor, loss_mask: torch.Tensor | None, seeds, *, block_size: int, vocab_size: int
) -> torch.Tensor:
    """Validate a clean batch [N, L]; returns the eligibility mask (all True when loss_mask is None)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [sequences, length]; got shape {tuple(input_ids.shape)}")
    n, length = input_ids.shape
    if length % block_size:
        raise ValueError(
            f"data.max_length: sequence length {length} is not a multiple of model.block_size={block_size} "
            f"(pad to a multiple)"
        )
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        raise ValueError(f"input_ids must be token ids in [0, {vocab_size}); got [{int(input_ids.min())}, "
                         f"{int(input_ids.max())}]")  # fmt: skip
    if loss_mask is not None and loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"loss_mask must match input_ids {tuple(input_ids.shape)}; got {tuple(loss_mask.shape)}"
        )
    if len(seeds) != n:
        raise ValueError(f"seeds: need one per sequence ({n}); got {len(seeds)}")
    return torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.to(torch.bool)


class NoiseDraw(NamedTuple):
    """One validated batch and its noise, all on the CPU, each [N, L]."""

    x0: torch.Tensor  # clean token ids (int64)
    eligible: torch.Tensor  # bool: the token may be masked and supervised (loss_mask)
    levels: torch.Tensor  # float64: the noise level t of the token's block
    drawn: torch.Tensor  # bool: the draw masks this token (before eligibility is applied)


@dataclass(frozen=True)
class MaskedObjective:
    """The fields, checks and noise draw every BDLM objective shares; subclasses build the 2L batch."""

    block_size: int
    mask_token_id: int
    vocab_size: int
    eps: float = 1e-3
    noise: str = "stratified"

    def __post_init__(self) -> None:
        check_noise_args(
            block_size=self.block_size, mask_token_id=self.mask_token_id, vocab_size=self.vocab_size,
            eps=self.eps, noise=self.noise,
        )  # fmt: skip

    def draw(self, input_ids: torch.Tensor, loss_mask: torch.Tensor | None, seeds: Sequence[int]) -> NoiseDraw:
        """Validate clean tokens [N, L] (+ eligibility [N, L], one seed per sequence) and draw their noise."""
        eligible = check_tokens(input_ids, loss_mask, seeds, block_size=self.block_size, vocab_size=self.vocab_size)
        x0 = input_ids.cpu().long()
        levels, drawn = draw_token_masks(seeds, x0.shape[1], self.block_size, eps=self.eps, schedule=self.noise)
        return NoiseDraw(x0, eligible.cpu(), levels, drawn)


@dataclass(frozen=True)
class BDLMBatch:
    """Rows of the 2L layout for N sequences (all of one length L), or one rank's share of them.

    input_ids [N, R] (token of each row), labels [N, R] (IGNORE_INDEX where the row carries no loss),
    weights [N, R] (loss weight of each supervised row), counts [N, R] (each row's share of the global
    denominator; the counts of all rows of the job sum to the denominator).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor

    @property
    def denominator(self) -> float:
        return float(self.counts.sum())

    @property
    def supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @staticmethod
    def two_stream(clean: torch.Tensor, noisy: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                   counts: torch.Tensor) -> BDLMBatch:  # fmt: skip
        """The 2L rows from [N, L] clean/corrupted tokens and the corrupted rows' labels, weights, counts."""
        ignore = torch.full_like(labels, IGNORE_INDEX)
        zero = torch.zeros_like(weights)
        return BDLMBatch(
            torch.cat([clean, noisy], 1), torch.cat([ignore, labels], 1),
            torch.cat([zero, weights], 1), torch.cat([torch.zeros_like(counts), counts], 1),
        )  # fmt: skip

    def shard(self, plan) -> BDLMBatch:
        """This rank's rows (plan.q_rows order). Rows the rank only replicates (BP's clean prefix) carry no
        loss and no count, so every supervised row is counted once in the job."""
        rows, primary = plan.q_rows, plan.q_primary
        labels = self.labels[:, rows].masked_fill(~primary, IGNORE_INDEX)
        counts = self.counts[:, rows].masked_fill(~primary, 0.0)
        return BDLMBatch(self.input_ids[:, rows], labels, self.weights[:, rows], counts)

    def to(self, device: torch.device | str) -> BDLMBatch:
        return replace(
            self, **{f: getattr(self, f).to(device) for f in ("input_ids", "labels", "weights", "counts")}
        )

    def loss_numerator(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        exclude_ids: list[int] | None = None,
        chunk_size: int = 4096,
    ) -> torch.Tensor:
        """sum over supervised rows of weight * CE(head(hidden)) - divide by the global denominator outside.

        hidden [N, R, H] are the final hidden states of these rows; only supervised rows reach the head.
        """
        if hidden.shape[:2] != self.labels.shape:
            raise ValueError(
                f"hidden must be [{', '.join(map(str, self.labels.shape))}, H]; got {tuple(hidden.shape)}"
            )
        sel = self.labels != IGNORE_INDEX
        h = hidden[sel]
        if torch.is_autocast_enabled(
            h.device.type
        ):  # run the head matmuls in the autocast dtype (fp32 logits)
            dtype = torch.get_autocast_dtype(h.device.type)
            h, weight = h.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        return linear_cross_entropy(
            h, weight, self.labels[sel], row_weights=self.weights[sel], bias=bias, exclude_ids=exclude_ids,
            chunk_size=chunk_size,
        )  # fmt: skip
