"""The feature store: round trips, interval-only reads per rank, integrity errors, compatibility checks."""

import json
import os

import pytest
import torch

import specforge_csbp.data.store as store_mod
from specforge_csbp.data import FeatureStore, FeatureStoreWriter, ShardedFeatureDataset, TargetInfo
from specforge_csbp.layout import ZigzagShards

LAYERS, HIDDEN = [1, 3, 4], 8
WIDTH = len(LAYERS) * HIDDEN
LENGTHS = [37, 64, 5, 100, 16]  # uneven, shorter than a block, block-aligned


def _samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, 500, (n,), generator=g)
        mask = (torch.rand(n, generator=g) > 0.3).long()
        hidden = torch.randn(n, WIDTH, generator=g, dtype=torch.float64)
        out.append((f"s{i}", ids, mask, hidden))
    return out


def _write(root, samples, dtype="float64", **kw):
    with FeatureStoreWriter(
        root, target=TargetInfo(name="test-target", config_sha256="abc"), target_layer_ids=LAYERS,
        hidden_size=HIDDEN, dtype=dtype, **kw,
    ) as w:  # fmt: skip
        for sid, ids, mask, hidden in samples:
            w.add(sid, ids, mask, hidden)
    return root


def test_round_trip_whole_and_intervals(tmp_path):
    samples = _samples()
    root = _write(str(tmp_path / "store"), samples)
    assert not [n for n in os.listdir(os.path.join(root, "samples")) if ".tmp" in n]  # renames completed
    store = FeatureStore(root, verify="full")
    assert store.sample_ids == [s[0] for s in samples]
    assert (store.target_layer_ids, store.hidden_size, store.feature_width) == (LAYERS, HIDDEN, WIDTH)
    for sid, ids, mask, hidden in samples:
        got_ids, got_mask = store.read_tokens(sid)
        assert torch.equal(got_ids, ids) and torch.equal(got_mask, mask)
        n = hidden.shape[0]
        assert torch.equal(store.read_intervals(sid, [(0, n)]), hidden)
        cuts = [(0, n // 3), (n // 2, n)]
        assert torch.equal(store.read_intervals(sid, cuts), torch.cat([hidden[lo:hi] for lo, hi in cuts]))
        assert store.read_intervals(sid, []).shape == (0, WIDTH)
        assert store.entry(sid).num_loss_tokens == int(mask.sum())
    with pytest.raises(ValueError, match=r"intervals: \[0, 38\) is not inside sample 's0' of length 37"):
        store.read_intervals("s0", [(0, 38)])
    with pytest.raises(ValueError, match="sample_id: 'nope' is not in the store"):
        store.read_tokens("nope")


def test_store_dtype_is_the_one_asked_for(tmp_path):
    samples = _samples()
    store = FeatureStore(_write(str(tmp_path / "bf16"), samples, dtype="bfloat16"))
    rows = store.read_intervals("s1", [(0, 64)])
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, samples[1][3].to(torch.bfloat16))


@pytest.mark.parametrize("chunk_rows", [3, 4])
def test_a_rank_reads_only_its_zigzag_intervals(tmp_path, monkeypatch, chunk_rows):
    """Every hidden-state read of a rank is one of its zigzag intervals (clipped to the real length), rounded
    out to whole checksummed chunks, and every byte read is hashed; a whole-sequence read fails this."""
    samples = _samples()
    row_bytes = WIDTH * 8
    root = _write(str(tmp_path / "store"), samples, chunk_bytes=chunk_rows * row_bytes)
    store = FeatureStore(root, verify="lazy")
    assert store.manifest.chunk_rows == chunk_rows
    checked = []
    real_check = store_mod.FeatureStore._check_chunk

    def check(self, entry, k, chunk):
        checked.append((entry.id, k))
        return real_check(self, entry, k, chunk)

    monkeypatch.setattr(store_mod.FeatureStore, "_check_chunk", check)
    for world in (1, 2, 3, 4):
        for block in (4, 16):
            rebuilt = {
                sid: torch.full((len(ids), WIDTH), float("nan"), dtype=torch.float64)
                for sid, ids, _, _ in samples
            }
            for rank in range(world):
                ds = ShardedFeatureDataset(
                    store, rank=rank, world_size=world, block_size=block, pad_token_id=7
                )
                for i, (sid, ids, mask, _) in enumerate(samples):
                    checked.clear()
                    start = store.bytes_read
                    store.read_tokens(sid)
                    tokens = store.bytes_read - start  # header + tokens + mask, which ds[i] reads too
                    before = (store.bytes_read, store.bytes_hashed)
                    item = ds[i]
                    n = len(ids)
                    zig = ZigzagShards(-(-n // block) * block, block, world)
                    wanted = [(lo, min(hi, n)) for lo, hi in zig.rank_intervals(rank) if min(hi, n) > lo]
                    rounded = [(lo // chunk_rows * chunk_rows, min(-(-hi // chunk_rows) * chunk_rows, n))
                               for lo, hi in wanted]  # fmt: skip
                    chunks = sorted(k for lo, hi in wanted for k in range(lo // chunk_rows, -(-hi // chunk_rows)))
                    assert sorted(k for s_, k in checked) == chunks and {s_ for s_, _ in checked} <= {sid}
                    read = store.bytes_read - before[0] - tokens
                    assert read == sum(hi - lo for lo, hi in rounded) * row_bytes, (world, block, rank, sid)
                    assert store.bytes_hashed - before[1] == store.bytes_read - before[0]  # every byte read, hashed
                    # the rows read are the rank's share, plus at most a partial chunk at each end
                    assert sum(hi - lo for lo, hi in rounded) <= sum(hi - lo for lo, hi in wanted) + 2 * (chunk_rows - 1) * len(wanted)
                    if world > 1 and n > 2 * block:
                        assert len(set(chunks)) * chunk_rows < n
                    # tokens whole and padded; rows zero on padding
                    assert item.seq_len == zig.seq_len and item.intervals == zig.rank_intervals(rank)
                    assert torch.equal(item.positions, zig.rank_positions(rank))
                    assert torch.equal(item.input_ids[:n], ids) and (item.input_ids[n:] == 7).all()
                    assert torch.equal(item.loss_mask[:n], mask) and (item.loss_mask[n:] == 0).all()
                    real = item.positions < n
                    assert (item.hidden_states[~real] == 0).all()
                    rebuilt[sid][item.positions[real]] = item.hidden_states[real]
            for sid, _, _, hidden in samples:
                assert torch.equal(rebuilt[sid], hidden)  # the ranks' shards tile each sample exactly


def _corrupt_byte(path, offset_from_end=10):
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _one_line_error(fn, match):
    with pytest.raises(ValueError, match=match) as err:
        fn()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_corrupted_and_missing_files_are_named(tmp_path):
    root = _write(str(tmp_path / "store"), _samples())
    victim = os.path.join(root, "samples", "00000001.safetensors")
    _corrupt_byte(victim)
    msg = _one_line_error(lambda: FeatureStore(root, verify="full"), "corrupted store file .*sha256")
    assert victim in msg
    FeatureStore(root, verify="trust")  # trust mode checks sizes only: documented, cheap for long samples
    with open(victim, "ab") as f:
        f.write(b"x")
    msg = _one_line_error(
        lambda: FeatureStore(root, verify="trust"), "corrupted store file .*bytes, manifest says"
    )
    assert victim in msg
    os.remove(victim)
    msg = _one_line_error(lambda: FeatureStore(root, verify="trust"), "missing store file")
    assert victim in msg and "'s1'" in msg
    _one_line_error(lambda: FeatureStore(str(tmp_path / "nowhere")), "store: missing .*manifest.json")
    _one_line_error(lambda: FeatureStore(root, verify="sometimes"), "verify must be one of full, lazy, trust")


def test_corrupted_header_in_trust_mode_is_named(tmp_path):
    root = _write(str(tmp_path / "store"), _samples())
    victim = os.path.join(root, "samples", "00000002.safetensors")
    with open(victim, "r+b") as f:  # same size, broken header length
        f.write(b"\xff" * 8)
    store = FeatureStore(root, verify="trust")
    msg = _one_line_error(lambda: store.read_intervals("s2", [(0, 1)]), "corrupted or missing store file")
    assert victim in msg


def test_bad_manifest_is_one_line(tmp_path):
    root = _write(str(tmp_path / "store"), _samples())
    path = os.path.join(root, "manifest.json")
    with open(path) as f:
        data = json.load(f)
    data["dtype"] = "int8"
    with open(path, "w") as f:
        json.dump(data, f)
    _one_line_error(lambda: FeatureStore(root), "dtype must be one of bfloat16, float16, float32, float64")


def test_compatibility_with_a_drafter(tmp_path):
    store = FeatureStore(_write(str(tmp_path / "store"), _samples()))
    store.check_compatible(LAYERS, HIDDEN)
    _one_line_error(
        lambda: store.check_compatible([1, 3, 5], HIDDEN), r"target_layer_ids: .*\[1, 3, 4\].*\[1, 3, 5\]"
    )
    _one_line_error(lambda: store.check_compatible(LAYERS, 16), r"feature width: .*24 features.*3 x 16 = 48")


def test_writer_validates_and_never_clobbers(tmp_path):
    root = str(tmp_path / "store")
    writer = FeatureStoreWriter(
        root, target=TargetInfo(name="t"), target_layer_ids=LAYERS, hidden_size=HIDDEN, dtype="float32"
    )
    ids, mask = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.long)
    _one_line_error(
        lambda: writer.add("a", ids, mask, torch.zeros(4, WIDTH + 1)), r"hidden_states: expected \[L, 24\]"
    )
    _one_line_error(
        lambda: writer.add("a", ids[:3], mask, torch.zeros(4, WIDTH)), r"input_ids: expected shape \[4\]"
    )
    writer.add("a", ids, mask, torch.zeros(4, WIDTH))
    _one_line_error(lambda: writer.add("a", ids, mask, torch.zeros(4, WIDTH)), "already in the store")
    writer.close()
    make = lambda **kw: FeatureStoreWriter(
        root, target=TargetInfo(name="t"), target_layer_ids=LAYERS, hidden_size=HIDDEN, dtype="float32", **kw
    )
    _one_line_error(make, "already exists and is not empty .*--overwrite")
    make(overwrite=True).close()
    assert len(FeatureStore(root)) == 0
    other = tmp_path / "precious"
    other.mkdir()
    (other / "thesis.tex").write_text("x")
    _one_line_error(
        lambda: FeatureStoreWriter(str(other), target=TargetInfo(name="t"), target_layer_ids=LAYERS,
                                   hidden_size=HIDDEN, dtype="float32", overwrite=True),
        "holds no manifest.json; refusing",
    )  # fmt: skip
    assert (other / "thesis.tex").exists()
    _one_line_error(
        lambda: FeatureStoreWriter(str(tmp_path / "x"), target=TargetInfo(name="t"), target_layer_ids=[2, 2],
                                   hidden_size=HIDDEN, dtype="float32"),
        "target_layer_ids must be non-empty and unique",
    )  # fmt: skip


def test_a_crash_mid_write_leaves_a_valid_store_of_complete_samples(tmp_path, monkeypatch):
    real_save, calls = store_mod.save_file, []

    def flaky(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            with open(path, "wb") as f:  # a half-written temp file, then the "crash"
                f.write(b"partial")
            raise OSError("disk full")
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(store_mod, "save_file", flaky)
    root = str(tmp_path / "store")
    with pytest.raises(OSError, match="disk full"):
        _write(root, _samples())
    assert sorted(os.listdir(os.path.join(root, "samples"))) == [
        "00000000.safetensors",
        "00000001.safetensors",
    ]
    # the finished samples are kept for --resume, but the store never looks complete
    _one_line_error(lambda: FeatureStore(root, verify="full"), "is incomplete .* stopped after 2 samples")
    monkeypatch.setattr(store_mod, "save_file", real_save)
    kw = dict(target=TargetInfo(name="t", config_sha256="abc"), target_layer_ids=LAYERS, hidden_size=HIDDEN)
    with FeatureStoreWriter(root, dtype="float64", resume=True, **kw) as writer:
        for sid, ids, mask, hidden in _samples()[2:]:
            writer.add(sid, ids, mask, hidden)
    assert FeatureStore(root, verify="full").sample_ids == [s[0] for s in _samples()]


def test_a_killed_writer_keeps_its_last_flush_and_resumes(tmp_path):
    root, samples = str(tmp_path / "store"), _samples()
    kw = dict(target=TargetInfo(name="t", config_sha256="abc"), target_layer_ids=LAYERS, hidden_size=HIDDEN)
    writer = FeatureStoreWriter(root, dtype="float64", flush_every_s=0.0, **kw)
    for sid, ids, mask, hidden in samples[:2]:
        writer.add(sid, ids, mask, hidden)
    del writer  # never closed: as if the process died
    _one_line_error(lambda: FeatureStore(root), "is incomplete")  # its last flush lists s0, s1; not complete
    _one_line_error(lambda: FeatureStoreWriter(root, dtype="float32", resume=True, **kw), "resume: dtype")
    other = dict(kw, target=TargetInfo(name="t", config_sha256="xyz"))
    _one_line_error(
        lambda: FeatureStoreWriter(root, dtype="float64", resume=True, **other), "different target"
    )
    with FeatureStoreWriter(root, dtype="float64", resume=True, **kw) as writer:
        assert writer.has("s1") and not writer.has("s2")
        for sid, ids, mask, hidden in samples[2:]:
            writer.add(sid, ids, mask, hidden)
    store = FeatureStore(root, verify="full")
    assert store.sample_ids == [s[0] for s in samples]
    for sid, _, _, hidden in samples:
        assert torch.equal(store.read_intervals(sid, [(0, hidden.shape[0])]), hidden)


def test_non_finite_features_are_refused_naming_the_sample(tmp_path):
    import math

    writer = FeatureStoreWriter(
        str(tmp_path / "store"), target=TargetInfo(name="t"), target_layer_ids=[0], hidden_size=4, dtype="float32"
    )
    feats = torch.zeros(3, 4)
    feats[1, 2] = math.nan
    feats[2, 0] = math.inf
    with pytest.raises(ValueError) as err:
        writer.add("s0", torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), feats)
    assert str(err.value) == "hidden_states: sample 's0' has 2 non-finite values as float32; features must be finite"
    assert not os.listdir(tmp_path / "store" / "samples")  # nothing half-written is left behind


def test_features_that_overflow_the_store_dtype_are_refused(tmp_path):
    """Judged after the cast: 1e5 is finite in float32 and inf in float16."""
    writer = FeatureStoreWriter(
        str(tmp_path / "store"), target=TargetInfo(name="t"), target_layer_ids=[0], hidden_size=4, dtype="float16"
    )
    feats = torch.zeros(3, 4)
    feats[2, 3] = 1e5
    with pytest.raises(ValueError, match=r"has 1 non-finite values as float16"):
        writer.add("s0", torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), feats)
    writer.add("s1", torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), torch.full((3, 4), 6e4))
    assert writer.close().samples[0].id == "s1"


def test_an_interrupt_right_after_the_rename_records_the_sample(tmp_path, monkeypatch):
    """SIGTERM's exception can land between any two lines: after a sample's file is renamed into place
    the sample is recorded, so the store's files and its manifest agree (capture's SIGTERM test)."""
    real_replace, calls = os.replace, []

    def interrupted(src, dst):
        real_replace(src, dst)
        calls.extend([dst] if str(dst).endswith(".safetensors") else [])  # not the manifest's own rename
        if len(calls) == 3:
            raise KeyboardInterrupt  # arrives just after the rename

    monkeypatch.setattr(store_mod.os, "replace", interrupted)
    root = str(tmp_path / "store")
    with pytest.raises(KeyboardInterrupt):
        _write(root, _samples())
    monkeypatch.setattr(store_mod.os, "replace", real_replace)
    manifest = json.load(open(os.path.join(root, "manifest.json")))
    files = sorted(os.path.basename(e["file"]) for e in manifest["samples"])
    assert files == sorted(os.listdir(os.path.join(root, "samples"))) == [f"{i:08d}.safetensors" for i in range(3)]
