"""benchmarks/store_contention_bench.py at a tiny shape: one record per reader, each reading (and, checked,
hashing) every row of every sample, the reference reader in sub-reads, records that load as the shared schema."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import store_contention_bench  # noqa: E402

from specforge_csbp.bench.records import load_records  # noqa: E402


def test_every_reader_is_recorded_with_the_trainer_threads_share(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    reads = []
    preadv = os.preadv

    def counted(fd, buffers, offset):
        reads.append(sum(len(b) for b in buffers))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    argv = ["--context", "1K", "--width", "2048", "--samples", "2", "--read-threads", "2", "--rounds", "2",
            "--sub-read-mib", "0.25", "--work", str(tmp_path / "w"), "--out", str(out)]  # fmt: skip
    assert store_contention_bench.main(argv) == 0
    records = load_records(out)
    assert [r.reader for r in records] == ["trust", "lazy", "lazy-sub0.25"]
    rows_bytes = 1024 * 2048 * 2  # 4 MiB a sample: one 4 MiB chunk, or 16 sub-reads of 256 KiB
    for r in records:
        assert r.workload == "store-contention" and r.context_len == 1024 and r.read_threads == 2
        assert r.mode == ("reference" if r.reader.startswith("lazy-sub") else "csbp")
        assert r.step_ms > 0 and r.read_gbps > 0 and len(r.trainer_shares) == 2 and 0 < r.trainer_share
        assert r.bytes_hashed_per_sample == (0 if r.reader == "trust" else rows_bytes)
    assert reads.count(256 << 10) == 2 * 2 * 16  # the reference reader: rounds x samples x sub-reads
