"""bench/provenance.library_digest names the library code; the report's planner error uses it to pick the
records that ran the code a profile calibrated (cli/report.py)."""

import json

from specforge_csbp.bench.provenance import PACKAGE_ROOT, library_digest
from specforge_csbp.bench.records import BenchRecord, load_records
from specforge_csbp.cli.report import _ran_calibrated_code
from specforge_csbp.planner.profile import MachineProfile


def _tree(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_digest_follows_every_source_byte_and_path(tmp_path):
    base = {"a.py": "x = 1\n", "sub/b.py": "y = 2\n", "notes.txt": "not code"}
    d0 = library_digest(_tree(tmp_path / "t0", base))
    assert len(d0) == 12 and int(d0, 16) >= 0
    assert library_digest(_tree(tmp_path / "t1", base)) == d0  # same sources, another place: same digest
    assert library_digest(_tree(tmp_path / "t2", {**base, "notes.txt": "edited"})) == d0  # only *.py count
    assert library_digest(_tree(tmp_path / "t3", {**base, "sub/b.py": "y = 3\n"})) != d0
    assert library_digest(_tree(tmp_path / "t4", {"a.py": "x = 1\n", "sub/c.py": "y = 2\n"})) != d0  # renamed
    assert library_digest() == library_digest(PACKAGE_ROOT)


def test_record_files_from_before_code_get_it_from_the_side_table(tmp_path):
    rec = {"workload": "w", "mode": "csbp", "world_size": 2, "context_len": 1, "block_size": 4, "device": "g",
           "date": "d", "command": "x"}  # fmt: skip
    (tmp_path / "old.jsonl").write_text(json.dumps(rec) + "\n")
    (tmp_path / "new.jsonl").write_text(json.dumps({**rec, "code": "own"}) + "\n" + json.dumps(rec) + "\n")
    table = {"old.jsonl": "c0de", "new.jsonl": "beef"}
    codes = sorted((r.model_extra or {}).get("code") for r in load_records(tmp_path, code_by_file=table))
    assert codes == ["beef", "c0de", "own"]  # a record's own digest wins over its file's
    assert all("code" not in (r.model_extra or {}) for r in load_records(tmp_path / "old.jsonl"))


def test_records_pair_with_their_profile_by_code_else_by_date():
    prof = MachineProfile(device="g", date="2026-11-30", world_size=2, gemm_tflops=1, attn_tflops=1, code="c0de")
    old = prof.model_copy(update={"code": None, "date": "2026-11-29"})
    rec = dict(workload="w", mode="csbp", world_size=2, context_len=1, block_size=4, device="g", command="x")
    same = BenchRecord(**rec, date="2026-11-30", code="c0de")
    other = BenchRecord(**rec, date="2026-11-30", code="beef")  # same day, other code: not the calibrated code
    undated = BenchRecord(**rec, date="2026-11-30")  # no digest: unknown code
    earlier = BenchRecord(**rec, date="2026-11-29")
    check = [_ran_calibrated_code(r, profile=prof, own={}) for r in (same, other, undated, earlier)]
    assert check == [True, False, False, False]  # a profile that names its code: only that code counts
    # a workload's own profile decides for it; for a profile without a digest, dates do
    assert _ran_calibrated_code(other, profile=prof, own={"w": old}) is True
    assert _ran_calibrated_code(undated, profile=prof, own={"w": old}) is True
    assert _ran_calibrated_code(earlier, profile=prof, own={"w": old}) is True
    assert _ran_calibrated_code(earlier, profile=prof, own={"v": old}) is False
