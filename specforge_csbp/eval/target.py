"""The target side of speculative decoding: chunked prefill and block verification over one KV cache.

    prefill   prompt[0:c], prompt[c:2c], ...   -> features of every prompt position, first token (argmax)
    verify    [x, d1 .. d(S-1)] at a .. a+S-1  -> the target's argmax after each of the S rows, and the
                                                  features of the S rows; the cache is then cropped to
                                                  the verified prefix (a + accepted + 1)

Features are the drafter's context: row p = [h_{ids[0]}(p) | h_{ids[1]}(p) | ...] with h_k = the output
of decoder layer k = transformers' `hidden_states[k + 1]` (the convention of SpecForge, SGLang and the
feature store, data/capture.py). Prefill asks for the logits of its last row only (`logits_to_keep=1`),
so a long prompt never materialises [tokens, vocab].
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

__all__ = ["TargetRunner"]


class TargetRunner:
    """One sequence at a time on a transformers causal LM (greedy)."""

    def __init__(self, model, target_layer_ids: Sequence[int]) -> None:
        self.model = model
        self.ids = [int(i) for i in target_layer_ids]
        self.device = next(model.parameters()).device
        # transformers renamed `past_key_values` to `cache` in 5.2x; pass whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache = None

    def _forward(self, ids: torch.Tensor, logits_to_keep: int = 0):
        out = self.model(
            input_ids=ids.to(self.device)[None], use_cache=True, output_hidden_states=True,
            logits_to_keep=logits_to_keep, **{self._cache_kw: self.cache},
        )  # fmt: skip
        features = torch.cat([out.hidden_states[k + 1][0] for k in self.ids], dim=-1)
        return out.logits[0], features

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor, chunk: int, on_features) -> int:
        """Run the prompt (chunks of `chunk` tokens, 0 = one pass), hand each chunk's features to
        `on_features`, and return the target's first generated token."""
        from transformers import DynamicCache

        try:
            self.cache = DynamicCache(config=self.model.config)
        except TypeError:  # transformers before the config argument
            self.cache = DynamicCache()
        n = int(prompt.shape[0])
        step = chunk if chunk > 0 else n
        for lo in range(0, n, step):
            logits, features = self._forward(prompt[lo : lo + step], logits_to_keep=1)
            on_features(features)
        return int(logits[-1].argmax())

    @torch.no_grad()
    def verify(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block [S] at the cache's end -> (argmax after each row [S], features [S, K*H]); the cache then
        holds the block, until `commit` crops it."""
        logits, features = self._forward(block)
        return logits.argmax(-1), features

    def commit(self, length: int) -> None:
        """Keep the first `length` positions of the cache (the verified prefix)."""
        drop = self.cache.get_seq_length() - length
        if drop > 0:  # a negative crop removes that many tokens in every transformers version
            self.cache.crop(-drop)
