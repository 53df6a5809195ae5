"""DFlash2's grouped dynamic depthwise convolution: causal inside a draft block, never across one.

Each sublayer (attention, MLP) is wrapped: `prepare` convolves the sublayer's input and hands the
coefficients of the output convolution to `finish`, both predicted from one projection of the input.

    out[i] = sum_t (base[t] + delta[i, t, group(c)]) * x[i - t]     for slot(i) >= t, else that tap is 0

Rows are draft blocks laid out contiguously (row i is slot i % S of block i // S), so the shift runs along
the slot axis of a [blocks, S, ...] view and a tap never reads the previous block:

    block b:  slot 0   1   2   3          taps = 2
              x0 ---> o1                  o1 = k0*x1 + k1*x0
                  x1 ---> o2              o0 = k0*x0 (no tap reaches back into block b-1)

Parameter names follow the serving checkpoints: `base_kernel` [2, taps, hidden] (side 0 = before the
sublayer, side 1 = after it) and `kernel_projection` (hidden -> 2 * taps * groups).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DFlashGroupedConv", "block_causal_conv"]


def block_causal_conv(
    x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, block_size: int
) -> torch.Tensor:
    """x [B, N, H] (N = blocks * S), base [taps, H], delta [B, N, taps, G] -> [B, N, H]."""
    b, n, h = x.shape
    taps, groups = base.shape[0], delta.shape[-1]
    if n % block_size:
        raise ValueError(f"rows ({n}) must be whole draft blocks of block_size = {block_size}")
    xs = x.view(b, n // block_size, block_size, groups, h // groups)
    coef = base.view(1, 1, 1, taps, groups, h // groups) + delta.view(
        b, n // block_size, block_size, taps, groups, 1
    )
    out = coef[:, :, :, 0] * xs
    for t in range(1, taps):
        # slot s reads slot s - t of the same block; slots < t read nothing (zero padding inside the block)
        out = out + torch.nn.functional.pad(coef[:, :, t:, t] * xs[:, :, :-t], (0, 0, 0, 0, t, 0))
    return out.view(b, n, h)


class DFlashGroupedConv(nn.Module):
    """Wraps one sublayer: `prepare(x) -> (conv_0(x), coefficients_1)`, `finish(y, coefficients_1)`."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.block_size, self.taps = int(block_size), int(kernel_size)
        self.num_groups = int(hidden_size) // int(group_size)
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, int(hidden_size)))
        self.kernel_projection = nn.Linear(int(hidden_size), 2 * self.taps * self.num_groups, bias=False)
        self.reset_to_identity()
        self.block_causal_conv = block_causal_conv  # compiled in place by DFlashDraftModel.compile_token_wise()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """Start as the identity (tap 0 = 1, no dynamic part), as the published checkpoints are initialised."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coef = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.num_groups))
        return self.block_causal_conv(x, self.base_kernel[0], coef[..., 0, :, :], self.block_size), coef[
            ..., 1, :, :
        ]

    def finish(self, y: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        return self.block_causal_conv(y, self.base_kernel[1], coef, self.block_size)
