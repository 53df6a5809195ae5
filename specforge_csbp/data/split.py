"""A deterministic held-out split of a capture: which samples go to the eval store, and where it lives.

    specforge-csbp capture ... --out store --eval-fraction 0.1
        sample id "00000017" -> u = sha256("eval-split:00000017")[:8] / 2**64 = 0.42   >= 0.1 -> store/
        sample id "00000023" -> u = 0.07                                               <  0.1 -> store-eval/

A sample's side depends on its id only (not on the order, the other samples, `--num-samples` or a resumed
capture), so a re-run or a resumed capture puts every sample where it went before, and no sample is in both
stores. `store-eval` is an ordinary feature store: point `data.eval_hidden_states_path` at it.
"""

from __future__ import annotations

import hashlib
import math
import os

__all__ = ["check_eval_fraction", "eval_store_dir", "held_out"]


def check_eval_fraction(fraction: float) -> float:
    """`fraction` if it is a share in [0, 1), else a one-line ValueError naming --eval-fraction."""
    if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0.0 <= fraction < 1.0):
        raise ValueError(
            f"--eval-fraction: must be in [0, 1) (the share of samples held out for eval; 0 = none); got {fraction}"
        )
    return float(fraction)


def eval_store_dir(out: str) -> str:
    """The eval store next to the training store `out`: `out-eval` (a sibling, so `out` stays one store)."""
    return os.path.normpath(out) + "-eval"


def held_out(sample_id: str, fraction: float) -> bool:
    """True when sample `sample_id` belongs to the eval split of share `fraction` (a pure function of both)."""
    if fraction <= 0.0:
        return False
    digest = hashlib.sha256(f"eval-split:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < fraction
