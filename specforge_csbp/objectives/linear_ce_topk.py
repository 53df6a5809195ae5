"""Token-chunked linear cross-entropy that also returns each row's top-k logits (DFlash2's selector input).

Like `linear_ce.py`, logits of one chunk live at a time; here the per-row losses are returned (not summed)
so weights that depend on them (D-PACE) and the selector's candidate logits can be built outside:

    forward, per chunk:   z = h W^T  ->  nll = lse(z) - z[y],   (top-k values, ids) of z
    backward, per chunk:  dz = d_nll * (softmax(z) - onehot(y))  +  scatter(d_topk at the top-k ids)
                          dH = dz W,  dW += dz^T h   (dW only if W requires grad; a frozen LM head does not)

The per-chunk arithmetic between the GEMMs is `ce_chunk.py` (compiled into one pass each way on CUDA).

The top-k ids carry no gradient; the top-k values do (the selector's unary term flows into the drafter).

`keep_logits_bytes`: when all chunks' logits (as the GEMM returns them, e.g. bf16) fit in this many bytes,
they are kept for backward instead of recomputed - one [N, V] GEMM fewer per step for N x V x 2 bytes of
memory (0, the default: always recompute). The gradients are the same either way (the same GEMM's output).
"""

from __future__ import annotations

import torch

from .ce_chunk import chunk_forward, chunk_grad

__all__ = ["linear_ce_topk"]


def _acc(z: torch.Tensor) -> torch.Tensor:
    return z if z.dtype == torch.float64 else z.float()


class _LinearCETopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, top_k, chunk_size, keep_logits_bytes, fused):
        n = hidden.shape[0]
        keep = n * weight.shape[0] * hidden.element_size() <= keep_logits_bytes  # the GEMM output's bytes
        kept: list[torch.Tensor] = []
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        nll = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        top_v = hidden.new_empty((n, top_k), dtype=acc)
        top_i = torch.empty((n, top_k), dtype=torch.long, device=hidden.device)
        for lo in range(0, n, chunk_size):
            hi = min(n, lo + chunk_size)
            raw = torch.matmul(hidden[lo:hi], weight.t())
            if keep:
                kept.append(raw)
            # lse, the target's logit and the top-1 in one pass (ce_chunk.py); top-k > 1 by radix select
            lse[lo:hi], picked, best, best_id = chunk_forward(raw, targets[lo:hi], fused=fused)
            nll[lo:hi] = lse[lo:hi] - picked
            if top_k == 1:
                top_v[lo:hi, 0], top_i[lo:hi, 0] = best, best_id
            elif top_k:
                top_v[lo:hi], top_i[lo:hi] = _acc(raw).topk(top_k, dim=-1)
            del raw  # before the next chunk's GEMM output exists: one chunk of logits at a time
        ctx.save_for_backward(hidden, weight, targets, lse, top_i)
        # an output no loss used (the top-k values without a selector) gets None, not a zero tensor: its
        # scatter, and the fp32 gradient buffer it needs, are skipped
        ctx.set_materialize_grads(False)
        ctx.chunk_size, ctx.fused = chunk_size, fused
        ctx.kept = kept  # intermediate results, not inputs: held on ctx until backward
        ctx.mark_non_differentiable(top_i)
        return nll, top_v, top_i

    @staticmethod
    def backward(ctx, d_nll, d_top, _d_ids):
        hidden, weight, targets, lse, top_i = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse.dtype
        d_hidden = torch.zeros_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        kept, ctx.kept = ctx.kept, []
        scatter_top = d_top is not None and top_i.shape[1] > 0
        for i, lo in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
            hi = min(hidden.shape[0], lo + ctx.chunk_size)
            raw = kept[i] if kept else torch.matmul(hidden[lo:hi], weight.t())
            if kept:
                kept[i] = None  # each chunk's logits go as soon as they are used
            # straight to the GEMM's dtype unless the top-k gradient still has to be added (at full precision)
            out_dtype = acc if (scatter_top or need_w) else weight.dtype
            if d_nll is not None:
                dz = chunk_grad(raw, lse[lo:hi], d_nll[lo:hi], targets[lo:hi], out_dtype, fused=ctx.fused)
            else:
                dz = torch.zeros(raw.shape, dtype=out_dtype, device=raw.device)
            if scatter_top:
                dz.scatter_add_(1, top_i[lo:hi], d_top[lo:hi].to(acc))
            if need_h:
                d_hidden[lo:hi] = torch.matmul(dz.to(weight.dtype), weight).to(hidden.dtype)
            if need_w:
                d_weight += torch.matmul(dz.t(), hidden[lo:hi].to(acc))
            del raw, dz  # before the next chunk's: one chunk's logits and gradient at a time
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), None, None, None, None, None


def linear_ce_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    top_k: int = 0,
    chunk_size: int = 2048,
    keep_logits_bytes: int = 0,
    check_targets: bool = True,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H], weight [V, H], targets [N] in [0, V) -> (nll [N], top-k logits [N, k], top-k ids [N, k]).

    Logits and losses are fp32 (fp64 for fp64 inputs); no [N, V] tensor outlives one chunk unless
    `keep_logits_bytes` allows keeping them (module docstring). `check_targets=False` skips the range check
    of `targets` (a host sync when they are on a GPU): for callers that checked them on the host already.
    `fused`: the per-chunk arithmetic compiled (ce_chunk.py; None: on CUDA only).
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
    if keep_logits_bytes < 0:
        raise ValueError(f"keep_logits_bytes must be >= 0; got {keep_logits_bytes}")
    if check_targets and targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        raise ValueError(f"targets must be in [0, {vocab})")
    return _LinearCETopK.apply(hidden, weight, targets, int(top_k), int(chunk_size), int(keep_logits_bytes), fused)
