"""Log-sum-exp merge of two partial attention results over disjoint key sets.

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Computed in fp32 (fp64 for fp64 inputs). Rows where a side saw no key carry lse = -inf and weight 0; rows
where neither side saw a key stay out = 0, lse = -inf with zero gradients (no NaN).
"""

from __future__ import annotations

import torch

__all__ = ["merge_partials"]


def _weights(lse_a, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse_a - finite), torch.exp(lse_b - finite), lse


class _Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_a, lse_a, out_b, lse_b):
        acc = lse_a.dtype
        w_a, w_b, lse = _weights(lse_a, lse_b.to(acc))
        out = w_a[..., None] * out_a.to(acc) + w_b[..., None] * out_b.to(acc)
        ctx.save_for_backward(out_a, out_b, out, w_a, w_b)
        return out.to(out_a.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out_a, out_b, out, w_a, w_b = ctx.saved_tensors
        acc = out.dtype
        dout = dout.to(acc)
        base = torch.zeros_like(w_a) if dlse is None else dlse.to(acc)
        d_lse_a = w_a * (base + (dout * (out_a.to(acc) - out)).sum(-1))
        d_lse_b = w_b * (base + (dout * (out_b.to(acc) - out)).sum(-1))
        d_out_a = (w_a[..., None] * dout).to(out_a.dtype)
        d_out_b = (w_b[..., None] * dout).to(out_b.dtype)
        return d_out_a, d_lse_a, d_out_b, d_lse_b


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _Merge.apply(out_a, lse_a, out_b, lse_b)
