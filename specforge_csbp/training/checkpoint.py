"""Atomic checkpoints: each one is written to a temporary directory, sealed with a manifest, renamed into
place, and only then does the `latest` pointer (itself replaced atomically) name it. A crash or SIGKILL at
any point leaves `latest` naming a complete checkpoint (or no pointer at all before the first one).

    output_dir/
      .step_00000030.tmp/  a save in progress (or killed): never named by `latest`, removed by the next save
      step_00000010/       model (workload format), optimizer.pt, trainer_state.json, manifest.json (last)
      step_00000020/
      latest               "step_00000020"   <- replaced last

    save:  mkdir .tmp -> model, optimizer, state -> manifest (file sizes) -> fsync -> rename -> fsync dir
           -> .latest.tmp -> fsync -> rename onto latest -> fsync dir -> prune old checkpoints

Parameters and optimizer states are replicated on every rank, so a checkpoint holds one full copy written
by rank 0 and any world size, DP degree or CP mode can load it (resharding is loading).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..outputs import file_sha256, naming_full_disk

__all__ = [
    "MANIFEST",
    "checkpoint_step",
    "incomplete_reason",
    "latest_checkpoint",
    "load_trainer_state",
    "save_checkpoint",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"
_POINTER = "latest"


def _name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a `step_NNNNNNNN` directory name, else None."""
    name = Path(path).name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def _sha256(path: Path) -> str:
    return file_sha256(str(path))


def _seal(tmp: Path, step: int) -> None:
    """Write the manifest (every file, its size and sha256) and flush everything to disk."""
    files = _files(tmp)
    sha256 = {rel: _sha256(tmp / rel) for rel in files}  # read back from the page cache: cheap
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files, "sha256": sha256}, indent=1))
    for rel in [*files, MANIFEST]:
        _fsync(tmp / rel)
    _fsync(tmp)


def incomplete_reason(path: Path) -> str | None:
    """Why checkpoint directory `path` is not complete (missing, unsealed, a file missing or resized)."""
    if not path.is_dir():
        return "it does not exist"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"it has no readable {MANIFEST} (a save that never finished)"
    for rel, size in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, the manifest says {size}"
    return None


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
    for stale in out.glob(".step_*.tmp"):  # saves killed before their rename
        shutil.rmtree(stale, ignore_errors=True)
    final = out / _name(step)
    tmp = out / f".{_name(step)}.tmp"
    # disk full (one line naming OUT), I/O error: free the space now; `latest` still names the last checkpoint
    with naming_full_disk(out, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True)):
        tmp.mkdir()
        write_model(tmp)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1, default=str))
        _seal(tmp, step)
    if final.exists():  # a complete checkpoint of this step from a run that `latest` no longer names
        old = out / f".{_name(step)}.old.tmp"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    _fsync(out)
    pointer = out / f".{_POINTER}.tmp"
    with naming_full_disk(out, cleanup=lambda: pointer.unlink(missing_ok=True)):  # `latest` stays the old one
        pointer.write_text(final.name)
        _fsync(pointer)
        os.replace(pointer, out / _POINTER)
    _fsync(out)
    done = sorted(
        (p for p in out.glob("step_*") if p.is_dir() and checkpoint_step(p) is not None), key=checkpoint_step
    )
    for p in [p for p in done if p != final][: max(len(done) - keep, 0)]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str | Path | None) -> Path | None:
    """The checkpoint `latest` names (None when there is none yet). A pointer naming an incomplete
    directory is a one-line ValueError: it cannot be written by `save_checkpoint`, only by damage."""
    if output_dir is None:
        return None
    out = Path(output_dir)
    pointer = out / _POINTER
    if not pointer.exists():
        return None
    path = out / pointer.read_text().strip()
    reason = incomplete_reason(path)
    if reason is not None:
        raise ValueError(
            f"train.output_dir: {pointer} names {path.name}, which is incomplete ({reason}); point it at a "
            f"complete step_* directory or use a new train.output_dir"
        )
    return path


def verify_checkpoint(path: Path) -> None:
    """Content check before a resume reads the checkpoint: every file's sha256 against the manifest (a
    checkpoint sealed before hashes were recorded is checked by size only). One line naming the file."""
    manifest = json.loads((path / MANIFEST).read_text())
    for rel, digest in manifest.get("sha256", {}).items():
        if _sha256(path / rel) != digest:
            raise ValueError(
                f"train.output_dir: checkpoint file {path / rel} is corrupted (sha256 differs from its "
                f"{MANIFEST}); point {path.parent / _POINTER} at an intact step_* directory or use a new "
                "train.output_dir"
            )


def load_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer_state.json").read_text())
