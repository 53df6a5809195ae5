"""bench/page_cache.py: a cold file is out of the page cache (a read that may not wait finds nothing), a
warm one in it, and the disk's read rate is a positive number of GB/s."""

import os

import pytest

from specforge_csbp.bench.page_cache import cached_fraction, evict, parallel_read_gbps, sequential_read_gbps, warm


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "sample.bin"
    path.write_bytes(os.urandom(8 << 20))  # dirty pages: evict() must fsync before it can drop them
    return str(path)


def test_evict_then_warm(data_file):
    assert evict([data_file], drop_caches=False) == "posix_fadvise DONTNEED"  # (drop_caches: the whole machine's)
    assert cached_fraction(data_file) <= 0.25  # read-ahead of a neighbour may keep a piece or two
    assert warm([data_file]) == 8 << 20
    assert cached_fraction(data_file) == 1.0


def test_the_disk_read_rate_is_measured_cold(data_file):
    warm([data_file])
    assert sequential_read_gbps(data_file) > 0
    assert cached_fraction(data_file) == 1.0  # the timed read itself brought the file back


@pytest.mark.parametrize("streams", [1, 3, 8])
def test_the_parallel_read_reads_every_byte_from_cold(tmp_path, streams):
    path = tmp_path / "uneven.bin"
    path.write_bytes(os.urandom((8 << 20) + 12345))  # shares of unequal size, the last one short
    warm([str(path)])
    assert parallel_read_gbps(str(path), streams=streams) > 0
    assert cached_fraction(str(path)) == 1.0  # evicted first, then every piece read back


def test_the_parallel_read_reads_each_byte_once_up_to_its_limit(tmp_path, monkeypatch):
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(8 << 20))
    spans, real = [], os.preadv

    def counting(fd, buffers, offset, *flags):
        got = real(fd, buffers, offset, *flags)
        spans.append((offset, got))
        return got

    monkeypatch.setattr(os, "preadv", counting)
    parallel_read_gbps(str(path), streams=3, limit=(2 << 20) + 7)
    assert sorted(b for o, n in spans for b in range(o, o + n)) == list(range((2 << 20) + 7))
