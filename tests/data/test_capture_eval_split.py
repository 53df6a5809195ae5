"""`specforge-csbp capture --eval-fraction F`: a deterministic held-out split written as its own store
(OUT-eval, data/split.py) that `data.eval_hidden_states_path` can point at; bad fractions are one-line errors."""

import pytest
import torch

from specforge_csbp.assets import TINY_DATASET, TINY_TARGET_DIR
from specforge_csbp.cli.main import main
from specforge_csbp.data import FeatureStore
from specforge_csbp.data.split import check_eval_fraction, eval_store_dir, held_out


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _capture(capsys, out, *extra):
    return _run(capsys, "capture", "--target", TINY_TARGET_DIR, "--data", TINY_DATASET, "--out", out,
                "--max-length", "40", "--target-layer-ids", "1,3", "--no-progress", *extra)  # fmt: skip


def test_split_is_a_pure_function_of_the_sample_id():
    ids = [f"{i:08d}" for i in range(2000)]
    picked = [i for i in ids if held_out(i, 0.2)]
    assert 300 < len(picked) < 500  # about a fifth
    assert picked == [i for i in reversed(ids) if held_out(i, 0.2)][::-1]  # order does not matter
    assert set(i for i in ids if held_out(i, 0.1)) <= set(picked)  # a smaller share is a subset
    assert not any(held_out(i, 0.0) for i in ids)
    assert eval_store_dir("runs/store/") == "runs/store-eval"


def test_capture_writes_a_disjoint_eval_store(tmp_path, capsys):
    out, whole = str(tmp_path / "store"), str(tmp_path / "whole")
    code, stdout, _ = _capture(capsys, out, "--eval-fraction", "0.25")
    assert code == 0, stdout
    train, held = FeatureStore(out, verify="full"), FeatureStore(out + "-eval", verify="full")
    assert f"train with data.eval_hidden_states_path={out}-eval" in stdout
    assert len(held) > 0 and len(train) > len(held)
    assert not set(train.sample_ids) & set(held.sample_ids)
    assert all(held_out(s, 0.25) for s in held.sample_ids) and not any(held_out(s, 0.25) for s in train.sample_ids)
    assert (held.target_layer_ids, held.hidden_size, held.manifest.target) == (
        train.target_layer_ids, train.hidden_size, train.manifest.target,
    )  # same target and layers: the plugin's store checks accept both
    # together they are the capture without a split, sample for sample
    assert _capture(capsys, whole)[0] == 0
    everything = FeatureStore(whole)
    assert sorted(train.sample_ids + held.sample_ids) == sorted(everything.sample_ids)
    sid = held.sample_ids[0]
    n = held.length(sid)
    assert torch.equal(held.read_intervals(sid, [(0, n)]), everything.read_intervals(sid, [(0, n)]))
    # a resumed capture keeps every sample on its side
    code, stdout, _ = _capture(capsys, out, "--eval-fraction", "0.25", "--resume")
    assert code == 0 and f"kept {len(everything)} from an earlier run" in stdout
    assert FeatureStore(out).sample_ids == train.sample_ids


@pytest.mark.parametrize("fraction", ["-0.1", "1", "1.5", "nan"])
def test_bad_eval_fraction_is_one_line(tmp_path, capsys, fraction):
    code, _, err = _capture(capsys, str(tmp_path / "s"), "--eval-fraction", fraction)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--eval-fraction: must be in [0, 1)" in err
    assert not (tmp_path / "s").exists() and not (tmp_path / "s-eval").exists()


def test_check_eval_fraction_accepts_shares():
    assert check_eval_fraction(0) == 0.0 and check_eval_fraction(0.5) == 0.5
