"""The reliability mechanisms of docs/reliability.md ("Beyond the table"), each exercised over the entry points
that share it: the error formatter (specforge_csbp/errors.py), the up-front checks (preflight.py), the
worker-error relay (distributed/relay.py), hash checks where data is read, outputs that are complete or
marked incomplete, and content-based sample identity."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from specforge_csbp.assets import TINY_TARGET_DIR
from specforge_csbp.cli.main import main
from specforge_csbp.data import store as store_mod
from specforge_csbp.data.manifest import TargetInfo
from specforge_csbp.data.store import FeatureStore, FeatureStoreWriter
from specforge_csbp.errors import load_config, load_json, load_yaml, one_line, read_jsonl, read_lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRAFTER = os.path.join(ROOT, "examples", "quickstart_drafter.json")
CAPTURE = ["capture", "--target", TINY_TARGET_DIR, "--target-layer-ids", "1,3", "--max-length", "32", "--no-progress"]


def _one_line(capsys, argv, code=2) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == code, err
    assert len(err.splitlines()) == 1, err
    return err


# -- one error formatter ------------------------------------------------------------------------------
def test_the_formatter_turns_file_system_and_parse_errors_into_one_line(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.safetensors"))
    assert one_line(full).startswith(f"cannot write {tmp_path}/x.safetensors: No space left on device (disk full)")
    assert "is a directory where a file is expected" in one_line(IsADirectoryError(errno.EISDIR, "Is a directory", "d"))
    assert "a part of this path is a file" in one_line(NotADirectoryError(errno.ENOTDIR, "Not a directory", "f/x"))
    assert "Permission denied (check the path's permissions" in one_line(PermissionError(errno.EACCES, "Permission denied", "p"))
    assert "disk full" in one_line(RuntimeError("PytorchStreamWriter failed: No space left on device\nmore"))
    from pydantic import BaseModel, ValidationError

    class Two(BaseModel):
        a: int
        b: int

    with pytest.raises(ValidationError) as err:
        Two(a="x", b="y")
    assert one_line(err.value) == "a: Input should be a valid integer, unable to parse string as an integer (got 'x') (and 1 more)"
    from typing import Literal

    from pydantic import Field

    class Union(BaseModel):  # a union field: one line naming every value it takes
        flag: bool | Literal["auto"] = "auto"
        size: int | Literal["auto", "off"] = "auto"
        bound: Literal["auto"] | int = Field("auto", ge=1)
        c: int = 0

    with pytest.raises(ValidationError) as err:
        Union(flag="sometimes", c="z")
    assert one_line(err.value) == "flag: must be true, false or 'auto' (got 'sometimes') (and 1 more)"
    with pytest.raises(ValidationError) as err:
        Union(size=[1])
    assert one_line(err.value) == "size: must be an integer, 'auto' or 'off' (got [1])"
    with pytest.raises(ValidationError) as err:
        Union(bound=0)  # a member's constraint failed: its own message is the informative one
    assert "greater than or equal to 1" in one_line(err.value)
    bad = tmp_path / "c.json"
    bad.write_text('{"a": 1,\n "b": }\n')
    with pytest.raises(ValueError, match=rf"--cfg: {bad}:2:7 is not valid JSON \(Expecting value\)"):
        load_json(bad, "--cfg")
    bad.write_text("a: 1\n  b: 2\n")
    with pytest.raises(ValueError, match=rf"--cfg: {bad} is not valid YAML: line 2 column 4: mapping values"):
        load_yaml(bad, "--cfg")
    bad.write_bytes(b"ok\nok\n\xff\xfe\n")
    with pytest.raises(ValueError, match=rf"--cfg: {bad}:3 is not UTF-8 text \(byte b'\\xff' at column 1\)"):
        list(read_lines(bad, "--cfg"))
    with pytest.raises(ValueError, match=rf"--cfg: {tmp_path} is a directory; give a file"):
        load_json(tmp_path, "--cfg")


def test_one_reader_per_format_every_entry_point_shares(tmp_path):
    """load_config picks YAML or JSON by the name; read_jsonl skips blank lines and names a bad line; every
    reader refuses a missing file and a directory with preflight.check_input_file's words."""
    (tmp_path / "a.yaml").write_text("training:\n  strategy: dflash2\n")
    (tmp_path / "a.json").write_text('{"training": {"strategy": "dflash"}}')
    (tmp_path / "a.cfg").write_text("training: {strategy: x}\n")  # YAML text under a JSON name
    assert load_config(tmp_path / "a.yaml", "--config") == {"training": {"strategy": "dflash2"}}
    assert load_config(tmp_path / "a.json", "--config") == {"training": {"strategy": "dflash"}}
    with pytest.raises(ValueError, match=rf"--config: {tmp_path}/a.cfg:1:1 is not valid JSON"):
        load_config(tmp_path / "a.cfg", "--config")
    rows = tmp_path / "r.jsonl"
    rows.write_text('{"a": 1}\n\n  \n[2]\n{"b": \n')
    it = read_jsonl(rows, "--rows")
    assert next(it) == (1, {"a": 1}) and next(it) == (4, [2])
    with pytest.raises(ValueError, match=rf"^--rows: {rows}:5 is not valid JSON \(Expecting value\)$"):
        next(it)
    for reader in (load_config, load_json, load_yaml, lambda path, field: list(read_jsonl(path, field))):
        with pytest.raises(ValueError, match=rf"^--x: {tmp_path}/none.yaml does not exist$"):
            reader(tmp_path / "none.yaml", "--x")
        with pytest.raises(ValueError, match=rf"^--x: {tmp_path} is a directory; give a file$"):
            reader(tmp_path, "--x")


