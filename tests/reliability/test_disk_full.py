"""A full disk in any save - train-bdlm and plugin (SpecForge) checkpoints, export, eval JSON, capture /
import - is one line that says the disk is full and names the directory, and `latest` still names the last
complete checkpoint. Fast unit tests with a writer that raises ENOSPC (or torch's zip writer's short-write
error), then the real thing on a 2 MiB tmpfs in a private mount namespace."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import specforge_csbp.data.store as store_mod
import specforge_csbp.errors as errors_mod
from specforge_csbp.data import FeatureStoreWriter, TargetInfo
from specforge_csbp.errors import one_line
from specforge_csbp.outputs import naming_full_disk, staged_dir, write_json_atomic
from specforge_csbp.training.checkpoint import latest_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ENOSPC = OSError(errno.ENOSPC, "No space left on device")  # as a write() raises it: no file name
ZIP_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 8997129408 vs 8997129308"


def _says_disk_full(err: BaseException, directory) -> str:
    line = one_line(err)
    assert "\n" not in line and "disk full" in line and str(directory) in line, line
    return line


def _save(out, step, model=lambda p: (p / "model.safetensors").write_bytes(b"m")):
    return save_checkpoint(out, step, write_model=model, optimizer_state={"lr": 1.0}, trainer_state={"step": step})


@pytest.mark.parametrize("failure", ["enospc", "zip-short-write"])
def test_a_train_bdlm_checkpoint_on_a_full_disk_is_one_line_and_latest_stays(tmp_path, monkeypatch, failure):
    out = tmp_path / "run"
    first = _save(out, 1)
    monkeypatch.setattr(errors_mod, "_NEARLY_FULL_BYTES", 1 << 62)  # the zip writer's error: judged by free space

    def model(p):
        (p / "model.safetensors").write_bytes(b"partial")
        raise ENOSPC if failure == "enospc" else RuntimeError(ZIP_SHORT_WRITE)

    with pytest.raises(OSError) as err:
        _save(out, 2, model)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(out)
    _says_disk_full(err.value, out)
    assert latest_checkpoint(out) == first
    assert sorted(p.name for p in out.iterdir()) == ["latest", "step_00000001"]  # the partial save is gone


def test_a_short_write_with_space_left_is_not_called_a_full_disk(tmp_path):
    with pytest.raises(RuntimeError, match="unexpected pos"):  # an I/O error on a disk with room: as it is
        with naming_full_disk(tmp_path):
            raise RuntimeError(ZIP_SHORT_WRITE)


def test_a_plugin_checkpoint_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    """SpecForge's CheckpointManager reports every rank's failure as one RuntimeError; the plugin's worker
    (plugin/launch.py) judges it against the run's output_dir."""
    monkeypatch.setattr(errors_mod, "_NEARLY_FULL_BYTES", 1 << 62)
    with pytest.raises(OSError) as err:
        with naming_full_disk(tmp_path):
            raise RuntimeError(f"checkpoint save failed: rank 0: RuntimeError: {ZIP_SHORT_WRITE}")
    _says_disk_full(err.value, tmp_path)


def test_eval_json_and_every_atomic_text_output_on_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "eval.json"
    write_json_atomic(path, {"tau": 1.0})

    def fsync(fd):
        raise ENOSPC

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError) as err:
        write_json_atomic(path, {"tau": 2.0})
    _says_disk_full(err.value, tmp_path)
    assert json.loads(path.read_text()) == {"tau": 1.0} and os.listdir(tmp_path) == ["eval.json"]


