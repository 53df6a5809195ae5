"""The sharded feature store: per-sample safetensors files of target hidden states, read by interval.

A sample of L tokens is one file holding the concatenated hidden states of the target layers (the rows
DFlash's context projection `fc` consumes) plus its tokens and loss mask:

    hidden_states [L, W]   W = len(target_layer_ids) * hidden_size, layer-major inside a row:
                           row p = [h_{ids[0]}(p) | h_{ids[1]}(p) | ...]
    input_ids     [L] int64
    loss_mask     [L] int64 (1 = supervised)

Under CSBP a rank holds only its zigzag shard of the context, so it reads only those rows:

    positions   0 ............................................. L
    P = 2       | chunk 0 | chunk 1 |  chunk 2  |   chunk 3   |
                   rank 0   rank 1     rank 1       rank 0
    rank 0 reads hidden_states[chunk 0] and hidden_states[chunk 3] - two positioned reads,
    never the rows in between.

`read_intervals` parses the file's safetensors header and reads the whole checksummed chunks that cover
the requested rows in pieces of `PIECE_BYTES`, several in flight on the read threads (a disk serves
parallel requests faster than one stream, and a mapped file's page faults are one stream per thread). A
read thread fills its piece by one positioned read, then hashes each of its chunks in one call (each call
releases the GIL) and checks it (checksums.py) before a row is returned; the read threads run at a
lower CPU priority (`READ_THREAD_NICE`) than the thread that started them, so a prefetch overlapping a
training step leaves the step's threads their cores. `read_pieces` yields the rows piece by piece, so a
consumer's copy to a GPU overlaps the reads still in flight. Tokens and loss mask are small and read whole.

Writes are atomic (temporary file + rename) for sample files and the manifest alike. The manifest is
written when the store is created, with `complete: false`, and marked complete only when the writer closes
without an error; so a capture or import that was killed, stopped by SIGTERM or failed halfway leaves a
store that `--resume` continues and `--overwrite` replaces, and that a reader refuses (it never looks
complete). A failed run that stored nothing leaves nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from ..outputs import file_sha256, naming_full_disk, write_json_atomic
from ..preflight import count_non_finite
from .checksums import (
    CHUNK_BYTES,
    Span,
    chunk_hash_name,
    chunk_rows_for,
    file_digests,
    hasher,
    read_bytes,
    tensor_spans,
)
from .manifest import (
    FEATURE_DTYPES,
    FORMAT,
    MANIFEST_NAME,
    SampleEntry,
    StoreManifest,
    TargetInfo,
)

__all__ = [
    "PIECE_BYTES",
    "READ_THREAD_NICE",
    "VERIFY_MODES",
    "FeatureStore",
    "FeatureStoreWriter",
    "SampleRows",
    "check_out_dir",
]

#: bytes of rows one read thread's piece holds (whole checksummed chunks): large enough that the kernel
#: issues large requests, small enough that 2 x read_threads of them in flight stay a few hundred MiB
PIECE_BYTES = 16 << 20
#: added to the nice value of each read thread: a read has a whole training step of slack, the step's own
#: threads (the trainer's, its OpenMP workers) must never wait for a core behind a read or a hash
READ_THREAD_NICE = 5

VERIFY_MODES = ("full", "lazy", "trust")
_SAMPLES_DIR = "samples"
_HIDDEN, _IDS, _MASK = "hidden_states", "input_ids", "loss_mask"
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


def _pydantic_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "manifest"
    return f"{where}: {first['msg']}"


class FeatureStoreWriter:
    """Create a store and add samples one by one; `close()` (or leaving the `with`) writes the manifest.

    The manifest is also rewritten (atomically) at most every `flush_every_s` seconds, so a killed capture
    keeps what it finished; `resume=True` reopens such a store (same target, layers, hidden size, dtype)
    and appends to it - `has(sample_id)` tells what is already there.

    >>> with FeatureStoreWriter(root, target=TargetInfo(name="Qwen/Qwen3-8B"), target_layer_ids=[1, 9, 17],
    ...                         hidden_size=4096, dtype="bfloat16") as w:
    ...     w.add("0", input_ids, loss_mask, hidden_states)   # hidden_states [L, 3 * 4096]
    """

    def __init__(
        self,
        root: str,
        *,
        target: TargetInfo,
        target_layer_ids: Sequence[int],
        hidden_size: int,
        dtype: str,
        source: str = "capture",
        overwrite: bool = False,
        resume: bool = False,
        flush_every_s: float = 60.0,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        try:
            itemsize = getattr(torch, dtype).itemsize if dtype in FEATURE_DTYPES else 1
            self.manifest = StoreManifest(
                target=target, target_layer_ids=list(target_layer_ids), hidden_size=hidden_size,
                dtype=dtype, source=source, chunk_hash=chunk_hash_name(),
                chunk_rows=chunk_rows_for(len(target_layer_ids) * hidden_size * itemsize, chunk_bytes),
            )  # fmt: skip
        except ValidationError as err:
            raise ValueError(_pydantic_error(err)) from None
        self.root = root
        self._resumed = resume and os.path.isfile(os.path.join(root, MANIFEST_NAME))
        if self._resumed:
            self.manifest = _resumable(root, self.manifest)
        else:
            _prepare_root(root, overwrite)
        self._created_root = not os.path.exists(root)
        os.makedirs(os.path.join(root, _SAMPLES_DIR), exist_ok=True)
        self._dtype = getattr(torch, dtype)
        self._ids = {s.id: s for s in self.manifest.samples}
        self._closed = False
        self.manifest.complete = False  # until close(): an interrupted store is resumable, never "complete"
        self._write_manifest()
        self._flush_every_s, self._flushed_at = flush_every_s, time.monotonic()

    def entry(self, sample_id: str) -> SampleEntry | None:
        """The stored entry of `sample_id` (None when absent)."""
        return self._ids.get(str(sample_id))

    def has(self, sample_id: str) -> bool:
        return str(sample_id) in self._ids

    def add(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden_states: torch.Tensor,
        *,
        source_file: str | None = None,
        record_sha256: str | None = None,
    ) -> SampleEntry:
        """Write one sample file atomically and record it; hidden_states is cast to the store dtype."""
        if self._closed:
            raise ValueError("writer: the store is already closed")
        sample_id = str(sample_id)
        if sample_id in self._ids:
            raise ValueError(f"sample_id: {sample_id!r} is already in the store")
        width = self.manifest.feature_width
        if hidden_states.dim() != 2 or hidden_states.shape[1] != width:
            raise ValueError(
                f"hidden_states: expected [L, {width}] (len(target_layer_ids) x hidden_size = "
                f"{len(self.manifest.target_layer_ids)} x {self.manifest.hidden_size}), "
                f"got {list(hidden_states.shape)}"
            )
        length = hidden_states.shape[0]
        if length < 1:
            raise ValueError(f"hidden_states: sample {sample_id!r} has no tokens")
        for name, t in ((_IDS, input_ids), (_MASK, loss_mask)):
            if t.dim() != 1 or t.shape[0] != length:
                raise ValueError(f"{name}: expected shape [{length}], got {list(t.shape)}")
        features = hidden_states.detach().to("cpu", self._dtype).contiguous()
        # Judged on what is stored: a NaN/inf feature would poison every block that sees it, on whichever
        # rank reads it, and a float32 value past float16's range becomes inf in the cast.
        bad = count_non_finite(features)
        if bad:
            raise ValueError(
                f"hidden_states: sample {sample_id!r} has {bad} non-finite values as {self.manifest.dtype}; "
                "features must be finite"
            )
        tensors = {
            _HIDDEN: features,
            _IDS: input_ids.detach().to("cpu", torch.int64).contiguous(),
            _MASK: loss_mask.detach().to("cpu", torch.int64).contiguous(),
        }
        rel = os.path.join(_SAMPLES_DIR, f"{len(self.manifest.samples):08d}.safetensors")
        path = os.path.join(self.root, rel)
        tmp = f"{path}.tmp-{os.getpid()}"
        entry = None
        try:
            with naming_full_disk(self.root):  # judged before the partial file is removed
                save_file(tensors, tmp, metadata={"sample_id": sample_id, "format": FORMAT})
            other, chunks = None, None
            if self.manifest.chunk_hash is not None:  # a store resumed from before checksums stays sha256-only
                other, chunks = file_digests(tmp, self.manifest.chunk_hash, self.manifest.chunk_rows,
                                             width, self._dtype.itemsize)  # fmt: skip
            entry = SampleEntry(
                id=sample_id, file=rel, length=length, num_loss_tokens=int(tensors[_MASK].sum()),
                nbytes=os.path.getsize(tmp), sha256=file_sha256(tmp), source_file=source_file,
                first_anchor=_first_anchor(tensors[_MASK]), record_sha256=record_sha256,
                chunk_digests=chunks, other_digest=other,
            )  # fmt: skip
            os.replace(tmp, path)
        except BaseException:  # e.g. SIGTERM's exception, which can land between any two lines
            if os.path.exists(tmp):
                os.remove(tmp)
            elif entry is not None and os.path.exists(path):  # after the rename: the file is whole, record it
                self._record(entry)
            raise
        self._record(entry)
        if time.monotonic() - self._flushed_at >= self._flush_every_s:
            self._write_manifest()
        return entry

    def _record(self, entry: SampleEntry) -> None:
        self.manifest.samples.append(entry)
        self._ids[entry.id] = entry

    def _write_manifest(self) -> None:
        write_json_atomic(os.path.join(self.root, MANIFEST_NAME), self.manifest.model_dump(mode="json"))
        self._flushed_at = time.monotonic()

    def close(self, complete: bool = True) -> StoreManifest:
        """Write the manifest (atomically), marked complete unless `complete=False`. Idempotent."""
        if not self._closed:
            self.manifest.complete = complete
            self._write_manifest()
            self._closed = True
        return self.manifest

    def discard(self) -> None:
        """Remove what this writer created (a failed run that stored nothing leaves nothing)."""
        self._closed = True
        if self._created_root:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            shutil.rmtree(os.path.join(self.root, _SAMPLES_DIR), ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.root, MANIFEST_NAME))

    def __enter__(self) -> FeatureStoreWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        elif not self.manifest.samples and not self._resumed:
            self.discard()
        else:  # keep the finished samples for --resume; the store stays marked incomplete
            self.close(complete=False)


def _first_anchor(loss_mask: torch.Tensor) -> int | None:
    m = loss_mask.reshape(-1) > 0
    hits = (m[:-1] & m[1:]).nonzero()
    return int(hits[0]) if hits.numel() else None


def check_out_dir(root: str, overwrite: bool) -> bool:
    """Raise unless a store may be created at `root`; True when an old store will be replaced."""
    if not os.path.exists(root):
        return False
    if not os.path.isdir(root):
        raise ValueError(f"out: {root} exists and is not a directory")
    entries = os.listdir(root)
    if not entries:
        return False
    if not overwrite:
        raise ValueError(f"out: {root} already exists and is not empty (pass --overwrite to replace a store)")
    if MANIFEST_NAME not in entries and not _only_sample_files(root, entries):
        # Never delete a directory this package did not create.
        raise ValueError(f"out: {root} is not empty and holds no {MANIFEST_NAME}; refusing to overwrite it")
    return True


def _only_sample_files(root: str, entries: list[str]) -> bool:
    """A store killed before its first manifest write: only samples/ holding sample files."""
    if entries != [_SAMPLES_DIR] or not os.path.isdir(os.path.join(root, _SAMPLES_DIR)):
        return False
    return all(".safetensors" in n for n in os.listdir(os.path.join(root, _SAMPLES_DIR)))


def _resumable(root: str, new: StoreManifest) -> StoreManifest:
    """The existing manifest at `root`, if it was written for the same features as `new`."""
    path = os.path.join(root, MANIFEST_NAME)
    try:
        with open(path) as f:
            old = StoreManifest.model_validate_json(f.read())
    except ValidationError as err:
        raise ValueError(f"resume: {path}: {_pydantic_error(err)}") from None
    for field in ("target_layer_ids", "hidden_size", "dtype"):
        if getattr(old, field) != getattr(new, field):
            raise ValueError(
                f"resume: {field} of the store at {root} is {getattr(old, field)}, "
                f"this run has {getattr(new, field)}"
            )
    if (
        old.target.config_sha256 != new.target.config_sha256
        or old.target.random_init_seed != new.target.random_init_seed
        or (None not in (old.target.weights_sha256, new.target.weights_sha256)
            and old.target.weights_sha256 != new.target.weights_sha256)
    ):
        raise ValueError(
            f"resume: the store at {root} was captured from a different target ({old.target.name})"
        )
    return old


def _prepare_root(root: str, overwrite: bool) -> None:
    if check_out_dir(root, overwrite):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(root, MANIFEST_NAME))
        shutil.rmtree(os.path.join(root, _SAMPLES_DIR), ignore_errors=True)


class FeatureStore:
    """Read side of a store. Opening checks every file the manifest lists:

    verify="full"   sha256 of every file against the manifest (reads every byte once; do it once after
                    capture or copying, e.g. on one rank before training); reads then verify as "lazy"
    verify="lazy"   existence and size now; every read verifies the per-chunk checksums of exactly the
                    bytes it read (checksums.py), in whichever thread reads (the prefetch thread of a
                    drafter run), holding no lock: a flipped byte stops the run at that sample, naming the
                    file, before a row of it is returned. A store written before per-chunk checksums gets
                    the older check instead (each file's whole sha256 at its first read, under a lock), and
                    one notice line says so
    verify="trust"  existence and size only (a stat per file); reads check nothing

A store whose capture or import did not finish (`complete: false`) is refused.

    Corrupted or missing files raise a one-line ValueError naming the file. `bytes_read` / `bytes_hashed`
    count the sample-file bytes reads have read and hashed (equal under "lazy" on a checksummed store).
    `read_threads`: threads the positioned reads of one long read run on, each hashing what it read (reads
    and hashes release the GIL), at READ_THREAD_NICE above their creator's nice value where the OS allows
    it; 2 x read_threads pieces are in flight.
    """

    def __init__(self, root: str, verify: str = "full", *, read_threads: int = 8) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}; got {verify!r}")
        self.root = root
        path = os.path.join(root, MANIFEST_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"store: missing {path} (not a feature store, or its capture never finished)")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                self.manifest = StoreManifest.model_validate_json(f.read())
        except ValidationError as err:
            raise ValueError(f"store: {path}: {_pydantic_error(err)}") from None
        if not self.manifest.complete:
            raise ValueError(
                f"store: {root} is incomplete (its {self.manifest.source} stopped after "
                f"{len(self.manifest.samples)} samples); "
                + ("finish it with `capture --resume` or replace it with `capture --overwrite`"
                   if self.manifest.source == "capture" else "rerun `import-specforge` with --overwrite")
            )
        self._entries = {s.id: s for s in self.manifest.samples}
        chunked = self.manifest.chunk_hash is not None and all(
            s.chunk_digests is not None for s in self.manifest.samples
        )
        # per-chunk checks on every read unless trusted; a store from before them: sha256 at the first read
        self._digest = hasher(self.manifest.chunk_hash) if chunked and verify != "trust" else None
        self._lazy_whole = verify == "lazy" and not chunked
        if self._lazy_whole and self.manifest.samples:
            print(
                f"notice: the store at {root} has no per-chunk checksums (written by an older specforge-csbp); "
                "verify='lazy' reads each sample file whole once for its sha256 at its first read, on the read "
                "path; rewrite the store (capture / import-specforge --overwrite) for per-chunk checks",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        self._verified: set[str] = set()
        self._lock = threading.Lock()  # only the whole-file first-read check of a store without checksums
        self._count_lock = threading.Lock()  # the byte counters (held for an addition)
        self.bytes_read = self.bytes_hashed = 0
        self._threads, self._pool, self._pool_lock = max(1, int(read_threads)), None, threading.Lock()
        for entry in self.manifest.samples:
            self._check_file(entry, full=verify == "full")
            if chunked and len(entry.chunk_digests) != -(-entry.length // self.manifest.chunk_rows):
                raise ValueError(
                    f"store: {path}: sample {entry.id!r} has {len(entry.chunk_digests)} chunk checksums, its "
                    f"{entry.length} rows in chunks of {self.manifest.chunk_rows} need "
                    f"{-(-entry.length // self.manifest.chunk_rows)}"
                )

    # -- metadata ------------------------------------------------------------------------------------------
    @property
    def sample_ids(self) -> list[str]:
        return [s.id for s in self.manifest.samples]

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.manifest.target_layer_ids)

    @property
    def hidden_size(self) -> int:
        return self.manifest.hidden_size

    @property
    def feature_width(self) -> int:
        return self.manifest.feature_width

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.manifest.dtype)

    def __len__(self) -> int:
        return len(self.manifest.samples)

    def entry(self, sample_id: str) -> SampleEntry:
        try:
            return self._entries[str(sample_id)]
        except KeyError:
            raise ValueError(f"sample_id: {sample_id!r} is not in the store at {self.root}") from None

    def length(self, sample_id: str) -> int:
        return self.entry(sample_id).length

    def check_compatible(self, target_layer_ids: Sequence[int], hidden_size: int) -> None:
        """Raise a one-line ValueError unless the store feeds a drafter with these layers and hidden size."""
        ids = [int(i) for i in target_layer_ids]
        if ids != self.manifest.target_layer_ids:
            raise ValueError(
                f"target_layer_ids: the store at {self.root} holds layers {self.manifest.target_layer_ids}, "
                f"the drafter expects {ids}"
            )
        expected = len(ids) * int(hidden_size)
        if self.feature_width != expected:
            raise ValueError(
                f"feature width: the store's rows have {self.feature_width} features, the drafter expects "
                f"len(target_layer_ids) x hidden_size = {len(ids)} x {hidden_size} = {expected}"
            )

    # -- reads ---------------------------------------------------------------------------------------------
    def read_tokens(self, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [L], loss_mask [L]), both int64 - small, read whole (with the header: every byte of the
        file outside hidden_states, checked against the manifest's other_digest)."""
        entry = self.entry(sample_id)
        path = self._path(entry)
        with self._file(entry) as f:
            spans = tensor_spans(f, path)
            hidden = self._hidden_span(entry, spans, path)
            size = os.fstat(f.fileno()).st_size
            outside = torch.empty(hidden.start + size - hidden.end, dtype=torch.uint8)
            read_bytes(f.fileno(), 0, outside[: hidden.start])
            read_bytes(f.fileno(), hidden.end, outside[hidden.start :])
        hashed = 0
        if self._digest is not None:
            if self._digest(memoryview(outside.numpy())) != entry.other_digest:
                raise ValueError(
                    f"corrupted store file {path}: its header, input_ids or loss_mask differ from the "
                    f"manifest's {self.manifest.chunk_hash} checksum"
                )
            hashed = outside.numel()
        self._count(outside.numel(), hashed)
        out = []
        for name in (_IDS, _MASK):
            span = spans.get(name)
            if span is None or span.dtype != "I64" or list(span.shape) != [entry.length]:
                got = "missing" if span is None else f"{span.dtype} {list(span.shape)}"
                raise ValueError(f"{path}: {name} is {got}, manifest says I64 [{entry.length}]")
            at = span.start if span.start < hidden.start else span.start - (hidden.end - hidden.start)
            out.append(outside[at : at + span.end - span.start].view(torch.int64).clone())
        return out[0], out[1]

    def read_intervals(self, sample_id: str, intervals: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Hidden-state rows of the token intervals [lo, hi), concatenated in order: [sum(hi - lo), W].

        Only those rows are read (rounded out to whole checksummed chunks, which are verified first), by
        positioned reads into pieces of `PIECE_BYTES` on the read threads, straight into the returned tensor's
        memory.
        """
        entry = self.entry(sample_id)
        parts = []
        with self._sample_file(entry, intervals) as (fd, hidden):
            for lo, hi in intervals:
                if hi <= lo:
                    continue
                a, b = self._covering(entry, lo, hi)
                buf = torch.empty((b - a) * self._row_bytes, dtype=torch.uint8)
                pieces = list(self._piece_bounds(a, b))

                def fill(piece: tuple[int, int], a: int = a, buf: torch.Tensor = buf) -> None:
                    p, q = piece
                    self._fill(entry, fd, hidden, p, q, buf[(p - a) * self._row_bytes : (q - a) * self._row_bytes])

                self._map(fill, pieces) if len(pieces) > 1 else fill(pieces[0])
                parts.append(buf.view(self.dtype).view(b - a, self.feature_width)[lo - a : hi - a])
        if not parts:
            return torch.zeros(0, self.feature_width, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_pieces(
        self, sample_id: str, lo: int, hi: int, *, pin: bool = False
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Rows [lo, hi) as consecutive pieces `(offset from lo, rows [n, W])`, in order, yielded while later
        pieces are still being read: up to 2 x read_threads pieces of `PIECE_BYTES` in flight on the read
        threads (what keeps a disk at its parallel rate), each read into its own buffer (page-locked when
        `pin`, so a caller can copy it to a GPU without waiting) and verified there before it is yielded. For
        a consumer that copies the rows anyway (to a GPU, to another dtype), its copies overlap the reads of
        the next pieces:

            rows    lo ....................................................... hi
            reads   | piece 0 | piece 1 | piece 2 | piece 3 | ...   (2 x threads in flight, whole chunks)
            yields    piece 0 -> copy      piece 1 -> copy      ...   (in order, each verified first)
        """
        entry = self.entry(sample_id)
        todo: deque = deque()
        pending: deque = deque()
        with self._sample_file(entry, [(lo, hi)]) as (fd, hidden):
            if hi > lo:
                todo.extend(self._piece_bounds(*self._covering(entry, lo, hi)))
            pool = self._executor()

            def submit() -> None:
                p, q = todo.popleft()
                buf = torch.empty((q - p) * self._row_bytes, dtype=torch.uint8, pin_memory=pin)
                pending.append((p, q, buf, pool.submit(self._fill, entry, fd, hidden, p, q, buf)))

            try:
                while todo and len(pending) < 2 * self._threads:
                    submit()
                while pending:
                    p, q, buf, future = pending.popleft()
                    future.result()  # a corrupted chunk raises here, before a row of it is yielded
                    if todo:
                        submit()
                    s, e = max(lo, p), min(hi, q)
                    yield s - lo, buf.view(self.dtype).view(q - p, self.feature_width)[s - p : e - p]
            finally:  # also when the consumer stops early: no read may outlive the file descriptor
                wait([item[-1] for item in pending])

    def rows(self, sample_id: str) -> SampleRows:
        """Sample `sample_id`'s rows as a drafter sample's feature source (`models/dflash/features.py`)."""
        return SampleRows(self, self.entry(sample_id).id)

    @property
    def _row_bytes(self) -> int:
        return self.feature_width * self.dtype.itemsize

    @property
    def _chunk_rows(self) -> int:
        return self.manifest.chunk_rows or chunk_rows_for(self._row_bytes)

    def _covering(self, entry: SampleEntry, lo: int, hi: int) -> tuple[int, int]:
        """The rows a read of [lo, hi) reads: rounded out to whole chunks when they are checked."""
        if self._digest is None:
            return lo, hi
        rows = self._chunk_rows
        return lo // rows * rows, min(-(-hi // rows) * rows, entry.length)

    def _piece_bounds(self, a: int, b: int) -> Iterator[tuple[int, int]]:
        """[a, b) cut at chunk boundaries into pieces of about PIECE_BYTES (whole chunks, but at a and b)."""
        rows = self._chunk_rows
        step = max(1, PIECE_BYTES // (rows * self._row_bytes)) * rows
        while a < b:
            end = min(b, a // rows * rows + step)
            yield a, end
            a = end

    def _fill(self, entry: SampleEntry, fd: int, hidden: Span, p: int, q: int, buf: torch.Tensor) -> None:
        """buf = the bytes of rows [p, q), read on a read thread by one positioned read; when checked, each
        chunk's bytes are then hashed by one call and the digest compared with the manifest (a failure raises
        before the piece is used):

            rows       p ................................................... q
            read       |<------------------ one positioned read -------------->|
            chunks     |       chunk k        |      chunk k+1       | ...        whole chunks (the sample's
            checks     hash(chunk k) == manifest, hash(chunk k+1) == ...            last may be shorter)

        Why one read, then one hash call per chunk: every call a read thread makes takes the GIL back from the
        trainer's thread, whose kernel launches then wait. 1 MiB sub-reads, each hashed as it lands, make 32
        calls per 16 MiB piece instead of 5 (1 read + 4 hashes): while a 64K sample of the 27B shape was read on an H100 host, a loop of
        kernel launches beside it kept 0.21 of its rate that way, 0.51 this way and 0.54 with the checks off
        (benchmarks/store_contention_bench.py), and hashing a chunk from memory instead of from the CPU's
        cache read at the same rate (21.7 vs 21.3 GB/s).
        """
        start, row_bytes = hidden.start + p * self._row_bytes, self._row_bytes
        view = memoryview(buf.numpy())
        try:
            read_bytes(fd, start, view)
        except OSError as err:
            raise ValueError(f"corrupted or missing store file {self._path(entry)}: {err}".replace("\n", " ")) from None
        if self._digest is not None:
            rows = self._chunk_rows
            for k in range(p // rows, -(-q // rows)):
                chunk = view[(max(p, k * rows) - p) * row_bytes : (min(q, k * rows + rows) - p) * row_bytes]
                self._check_chunk(entry, k, self._digest(chunk))
        self._count(buf.numel(), buf.numel() if self._digest is not None else 0)

    @contextlib.contextmanager
    def _sample_file(self, entry: SampleEntry, intervals: Sequence[tuple[int, int]]):
        """(fd, hidden_states span) of the sample's file, open while the reads of `intervals` run."""
        for lo, hi in intervals:
            if not 0 <= lo <= hi <= entry.length:
                raise ValueError(
                    f"intervals: [{lo}, {hi}) is not inside sample {entry.id!r} of length {entry.length}"
                )
        path = self._path(entry)
        with self._file(entry) as f:
            yield f.fileno(), self._hidden_span(entry, tensor_spans(f, path), path)

    def _check_chunk(self, entry: SampleEntry, k: int, digest: str) -> None:
        """Chunk k's digest (of the bytes read) against the manifest."""
        if digest != entry.chunk_digests[k]:
            rows = self.manifest.chunk_rows
            raise ValueError(
                f"corrupted store file {self._path(entry)}: hidden_states rows {k * rows}-"
                f"{min(k * rows + rows, entry.length) - 1} (chunk {k}) differ from the manifest's "
                f"{self.manifest.chunk_hash} checksum"
            )

    def _map(self, fn, items) -> list:
        """fn over items on the read threads; every call has finished before this returns or raises (a
        failed chunk must not leave another thread reading the file)."""
        pool = self._executor()
        futures = [pool.submit(fn, item) for item in items]
        wait(futures)
        return [f.result() for f in futures]  # the first failure, in order, is raised here

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._threads, thread_name_prefix="store-read", initializer=_lower_this_threads_priority
                )
        return self._pool

    def _count(self, read: int, hashed: int) -> None:
        with self._count_lock:
            self.bytes_read += read
            self.bytes_hashed += hashed

    def _hidden_span(self, entry: SampleEntry, spans: dict[str, Span], path: str) -> Span:
        hidden = spans.get(_HIDDEN)
        expected = [entry.length, self.feature_width]
        if hidden is None or list(hidden.shape) != expected or hidden.dtype != _SAFETENSORS_DTYPES[self.manifest.dtype]:
            got = "missing" if hidden is None else f"{hidden.dtype} {list(hidden.shape)}"
            raise ValueError(
                f"{path}: hidden_states is {got}, manifest says {_SAFETENSORS_DTYPES[self.manifest.dtype]} {expected}"
            )
        return hidden

    # -- integrity -----------------------------------------------------------------------------------------
    def _path(self, entry: SampleEntry) -> str:
        return os.path.join(self.root, entry.file)

    def _file(self, entry: SampleEntry):
        path = self._path(entry)
        if self._lazy_whole and entry.id not in self._verified:
            with self._lock:
                if entry.id not in self._verified:
                    self._check_file(entry, full=True)
                    self._verified.add(entry.id)
        try:
            return open(path, "rb")
        except OSError as err:
            raise ValueError(f"corrupted or missing store file {path}: {err}".replace("\n", " ")) from None

    def _check_file(self, entry: SampleEntry, full: bool) -> None:
        path = self._path(entry)
        if not os.path.isfile(path):
            raise ValueError(f"missing store file {path} (sample {entry.id!r})")
        size = os.path.getsize(path)
        if size != entry.nbytes:
            raise ValueError(f"corrupted store file {path}: {size} bytes, manifest says {entry.nbytes}")
        if full and file_sha256(path) != entry.sha256:
            raise ValueError(f"corrupted store file {path}: sha256 differs from the manifest")


def _lower_this_threads_priority() -> None:
    """Raise the calling thread's nice value by READ_THREAD_NICE (Linux: a thread id names one thread, and
    any process may raise its own threads' nice values); where that is not possible, nothing."""
    try:
        tid = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + READ_THREAD_NICE))
    except (AttributeError, OSError):  # no setpriority (another OS), or a sandbox that refuses it
        pass


class SampleRows:
    """One sample's hidden-state rows as a drafter sample's feature source: `rows(lo, hi)` reads them into
    one tensor (`FeatureStore.read_intervals`), `rows.pieces(lo, hi, pin=...)` yields them piece by piece
    (`FeatureStore.read_pieces`) for a consumer that copies them anyway (`load_context`)."""

    def __init__(self, store: FeatureStore, sample_id: str) -> None:
        self.store, self.sample_id, self.dtype = store, sample_id, store.dtype

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        return self.store.read_intervals(self.sample_id, [(lo, hi)])

    def pieces(self, lo: int, hi: int, *, pin: bool = False) -> Iterator[tuple[int, torch.Tensor]]:
        return self.store.read_pieces(self.sample_id, lo, hi, pin=pin)