@pytest.mark.parametrize("case", ["plan-block-0", "plan-gpu-mem-inf", "plan-model-dir", "plan-model-utf8",
                                  "report-missing", "report-bad-jsonl", "report-record", "report-out-dir",
                                  "verify-profile-json"])  # fmt: skip
def test_other_entry_points_refuse_bad_input_in_one_line(case, tmp_path, capsys):
    model = tmp_path / "m.json"
    model.write_bytes(b'{"hidden_size": 64, "name": "caf\xe9"}')
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.jsonl").write_text('{"workload": "sft"}\n{"workload": \n')
    (tmp_path / "r.json").write_text(json.dumps([{"workload": "sft", "mode": "warp"}]))
    (tmp_path / "p.json").write_text("{not json")
    doc = tmp_path / "doc.md"
    doc.write_text("# the existing report\n")
    argv, expected = {
        "plan-block-0": (["plan", "--model", DRAFTER, "--block-size", "0"], "block_size (--block-size) must be a finite number >= 1, got 0"),
        "plan-gpu-mem-inf": (["plan", "--model", DRAFTER, "--gpu-mem", "inf"], "gpu_mem (--gpu-mem) must be a finite number > 0, got inf"),
        "plan-model-dir": (["plan", "--model", str(tmp_path)], f"model: {tmp_path} is a directory; give a file"),
        "plan-model-utf8": (["plan", "--model", str(model)], f"model: {model}:1 is not UTF-8 text"),
        "report-missing": (["report", "--results", str(tmp_path / "resluts"), "--out", str(doc)],
                           f"--results: {tmp_path}/resluts does not exist; {doc} was left unchanged"),
        "report-bad-jsonl": (["report", "--results", str(results), "--out", str(doc)],
                             f"--results: {results}/a.jsonl:2 is not valid JSON"),
        "report-record": (["report", "--results", str(tmp_path / "r.json"), "--out", str(doc)],
                          f"--results: {tmp_path}/r.json: record 1: mode: Input should be"),
        "report-out-dir": (["report", "--results", str(results), "--out", str(tmp_path)],
                           f"--out: {tmp_path} is a directory"),
        "verify-profile-json": (["plan", "--model", DRAFTER, "--profile", str(tmp_path / "p.json")],
                                f"profile: {tmp_path}/p.json:1:2 is not valid JSON"),
    }[case]  # fmt: skip
    err = _one_line(capsys, argv)
    assert expected in err, err
    assert doc.read_text() == "# the existing report\n"  # nothing replaced the report


