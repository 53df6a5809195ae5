"""One sharded-attention strategy that runs every mode's plan over the partial-attention seam."""

from .sharded_attention import ShardedAttention, bdlm_attention

__all__ = ["ShardedAttention", "bdlm_attention"]
