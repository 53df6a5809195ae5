"""FlexAttention backend (GPU): compiled flex_attention with a block mask built from the same rule.

Block masks are cached on the Visibility object, so a plan built once per step serves every layer.
"""

from __future__ import annotations

import functools

import torch

from ..masks.visibility import Visibility

__all__ = ["flex_attention_partial", "flex_available"]


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - torch < 2.5
        return False
    return True


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask_for(vis: Visibility, device: torch.device):
    key = ("block_mask", str(device))
    if key not in vis._cache:
        from torch.nn.attention.flex_attention import create_block_mask

        vis._cache[key] = create_block_mask(
            vis.mask_mod(device), None, None, len(vis.q), len(vis.k), device=device, _compile=True
        )
    return vis._cache[key]


def flex_attention_partial(q, k, v, vis: Visibility, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    block_mask = block_mask_for(vis, q.device)
    out, lse = _compiled_flex()(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], return_lse=True
    )
    return out, lse
