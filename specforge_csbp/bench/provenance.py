"""Which library code produced a benchmark record or a machine profile: a digest of the package's sources.

Why: the planner's error is only meaningful against records that ran the code its profile calibrated, and
one date can hold several versions of the code, so a date does not name it. Records and profiles carry `code`, the first 12
hex digits of SHA-256 over every `specforge_csbp/**/*.py` (relative path and bytes, in path order), so the
report can tell them apart (cli/report.py). The benchmark scripts themselves are not included: they time
the library, the planner models the library.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["library_digest"]

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def library_digest(root: Path = PACKAGE_ROOT) -> str:
    """12 hex digits identifying the source of the package at `root` (the installed specforge_csbp)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]
