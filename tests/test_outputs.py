"""The one set of atomic writers (specforge_csbp/outputs.py): an output is the old one or the new one, whole."""

from __future__ import annotations

import errno
import os

import pytest

from specforge_csbp.outputs import (
    file_sha256,
    pyplot,
    save_figure_atomic,
    staged_dir,
    write_json_atomic,
    write_text_atomic,
)


def _disk_full_on(monkeypatch, target):
    real = os.replace

    def replace(src, dst):
        if os.fspath(dst) == os.fspath(target):
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_text_and_json_replace_whole_and_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    write_text_atomic(page, "old\n")
    write_text_atomic(str(page), "new ü\n")
    assert page.read_text(encoding="utf-8") == "new ü\n"
    data = tmp_path / "d.json"
    write_json_atomic(data, {"b": [1, 2]})
    assert data.read_text() == '{\n "b": [\n  1,\n  2\n ]\n}\n'  # indent 1, a final newline
    write_json_atomic(data, {"a": 1}, indent=None)
    assert data.read_text() == '{"a": 1}\n'
    _disk_full_on(monkeypatch, page)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(page, "lost\n")
    assert page.read_text(encoding="utf-8") == "new ü\n"
    assert sorted(os.listdir(tmp_path)) == ["d.json", "page.md"]  # no temporary left


def test_a_figure_is_saved_reproducibly_and_closed(tmp_path):
    plt = pyplot()
    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path in paths:
        fig, ax = plt.subplots(figsize=(2, 2))
        ax.plot([0, 1], [1, 0])
        save_figure_atomic(fig, path)
        assert not plt.fignum_exists(fig.number)
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths[0].read_bytes() == paths[1].read_bytes()  # no timestamp metadata
    assert sorted(os.listdir(tmp_path)) == ["a.png", "b.png"]


def test_staged_dir_replaces_on_success_and_keeps_the_old_dir_on_failure(tmp_path):
    out = tmp_path / "sub" / "export"
    with staged_dir(out) as tmp:
        assert os.path.dirname(tmp) == str(out.parent) and not os.listdir(tmp)
        (tmp_path / "sub" / "x").write_text("")  # the parent exists while the block runs
        open(os.path.join(tmp, "v1"), "w").close()
    assert os.listdir(out) == ["v1"]
    with pytest.raises(RuntimeError, match="half way"), staged_dir(out) as tmp:
        open(os.path.join(tmp, "v2"), "w").close()
        raise RuntimeError("half way")
    assert os.listdir(out) == ["v1"]
    with staged_dir(str(out)) as tmp:
        open(os.path.join(tmp, "v3"), "w").close()
    assert os.listdir(out) == ["v3"]
    assert sorted(os.listdir(out.parent)) == ["export", "x"]  # no temporary directory left


def test_file_sha256_reads_in_chunks_and_matches_hashlib(tmp_path):
    import hashlib

    blob = bytes(range(256)) * 41 + b"tail"
    path = tmp_path / "w.bin"
    path.write_bytes(blob)
    expected = hashlib.sha256(blob).hexdigest()
    assert file_sha256(path) == file_sha256(str(path), chunk_bytes=7) == expected
