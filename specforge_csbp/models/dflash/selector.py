"""DFlash2's low-rank candidate selector over the draft head's top-k.

For a draft slot with hidden state h, its top-k candidates c_1..c_k from the (target's) LM head with unary
logits u_j, and the previous token p (the anchor for slot 1, the gold token at slot - 1 while training):

    score_j = u_j + < predecessor_codebook[p] * hidden_projection(h),  successor_codebook[c_j] >

Training: cross-entropy over the k scores toward the gold token, on rows whose gold token is in the top-k.
Serving (SGLang / vLLM) walks the slots greedily with the chosen candidate as the next predecessor.
Parameter names are the serving checkpoint's: candidate_selector.{predecessor_codebook, successor_codebook,
hidden_projection.weight}.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CandidateSelector"]


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = int(top_k)
        self.predecessor_codebook = nn.Parameter(torch.zeros(int(vocab_size), int(rank)))
        self.successor_codebook = nn.Parameter(torch.zeros(int(vocab_size), int(rank)))
        self.hidden_projection = nn.Linear(int(hidden_size), int(rank), bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        candidate_ids: torch.Tensor,
        unary_logits: torch.Tensor,
        predecessor_ids: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [N, H], candidate_ids / unary_logits [N, k], predecessor_ids [N] -> scores [N, k]."""
        state = self.predecessor_codebook[predecessor_ids] * self.hidden_projection(hidden)
        pairwise = torch.einsum("nr,nkr->nk", state, self.successor_codebook[candidate_ids])
        return unary_logits + pairwise.to(unary_logits.dtype)
