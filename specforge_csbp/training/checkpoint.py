"""Atomic checkpoints: each one is written to a temporary directory, renamed into place, and only then
does the `latest` pointer (itself replaced atomically) name it. A crash at any point leaves the previous
checkpoint intact and `latest` pointing at a complete directory.

    output_dir/
      step_00000010/   model (workload format), optimizer.pt, trainer_state.json
      step_00000020/
      latest           "step_00000020"   <- written last
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["latest_checkpoint", "load_trainer_state", "save_checkpoint"]


def _name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    write_model: Callable[[Path], None],
    optimizer_state: dict[str, Any],
    trainer_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` (call on one rank). Returns its final path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / _name(step)
    tmp = out / f".{_name(step)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_model(tmp)
    torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1, default=str))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = out / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, out / "latest")
    old = sorted(p for p in out.glob("step_*") if p.is_dir() and p.name != final.name)
    for p in old[: max(len(old) - (keep - 1), 0)]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str | Path | None) -> Path | None:
    if output_dir is None:
        return None
    pointer = Path(output_dir) / "latest"
    if not pointer.exists():
        return None
    path = Path(output_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer_state.json").read_text())
