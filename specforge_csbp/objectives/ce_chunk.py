"""The cross-entropy arithmetic on one chunk of logits, eager or compiled into one or two passes.

A chunked linear CE (linear_ce_topk.py) spends its GEMMs' time well; what it does with each [rows, vocab]
chunk between them is, run eagerly, a string of full passes over the chunk - an fp32 copy, logsumexp's
reductions, a radix-select top-1, and in backward exp, subtract, scale, scatter and a cast back: a sizeable
share of a one-GPU DFlash step at a large vocabulary (docs/performance.md). Compiled, each direction reads
the chunk once or twice in the GEMM's dtype and writes the gradient once:

    forward   raw [n, V] (GEMM dtype)  ->  lse [n], z[y] [n], (max [n], argmax [n])     math in fp32 / fp64
    backward  raw, lse, g, y           ->  dz = g * (softmax(z) - onehot(y))             in the dtype asked

`fused=None` compiles on CUDA and runs eagerly elsewhere (the float64 CPU tests); both compute the same
function (tests/objectives/test_ce_chunk_compiled_equals_eager.py runs the compiled form on CPU against the eager one).
"""

from __future__ import annotations

import torch

from ..devices import compiled_once

__all__ = ["chunk_forward", "chunk_grad"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward_eager(raw: torch.Tensor, targets: torch.Tensor):
    z = raw.to(_acc_dtype(raw.dtype))
    best, best_id = z.max(dim=-1)
    return torch.logsumexp(z, dim=-1), z.gather(1, targets[:, None])[:, 0], best, best_id


def _grad_eager(raw: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, targets: torch.Tensor, out_dtype):
    dz = torch.exp(raw.to(lse.dtype) - lse[:, None]) * g[:, None]
    dz.scatter_add_(1, targets[:, None], -g[:, None])
    return dz.to(out_dtype)


def _forward_fusable(raw: torch.Tensor, targets: torch.Tensor):
    # the same function as _forward_eager, written so inductor fuses it into reductions over raw
    z = raw.to(_acc_dtype(raw.dtype))
    best, best_id = z.max(dim=-1)
    lse = best + torch.log(torch.exp(z - best[:, None]).sum(dim=-1))
    return lse, z.gather(1, targets[:, None])[:, 0], best, best_id


def _grad_fusable(raw: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, targets: torch.Tensor, out_dtype):
    # one pointwise pass: the one-hot is a column compare (a scatter would be a second pass)
    cols = torch.arange(raw.shape[1], device=raw.device)
    onehot = (cols[None, :] == targets[:, None]).to(lse.dtype)
    return ((torch.exp(raw.to(lse.dtype) - lse[:, None]) - onehot) * g[:, None]).to(out_dtype)


def _use_fused(fused: bool | None, t: torch.Tensor) -> bool:
    return t.is_cuda if fused is None else fused


def chunk_forward(
    raw: torch.Tensor, targets: torch.Tensor, *, fused: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw logits [n, V] and targets [n] -> (lse, z[target], top-1 value, top-1 id), each [n]; fp32 math
    (fp64 for fp64 logits)."""
    fn = compiled_once(_forward_fusable) if _use_fused(fused, raw) else _forward_eager
    return fn(raw, targets)


def chunk_grad(
    raw: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    targets: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    fused: bool | None = None,
) -> torch.Tensor:
    """d(sum_i g_i * nll_i)/d(logits) for one chunk: g * (softmax(raw) - onehot(targets)), in `out_dtype`.
    `lse` (from chunk_forward) sets the math dtype; `g` [n] is cast to it."""
    fn = compiled_once(_grad_fusable) if _use_fused(fused, raw) else _grad_eager
    return fn(raw, lse, g.to(lse.dtype), targets, out_dtype)
