"""data/fingerprint.py: one digest per target's weights - the same weights however they are saved, other
weights (another seed, one training step, one probed value) another digest; no weights, no digest."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_csbp.assets import materialize_tiny_target
from specforge_csbp.data.fingerprint import PROBE_VALUES, weights_fingerprint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp") / "target"
    materialize_tiny_target(str(root), seed=0)
    return root


def _copy_with(tmp_path, target, name, change):
    """A copy of `target` whose weights are `change(weights)` (saved as `name`, possibly several files)."""
    out = tmp_path / name
    shutil.copytree(target, out)
    (out / "model.safetensors").unlink()
    for file, tensors in change(load_file(str(target / "model.safetensors"))).items():
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    return out


def test_the_same_weights_give_the_same_digest_whatever_the_dtype_or_sharding(target, tmp_path):
    base = weights_fingerprint(str(target))
    assert base is not None and len(base) == 64
    assert weights_fingerprint(str(target)) == base  # deterministic
    bf16 = _copy_with(tmp_path, target, "bf16", lambda w: {"model.safetensors": {k: v.bfloat16() for k, v in w.items()}})
    bf16_twice = weights_fingerprint(str(bf16))
    # float32 values hashed as bfloat16: the bfloat16 copy of the same weights has the same digest
    assert bf16_twice == base

    def shard(w):
        names = sorted(w)
        return {"model-00001-of-00002.safetensors": {k: w[k] for k in names[::2]},
                "model-00002-of-00002.safetensors": {k: w[k] for k in names[1::2]}}  # fmt: skip

    assert weights_fingerprint(str(_copy_with(tmp_path, target, "sharded", shard))) == base


def test_other_weights_of_the_same_config_give_another_digest(target, tmp_path):
    base = weights_fingerprint(str(target))
    other = tmp_path / "seed1"
    materialize_tiny_target(str(other), seed=1)
    assert weights_fingerprint(str(other)) != base

    def step(w):  # one optimizer step's worth of change to every weight
        g = torch.Generator().manual_seed(0)
        return {"model.safetensors": {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in w.items()}}

    assert weights_fingerprint(str(_copy_with(tmp_path, target, "step", step))) != base

    def one_value(w):  # a single probed value of one matrix (row 0, the first PROBE_VALUES columns are read)
        key = min(k for k in w if w[k].dim() == 2)
        changed = w[key].clone()
        changed[0, min(PROBE_VALUES, changed.shape[1]) - 1] += 1.0
        return {"model.safetensors": {**w, key: changed}}

    assert weights_fingerprint(str(_copy_with(tmp_path, target, "one", one_value))) != base

    def renamed(w):  # the same values under another tensor name: another model
        key = min(w)
        return {"model.safetensors": {**{k: v for k, v in w.items() if k != key}, key + "_x": w[key]}}

    assert weights_fingerprint(str(_copy_with(tmp_path, target, "renamed", renamed))) != base


def test_no_safetensors_weights_no_digest_and_a_broken_file_is_one_line(target, tmp_path):
    assert weights_fingerprint(None) is None
    assert weights_fingerprint("Qwen/Qwen3-8B") is None  # a hub name: checked where it is resolved
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(target / "config.json", config_only / "config.json")
    assert weights_fingerprint(str(config_only)) is None
    (config_only / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"^target weights: .*model.safetensors is not a readable safetensors file"):
        weights_fingerprint(str(config_only))