def test_disk_full_while_writing_the_report_keeps_the_old_one(tmp_path, capsys, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("# old\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text(json.dumps([{  # one record: results with none are refused
        "workload": "drafter", "mode": "csbp", "world_size": 2, "context_len": 65536, "block_size": 16,
        "status": "ok", "device": "H200", "date": "2025-11-30", "command": "bench", "step_ms": 100.0,
        "tokens_per_s": 655360.0, "peak_mem_gib": 1.5}]))  # fmt: skip
    real = os.replace

    def full(src, dst):
        if str(dst) == str(doc):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", full)
    err = _one_line(capsys, ["report", "--results", str(tmp_path / "results"), "--out", str(doc)])
    assert "No space left on device (disk full)" in err
    assert doc.read_text() == "# old\n"
    left = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "tmp" in p.name]
    assert left == [] and "doc.md" in os.listdir(tmp_path)  # no temp left


# -- capture: checked up front, outputs complete or marked incomplete, content identity ------------------
def _data(tmp_path, lines: list, name="d.jsonl") -> str:
    path = tmp_path / name
    path.write_bytes(b"".join(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode() for line in lines))
    return str(path)


CHAT = {"messages": [{"role": "user", "content": "Is the museum open on Monday?"},
                     {"role": "assistant", "content": "Yes, from ten until six, and the garden is free."}]}  # fmt: skip


@pytest.mark.parametrize("case", ["empty", "blank-lines", "repeated-id", "repeated-line-id", "not-utf8", "no-kind",
                                  "out-file", "out-under-file", "tokenizer-missing", "tokenizer-dir",
                                  "target-missing", "layer-ids-float", "num-samples-0"])  # fmt: skip
def test_capture_refuses_before_loading_the_target(case, tmp_path, capsys):
    out = tmp_path / "store"
    data = _data(tmp_path, [CHAT, CHAT])
    extra: list[str] = []
    expected = {
        "empty": (lambda: _data(tmp_path, []), "has no records"),
        "blank-lines": (lambda: _data(tmp_path, [b"\n", b"  \n"]), "has no records"),
        "repeated-id": (lambda: _data(tmp_path, [{**CHAT, "id": "a"}, CHAT, {**CHAT, "id": "a"}]),
                        "line 3 of {d} repeats the sample id 'a' of line 1; sample ids must be unique"),
        "repeated-line-id": (lambda: _data(tmp_path, [{**CHAT, "id": "00000001"}, CHAT]),
                             "line 2 of {d} repeats the sample id '00000001' of line 1"),
        "not-utf8": (lambda: _data(tmp_path, [CHAT, b'{"text": "caf\xe9"}\n']), "--data: {d}:2 is not UTF-8 text"),
        "no-kind": (lambda: _data(tmp_path, [CHAT, {"prompt": "x"}]), "--data: line 2 of {d} needs exactly one of 'messages'"),
        "out-file": (lambda: data, "--out: {o} is a file; it must be a directory"),
        "out-under-file": (lambda: data, "--out: {o}/inner cannot be created: {o} is a file"),
        "tokenizer-missing": (lambda: data, "--tokenizer: {t}/nope does not exist"),
        "tokenizer-dir": (lambda: data, "--tokenizer: cannot load a tokenizer from {t}"),
        "target-missing": (lambda: data, "--target: {t}/nope does not exist"),
        "layer-ids-float": (lambda: data, "dflash_config.target_layer_ids must be a list of integers, got [1.5, 3]"),
        "num-samples-0": (lambda: data, "--num-samples must be >= 1, got 0"),
    }[case]
    make, message = expected
    data = make()
    argv = [*CAPTURE, "--data", data, "--out", str(out)]
    if case in ("out-file", "out-under-file"):
        out.write_text("a file")
        if case == "out-under-file":
            argv[-1] = str(out / "inner")
    if case == "tokenizer-missing":
        argv += ["--tokenizer", str(tmp_path / "nope")]
    if case == "tokenizer-dir":
        (tmp_path / "tok").mkdir()
        argv += ["--tokenizer", str(tmp_path / "tok")]
    if case == "target-missing":
        argv[argv.index("--target") + 1] = str(tmp_path / "nope")
    if case == "layer-ids-float":
        (tmp_path / "dr.json").write_text(json.dumps({"dflash_config": {"target_layer_ids": [1.5, 3]}}))
        i = argv.index("--target-layer-ids")
        argv[i : i + 2] = ["--draft-config", str(tmp_path / "dr.json")]
    if case == "num-samples-0":
        argv += ["--num-samples", "0"]
    err = _one_line(capsys, argv + extra)
    assert message.format(d=data, o=out, t=tmp_path if "tok" in case or "target" in case else tmp_path) in err, err
    if case not in ("out-file", "out-under-file"):
        assert not out.exists()  # nothing written


