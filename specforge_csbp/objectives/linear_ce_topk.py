"""Token-chunked linear cross-entropy that also returns each row's top-k logits (DFlash2's selector input).

Like `linear_ce.py`, logits of one chunk live at a time; here the per-row losses are returned (not summed)
so weights that depend on them (D-PACE) and the selector's candidate logits can be built outside:

    forward, per chunk:   z = h W^T  ->  nll = lse(z) - z[y],   (top-k values, ids) of z
    backward, per chunk:  dz = d_nll * (softmax(z) - onehot(y))  +  scatter(d_topk at the top-k ids)
                          dH = dz W,  dW += dz^T h   (dW only if W requires grad; a frozen LM head does not)

The top-k ids carry no gradient; the top-k values do (the selector's unary term flows into the drafter).
"""

from __future__ import annotations

import torch

__all__ = ["linear_ce_topk"]


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    z = torch.matmul(h, weight.t())
    return z if z.dtype == torch.float64 else z.float()


class _LinearCETopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, top_k, chunk_size):
        n = hidden.shape[0]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        nll = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        top_v = hidden.new_empty((n, top_k), dtype=acc)
        top_i = torch.empty((n, top_k), dtype=torch.long, device=hidden.device)
        for lo in range(0, n, chunk_size):
            hi = min(n, lo + chunk_size)
            z = _logits(hidden[lo:hi], weight)
            lse[lo:hi] = torch.logsumexp(z, dim=-1)
            nll[lo:hi] = lse[lo:hi] - z.gather(1, targets[lo:hi, None])[:, 0]
            if top_k:
                top_v[lo:hi], top_i[lo:hi] = z.topk(top_k, dim=-1)
        ctx.save_for_backward(hidden, weight, targets, lse, top_i)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(top_i)
        return nll, top_v, top_i

    @staticmethod
    def backward(ctx, d_nll, d_top, _d_ids):
        hidden, weight, targets, lse, top_i = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse.dtype
        d_hidden = torch.zeros_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for lo in range(0, hidden.shape[0], ctx.chunk_size):
            hi = min(hidden.shape[0], lo + ctx.chunk_size)
            z = _logits(hidden[lo:hi], weight)
            dz = torch.zeros_like(z)
            if d_nll is not None:
                g = d_nll[lo:hi].to(acc)
                dz = torch.exp(z - lse[lo:hi, None]) * g[:, None]
                dz.scatter_add_(1, targets[lo:hi, None], -g[:, None])
            if d_top is not None and top_i.shape[1]:
                dz.scatter_add_(1, top_i[lo:hi], d_top[lo:hi].to(acc))
            if need_h:
                d_hidden[lo:hi] = torch.matmul(dz.to(weight.dtype), weight).to(hidden.dtype)
            if need_w:
                d_weight += torch.matmul(dz.t(), hidden[lo:hi].to(acc))
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), None, None, None


def linear_ce_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    top_k: int = 0,
    chunk_size: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H], weight [V, H], targets [N] in [0, V) -> (nll [N], top-k logits [N, k], top-k ids [N, k]).

    Logits and losses are fp32 (fp64 for fp64 inputs); no [N, V] tensor outlives one chunk.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H]; got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}]; got {tuple(targets.shape)}")
    vocab = weight.shape[0]
    if not 0 <= top_k <= vocab:
        raise ValueError(f"top_k must be in 0..vocab = {vocab}; got {top_k}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        raise ValueError(f"targets must be in [0, {vocab})")
    return _LinearCETopK.apply(hidden, weight, targets, int(top_k), int(chunk_size))
