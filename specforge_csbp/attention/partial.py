"""The partial-attention seam: `(q, k, v, visibility) -> (out, lse)`, with autograd.

Every mode (reference, CP, BP, CSBP, DFlash drafters) calls only this function; backends differ in speed,
never in the function computed. Shapes follow SDPA: q [B, H, Nq, D], k/v [B, Hk, Nk, D] with H % Hk == 0
(GQA); out has q's dtype, lse is fp32 (fp64 for fp64 inputs) and is -inf on rows that see no key.

GQA head packing (`packing.py`) is a layout transform of the same computation: the G query heads of a kv
head are packed into rows so FlexAttention's 128-row query tiles hold fewer distinct visibility patterns.
`pack_gqa=None` packs on the flex backend when G > 1 and the block masks say the kernel visits fewer tiles
x heads that way (decided once per Visibility object); dense packs only when asked (`pack_gqa=True`).
"""

from __future__ import annotations

import torch

from ..devices import device_key
from ..masks.visibility import Visibility
from .dense import dense_attention
from .flex import block_mask_for, flex_attention_partial
from .packing import pack_q, packed_visibility, should_pack, tile_counts, unpack

__all__ = ["BACKENDS", "check_qkv", "partial_attention", "prepare_attention"]

BACKENDS = ("auto", "dense", "flex")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One-line errors for inconsistent q/k/v."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, tokens, head_dim]; got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device; got q {q.device}, k {k.device}, v {v.device}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share batch and head_dim; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})")


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    vis: Visibility,
    *,
    scale: float | None = None,
    backend: str = "auto",
    pack_gqa: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q's rows over k/v's rows where `vis` allows: (out, lse). See the module docstring."""
    check_qkv(q, k, v)
    if q.shape[2] != len(vis.q) or k.shape[2] != len(vis.k):
        raise ValueError(
            f"visibility covers {len(vis.q)} queries x {len(vis.k)} keys; got q tokens {q.shape[2]}, "
            f"k tokens {k.shape[2]}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = q.shape[1] // k.shape[1]
    backend, pack, target = prepare_attention(
        vis, groups=groups, device=q.device, backend=backend, pack_gqa=pack_gqa
    )
    if pack:
        packed = packed_visibility(vis, groups)
        out, lse = _attend(pack_q(q, k.shape[1], packed.chunk), k, v, target, scale, backend)
        return unpack(out, groups, packed.chunk, packed.rows), unpack(lse, groups, packed.chunk, packed.rows)
    return _attend(q, k, v, target, scale, backend)


def prepare_attention(
    vis: Visibility,
    *,
    groups: int,
    device: torch.device | str,
    backend: str = "auto",
    pack_gqa: bool | None = None,
) -> tuple[str, bool, Visibility]:
    """Everything `partial_attention` builds for `vis` before its kernels run - the backend, the packing
    decision, the packed view, the mask tables and the block masks (flex) or dense mask - cached on `vis`.
    Returns (backend, pack, the visibility the kernel runs with). Calling it ahead of the first attention
    call of a plan moves that work (CPU tables, tile counting, host syncs) out of the forward pass; the
    attention computed is the same."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if pack_gqa not in (None, True, False):
        raise ValueError(f"pack_gqa must be one of None, True, False; got {pack_gqa!r}")
    device = device_key(device)  # the key the call's q.device will look up
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "dense"
    pack = pack_gqa
    if pack is None:
        pack = backend == "flex" and should_pack(vis, groups, device)
    target = vis
    if pack:
        target = packed_visibility(vis, groups).vis
        if backend == "flex":  # both block masks from one pass over chunks of rows (cached on vis)
            tile_counts(vis, groups, device)
    if backend == "flex":
        block_mask_for(target, device)
    else:
        target.dense(device)
    return backend, bool(pack), target


def _attend(q, k, v, vis: Visibility, scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "flex":
        return flex_attention_partial(q, k, v, vis, scale)
    return dense_attention(q, k, v, vis.dense(q.device), scale)
