"""The page cache around a benchmark's data files: cold (evicted) or warm (read once) before a run, and the
disk's own sequential read rate, so a first pass over the data can be told apart from a disk that is slow.

    evict(paths)                  fsync + posix_fadvise(POSIX_FADV_DONTNEED) on every file (no root needed),
                                  then /proc/sys/vm/drop_caches when it is writable (root); returns how
    warm(paths)                   read every file once (its pages then sit in the page cache)
    cached_fraction(path)         the share of a file's 1 MiB pieces in the page cache (preadv RWF_NOWAIT)
    sequential_read_gbps(path)    GB/s of one sequential read of the (evicted) file, 16 MiB at a time
    parallel_read_gbps(path)      GB/s of the (evicted) file read by several threads at once, 16 MiB a read:
                                  the disk at queue depth, which one sequential stream does not reach on NVMe

A dirty page cannot be dropped, hence the fsync first (a store just written is all dirty pages).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable

__all__ = ["cached_fraction", "evict", "parallel_read_gbps", "sequential_read_gbps", "warm"]

_READ_BYTES = 16 << 20
_DROP_CACHES = "/proc/sys/vm/drop_caches"


def evict(paths: Iterable[str], *, drop_caches: bool = True) -> str:
    """Drop the files' pages from the page cache; returns the methods that ran ('posix_fadvise' and, as
    root, '+ drop_caches')."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how = "posix_fadvise DONTNEED"
    if drop_caches and os.access(_DROP_CACHES, os.W_OK):
        os.sync()
        try:
            with open(_DROP_CACHES, "w") as f:
                f.write("1\n")
            how += " + drop_caches"
        except OSError:  # writable bit but a read-only /proc/sys (a container): fadvise alone
            pass
    return how


def _read_all(path: str, limit: int | None = None) -> int:
    done = 0
    buf = bytearray(_READ_BYTES)
    with open(path, "rb", buffering=0) as f:
        while limit is None or done < limit:
            got = f.readinto(buf)
            if not got:
                break
            done += got
    return done


def warm(paths: Iterable[str]) -> int:
    """Read every file once; returns the bytes read."""
    return sum(_read_all(p) for p in paths)


def cached_fraction(path: str, piece: int = 1 << 20) -> float:
    """The share of the file's `piece`-byte pieces whose first page is in the page cache (a read that may
    not wait for the disk: preadv RWF_NOWAIT)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    buf = bytearray(4096)
    hits = total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for at in range(0, size, piece):
            total += 1
            try:
                hits += os.preadv(fd, [buf], at, os.RWF_NOWAIT) > 0
            except BlockingIOError:
                pass
    finally:
        os.close(fd)
    return hits / total


def sequential_read_gbps(path: str, limit: int = 2 << 30) -> float:
    """Evict `path`, then time one sequential read of up to `limit` bytes of it: the disk's read rate."""
    evict([path], drop_caches=False)
    start = time.perf_counter()
    done = _read_all(path, limit)
    return done / max(time.perf_counter() - start, 1e-9) / 1e9


def parallel_read_gbps(path: str, streams: int = 8, limit: int = 2 << 30) -> float:
    """Evict `path`, then time `streams` threads reading its first `limit` bytes at once, each a contiguous
    share in 16 MiB preads (the GIL is released while a read waits): the rate a reader that keeps several
    requests in flight can get."""
    evict([path], drop_caches=False)
    size = min(os.path.getsize(path), limit)
    share = -(-size // max(1, streams))
    fd = os.open(path, os.O_RDONLY)

    def read_share(lo: int) -> int:
        buf, done, hi = bytearray(_READ_BYTES), 0, min(lo + share, size)
        while lo + done < hi:
            got = os.preadv(fd, [memoryview(buf)[: min(_READ_BYTES, hi - lo - done)]], lo + done)
            if not got:
                break
            done += got
        return done

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(max(1, streams)) as pool:
            done = sum(pool.map(read_share, range(0, size, share)))
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    return done / max(seconds, 1e-9) / 1e9
