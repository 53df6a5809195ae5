"""benchmarks/plugin_setup.py builds what `specforge train --csbp` needs without a target model (a head-only
target checkpoint and a random feature store), and the plugin trains on it: the GPU run of the plugin
(benchmarks/README.md) on 2 CPU ranks with the quickstart's drafter."""

import os
import subprocess
import sys
from pathlib import Path

from specforge_csbp.data.store import FeatureStore

ROOT = Path(__file__).resolve().parents[2]


def _run(*cmd, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_synthetic_target_and_store_train_with_the_plugin(tmp_path):
    out = tmp_path / "plugin"
    _run("benchmarks/plugin_setup.py", "--draft-config", "examples/quickstart_drafter.json", "--context", "300",
         "--samples", "2", "--out", str(out))  # fmt: skip
    store = FeatureStore(str(out / "store"), verify="full")  # hashes match the manifest
    assert len(store) == 2 and store.length("0") == 300 and store.target_layer_ids == [1, 3]
    ids, mask = store.read_tokens("1")
    assert int(mask[:64].sum()) == 0 and int(mask[64:].sum()) == 300 - 64 and not bool((ids == 3).any())
    assert sorted(os.listdir(out / "target")) == ["config.json", "model.safetensors"]

    log = _run("-m", "specforge_csbp", "train", "--csbp", "-c", "examples/quickstart.yaml",
               f"model.target_model_path={out / 'target'}", f"data.hidden_states_path={out / 'store'}",
               f"output_dir={tmp_path / 'output'}", "training.num_epochs=1", "training.log_interval=1")  # fmt: skip
    # a step trains world x batch_size samples (like data parallel), here both through CSBP one after the other
    assert "Loaded LM Head" in log and "trained 1 step(s)" in log, log[-3000:]
    assert "perf/optimizer_step_time_s" in log  # the per-step time the GPU run reads
