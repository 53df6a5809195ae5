"""Token sources for BDLM training: sequence `i` of the job is a pure function of i (no state, no files
written), so every rank of a CP group builds the same clean batch and any DP split sees the same data.

    synthetic   learnable arithmetic ramps (x_j = a + k*j over the allowed ids), optional prompt prefix
    jsonl       one {"input_ids": [...], "loss_mask": [...]?} per line; truncated / right-padded with
                pad_token_id to max_length (pad tokens get loss_mask 0; max_length must be a multiple of
                the block size, so padding never changes the block grid)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from ...errors import read_jsonl
from ...objectives.noise import sequence_seed

__all__ = ["JsonlSource", "SyntheticSource", "TokenSource"]


class TokenSource(Protocol):
    def get(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [n, L] long, loss_mask [n, L] bool) for global sequence ids `indices`."""


class SyntheticSource:
    def __init__(self, *, vocab_size: int, seq_len: int, prompt_len: int = 0, reserved: Sequence[int] = (),
                 seed: int = 0):  # fmt: skip
        if not 0 <= prompt_len < seq_len:
            raise ValueError(f"data.prompt_len must be in [0, max_length={seq_len}); got {prompt_len}")
        keep = torch.ones(vocab_size, dtype=torch.bool)
        keep[[r for r in reserved if 0 <= r < vocab_size]] = False
        self.allowed = keep.nonzero().flatten()
        if len(self.allowed) < 2:
            raise ValueError(f"data: synthetic data needs >= 2 usable token ids, vocab_size={vocab_size}")
        self.seq_len, self.prompt_len, self.seed = seq_len, prompt_len, seed

    def get(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.allowed)
        rows = []
        for i in indices:
            gen = torch.Generator().manual_seed(sequence_seed(self.seed, -1, int(i)))
            start = int(torch.randint(n, (1,), generator=gen))
            stride = int(torch.randint(1, min(n, 5), (1,), generator=gen))
            rows.append(self.allowed[(start + stride * torch.arange(self.seq_len)) % n])
        ids = torch.stack(rows)
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[:, : self.prompt_len] = False
        return ids, mask


class JsonlSource:
    def __init__(self, path: str | Path, *, seq_len: int, pad_token_id: int, vocab_size: int):
        self.records: list[tuple[list[int], list[int]]] = []
        for n, item in read_jsonl(path, "data.path"):  # not UTF-8 or not JSON: one line naming file and line
            try:
                ids, mask = item["input_ids"], item.get("loss_mask", [1] * len(item["input_ids"]))
                if not isinstance(ids, list) or not isinstance(mask, list):
                    raise TypeError("input_ids and loss_mask must be lists")
            except (KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"data.path: {path}:{n} needs an input_ids list ({err})") from None
            if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):  # 3.7 would become 3 silently
                raise ValueError(f"data.path: {path}:{n} input_ids must be integers; got {ids[:8]}")
            if any(m not in (0, 1) or isinstance(m, float) for m in mask):
                raise ValueError(f"data.path: {path}:{n} loss_mask must hold 0 or 1; got {mask[:8]}")
            if len(mask) != len(ids):
                raise ValueError(
                    f"data.path: {path}:{n} loss_mask has {len(mask)} entries, input_ids {len(ids)}"
                )
            if any(not 0 <= t < vocab_size for t in ids):
                raise ValueError(f"data.path: {path}:{n} has token ids outside [0, {vocab_size})")
            if not any(mask[:seq_len]):  # such a record would add nothing but padding to the loss
                raise ValueError(
                    f"data.path: {path}:{n} has no supervised token within data.max_length={seq_len} "
                    "(loss_mask all 0 after truncation); drop it or supervise at least one token"
                )
            self.records.append((ids[:seq_len], mask[:seq_len]))
        if not self.records:
            raise ValueError(f"data.path: {path} has no records")
        self.seq_len, self.pad = seq_len, pad_token_id

    def get(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(indices), self.seq_len), self.pad, dtype=torch.long)
        mask = torch.zeros(len(indices), self.seq_len, dtype=torch.bool)
        for row, i in enumerate(indices):
            toks, m = self.records[int(i) % len(self.records)]
            ids[row, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            mask[row, : len(m)] = torch.tensor(m, dtype=torch.bool)
        return ids, mask
