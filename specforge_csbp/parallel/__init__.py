"""One sharded-attention strategy that runs every mode's plan over the partial-attention seam."""

from .options import AttentionOptions
from .sharded_attention import ShardedAttention, bdlm_attention

__all__ = ["AttentionOptions", "ShardedAttention", "bdlm_attention"]
