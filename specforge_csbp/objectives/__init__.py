"""Training objectives: token-chunked linear cross-entropy and the BDLM / DFlash losses built on it."""

from .linear_ce import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
