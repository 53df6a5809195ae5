"""The drafter at inference: one draft block per verify step over a context that is only ever appended to.

SGLang's DFLASH worker keeps, per request, the drafter's K/V of every verified context position in the
draft KV cache: target features of newly verified tokens are projected once (fc + hidden_norm), turned into
each draft layer's K/V (k-norm, RoPE at their positions) and appended; they are never recomputed. This
module does the same with one preallocated K/V buffer per draft layer:

    verified:   t0 t1 ... t(a-1) | x            x = last verified token (the bonus of the last verify)
    context:    K/V(0 .. a-1)                   appended after each verify with the accepted rows
    draft block [x, MASK, ..., MASK] at positions a .. a+S-1  (the only queries)

    slot j of the block sees: context positions < a (sliding layers: > a + j - W as well) and the
    block itself (full layers bidirectionally; sliding layers causally unless is_causal = false) -
    the visibility rule the drafter was trained with (masks/visibility.py), as a dense mask.

Slots 1..S-1 become proposals through the target's LM head: DFlash takes the argmax; DFlash2 takes the
head's top-k and walks its candidate selector greedily (slot 1's predecessor is x, slot j's the candidate
chosen at slot j-1), as SGLang's `CandidateSelector.sample_path` does for greedy requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layout.tokens import CLEAN, NOISY, TokenSet
from ..masks.visibility import Visibility
from ..models.dflash.modeling import DFlashDraftModel, LayerContext

__all__ = ["DraftContext", "block_visibility"]


def block_visibility(
    anchor: int, ctx_lo: int, block_size: int, *, window: int | None, noisy_causal: bool
) -> Visibility:
    """The rule for one draft block at `anchor` over context positions [ctx_lo, anchor) ++ its own rows."""
    pos = torch.arange(anchor, anchor + block_size)
    q = TokenSet(pos, torch.full_like(pos, NOISY), torch.zeros_like(pos), torch.full_like(pos, anchor))
    cpos = torch.arange(ctx_lo, anchor)
    ctx = TokenSet(cpos, torch.full_like(cpos, CLEAN), torch.full_like(cpos, -1), torch.zeros_like(cpos))
    return Visibility(q, TokenSet.cat([ctx, q]), block_size, window=window, noisy_causal=noisy_causal)


class DraftContext:
    """A drafter's context K/V for one sequence (capacity fixed up front) and its block proposals.

    `embed` / `lm_head` are the target's (frozen; the drafter has none of its own).
    """

    def __init__(
        self, drafter: DFlashDraftModel, embed: nn.Module, lm_head: nn.Module, capacity: int
    ) -> None:
        self.model, self.embed, self.lm_head = drafter, embed, lm_head
        cfg = drafter.config
        self.block_size = int(drafter.block_size)
        self.mask_token_id = int(drafter.mask_token_id)
        p = next(drafter.parameters())
        kv, d = int(cfg.num_key_value_heads), int(cfg.head_dim)
        shape = (1, kv, int(capacity), d)
        self.k = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in drafter.layers]
        self.v = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in drafter.layers]
        self.length = 0
        self.window = cfg.sliding_window
        self.sliding_causal = cfg.sliding_layers_causal

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @torch.no_grad()
    def append(self, features: torch.Tensor) -> None:
        """Append the target features [n, K*H] of the next n verified positions (projected once)."""
        n = int(features.shape[0])
        if n == 0:
            return
        lo, hi = self.length, self.length + n
        if hi > self.k[0].shape[2]:
            raise ValueError(f"draft context: {hi} positions exceed the capacity {self.k[0].shape[2]}")
        ctx = self.model.project_context(features[None].to(self.device))
        positions = torch.arange(lo, hi, device=self.device)[None]
        rope = self.model.rotary_emb(ctx, positions)
        for i, layer in enumerate(self.model.layers):
            k, v = layer.self_attn.context_kv(ctx, *rope)
            self.k[i][:, :, lo:hi] = k
            self.v[i][:, :, lo:hi] = v
        self.length = hi

    @torch.no_grad()
    def hidden(self, last_token: int) -> torch.Tensor:
        """Final-normed drafter states [S, H] of the block [last_token, MASK x (S-1)] at the context's end."""
        S, a = self.block_size, self.length
        ids = torch.full((1, S), self.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = int(last_token)
        x = self.embed(ids).to(self.k[0].dtype)
        rope_q = self.model.rotary_emb(x, torch.arange(a, a + S, device=self.device)[None])
        masks: dict[str, tuple[int, torch.Tensor]] = {}
        for i, layer in enumerate(self.model.layers):
            kind = layer.layer_type
            if kind not in masks:
                sliding = kind == "sliding_attention"
                window = self.window if sliding else None
                lo = max(0, a - window + 1) if sliding else 0  # rows no slot of the block can see: skipped
                vis = block_visibility(a, lo, S, window=window, noisy_causal=sliding and self.sliding_causal)
                masks[kind] = (lo, vis.dense(self.device))
            lo, mask = masks[kind]
            context = LayerContext(self.k[i][:, :, lo:a], self.v[i][:, :, lo:a])
            x = layer(x, None, rope_q, None, _masked_sdpa(mask), context)
        return self.model.norm(x)[0]

    @torch.no_grad()
    def propose(self, last_token: int) -> torch.Tensor:
        """The S-1 drafted tokens (int64, on the context's device) after `last_token`."""
        h = self.hidden(last_token)[1:]  # slot 0 holds the verified token: no proposal
        logits = self.lm_head(h.to(self.lm_head.weight.dtype)).float()
        selector = getattr(self.model, "candidate_selector", None)
        if selector is None:
            return logits.argmax(-1)
        unary, cand = logits.topk(selector.top_k, dim=-1)
        chosen, prev = [], torch.tensor([int(last_token)], device=logits.device)
        for j in range(h.shape[0]):  # greedy walk: the chosen candidate is the next slot's predecessor
            scores = selector(h[j : j + 1].to(selector.hidden_projection.weight.dtype), cand[j : j + 1],
                              unary[j : j + 1], prev)  # fmt: skip
            prev = cand[j : j + 1].gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
            chosen.append(prev)
        return torch.cat(chosen)


def _masked_sdpa(mask: torch.Tensor):
    """attend(q, k, v) -> (out, None) with the block's dense mask [S, Nk].

    GQA by packing (as attention/packing.py does for training): the G query heads of one kv head become
    G x S rows of that head, so K/V are read once and never repeated, and SDPA's masked kernels apply:

        q [B, G*kv, S, D] -> [B, kv, G*S, D]   (head kv*G + g, slot i -> row g*S + i)   mask -> G copies
    """

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        b, hq, s, d = q.shape
        hk = k.shape[1]
        g = hq // hk
        packed = q.reshape(b, hk, g * s, d)
        out = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask.repeat(g, 1) if g > 1 else mask)
        return out.reshape(b, hq, s, d), None

    return attend
