"""Outputs that appear whole or not at all: written beside their final name, then renamed over it.

    write_text_atomic(path, text)     PATH.tmp-PID, then os.replace; the temporary is removed on any failure
    write_json_atomic(path, data)     JSON + newline through write_text_atomic, flushed to disk first
    save_figure_atomic(fig, path)     a matplotlib figure as PNG without timestamp metadata (same data ->
                                      same bytes), closed after saving; pyplot() is matplotlib set up for it
    staged_dir(out)                   a temporary directory beside OUT to fill; on success it replaces OUT
    file_sha256(path)                 the digest manifests and provenance record for a file, read in chunks
    naming_full_disk(directory)       a write inside the block that fails for lack of space becomes one
                                      OSError(ENOSPC) naming `directory` (every writer here uses it)

A reader (a resumed run, a report, a server loading an export) therefore sees the old output or the new
one, never half of one; a killed or disk-full write leaves the old output in place, and a full disk is one
line that says so and names the directory (`errors.one_line` of the OSError). The temporary lives in
the target's directory so the final rename stays on one file system (os.replace is atomic there).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from .errors import is_disk_full

__all__ = [
    "file_sha256",
    "naming_full_disk",
    "pyplot",
    "save_figure_atomic",
    "staged_dir",
    "write_json_atomic",
    "write_text_atomic",
]


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 24) -> str:
    """sha256 hex digest of a file, read `chunk_bytes` at a time (weights and features can be many GiB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def naming_full_disk(directory: str | os.PathLike, cleanup=None) -> Iterator[None]:
    """Re-raise a failure of the block that is a full disk (errors.is_disk_full, judged before `cleanup()`
    frees the partial output) as OSError(ENOSPC, ..., directory); `cleanup` runs on any failure."""
    try:
        yield
    except BaseException as err:
        full = is_disk_full(err, directory)
        if cleanup is not None:
            cleanup()
        if full and not (isinstance(err, OSError) and err.errno == errno.ENOSPC and err.filename == os.fspath(directory)):
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(directory)) from err
        raise


def _temporary(path: str, suffix: str = "") -> str:
    return f"{path}.tmp-{os.getpid()}{suffix}"


def write_text_atomic(path: str | os.PathLike, text: str, *, fsync: bool = False) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file and a rename; `fsync`: on disk before the rename."""
    path = os.fspath(path)
    tmp = _temporary(path)
    try:
        with naming_full_disk(os.path.dirname(os.path.abspath(path))):
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_json_atomic(path: str | os.PathLike, data: Any, *, indent: int | None = 1, **dumps: Any) -> None:
    """`data` as JSON (+ a final newline), written atomically and flushed to disk (manifests, summaries)."""
    write_text_atomic(path, json.dumps(data, indent=indent, **dumps) + "\n", fsync=True)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed) with a fixed SVG hash salt (reproducible)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "specforge-csbp"
    return plt


def save_figure_atomic(fig, path: str | os.PathLike, *, dpi: int = 110) -> None:
    """Save a matplotlib figure as PNG through a temporary file, then close it. No Software/date metadata:
    the bytes depend only on what was drawn (and the matplotlib version)."""
    import matplotlib.pyplot as plt

    path = os.fspath(path)
    tmp = _temporary(path, ".png")  # the suffix tells matplotlib the format
    try:
        with naming_full_disk(os.path.dirname(os.path.abspath(path))):
            fig.savefig(tmp, dpi=dpi, metadata={"Software": None})
            os.replace(tmp, path)
    finally:
        plt.close(fig)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike) -> Iterator[str]:
    """Yield an empty temporary directory beside `out`; when the block succeeds it replaces `out` (an old
    `out` is removed first), when it raises the temporary is removed and `out` is left as it was."""
    out = os.path.abspath(os.fspath(out))
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    with naming_full_disk(parent):
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    with naming_full_disk(parent, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True)):
        yield tmp
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
