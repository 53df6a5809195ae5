"""Progress off a terminal: plain lines now and then, never a carriage return - the helper itself, and the bars
of real commands (capture, eval) written into a log file."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest
import torch

from specforge_csbp import progress
from specforge_csbp.assets import TINY_DATASET, TINY_TARGET_DIR, materialize_tiny_target
from specforge_csbp.cli.main import main
from specforge_csbp.progress import PlainProgress, progress_bar
from tests.support.eval_fixtures import random_drafter, write_training_output


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_tqdms_own_bar():
    out = _Terminal()
    bar = progress_bar(total=3, file=out, desc="x")
    bar.update(3)
    bar.close()
    assert not isinstance(bar, PlainProgress) and "\r" in out.getvalue()


def test_off_a_terminal_lines_come_at_most_every_interval_and_at_the_end(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    bar = progress_bar(total=100, file=out, desc="eval", unit="tok", interval_s=30.0, mininterval=0)
    for step in range(100):
        clock[0] = step * 1.0  # one update a second: the opening line (0/100), then at 30 s, 60 s, 90 s, the end
        bar.update(1)
        bar.set_postfix(tau=f"{step}")
    bar.write("a message", file=out)  # between the bar's lines, on its own line
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert [line.split(" ")[1] for line in lines] == ["0/100", "31/100", "61/100", "91/100", "message", "100/100"]
    assert lines[-1].startswith("eval: 100/100 [") and lines[-1].endswith("tau=99]")


def test_a_bar_closed_early_prints_where_it_stopped(monkeypatch):
    monkeypatch.setattr(progress.time, "monotonic", lambda: 0.0)
    out = io.StringIO()
    with progress_bar(range(10), file=out, desc="capture", unit="sample", total=10, mininterval=0) as bar:
        for i in bar:
            if i == 4:
                break
    assert out.getvalue().splitlines()[-1].startswith("capture: 4/10 [")  # tqdm counts an item once the loop asks for the next


@pytest.fixture(scope="module")
def eval_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    target = materialize_tiny_target(str(root / "target"), seed=0)
    run = write_training_output(random_drafter(True, dtype=torch.float32), str(root / "run"))
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": list(range(10, 30))}) + "\n")
    return {"target": target, "run": run, "prompts": str(prompts)}


def _logged(tmp_path, argv: list[str]) -> str:
    """A command's stderr written into a log file, as CI or `cmd 2> log` sees it."""
    log = tmp_path / "run.log"
    with open(log, "w") as f, contextlib.redirect_stderr(f):
        assert main(argv) == 0
    return log.read_text()


def test_capture_and_eval_logs_hold_no_carriage_returns(tmp_path, eval_files):
    capture = _logged(tmp_path, [
        "capture", "--target", os.path.join(TINY_TARGET_DIR, "config.json"), "--tokenizer", TINY_TARGET_DIR,
        "--data", TINY_DATASET, "--out", str(tmp_path / "store"), "--target-layer-ids", "1",
        "--max-length", "32", "--num-samples", "3",
    ])  # fmt: skip
    assert "\r" not in capture
    assert re.search(r"^capture: \d+/\d+ \[.*tokens=96\]$", capture, re.M), capture  # 3 samples x 32 tokens
    evaluated = _logged(tmp_path, [
        "eval", "--dtype", "float64", "--ignore-eos", "--drafter", eval_files["run"], "--target",
        eval_files["target"], "--prompts", eval_files["prompts"], "--max-new-tokens", "6",
        "--out", str(tmp_path / "e.json"),
    ])  # fmt: skip
    assert "\r" not in evaluated and "eval: 6/6 [" in evaluated


def test_library_bars_are_off_only_off_a_terminal(monkeypatch):
    """transformers' own bars ("Loading weights") would write carriage returns into a log: off a terminal they are
    switched off here and, through the environment, in every worker; on a terminal nothing changes."""
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    try:
        progress.quiet_library_bars(_Terminal())
        assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ and hf_logging.is_progress_bar_enabled()
        progress.quiet_library_bars(io.StringIO())
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and not hf_logging.is_progress_bar_enabled()
        hf_logging.enable_progress_bar()
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # the user's own choice wins
        progress.quiet_library_bars(io.StringIO())
        assert hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