def test_capture_with_nothing_to_learn_leaves_nothing(tmp_path, capsys):
    user_only = {"messages": [{"role": "user", "content": "Hello there, is anyone reading this?"}]}
    data = _data(tmp_path, [user_only, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}])
    out = tmp_path / "store"
    err = _one_line(capsys, [*CAPTURE, "--data", data, "--out", str(out)])
    assert "none of the 2 records" in err and "chat records need an assistant turn" in err
    assert not out.exists()


def test_capture_failures_leave_a_store_marked_incomplete_that_resume_finishes(tmp_path, capsys, monkeypatch):
    records = [{**CHAT, "id": f"r{i}"} for i in range(4)]
    bad = [*records[:2], {"messages": "not a list", "id": "r2"}, records[3]]
    out = str(tmp_path / "store")
    # a data error halfway: the two samples before it stay, the store never looks complete
    err = _one_line(capsys, [*CAPTURE, "--data", _data(tmp_path, bad, "bad.jsonl"), "--out", out])
    assert "messages: line 3 of" in err
    with pytest.raises(ValueError, match="is incomplete .*stopped after 2 samples.*capture --resume"):
        FeatureStore(out)
    # disk full at the next sample file: one line, the store still incomplete and resumable
    real = store_mod.save_file

    def full(tensors, path, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(store_mod, "save_file", full)
    data = _data(tmp_path, records)
    err = _one_line(capsys, [*CAPTURE, "--data", data, "--out", out, "--resume"])
    assert "No space left on device (disk full)" in err and "--resume" in err
    monkeypatch.setattr(store_mod, "save_file", real)
    # another data file under the same ids is refused (content identity, not line numbers)
    other = _data(tmp_path, [{**CHAT, "id": "r0", "messages": CHAT["messages"][:1] + [
        {"role": "assistant", "content": "No, it is closed on Mondays."}]}, *records[1:]], "other.jsonl")
    err = _one_line(capsys, [*CAPTURE, "--data", other, "--out", out, "--resume"])
    assert "--resume: line 1 of" in err and "(sample id 'r0') is not the record the store" in err
    err = _one_line(capsys, [*CAPTURE, "--data", data, "--out", out, "--resume", "--max-length", "24"])
    assert "another data file or --max-length" in err
    assert main([*CAPTURE, "--data", data, "--out", out, "--resume"]) == 0
    assert "kept 2 from an earlier run" in capsys.readouterr().out
    store = FeatureStore(out, verify="full")
    assert store.sample_ids == ["r0", "r1", "r2", "r3"] and store.manifest.complete
    assert all(s.record_sha256 and s.first_anchor is not None for s in store.manifest.samples)


def test_sigterm_mid_capture_leaves_a_resumable_store(tmp_path):
    records = [{"text": f"sample {i}: " + "the quick brown fox jumps over the lazy dog " * 3} for i in range(3000)]
    data, out = _data(tmp_path, records), str(tmp_path / "store")
    argv = [sys.executable, "-m", "specforge_csbp", *CAPTURE, "--data", data, "--out", out]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    samples = os.path.join(out, "samples")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (os.path.isdir(samples) and len(os.listdir(samples)) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("capture: stopped by SIGTERM after")
    manifest = json.loads(open(os.path.join(out, "manifest.json")).read())
    assert manifest["complete"] is False and 2 <= len(manifest["samples"]) < 3000
    # every finished sample is listed, and no half-written file is left beside them
    assert sorted(os.listdir(samples)) == sorted(os.path.basename(e["file"]) for e in manifest["samples"])
    with pytest.raises(ValueError, match="is incomplete"):
        FeatureStore(out)
    # --overwrite replaces it (it is recognisably a store); --resume finishes it: both are accepted
    small = _data(tmp_path, records[:5], "small.jsonl")
    assert main([*CAPTURE, "--data", small, "--out", out, "--overwrite"]) == 0
    assert len(FeatureStore(out)) == 5


def test_an_overwrite_accepts_a_store_killed_before_its_first_manifest(tmp_path, capsys):
    out = tmp_path / "store"
    (out / "samples").mkdir(parents=True)
    (out / "samples" / "00000000.safetensors.tmp-123").write_bytes(b"partial")
    assert main([*CAPTURE, "--data", _data(tmp_path, [CHAT]), "--out", str(out), "--overwrite"]) == 0
    assert len(FeatureStore(str(out))) == 1


# -- integrity where data is read ----------------------------------------------------------------------
def _small_store(root: str, n: int = 3) -> str:
    with FeatureStoreWriter(root, target=TargetInfo(name="t"), target_layer_ids=[0], hidden_size=4,
                            dtype="float32") as w:  # fmt: skip
        for i in range(n):
            w.add(f"s{i}", torch.arange(6), torch.tensor([0, 1, 1, 1, 0, 1]), torch.randn(6, 4))
    return root


def test_lazy_verification_names_a_flipped_byte_at_the_first_read_in_any_thread(tmp_path):
    root = _small_store(str(tmp_path / "store"))
    victim = os.path.join(root, "samples", "00000001.safetensors")
    data = bytearray(open(victim, "rb").read())
    data[-3] ^= 0x01  # inside the hidden states: the file still parses, sizes agree
    open(victim, "wb").write(bytes(data))
    FeatureStore(root, verify="trust").read_intervals("s1", [(0, 6)])  # trust: nothing notices
    store = FeatureStore(root, verify="lazy")  # opening stays a stat per file
    store.read_tokens("s0")
    errors = []

    def read():
        try:
            store.read_intervals("s1", [(0, 2)])
        except ValueError as err:
            errors.append(str(err))

    import threading

    t = threading.Thread(target=read)  # as the drafter's prefetch thread reads
    t.start()
    t.join()
    assert errors == [f"corrupted store file {victim}: hidden_states rows 0-5 (chunk 0) differ from the "
                      f"manifest's {store.manifest.chunk_hash} checksum"]  # fmt: skip
    with pytest.raises(ValueError, match="sha256 differs"):
        FeatureStore(root, verify="full")


def test_a_truncated_store_manifest_or_wrong_schema_is_one_line(tmp_path):
    root = _small_store(str(tmp_path / "store"))
    path = os.path.join(root, "manifest.json")
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 2])
    with pytest.raises(ValueError) as err:
        FeatureStore(root)
    assert str(err.value).startswith(f"store: {path}: ") and "\n" not in str(err.value)
    data = json.loads(text)
    data["samples"][0]["length"] = "long"
    open(path, "w").write(json.dumps(data))
    with pytest.raises(ValueError, match=r"store: .*samples.0.length: Input should be a valid integer") as err:
        FeatureStore(root)
    assert "\n" not in str(err.value)


