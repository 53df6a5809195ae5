"""How a rank's attention executors run: ONE frozen options object, built at the edge and passed whole.

    CLI / benchmark flags ─┐
    plugin `csbp:` section ┼─► AttentionOptions(...)  (validated once, here) ─► plan_attention / drafter_step
    BDLM recipe            ┘                                                   ─► ShardedAttention(plan, options=...)

Every field changes how the attention is computed, never what it computes: every combination gives the
float64 reference's out, lse and gradients (tests/parallel/test_modes_equal_reference.py, tests/models/dflash/test_modes_equal_reference.py).
A leaf module (it imports only the seam's list of backends and the byte counters), so the executor, the
drafter's plans and step, the prefetch worker and the plugin all take the same object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..attention.partial import BACKENDS
from ..distributed.collectives import COMM_STATS, CommStats

__all__ = ["SCHEDULES", "AttentionOptions", "resolve_schedule"]

SCHEDULES = ("fused", "overlap")


def resolve_schedule(schedule: str | None, regather: bool = False) -> str:
    """None -> "fused" ("overlap" when regather); one-line errors for unknown or incompatible choices."""
    if schedule is None:
        return "overlap" if regather else "fused"
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if regather and schedule == "fused":
        raise ValueError("regather needs schedule 'overlap' (the fused schedule saves the concatenated K/V)")
    return schedule


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be one of True, False; got {value!r}")  # noqa: TRY004 - one user error type


@dataclass(frozen=True)
class AttentionOptions:
    """The attention executors' settings. Two steps built with equal options share prepared masks
    (models/dflash/prefetch.py compares them); `stats` is where bytes are counted and takes no part in that."""

    backend: str = "auto"
    """The seam's kernels: "flex" (compiled FlexAttention, GPU), "dense" (plain torch, the CPU / float64
    oracle) or "auto" (flex on CUDA, dense elsewhere)."""

    schedule: str | None = None
    """How attention over gathered K/V runs (parallel/sharded_attention.py): "fused" - one call over the local
    ++ gathered rows after the all-gather - or "overlap" - a call over the local rows overlapped with the
    gather, then one per other rank's segment, LSE-merged (for slow links; the only one that can regather).
    None: "fused", or "overlap" when `regather` (`resolved_schedule`)."""

    regather: bool = False
    """Free each call's gathered K/V after forward and gather it again in backward: world x shard less memory
    per layer for one more all-gather (long contexts near the memory limit). Needs schedule "overlap"."""

    pack_gqa: bool | None = None
    """GQA head packing (attention/packing.py): the G query heads of a kv head become rows, so a 128-row
    tile holds fewer visibility patterns. None: decided per call from the block masks (flex only); True /
    False force it on / off."""

    gather_ahead: bool = True
    """Drafter layers whose plan gathers context K/V (CSBP) start that gather one layer early, behind the
    layer before (models/dflash/layer_attention.py); False gathers in front of each layer."""

    stats: CommStats = field(default_factory=lambda: COMM_STATS, compare=False)
    """Where the collectives' bytes are counted (distributed/collectives.py); the process-wide COMM_STATS
    unless a caller (a benchmark, a test) wants its own counter."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        _flag("regather", self.regather)
        _flag("gather_ahead", self.gather_ahead)
        if not isinstance(self.pack_gqa, (bool, type(None))):
            raise ValueError(f"pack_gqa must be one of None, True, False; got {self.pack_gqa!r}")  # noqa: TRY004
        if not isinstance(self.stats, CommStats):
            raise ValueError(f"stats must be a CommStats; got {type(self.stats).__name__}")  # noqa: TRY004
        resolve_schedule(self.schedule, self.regather)

    @property
    def resolved_schedule(self) -> str:
        """The schedule that runs: `schedule`, or its default for `regather`."""
        return resolve_schedule(self.schedule, self.regather)

    def replace(self, **changes) -> AttentionOptions:
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)
