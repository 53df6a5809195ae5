"""benchmarks/store_read_bench.py at a tiny shape: one record per reader and thread count, every store read
hashing exactly the rows it read under lazy and nothing under trust, the disk's rates beside, records that
load as the shared schema, and the store reused when its shape matches."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import store_read_bench  # noqa: E402

from specforge_csbp.bench.records import load_records  # noqa: E402


def test_every_reader_is_recorded_cold(tmp_path):
    out = tmp_path / "r.jsonl"
    argv = ["--context", "1K", "--width", "64", "--samples", "3", "--read-threads", "1,3", "--streams", "2",
            "--work", str(tmp_path / "w"), "--out", str(out), "--fadvise-only"]  # fmt: skip
    assert store_read_bench.main(argv) == 0
    records = load_records(out)
    got = [(r.reader, r.read_threads) for r in records]
    assert got == [("store-lazy", 1), ("store-lazy", 3), ("store-trust", 1), ("store-trust", 3),
                   ("mapped-lazy", 1), ("mapped-lazy", 3), ("disk-sequential", 1), ("disk-parallel", 2)]  # fmt: skip
    rows_bytes = 1024 * 64 * 2
    for r in records:
        assert r.workload == "store-read" and r.context_len == 1024 and r.page_cache == "cold"
        assert r.reader.startswith("disk") or r.cache_prepared_by == "posix_fadvise DONTNEED"
        if r.reader == "mapped-lazy":
            assert r.mode == "reference" and r.bytes_per_sample == rows_bytes
            continue
        assert r.read_gbps > 0 and r.step_ms > 0 and r.p90_ms >= r.step_ms
        if r.reader.startswith("store"):
            assert r.mode == "csbp" and r.bytes_per_sample == rows_bytes
            assert r.bytes_hashed == (3 * rows_bytes if r.reader == "store-lazy" else 0)
        else:
            assert r.mode == "reference" and r.bytes_per_sample > rows_bytes  # the whole file: rows + tokens
    manifest = tmp_path / "w" / "store" / "manifest.json"
    written = manifest.stat().st_mtime_ns
    assert store_read_bench.main(argv) == 0  # same shape: the store is read again, not rewritten
    assert manifest.stat().st_mtime_ns == written and len(load_records(out)) == 16


def test_a_bad_thread_count_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        store_read_bench.main(["--read-threads", "0", "--work", str(tmp_path), "--out", str(tmp_path / "r")])
    assert "--read-threads: expected comma-separated integers >= 1" in capsys.readouterr().err