# -- the drafter launcher: checked before any worker starts, worker errors relayed ----------------------
def _run_config(tmp_path, training=None, nproc=1, model=None, **top):
    (tmp_path / "target").mkdir(exist_ok=True)
    raw = {
        "model": {"target_model_path": str(tmp_path / "target"), "draft_model_config": DRAFTER,
                  "torch_dtype": "float32", **(model or {})},
        "data": {"hidden_states_path": str(tmp_path / "store"), "max_length": 64},
        "training": {"strategy": "dflash2", "fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa",
                     **(training or {})},
        "deployment": {"trainer": {"nproc_per_node": nproc}},
        "output_dir": str(tmp_path / "out"),
        **top,
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _drafter_store(tmp_path, first_supervised: int = 0, length: int = 40, config_sha256=None):
    hidden = json.load(open(DRAFTER))["hidden_size"]
    layers = json.load(open(DRAFTER))["dflash_config"]["target_layer_ids"]
    mask = torch.zeros(length, dtype=torch.long)
    mask[first_supervised:] = 1
    with FeatureStoreWriter(str(tmp_path / "store"), target=TargetInfo(name="t", config_sha256=config_sha256),
                            target_layer_ids=layers, hidden_size=hidden, dtype="float32", overwrite=True) as w:  # fmt: skip
        w.add("ok", torch.arange(length), torch.ones(length, dtype=torch.long), torch.zeros(length, len(layers) * hidden))
        w.add("late", torch.arange(length), mask, torch.zeros(length, len(layers) * hidden))


@pytest.mark.parametrize("case", ["output-dir-file", "output-dir-read-only", "lr-inf", "grad-norm-nan", "csbp-nan",
                                  "beyond-max-length", "other-target", "warm-start-other-drafter",
                                  "resume-other-drafter", "config-not-utf8", "draft-config-json",
                                  "target-missing"])  # fmt: skip
def test_drafter_launcher_refuses_before_any_worker_starts(case, tmp_path, capsys, monkeypatch):
    from transformers import AutoConfig

    from specforge_csbp.data.manifest import config_hash
    from specforge_csbp.plugin.launch import train_main

    import shutil

    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(os.path.join(TINY_TARGET_DIR, "config.json"), target / "config.json")
    _drafter_store(tmp_path, first_supervised=30 if case == "beyond-max-length" else 0,
                   config_sha256=config_hash(AutoConfig.from_pretrained(TINY_TARGET_DIR)))  # fmt: skip
    training, model, overrides = {}, {}, []
    drafter = json.load(open(DRAFTER))
    other = {**drafter, "num_hidden_layers": drafter["num_hidden_layers"] + 1}
    if case == "output-dir-file":
        (tmp_path / "out").write_text("x")
    if case == "output-dir-read-only":  # root ignores file modes; the check asks os.access
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m, **k: False if str(p) == str(tmp_path) else real(p, m, **k))
    if case == "lr-inf":
        overrides = ["training.learning_rate=inf"]
    if case == "grad-norm-nan":
        training = {"max_grad_norm": float("nan")}
    if case == "csbp-nan":
        overrides = ["csbp.selector_alpha=nan"]
    if case == "beyond-max-length":
        overrides = ["data.max_length=24"]
    if case == "other-target":
        cfg = json.load(open(target / "config.json"))
        (target / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 12345}))  # another target's config
    if case == "warm-start-other-drafter":
        (tmp_path / "ws").mkdir()
        (tmp_path / "ws" / "config.json").write_text(json.dumps(other))
        model = {"draft_checkpoint_path": str(tmp_path / "ws")}
    if case == "resume-other-drafter":
        ckpt = tmp_path / "out" / "run-step2"
        ckpt.mkdir(parents=True)
        torch.save({"strategy": "dflash2", "csbp_draft_config": json.dumps(other)}, ckpt / "training_state.pt")
        training = {"resume_from": str(ckpt)}
    if case == "target-missing":
        model = {"target_model_path": str(tmp_path / "nowhere")}
    path = _run_config(tmp_path, training, model=model)
    if case == "config-not-utf8":
        open(path, "ab").write(b"# caf\xe9\n")
    if case == "draft-config-json":
        (tmp_path / "d.json").write_text('{"hidden_size": 64,\n}')
        path = _run_config(tmp_path, training, model={"draft_model_config": str(tmp_path / "d.json")})
    expected = {
        "output-dir-file": f"output_dir: {tmp_path}/out is a file; it must be a directory",
        "output-dir-read-only": f"output_dir: {tmp_path}/out cannot be created: {tmp_path} is not writable",
        "lr-inf": "training.learning_rate: inf is not a finite number",
        "grad-norm-nan": "training.max_grad_norm: Input should be greater than 0",  # SpecForge's bound catches nan
        "csbp-nan": "csbp.selector_alpha: Input should be a finite number",
        "beyond-max-length": ("data.max_length: 1 of 2 samples of the feature store "
                              f"{tmp_path}/store have no two consecutive supervised tokens within data.max_length=24 "
                              "(first: sample 'late'; data.max_length >= 32 keeps it)"),
        "other-target": f"model.target_model_path={target}: its config is not the one the feature store",
        "warm-start-other-drafter": (f"model.draft_checkpoint_path: its drafter has num_hidden_layers="
                                     f"{other['num_hidden_layers']}, model.draft_model_config has num_hidden_layers="
                                     f"{drafter['num_hidden_layers']}"),
        "resume-other-drafter": f"training.resume_from: its drafter has num_hidden_layers={other['num_hidden_layers']}",
        "config-not-utf8": f"--config: {path}:",
        "target-missing": f"model.target_model_path: {tmp_path}/nowhere does not exist",
        "draft-config-json": f"model.draft_model_config: {tmp_path}/d.json:2:1 is not valid JSON",
    }[case]  # fmt: skip
    rc = train_main(["--csbp", "-c", path, "--plan", *overrides])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert expected in err, err
    assert not (tmp_path / "out").is_dir() or case == "resume-other-drafter"


