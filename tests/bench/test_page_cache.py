"""bench/page_cache.py: a cold file is out of the page cache (a read that may not wait finds nothing), a
warm one in it, and the disk's read rate is a positive number of GB/s."""

import os

import pytest

from specforge_csbp.bench.page_cache import cached_fraction, evict, sequential_read_gbps, warm


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
