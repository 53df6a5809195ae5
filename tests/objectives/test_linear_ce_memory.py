"""The chunked linear cross-entropy never holds [tokens, vocab] logits: its peak memory (forward + backward)
is a fraction of the naive `cross_entropy(h @ W.T)` at the same sizes, for the same loss and gradients.

Measured with torch's profiler, which records every CPU allocation and free (profile_memory=True): the peak of
their running sum is exactly the bytes the step allocated above its inputs - unlike the process's resident
set, it does not depend on what the interpreter touched before (imports, other tests, the allocator).
"""

from __future__ import annotations

import torch

from specforge_csbp.objectives.linear_ce import linear_cross_entropy
from tests.support.memory_probe import peak_allocated_bytes


def test_chunked_ce_peak_memory_below_naive():
    torch.manual_seed(0)
    N, H, V = 4096, 64, 16384
    logits_bytes = N * V * 4
    h = torch.randn(N, H, requires_grad=True)
    w = (0.1 * torch.randn(V, H)).requires_grad_()
    y = torch.randint(0, V, (N,))
    losses, grads = {}, {}

    def run(name, loss_fn):
        def step():
            loss = loss_fn()
            loss.backward()
            losses[name] = float(loss)

        h.grad = w.grad = None
        peak = peak_allocated_bytes(step)
        grads[name] = (h.grad.clone(), w.grad.clone())
        return peak

    chunked = run("chunked", lambda: linear_cross_entropy(h, w, y, chunk_size=128))
    naive = run("naive", lambda: torch.nn.functional.cross_entropy(h @ w.t(), y, reduction="sum"))
    assert abs(losses["chunked"] - losses["naive"]) / abs(losses["naive"]) < 1e-5  # the same computation
    for a, b in zip(grads["chunked"], grads["naive"], strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4
    assert naive >= logits_bytes, (naive, logits_bytes)  # the naive loss holds at least the logits
    assert chunked < logits_bytes / 4, (chunked, logits_bytes)  # chunks of 128 rows: far below one logits
    assert chunked * 4 < naive, (chunked, naive)