def test_worker_errors_are_relayed_as_the_launchers_last_line(tmp_path, capsys, monkeypatch):
    import specforge.launch_plan as launch_plan

    from specforge_csbp.distributed import relay
    from specforge_csbp.plugin.launch import train_main

    _drafter_store(tmp_path)
    seen = {}

    def fake_torchrun(plan, **_kw):  # two workers: rank 1 fails on its own, rank 0 on the closed connection
        code = ("import os, sys; from specforge_csbp.distributed import relay; "
                "relay.record(ValueError(sys.argv[1])); sys.exit(1)")  # fmt: skip
        seen["env"] = os.environ.get(relay.ENV)
        for rank, msg in ((1, "loss_mask: sample 7 has no valid anchor"), (0, "Connection closed by peer [::1]:29500")):
            env = {**os.environ, "RANK": str(rank), "PYTHONPATH": ROOT}
            subprocess.run([sys.executable, "-c", code, msg], env=env, check=False)
            time.sleep(0.02)
        print("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ...", file=sys.stderr)
        return 1

    monkeypatch.setattr(launch_plan, "run_commands", fake_torchrun)
    rc = train_main(["--csbp", "-c", _run_config(tmp_path, nproc=2)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and seen["env"] and not os.path.exists(seen["env"])  # the relay directory is removed
    assert err[-1] == "specforge-csbp train: error: rank 1: loss_mask: sample 7 has no valid anchor"
    d = tmp_path / "relay"
    d.mkdir()
    assert "without reporting an error" in relay.root_cause(str(d), -9)
    (d / "rank3.txt").write_text("RuntimeError: CUDA error: out of memory\n")
    assert relay.root_cause(str(d), 1) == "rank 3: RuntimeError: CUDA error: out of memory"


# -- export: not inside a rotated checkpoint directory; truncated weights ----------------------------------
def test_export_refuses_a_rotated_directory_and_names_truncated_weights(tmp_path, capsys):
    ckpt = tmp_path / "run" / "run1-step4"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(open(DRAFTER).read())
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # truncated header
    for out in (ckpt / "export", tmp_path / "run" / "run1-step2" / "x"):
        err = _one_line(capsys, ["export", "--to", "hf", str(ckpt), str(out)])
        assert "is inside" in err and "checkpoint rotation deletes" in err, err
    err = _one_line(capsys, ["export", "--to", "hf", str(ckpt), str(tmp_path / "ok")])
    assert err.startswith(f"specforge-csbp export: error: CHECKPOINT: {ckpt}") and not (tmp_path / "ok").exists(), err


def test_every_cli_error_class_is_one_line_not_a_traceback(tmp_path, capsys):
    # a directory where a file is expected, and a file where a directory is: the same formatter
    err = _one_line(capsys, ["import-specforge", str(tmp_path), str(tmp_path / "s"), "--target-layer-ids", "1",
                             "--hidden-size", "0"])  # fmt: skip
    assert "--hidden-size must be >= 1" in err
    (tmp_path / "f").write_text("x")
    err = _one_line(capsys, ["import-specforge", str(tmp_path), str(tmp_path / "f" / "s"), "--target-layer-ids", "1",
                             "--hidden-size", "4"])  # fmt: skip
    assert re.search(r"out: .*/f/s cannot be created: .*/f is a file", err), err


# -- disk full in the trainer core: one line, `latest` intact, no partial checkpoint left ----------------
def _disk_full_rank(rank: int, world: int, path: str) -> None:
    if rank == 1:
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, f"rank{rank}.bin"))
    time.sleep(5)  # stopped by the launcher when rank 1 fails (or done by then)


