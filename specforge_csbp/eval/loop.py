"""Greedy speculative decoding of one prompt, as SGLang's DFLASH worker runs it (batch 1, temperature 0).

    prefill(prompt)               -> context features of positions 0..n-1, first token x (position n)
    repeat:
      d1..d(S-1) = drafter([x, MASK x (S-1)] at n .. n+S-1, context < n)
      t0..t(S-1) = target argmax after [x, d1 .. d(S-1)]          (one forward over the block)
      k          = leading slots with d(j+1) == t(j)               (0 <= k <= S-1)
      commit d1..dk and the bonus t(k): k + 1 tokens; the cache keeps x, d1..dk (n + k + 1 positions),
      their features are appended to the drafter's context, x = t(k), n += k + 1

Every committed token is the target's own argmax given the tokens before it, so the output equals plain
greedy decoding of the target token for token (tests/eval/test_loop.py); the drafter only decides how many
tokens one verify step commits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .target import TargetRunner

__all__ = ["Proposer", "SequenceResult", "VerifyStep", "speculative_generate"]


class Proposer(Protocol):
    """What the loop needs of a drafter: context appends and one block's proposals."""

    block_size: int

    def append(self, features: torch.Tensor) -> None: ...

    def propose(self, last_token: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class VerifyStep:
    position: int  # context position of the block's first row (the last verified token)
    accepted: int  # drafted tokens accepted (0..S-1); the step commits accepted + 1 tokens


@dataclass
class SequenceResult:
    prompt_len: int
    tokens: list[int]  # generated tokens (the first comes from the prefill), at most max_new_tokens
    steps: list[VerifyStep] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0


def speculative_generate(
    target: TargetRunner,
    drafter: Proposer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    prefill_chunk: int = 0,
    stop_ids: Sequence[int] = (),
    on_step: Callable[[int], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> SequenceResult:
    """Generate up to `max_new_tokens` tokens after `prompt` [n] (stopping after a token in `stop_ids`).

    `on_step(n)` is called with the tokens each verify step commits (progress bars); `clock` returns a
    synchronised time (the CLI passes one that waits for the GPU)."""
    import time

    clock = clock or time.perf_counter
    stops = {int(s) for s in stop_ids}
    S = int(drafter.block_size)
    t0 = clock()
    first = target.prefill(prompt, prefill_chunk, drafter.append)
    result = SequenceResult(prompt_len=int(prompt.shape[0]), tokens=[first], prefill_s=clock() - t0)
    if on_step is not None:
        on_step(1)
    position, last = result.prompt_len, first
    t0 = clock()
    while len(result.tokens) < max_new_tokens and last not in stops:
        draft = drafter.propose(last).to(target.device)
        block = torch.cat([torch.tensor([last], device=target.device), draft])
        predicted, features = target.verify(block)
        match = (draft == predicted[: S - 1]).to(torch.long)
        accepted = int(match.cumprod(0).sum())  # the longest matching prefix
        target.commit(position + accepted + 1)
        drafter.append(features[: accepted + 1])
        committed = draft[:accepted].tolist() + [int(predicted[accepted])]
        result.steps.append(VerifyStep(position, accepted))
        for tok in committed:
            if len(result.tokens) >= max_new_tokens:
                break
            result.tokens.append(tok)
            if tok in stops:
                break
        if on_step is not None:
            on_step(len(committed))
        position, last = position + accepted + 1, committed[-1]
        if stops.intersection(committed):
            break
    result.decode_s = clock() - t0
    return result
