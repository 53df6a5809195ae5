"""Comparisons several test folders share: relative error against a reference, one-line errors."""

from __future__ import annotations

import pytest
import torch

__all__ = ["raises_one_line", "rel_err"]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|: the error relative to the reference's scale (0 when both are all zero)."""
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def raises_one_line(match: str, fn, *args, **kw) -> None:
    """fn(*args, **kw) raises a ValueError matching `match`, and its message is one line."""
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kw)
    assert "\n" not in str(info.value)
