"""Importing SpecForge 0.2.0 offline DFlash records.

The records are built with SpecForge's own DFlash capture layout (`OfflineCaptureLayout.materialize` from
its DFlash providers) and saved the way `scripts/prepare_hidden_states.py` saves them (torch.save, or
through gzip, as rows_{g}-{g+2000}/data_{idx}.ckpt[.gz]) - the script itself needs sglang and CUDA. They
are read back with SpecForge's own DFlash offline reader and normalizer, and the imported store must
hold exactly what SpecForge's trainer would see, sample by sample, in SpecForge's order.
"""

import gzip
import os

import pytest
import torch
from specforge.algorithms.common.dflash_family_data import build_offline_reader, normalize_offline_sample
from specforge.algorithms.dflash.providers import algorithm_providers
from specforge.runtime.data_plane.feature_store import LocalFeatureStore

from specforge_csbp.assets import TINY_TARGET_DIR
from specforge_csbp.cli.main import main
from specforge_csbp.data import FeatureStore

LAYERS, HIDDEN = [1, 2, 3], 64
WIDTH = len(LAYERS) * HIDDEN


def _write_records(root, n=12, width=WIDTH, compress_every=3):
    """n records with indices 0..n-1 (data_10 sorts before data_2, as in SpecForge's reader)."""
    layout = algorithm_providers().offline[0].capture_layout
    g = torch.Generator().manual_seed(0)
    for idx in range(n):
        length = 5 + 7 * idx
        record = layout.materialize({
            "input_ids": torch.randint(0, 512, (length,), generator=g),
            "loss_mask": (torch.arange(length) >= 2).long(),
            "aux_hidden_states": torch.randn(1, length, width, generator=g).to(torch.bfloat16),
            "last_hidden_states": None,
        })  # fmt: skip
        group = os.path.join(root, "rows_0-2000")
        os.makedirs(group, exist_ok=True)
        if idx % compress_every == 2:
            with gzip.open(os.path.join(group, f"data_{idx}.ckpt.gz"), "wb") as f:
                torch.save(record, f)
        else:
            torch.save(record, os.path.join(group, f"data_{idx}.ckpt"))
    return root


def _specforge_view(src, max_len):
    """What SpecForge 0.2.0's DFlash offline pipeline hands its trainer, in order."""
    reader = build_offline_reader("dflash", src, run_id="offline", ttt_length=1, max_len=max_len)
    fs = LocalFeatureStore()
    out = []
    for ref in reader:
        raw, handle = fs.get(ref)
        out.append((ref.sample_id, normalize_offline_sample(raw, max_len)))
        fs.release(handle)
    return out


@pytest.mark.parametrize("max_len", [10_000, 40])
def test_import_matches_specforges_own_reader(tmp_path, capsys, max_len):
    src = _write_records(str(tmp_path / "records"))
    out = str(tmp_path / "store")
    code = main([
        "import-specforge", src, out, "--target-layer-ids", "1,2,3", "--target", TINY_TARGET_DIR,
        "--max-length", str(max_len), "--no-progress",
    ])  # fmt: skip
    assert code == 0 and "wrote 12 samples" in capsys.readouterr().out
    store = FeatureStore(out, verify="full")
    assert store.manifest.source == "specforge-import" and store.manifest.dtype == "bfloat16"
    expected = _specforge_view(src, max_len)
    assert [e.source_file for e in store.manifest.samples][:3] == [
        "rows_0-2000/data_0.ckpt",
        "rows_0-2000/data_1.ckpt",
        "rows_0-2000/data_10.ckpt",
    ]
    assert len(store) == len(expected) == 12
    for sid, (sf_id, sf) in zip(store.sample_ids, expected, strict=True):
        assert sf_id == f"offline:{sid}"  # same index as SpecForge's sample ids
        ids, mask = store.read_tokens(sid)
        assert torch.equal(ids, sf["input_ids"][0]) and torch.equal(mask, sf["loss_mask"][0])
        rows = store.read_intervals(sid, [(0, store.length(sid))])
        assert rows.dtype == torch.bfloat16 and torch.equal(rows, sf["hidden_states"][0])


def test_import_errors_name_the_file(tmp_path, capsys):
    src = _write_records(str(tmp_path / "records"), n=3)
    code = main(
        ["import-specforge", src, str(tmp_path / "s1"), "--target-layer-ids", "1,2", "--hidden-size", "64"]
    )
    err = capsys.readouterr().err
    assert (
        code == 2
        and "data_0.ckpt: feature width 192 != len(target_layer_ids) x hidden_size = 2 x 64 = 128" in err
    )
    victim = os.path.join(src, "rows_0-2000", "data_1.ckpt")
    with open(victim, "wb") as f:
        f.write(b"not a torch file")
    code = main(["import-specforge", src, str(tmp_path / "s2"), "--target-layer-ids", "1,2,3",
                 "--hidden-size", "64", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and f"corrupted SpecForge record {victim}" in err and len(err.strip().splitlines()) == 1
    # the sample converted before the bad one is listed, but the store is marked incomplete: a reader refuses
    # it (naming how to redo it), and --overwrite replaces it
    with pytest.raises(ValueError, match="is incomplete .*rerun `import-specforge` with --overwrite"):
        FeatureStore(str(tmp_path / "s2"))
    code = main(["import-specforge", str(tmp_path / "empty"), str(tmp_path / "s3"), "--target-layer-ids", "1",
                 "--hidden-size", "64"])  # fmt: skip
    assert code == 2 and "neither a SpecForge record file nor a directory" in capsys.readouterr().err
