"""The MoE router's load-balancing loss (Switch / Mixtral / Qwen3-MoE form) under any partition of the rows.

transformers' `load_balancing_loss_func` over the rows n of one forward and all layers l:

    aux = E * sum_e f_e * P_e,   f_e = (top-k slots routed to e) / N,   P_e = sum_{n,l} softmax(logits)_{n,l,e} / N

with N = rows x layers. f_e is a count (no gradient); P_e is a mean of router probabilities, so once the
counts are known, aux is a SUM over rows, which any partition computes in pieces:

    rank r:  counts_r[b, e], rows_r[b]  ──all-reduce (no grad)──►  f[b, e] = counts[b, e] / N[b]
             aux_r[b] = E * sum_e f[b, e] * (sum over r's rows of P) / N[b]       sum_r aux_r[b] = aux[b]

Which rows: `tokens` = "both" (default: every row of the 2L sequence, clean and corrupted copies, since
the served model routes both: the clean prefix when it is written to the KV cache, the corrupted block
while it is denoised), "clean" or "corrupted". A row replicated by BP counts on its primary rank only, so
every mode sums over the same rows as the single-process reference.

Per sequence, not per batch: the statistics of each 2L sequence (each view, for conversion) are its own,
so the loss does not depend on how sequences are split into micro batches or DP ranks (transformers' per
forward statistics would). The trainer divides numerators by the global loss denominator D = sum_b d_b
(d_b: sequence b's count, e.g. its eligible tokens), so sequence b contributes coef * d_b * aux[b] to
the numerator: the step's aux term is the d-weighted mean of the sequences' aux, with the same global
denominator in every mode, split and accumulation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..layout.tokens import CLEAN, NOISY

__all__ = ["ROUTER_AUX_TOKENS", "router_aux_numerator", "router_aux_rows"]

ROUTER_AUX_TOKENS = ("both", "clean", "corrupted")


def router_aux_rows(plan, tokens: str) -> torch.Tensor:
    """bool [R]: this rank's rows (plan.q_rows order) that enter the load-balancing statistics."""
    if tokens not in ROUTER_AUX_TOKENS:
        allowed = ", ".join(ROUTER_AUX_TOKENS)
        raise ValueError(f"objective.router_aux_tokens must be one of {allowed}; got {tokens!r}")
    kind = plan.q_tokens.kind
    clean, noisy = kind == CLEAN, kind == NOISY
    keep = {"both": clean | noisy, "clean": clean, "corrupted": noisy}[tokens]
    return keep & plan.q_primary


def router_aux_numerator(
    router_logits: Sequence[torch.Tensor],
    rows: torch.Tensor,
    sequence_counts: torch.Tensor,
    *,
    top_k: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """sum_b d_b * aux_r[b] on this rank (see module docstring; multiply by the coefficient outside).

    router_logits: one [B * R, E] tensor per MoE layer (rows in this rank's order); rows: bool [R] (which
    rows count, `router_aux_rows`); sequence_counts: [B] this rank's share of each sequence's denominator
    count d_b. `group`: the ranks that hold the other rows of the same sequences (None: all rows here)."""
    if not router_logits:
        return torch.zeros((), dtype=sequence_counts.dtype, device=sequence_counts.device)
    B, R = sequence_counts.shape[0], rows.shape[0]
    E = router_logits[0].shape[-1]
    device = router_logits[0].device
    dtype = torch.float64 if router_logits[0].dtype == torch.float64 else torch.float32
    w = rows.to(device=device, dtype=dtype)  # [R]
    counts = torch.zeros(B, E, dtype=dtype, device=device)
    prob_sum = torch.zeros(B, E, dtype=dtype, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.to(dtype).view(B, R, E), dim=-1)
        chosen = torch.topk(probs.detach(), top_k, dim=-1).indices  # [B, R, k]
        slots = torch.zeros_like(probs).scatter_(-1, chosen, 1.0)  # one per routed slot (k per row)
        counts += (slots * w[None, :, None]).sum(1)
        prob_sum = prob_sum + (probs * w[None, :, None]).sum(1)
    stats = torch.cat(
        [counts, (w.sum() * len(router_logits)).expand(B, 1), sequence_counts.to(device, dtype)[:, None]], 1
    )
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    counts, total, d = stats[:, :E], stats[:, E].clamp_min(1.0), stats[:, E + 1]
    aux = E * ((counts / total[:, None]) * (prob_sum / total[:, None])).sum(-1)  # [B], this rank's part
    return (d * aux).sum()
