"""The shared benchmark record: one JSON object per measured point, files under benchmarks/results/.

Every benchmark, sweep, table and plot reads and writes this one schema; extra fields are kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import load_json, one_line, read_jsonl
from ..outputs import write_text_atomic

__all__ = ["BenchRecord", "load_records", "write_records"]

Workload = str  # "attention" | "sft" | "convert" | "drafter" | "drafter-<shape>" | "eval"
Mode = Literal["reference", "dp", "cp", "bp", "csbp", "torch-cp", "specforge"]


class BenchRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    workload: Workload
    mode: Mode
    world_size: int
    context_len: int
    block_size: int
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_mem_gib: float | None = None
    status: Literal["ok", "oom", "error"] = "ok"
    device: str
    date: str
    command: str
    useful_tflops_per_gpu: float | None = None  # attention records
    exposed_comm_ms: float | None = None  # attention records


def load_records(
    paths: list[str | os.PathLike] | str | os.PathLike, *, code_by_file: dict[str, str] | None = None
) -> list[BenchRecord]:
    """Read records from files or directories (*.json: a list or one object; *.jsonl: one per line).
    `code_by_file`: file name -> the library digest its records ran (bench/provenance.py), for records
    written before they carried `code` themselves; a record's own `code` wins."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        # only record files: a leftover *.jsonl.tmp or a log beside them is not a record
        files.extend(sorted(f for f in p.glob("**/*") if f.suffix in (".json", ".jsonl")) if p.is_dir() else [p])
    records = []
    for f in files:
        if f.suffix == ".jsonl":
            items = list(read_jsonl(f, "--results"))
        else:
            data = load_json(f, "--results")
            items = list(enumerate(data if isinstance(data, list) else [data], 1))
        code = (code_by_file or {}).get(f.name)
        for n, item in items:
            if not isinstance(item, dict):
                raise ValueError(f"--results: {f}: record {n} is not a JSON object")
            if code is not None:
                item = {"code": code, **item}
            try:
                records.append(BenchRecord.model_validate(item))
            except ValidationError as err:
                raise ValueError(f"--results: {f}: record {n}: {one_line(err)}") from None
    return records


def write_records(path: str | os.PathLike, records: list[BenchRecord], *, append: bool = True) -> None:
    """Append records as JSON lines (atomic per call: written to a temp file, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if append and path.exists() else ""
    write_text_atomic(path, old + "".join(r.model_dump_json(exclude_none=True) + "\n" for r in records))
