"""The plugin's console (plugin/reporting.py): SpecForge's tracker still receives every metric; a terminal
shows a tqdm bar with loss / accuracy / est_tau / tokens per second instead of a dict dump; a log keeps
SpecForge's line; every metric lands in <output_dir>/metrics.jsonl."""

import json
from types import SimpleNamespace

from specforge.training.tracking import TrackerLogger

from specforge_csbp.plugin import reporting

METRICS = {
    "loss": 2.3104912345678, "acc": 0.41234, "est_tau": 1.8345, "slot_acc_1": 0.6, "tokens_per_micro_step": 4096.0,
    "perf/optimizer_step_time_s": 0.5, "lr": 1e-3, "grad_norm": 0.7,
}  # fmt: skip


class _Tracker:
    def __init__(self):
        self.logged = []

    def log(self, values, step):
        self.logged.append((step, dict(values)))

    def close(self):
        pass


def _controller(logger, tmp_path):
    core = SimpleNamespace(accumulation_steps=2, strategy=None)
    return SimpleNamespace(logger=logger, _make_progress_bar=lambda: None, core=core, max_steps=10,
                           total_steps=None, global_step=0, output_dir=str(tmp_path))  # fmt: skip


def test_tracker_gets_every_metric_and_a_log_keeps_specforges_line(tmp_path, capsys):
    tracker = _Tracker()
    logger = TrackerLogger(tracker, console_logger=lambda values, step: print(f"step {step}: {values}"))
    controller = _controller(logger, tmp_path)
    assert reporting.install(SimpleNamespace(trainer=SimpleNamespace(_controller=controller)))
    assert controller._make_progress_bar() is None  # not a terminal (pytest captures stderr)
    controller.logger(METRICS, 3)
    evals = {"eval/avg_loss": 2.5, "eval/avg_acc": 0.3, "eval/est_tau": 1.4, "eval/slot_acc_1": 0.5}
    controller.logger(evals, 3)
    assert [step for step, _ in tracker.logged] == [3, 3]
    assert set(tracker.logged[0][1]) == {f"train/{k}" for k in METRICS}  # SpecForge's names, all of them
    out = capsys.readouterr().out.splitlines()  # a log: SpecForge's own line, which tools parse
    assert out == [f"step 3: { {f'train/{k}': v for k, v in METRICS.items()} }", f"step 3: {evals}"]
    lines = [json.loads(x) for x in (tmp_path / reporting.METRICS_FILE).read_text().splitlines()]
    assert lines[0] == {"step": 3, **METRICS} and lines[1] == {"step": 3, **evals}


def test_a_terminal_gets_a_bar_instead_of_dicts(tmp_path, monkeypatch, capsys):
    def dict_dump(metrics, step):
        print(f"step {step}: {dict(metrics)}")

    controller = _controller(dict_dump, tmp_path)
    assert reporting.install(SimpleNamespace(trainer=SimpleNamespace(_controller=controller)))
    console = controller.logger
    assert isinstance(console, reporting.ProgressConsole) and console.fallback is dict_dump
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    bar = controller._make_progress_bar()
    assert bar is not None and bar.total == 10
    controller.logger(METRICS, 1)
    assert bar.postfix == "loss=2.31, acc=0.412, est_tau=1.835, tok/s=1.64e+04"  # 4096 x 2 / 0.5 s
    controller.logger({"eval/avg_loss": 2.5, "eval/avg_acc": 0.3, "eval/simulated_acc_len": 0.3,
                       "eval/est_tau": 1.4, "eval/slot_acc_1": 0.5}, 1)  # fmt: skip
    bar.close()
    captured = capsys.readouterr()
    assert "step 1:" not in captured.out and "{" not in captured.out  # no dict dump
    assert "eval step 1: avg_loss=2.5 avg_acc=0.3 est_tau=1.4" in captured.err
    assert (tmp_path / reporting.METRICS_FILE).read_text().count("\n") == 2


def test_install_changes_nothing_without_a_controller():
    assert reporting.install(SimpleNamespace(trainer=None)) is False
    assert reporting.install(SimpleNamespace(trainer=SimpleNamespace(_controller=SimpleNamespace()))) is False


def test_a_drafter_on_the_plateau_is_said_so_once(tmp_path, capsys):
    """csbp.plateau_steps: the first logged step at or after it with est_tau < 1.1 prints one line naming the
    cause (from scratch at long context, or not) and the recipe; a learning drafter, an earlier step, a later
    step and plateau_steps 0 print nothing."""
    check = reporting.PlateauCheck(300, max_length=65536)
    console = reporting.ProgressConsole(str(tmp_path), plateau=check)
    console({**METRICS, "est_tau": 1.02}, 296)  # before the step count: nothing yet
    console({**METRICS, "est_tau": 1.04}, 300)
    console({**METRICS, "est_tau": 1.03}, 304)  # said once
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1
    assert err[0].startswith("specforge-csbp: est_tau 1.040 after 300 steps (csbp.plateau_steps=300): the drafter is "
                             "still on the unigram plateau")  # fmt: skip
    assert "trained from scratch at data.max_length=65536 with full-attention layers" in err[0]
    assert "sliding-window layers" in err[0] and "model.draft_checkpoint_path" in err[0]
    # a sliding-window drafter from scratch at long context: not the attention spread; the schedule, two stages
    windowed = reporting.PlateauCheck(8, max_length=65536, full_attention=False)({"est_tau": 1.0}, 8)
    assert windowed is not None and "full-attention" not in windowed and "sliding-window layers" not in windowed
    assert "training.learning_rate" in windowed and "model.draft_checkpoint_path" in windowed
    warm = reporting.PlateauCheck(8, max_length=65536, warm_start="/runs/drafter-4k", full_attention=True)
    short = reporting.PlateauCheck(8, max_length=4096, full_attention=True)
    for c in (warm, short):
        line = c({"est_tau": 1.0}, 8)
        assert line is not None and "from scratch" not in line and "training.learning_rate" in line
    assert reporting.PlateauCheck(8, max_length=65536)({"est_tau": reporting.PLATEAU_TAU}, 8) is None  # learning
    off = reporting.PlateauCheck(0, max_length=65536)
    assert off({"est_tau": 1.0}, 1000) is None
    learning = reporting.PlateauCheck(8)
    assert learning({"est_tau": 1.5}, 8) is None and learning({"est_tau": 1.0}, 12) is None  # looked once


def test_full_attention_is_read_from_the_drafter_config():
    """The plateau line's cause: a config without layer_types is full attention (SpecForge's DFlash default);
    one full layer among sliding ones counts; no config is not known."""
    from specforge_csbp.plugin.launch import _has_full_attention

    assert _has_full_attention({"num_hidden_layers": 2}) is True
    assert _has_full_attention({"layer_types": ["sliding_attention", "full_attention"]}) is True
    assert _has_full_attention({"layer_types": ["sliding_attention"] * 5}) is False
    assert _has_full_attention(None) is None