def test_an_export_on_a_full_disk_leaves_the_old_export(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(OSError) as err:
        with staged_dir(out) as tmp:
            Path(tmp, "model.safetensors").write_bytes(b"partial")
            raise ENOSPC
    _says_disk_full(err.value, tmp_path)
    assert os.listdir(tmp_path) == ["export"] and os.listdir(out) == ["config.json"]


def test_a_capture_or_import_on_a_full_disk_names_the_store(tmp_path, monkeypatch):
    root = tmp_path / "store"

    def save_file(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                           '"No space left on device" })')  # fmt: skip

    with FeatureStoreWriter(str(root), target=TargetInfo(name="t"), target_layer_ids=[0], hidden_size=2,
                            dtype="float32") as w:  # fmt: skip
        w.add("a", torch.arange(3), torch.ones(3, dtype=torch.long), torch.zeros(3, 2))
        monkeypatch.setattr(store_mod, "save_file", save_file)
        with pytest.raises(OSError) as err:
            w.add("b", torch.arange(3), torch.ones(3, dtype=torch.long), torch.zeros(3, 2))
    assert err.value.filename == str(root)
    _says_disk_full(err.value, root)
    assert sorted(os.listdir(root / "samples")) == ["00000000.safetensors"]  # the partial file removed


_ON_TMPFS = textwrap.dedent('''
    import json, os, sys
    import torch
    from specforge_csbp.errors import one_line
    from specforge_csbp.outputs import naming_full_disk, staged_dir, write_json_atomic
    from specforge_csbp.training.checkpoint import latest_checkpoint, save_checkpoint
    from specforge_csbp.data import FeatureStoreWriter, TargetInfo
    from specforge.training.checkpoint import CheckpointManager

    disk, lines = sys.argv[1], {}
    big = {"w": torch.randn(1 << 20)}  # 4 MiB: more than the 2 MiB disk holds

    def attempt(name, fn):
        try:
            fn()
            lines[name] = "no error"
        except Exception as err:
            lines[name] = one_line(err)

    ckpt = os.path.join(disk, "bdlm")
    save_checkpoint(ckpt, 1, write_model=lambda p: (p / "model.safetensors").write_bytes(b"m"),
                    optimizer_state={}, trainer_state={})
    attempt("train-bdlm checkpoint", lambda: save_checkpoint(
        ckpt, 2, write_model=lambda p: (p / "model.safetensors").write_bytes(b"m"), optimizer_state=big,
        trainer_state={}))
    lines["latest"] = latest_checkpoint(ckpt).name
    plugin = os.path.join(disk, "plugin")
    manager = CheckpointManager(plugin, run_id="run")
    manager.save({"tiny": 1}, 1)

    def plugin_save():
        with naming_full_disk(plugin):  # what the plugin's worker wraps SpecForge's run in
            manager.save(big, 2)

    attempt("plugin checkpoint", plugin_save)
    lines["plugin latest"] = os.readlink(os.path.join(plugin, "run-latest"))
    attempt("eval json", lambda: write_json_atomic(os.path.join(disk, "eval.json"), {"x": "y" * (3 << 20)}))

    def export():
        with staged_dir(os.path.join(disk, "export")) as tmp:
            torch.save(big, os.path.join(tmp, "model.pt"))

    attempt("export", export)

    def capture():
        with FeatureStoreWriter(os.path.join(disk, "store"), target=TargetInfo(name="t"), target_layer_ids=[0],
                                hidden_size=1024, dtype="float32") as w:
            w.add("a", torch.arange(1024), torch.ones(1024, dtype=torch.long), torch.zeros(1024, 1024))

    attempt("capture", capture)
    print(json.dumps(lines))
''')


def test_a_real_full_disk_in_every_save(tmp_path):
    """A 2 MiB tmpfs (root, a private mount namespace): the real writers fill it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(_ON_TMPFS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=2m tmpfs "{disk}" && exec "{sys.executable}" "{script}" "{disk}"'],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = json.loads(done.stdout.strip().splitlines()[-1])
    where = {"train-bdlm checkpoint": disk / "bdlm", "plugin checkpoint": disk / "plugin", "eval json": disk,
             "export": disk, "capture": disk / "store"}  # fmt: skip
    for name, directory in where.items():
        assert lines[name].startswith(f"cannot write {directory}: No space left on device (disk full)"), (name, lines)
    assert lines["latest"] == "step_00000001" and lines["plugin latest"] == "run-step1"
