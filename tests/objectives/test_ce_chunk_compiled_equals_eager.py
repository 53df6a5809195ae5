"""The per-chunk CE arithmetic (objectives/ce_chunk.py): the compiled form the GPU runs computes the same
function as the eager form, here compiled by inductor for the CPU; and linear_ce_topk gives the same losses,
top-k and gradients either way."""

import pytest
import torch

from specforge_csbp.objectives.ce_chunk import chunk_forward, chunk_grad
from specforge_csbp.objectives.linear_ce_topk import linear_ce_topk


def _chunk(dtype, n=37, vocab=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = (torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
    return raw, torch.randint(0, vocab, (n,), generator=g)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_chunk_forward_compiled_equals_eager(dtype):
    raw, y = _chunk(dtype)
    eager = chunk_forward(raw, y, fused=False)
    compiled = chunk_forward(raw, y, fused=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(eager[:3], compiled[:3]):
        assert a.dtype == b.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    assert torch.equal(eager[3], compiled[3])
    z = raw.to(eager[0].dtype)  # against the definitions
    torch.testing.assert_close(eager[0], torch.logsumexp(z, -1), rtol=tol, atol=tol)
    assert torch.equal(eager[3], z.argmax(-1)) and torch.equal(eager[1], z[torch.arange(len(y)), y])


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float64, torch.float64), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])  # fmt: skip
def test_chunk_grad_compiled_equals_eager(dtype, out_dtype):
    raw, y = _chunk(dtype)
    lse = chunk_forward(raw, y, fused=False)[0]
    g = torch.rand(len(y), dtype=torch.float64).to(lse.dtype)
    eager = chunk_grad(raw, lse, g, y, out_dtype, fused=False)
    compiled = chunk_grad(raw, lse, g, y, out_dtype, fused=True)
    assert eager.dtype == compiled.dtype == out_dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[out_dtype]
    torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)
    # the definition: g * (softmax - onehot)
    z = raw.to(lse.dtype)
    ref = (torch.softmax(z, -1) - torch.nn.functional.one_hot(y, z.shape[1]).to(z.dtype)) * g[:, None]
    torch.testing.assert_close(eager.to(ref.dtype), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("top_k", [0, 1, 5])
def test_linear_ce_topk_fused_equals_eager(top_k):
    g = torch.Generator().manual_seed(1)
    n, hid, vocab = 45, 16, 211
    h0 = torch.randn(n, hid, generator=g, dtype=torch.float64)
    w0 = torch.randn(vocab, hid, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    row_w, top_w = torch.rand(n, generator=g, dtype=torch.float64), torch.randn(n, top_k, generator=g, dtype=torch.float64)
    results = []
    for fused in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        nll, top_v, top_i = linear_ce_topk(h, w, y, top_k=top_k, chunk_size=16, fused=fused)
        ((nll * row_w).sum() + (top_v * top_w).sum()).backward()
        results.append((nll, top_v, top_i, h.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    logits = h0 @ w0.t()  # against the definitions
    torch.testing.assert_close(results[0][0], torch.logsumexp(logits, -1) - logits[torch.arange(n), y])
    if top_k:
        assert torch.equal(results[0][2], logits.topk(top_k, -1).indices)
