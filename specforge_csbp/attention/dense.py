"""Dense attention with an explicit (out, lse) backward: the CPU backend and the float64 exactness oracle.

FlexAttention has no CPU backward, and plain autograd through logsumexp turns fully masked rows (which
partial attention produces all the time: a query that sees nothing on a remote shard) into NaN gradients.
This Function writes the flash-attention backward by hand, with the lse gradient folded in:

    dS = P * (dP - rowsum(dO * O) + dlse),   P = exp(S - lse) (0 on fully masked rows)
"""

from __future__ import annotations

import torch

__all__ = ["dense_attention"]


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _probabilities(q, k, mask, scale, groups, acc):
    s = torch.matmul(q.to(acc), k.to(acc).repeat_interleave(groups, dim=1).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - finite_lse[..., None]), lse


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        groups = q.shape[1] // k.shape[1]
        acc = _accumulate_dtype(q.dtype)
        p, lse = _probabilities(q, k, mask, scale, groups, acc)
        out = torch.matmul(p, v.to(acc).repeat_interleave(groups, dim=1))
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.scale, ctx.groups = scale, groups
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        scale, groups = ctx.scale, ctx.groups
        acc = out.dtype
        p, _ = _probabilities(q, k, mask, scale, groups, acc)
        dout = dout.to(acc)
        v_rep = v.to(acc).repeat_interleave(groups, dim=1)
        k_rep = k.to(acc).repeat_interleave(groups, dim=1)
        row_term = (dout * out).sum(-1)
        if dlse is not None:
            row_term = row_term - dlse.to(acc)
        ds = p * (torch.matmul(dout, v_rep.transpose(-1, -2)) - row_term[..., None])
        dq = torch.matmul(ds, k_rep) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        dv = torch.matmul(p.transpose(-1, -2), dout)

        def fold(t):  # sum the gradients of query heads sharing one kv head (GQA)
            b, h, n, d = t.shape
            return t.view(b, h // groups, groups, n, d).sum(2)

        return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype), None, None


def dense_attention(q, k, v, mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,H,Nq,D], k/v [B,Hk,Nk,D], mask [Nq,Nk] bool -> out [B,H,Nq,D], lse [B,H,Nq] (fp32/fp64)."""
    return _DenseAttention.apply(q, k, v, mask, scale)
