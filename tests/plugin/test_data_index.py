"""plugin/data.py's index file through SpecForge's own offline loader: every trained store index arrives
once, in order, whatever the batch size and loader workers; the file holds one mask, not one tensor per
sample (its load is what SpecForge pays per sample)."""

from __future__ import annotations

import pytest
import torch

STRATEGY = "dflash-csbp"


def _store(root, lengths_and_loss):
    from specforge_csbp.data.manifest import TargetInfo
    from specforge_csbp.data.store import FeatureStoreWriter

    with FeatureStoreWriter(str(root), target=TargetInfo(name="t"), target_layer_ids=[0], hidden_size=4,
                            dtype="float32") as w:  # fmt: skip
        for i, (length, supervised) in enumerate(lengths_and_loss):
            mask = torch.zeros(length, dtype=torch.long)
            mask[length - supervised :] = 1
            w.add(str(i), torch.arange(length), mask, torch.randn(length, 4))
    return str(root)


@pytest.fixture
def store(tmp_path):
    # sample 2 has one supervised token: no anchor, filtered by the reader as SpecForge does
    return _store(tmp_path / "store", [(8, 4), (6, 3), (5, 1), (9, 9), (7, 2), (4, 2), (8, 5)])


@pytest.mark.parametrize("batch_size,workers", [(1, 0), (3, 0), (2, 2)])
def test_specforge_loader_yields_every_trained_index_in_order(store, batch_size, workers):
    from specforge.runtime.data_plane import FeatureDataLoader, LocalFeatureStore

    from specforge_csbp.plugin.data import FEATURE, StoreIndexReader, build_collator, build_normalizer

    reader = StoreIndexReader(STRATEGY, store, run_id="r", ttt_length=7, max_len=100)
    assert reader.indices == [0, 1, 3, 4, 5, 6]
    refs = reader.read()
    assert len({r.feature_store_uri for r in refs}) == 1  # one index file for the whole store
    loader = FeatureDataLoader(LocalFeatureStore(f"r{batch_size}{workers}"), refs=refs, batch_size=batch_size,
                               collate_fn=build_collator(), per_sample_transform=build_normalizer(100),
                               drop_last=False, strategy=STRATEGY, num_workers=workers)  # fmt: skip
    got = [b.tensors[FEATURE].tolist() for b in loader]
    flat = [i for b in got for i in b]
    assert flat == reader.indices
    assert all(len(b) == batch_size for b in got[:-1])


def test_index_file_holds_one_mask_and_refuses_other_keys(store):
    from specforge.runtime.data_plane.feature_store import load_feature_file

    from specforge_csbp.plugin.data import StoreIndexKeys, StoreIndexReader

    reader = StoreIndexReader(STRATEGY, store, run_id="r", ttt_length=7, max_len=100)
    raw = load_feature_file(reader.read()[0].feature_store_uri[len("file://") :])  # SpecForge's own load
    assert isinstance(raw, StoreIndexKeys) and raw.trained.tolist() == [
        True,
        True,
        False,
        True,
        True,
        True,
        True,
    ]
    assert torch.equal(raw[StoreIndexReader.key(6)], torch.tensor([6]))
    for key in (StoreIndexReader.key(2), StoreIndexReader.key(7), "s-1", "hidden_states", 3):
        assert key not in raw
    with pytest.raises(KeyError):
        raw[StoreIndexReader.key(2)]