def test_disk_full_in_a_spawned_rank_comes_back_as_one_line(tmp_path):
    from specforge_csbp.distributed import spawn

    with pytest.raises(ValueError) as err:  # RankValueError: printed by the CLI as its one line
        spawn(_disk_full_rank, 2, str(tmp_path), timeout_s=60)
    assert str(err.value) == (f"rank 1: cannot write {tmp_path}/rank1.bin: No space left on device (disk full); "
                              "free space or choose another output directory, then rerun (with --resume where "
                              "the command has it)")  # fmt: skip


def test_disk_full_at_a_train_bdlm_checkpoint_keeps_the_last_one(tmp_path, capsys, monkeypatch):
    from specforge_csbp.training import checkpoint as ckpt
    from tests.support.reliability_runs import SFT

    real, calls = torch.save, []

    def full(obj, f, *a, **kw):
        calls.append(str(f))
        if len(calls) == 2:  # the second checkpoint's optimizer state
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(ckpt.torch, "save", full)
    out = tmp_path / "out"
    err = _one_line(capsys, ["train-bdlm", "-c", SFT, "parallel.world_size=1", "parallel.cp_degree=1",
                             "train.steps=2", "train.warmup_steps=0", "train.save_every=1", f"train.output_dir={out}",
                             "train.progress=false"])  # fmt: skip
    assert f"cannot write {out}: No space left on device (disk full)" in err, err  # the directory, not a temporary
    assert ckpt.latest_checkpoint(out).name == "step_00000001"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["step_00000001"]  # no partial save left


def test_a_device_out_of_memory_outside_the_step_is_one_line(capsys, monkeypatch):
    """torch.OutOfMemoryError where no trainer turns it into advice (model build, capture, eval, export): the
    user's machine, not a bug - one line with what torch said it tried, no traceback; cuBLAS's allocation
    failure too."""
    import torch

    from specforge_csbp.cli import main as cli
    from specforge_csbp.errors import is_out_of_memory, is_user_error, one_line

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                 "139.80 GiB of which 1.19 GiB is free. Including non-PyTorch memory ...")  # fmt: skip
    assert is_out_of_memory(oom) and is_user_error(oom)
    assert one_line(oom) == ("device out of memory (tried to allocate 2.00 GiB, of a 139.80 GiB device): use a "
                             "shorter context, a smaller batch or more GPUs, or free the device of other processes")
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert is_user_error(cublas) and one_line(cublas).startswith("device out of memory: use a shorter context")
    assert not is_user_error(KeyError("x")) and not is_out_of_memory(RuntimeError("shape mismatch"))

    def run(args):
        raise oom

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(func=run)
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.set_defaults(func=run)
    assert cli.main(["report"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specforge-csbp report: error: device out of memory (tried to allocate 2.00 GiB")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
