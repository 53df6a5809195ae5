"""Token-chunked linear cross-entropy: sum_i w_i * CE(h_i @ W^T + b, y_i), never materialising the
[tokens, vocab] logits.

Forward walks the rows in chunks (logits of one chunk live at a time) and keeps only the per-row
log-sum-exp; backward recomputes each chunk's logits and accumulates dH and dW chunk by chunk. Peak extra
memory is chunk_size x vocab instead of tokens x vocab.

    rows:  [ chunk 0 | chunk 1 | ... ]   each: logits = h_c W^T (fp32) -> lse_c, z_c[y]   (forward)
                                         each: p_c = softmax - onehot, dH_c = p_c W, dW += p_c^T h_c (backward)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["linear_cross_entropy"]


def _chunk_logits(h, weight, bias, excluded):
    logits = torch.matmul(h, weight.t()).float() if h.dtype != torch.float64 else torch.matmul(h, weight.t())
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    if excluded is not None:
        logits[:, excluded] = float("-inf")
    return logits


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_weights, chunk_size, excluded):
        total = hidden.new_zeros((), dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        lses = []
        for lo in range(0, hidden.shape[0], chunk_size):
            h, y, w = hidden[lo : lo + chunk_size], targets[lo : lo + chunk_size], row_weights[lo : lo + chunk_size]
            logits = _chunk_logits(h, weight, bias, excluded)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, y.clamp_min(0)[:, None])[:, 0]
            total = total + ((lse - picked) * w.to(lse.dtype)).sum()
            lses.append(lse)
        lse_all = torch.cat(lses) if lses else hidden.new_zeros(0, dtype=total.dtype)
        ctx.save_for_backward(hidden, weight, bias, targets, row_weights, lse_all)
        ctx.chunk_size, ctx.excluded = chunk_size, excluded
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, targets, row_weights, lse_all = ctx.saved_tensors
        chunk_size, excluded = ctx.chunk_size, ctx.excluded
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        acc = lse_all.dtype
        d_hidden = torch.zeros_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        d_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for lo in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[lo : lo + chunk_size], targets[lo : lo + chunk_size]
            w = row_weights[lo : lo + chunk_size].to(acc) * grad_total.to(acc)
            logits = _chunk_logits(h, weight, bias, excluded)
            grad = torch.exp(logits - lse_all[lo : lo + chunk_size, None])
            grad.scatter_add_(1, y.clamp_min(0)[:, None], -torch.ones_like(grad[:, :1]))
            grad = grad * w[:, None]  # rows with weight 0 (ignored targets) contribute nothing
            if need_h:
                d_hidden[lo : lo + chunk_size] = torch.matmul(grad.to(weight.dtype), weight).to(hidden.dtype)
            if need_w:
                d_weight += torch.matmul(grad.t(), h.to(acc))
            if need_b:
                d_bias += grad.sum(0)
        return (
            d_hidden,
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype),
            None, None, None, None,
        )  # fmt: skip


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    row_weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int = 4096,
    exclude_ids: Sequence[int] | None = None,
) -> torch.Tensor:
    """Weighted sum (not mean) of per-row CE; divide by a global denominator outside.

    hidden [N, H], weight [V, H] (e.g. a frozen LM head), targets [N] (ignore_index rows count 0),
    row_weights [N] (default 1), exclude_ids: vocabulary ids removed from the softmax (e.g. the mask token).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V, H]; got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}]; got {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    vocab = weight.shape[0]
    valid = targets != ignore_index
    if bool(((targets[valid] < 0) | (targets[valid] >= vocab)).any()):
        raise ValueError(f"targets must be in [0, {vocab}) or ignore_index={ignore_index}")
    w = torch.ones_like(targets, dtype=torch.float32) if row_weights is None else row_weights
    w = torch.where(valid, w, torch.zeros_like(w))
    excluded = None
    if exclude_ids:
        excluded = torch.tensor(sorted(set(exclude_ids)), dtype=torch.long, device=hidden.device)
        if bool(torch.isin(targets[valid], excluded).any()):
            raise ValueError("exclude_ids must not contain a supervised target id")
    return _LinearCE.apply(hidden, weight, bias, targets, w.detach(), chunk_size, excluded)
