"""Pure layout math: who owns which clean token, which corrupted block, which query row.

Nothing here communicates or touches a device; every function is deterministic in its arguments, so each
rank can compute every other rank's layout without asking it.
"""

from .assignment import Assignment, assign_dual_end, assign_near_home
from .plans import MODES, ShardPlan, bdlm_plan, check_bdlm_shape, check_mode
from .tokens import CLEAN, NOISY, PAD, TokenSet
from .zigzag import ZigzagShards, check_block_shape

__all__ = [
    "CLEAN",
    "MODES",
    "NOISY",
    "PAD",
    "Assignment",
    "ShardPlan",
    "TokenSet",
    "ZigzagShards",
    "assign_dual_end",
    "assign_near_home",
    "bdlm_plan",
    "check_bdlm_shape",
    "check_block_shape",
    "check_mode",
]
