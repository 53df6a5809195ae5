"""Atomic checkpoints: a save killed at any point leaves `latest` naming a complete checkpoint.

Every file-system operation of `save_checkpoint` (and the model writer) is a crash point: the test replays
the save of step 2 once per point, stopping it there (the on-disk state equals a SIGKILL at that moment,
as the save has no cleanup path), and checks that `latest` names step 1 or step 2, complete, and that the
next save succeeds and removes the leftovers. A real SIGKILL during a trainer save is in
tests/reliability/test_exact_resume.py.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
import torch

from specforge_csbp.training import checkpoint as ckpt


class _Killed(BaseException):
    pass


def _model_writer(path: pathlib.Path) -> None:
    torch.save({"w": torch.arange(1000.0)}, path / "model.pt")
    (path / "config.json").write_text("{}")


def _save(out, step, keep=8):
    return ckpt.save_checkpoint(out, step, write_model=_model_writer, optimizer_state={"s": torch.ones(100)},
                                trainer_state={"step": step}, keep=keep)  # fmt: skip


def _crash_at(monkeypatch, k: int) -> list[int]:
    """Make the k-th file-system operation raise (before it happens); returns the live counter."""
    count = [0]

    def wrap(fn):
        def inner(*a, **kw):
            if count[0] == k:
                raise _Killed
            count[0] += 1
            return fn(*a, **kw)

        return inner

    for owner, name in ((os, "replace"), (os, "fsync"), (shutil, "rmtree"), (torch, "save"),
                        (pathlib.Path, "write_text"), (pathlib.Path, "mkdir")):  # fmt: skip
        monkeypatch.setattr(owner, name, wrap(getattr(owner, name)))
    return count


def test_a_save_killed_at_any_point_leaves_latest_complete(tmp_path, monkeypatch):
    points = 0
    while True:
        out = tmp_path / f"k{points}"
        _save(out, 1)
        with monkeypatch.context() as m:
            _crash_at(m, points)
            try:
                _save(out, 2)
                finished = True
            except _Killed:
                finished = False
        latest = ckpt.latest_checkpoint(out)
        assert latest is not None and latest.name in ("step_00000001", "step_00000002"), points
        assert ckpt.incomplete_reason(latest) is None
        assert ckpt.load_trainer_state(latest)["step"] == ckpt.checkpoint_step(latest)
        _save(out, 3)  # the next save works and leaves no temporary directory behind
        assert ckpt.latest_checkpoint(out).name == "step_00000003"
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
        if finished:
            break
        points += 1
    assert points >= 15  # every write, fsync, rename and removal of a save was a crash point


def test_latest_pointing_at_an_incomplete_checkpoint_is_one_line(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / "step_00000001" / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=r"^train.output_dir: .*latest names step_00000001, which is incomplete "
                       r"\(optimizer.pt is missing\); point it at a complete step_\* directory") as err:  # fmt: skip
        ckpt.latest_checkpoint(tmp_path)
    assert len(str(err.value).splitlines()) == 1
    (tmp_path / "latest").write_text("step_00000009")
    with pytest.raises(ValueError, match=r"names step_00000009, which is incomplete \(it does not exist\)"):
        ckpt.latest_checkpoint(tmp_path)


def test_keep_bounds_the_checkpoints_and_never_drops_latest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000004", "step_00000005"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000005"
