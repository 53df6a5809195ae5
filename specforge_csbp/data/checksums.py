"""Checksums per chunk of hidden-state rows: written with each sample file, verified for the rows a reader reads.

A sample file is a safetensors file; its hidden states [L, W] are one contiguous byte range. The manifest
keeps one digest per chunk of `chunk_rows` rows of that range and one digest of everything else (the
header, input_ids, loss_mask), so together they cover every byte of the file:

    file      | 8 + header | input_ids | loss_mask | hidden_states rows 0 .. L-1                         |
    digests   '-------- other_digest --------------' chunk 0 | chunk 1 | ... | chunk ceil(L/rows)-1 |

A reader of rows [lo, hi) reads the whole chunks that cover them (at most one partial chunk at each end),
each piece by one positioned read (store.py), and hashes each chunk's bytes in one call before a row of it
is returned: no pass over the whole file, nothing on the path but the bytes the step needs. The hash
is xxHash's XXH3-64 (python `xxhash`, about 10-23 GB/s on one CPU core); where `xxhash` is not installed,
a new store gets zlib's CRC-32 (standard library, about 4 GB/s) and says so in its manifest (`chunk_hash`).
Both detect any flipped byte of a chunk; neither is a defence against a forger (the whole-file sha256 stays
in the manifest for that).

    chunk_hash_name()                          the algorithm a new store records
    hasher(name)                               bytes -> hex digest for a recorded algorithm (one-line error
                                               when its library is missing)
    chunk_rows_for(row_bytes)                  rows per chunk for about CHUNK_BYTES per chunk
    tensor_spans(f, path)                      each tensor's byte range in an open sample file (header parse)
    read_bytes(fd, offset, out)                os.preadv until `out` is full (every read of a sample file)
    file_digests(path, name, rows, width, itemsize)   (other digest, chunk digests) of a written file
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .manifest import CHUNK_HASHES

__all__ = [
    "CHUNK_BYTES",
    "CHUNK_HASHES",
    "Span",
    "chunk_hash_name",
    "chunk_rows_for",
    "file_digests",
    "hasher",
    "read_bytes",
    "tensor_spans",
]

#: bytes of hidden-state rows per chunk: small against a rank's share of a long sample (a 64K sample of a
#: 27B target's 5 layers is 3.4 GB, 800 chunks), large against the per-call cost of a hash (microseconds)
CHUNK_BYTES = 4 << 20
_HIDDEN = "hidden_states"
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class _Crc32:
    """zlib's CRC-32 as a hash object: `zlib.crc32(b, zlib.crc32(a))` is the CRC-32 of a + b (zlib releases
    the GIL for buffers over 5 KiB: every chunk)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, buf: memoryview) -> None:
        self.value = zlib.crc32(buf, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def chunk_hash_name() -> str:
    """'xxh3_64' when the `xxhash` package is installed, else 'crc32' (zlib, always there)."""
    try:
        import xxhash  # noqa: F401  # lazy: optional dependency (the stdlib CRC-32 stands in without it)
    except ImportError:
        return "crc32"
    return "xxh3_64"


def _hash_object(name: str) -> Callable[[], Any]:
    """A factory of hash objects (`update(buf)`, then `hexdigest()`) for a recorded `chunk_hash`. An unknown
    name, or a store made with xxhash read without it, is one line."""
    if name == "crc32":
        return _Crc32
    if name != "xxh3_64":
        raise ValueError(f"chunk_hash must be one of {', '.join(CHUNK_HASHES)}; got {name!r}")
    try:
        import xxhash  # lazy: optional dependency
    except ImportError:
        raise ValueError(
            "chunk_hash: this store's checksums are xxh3_64; install the `xxhash` package to read it"
        ) from None
    # The hash object, never the one-shot `xxh3_64_hexdigest`: every python-xxhash release (pyproject allows
    # >= 3) releases the GIL in an object's update, while its one-shot function holds it for the whole buffer
    # before 4.0, which would stall the trainer's own thread while the read threads hash a 3.4 GB sample.
    # Both give the same digest, so stores written either way verify alike.
    return lambda: xxhash.xxh3_64(b"")


def hasher(name: str) -> Callable[[memoryview], str]:
    """bytes -> hex digest of a recorded `chunk_hash` (one-line errors for an unknown or missing hash)."""
    new = _hash_object(name)

    def digest(buf: memoryview) -> str:
        h = new()
        h.update(buf)
        return h.hexdigest()

    return digest


def chunk_rows_for(row_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // max(1, row_bytes))


@dataclass(frozen=True)
class Span:
    """Where one tensor lies in a sample file (absolute byte offsets) and what the header says it is."""

    start: int
    end: int
    dtype: str  # safetensors' name: BF16, F16, F32, F64, I64
    shape: tuple[int, ...]


def tensor_spans(f, path: str) -> dict[str, Span]:
    """Parse the safetensors header of the open binary file `f`; a broken header is a one-line ValueError."""
    f.seek(0)
    head = f.read(8)
    try:
        if len(head) != 8:
            raise ValueError("shorter than its header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise ValueError(f"header length {n} is not plausible")
        header = json.loads(f.read(n))
        spans = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            lo, hi = (int(x) for x in info["data_offsets"])
            spans[name] = Span(8 + n + lo, 8 + n + hi, str(info["dtype"]), tuple(int(s) for s in info["shape"]))
        if _HIDDEN not in spans:
            raise ValueError(f"no {_HIDDEN}")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise ValueError(f"corrupted or missing store file {path}: unreadable header ({err})") from None
    return spans


def read_bytes(fd: int, offset: int, out: torch.Tensor | memoryview) -> None:
    """Fill `out` (a uint8 tensor or a byte memoryview) with the file's bytes from `offset` (preadv loops: one
    call reads < 2 GiB)."""
    view = out if isinstance(out, memoryview) else memoryview(out.numpy()).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += got


def file_digests(path: str, name: str, rows: int, width: int, itemsize: int) -> tuple[str, list[str]]:
    """(digest of every byte outside hidden_states, digest of each chunk of `rows` rows) of a sample file,
    found through the same header parse the store's reader uses."""
    digest = hasher(name)
    row_bytes = width * itemsize
    with open(path, "rb") as f:
        span = tensor_spans(f, path)[_HIDDEN]
        size = os.fstat(f.fileno()).st_size
        outside = torch.empty(span.start + size - span.end, dtype=torch.uint8)
        read_bytes(f.fileno(), 0, outside[: span.start])
        read_bytes(f.fileno(), span.end, outside[span.start :])
        chunks = []
        buf = torch.empty(rows * row_bytes, dtype=torch.uint8)
        for at in range(span.start, span.end, rows * row_bytes):
            piece = buf[: min(rows * row_bytes, span.end - at)]
            read_bytes(f.fileno(), at, piece)
            chunks.append(digest(memoryview(piece.numpy())))
    return digest(memoryview(outside.numpy())), chunks
