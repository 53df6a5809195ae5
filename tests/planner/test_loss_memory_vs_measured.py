"""The planner's drafter loss memory (planner/memory.loss_chunk_bytes) against the measured peak of
`linear_ce_topk` with its per-chunk arithmetic compiled (the GPU path, here compiled by inductor for the
CPU), bf16, forward + backward, with and without the selector's top-k."""

import pytest
import torch

from specforge_csbp.objectives.linear_ce_topk import linear_ce_topk
from specforge_csbp.planner.memory import loss_chunk_bytes
from tests.support.memory_probe import peak_allocated_bytes

ROWS, CHUNK, HIDDEN, VOCAB = 512, 128, 64, 8192


@pytest.mark.parametrize("top_k", [1, 6])
def test_loss_chunk_model_matches_the_compiled_peak(top_k):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=g).bfloat16()  # the target's frozen head
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)

    def step():
        nll, top_v, _ = linear_ce_topk(hidden, weight, targets, top_k=top_k, chunk_size=CHUNK, fused=True)
        (nll.sum() + (top_v.sum() if top_k > 1 else 0)).backward()
        hidden.grad = None

    step()  # compile first: the measured call allocates what a warm step does
    measured = peak_allocated_bytes(step, repeats=2)
    modelled = loss_chunk_bytes(VOCAB, CHUNK, 2, top_k)
    # the rest of the step is [ROWS, *] vectors (lse, nll, top-k, grad of hidden): < 1% of a chunk here
    assert modelled * 0.9 <= measured <= modelled * 1.1, (measured, modelled)
    assert measured < CHUNK * VOCAB * 12 * 0.75  # well under the three fp32 buffers of the eager form
