"""The partial-attention seam `(q, k, v, visibility) -> (out, lse)` and the LSE merge."""

from .merge import merge_partials
from .partial import BACKENDS, partial_attention, prepare_attention

__all__ = ["BACKENDS", "merge_partials", "partial_attention", "prepare_attention"]
