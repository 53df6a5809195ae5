"""Building the CLI's parser (`specforge-csbp --help`, and every command before it runs) imports neither
transformers, SpecForge nor the models: each command's heavy imports wait until it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HEAVY = ("transformers", "specforge", "specforge_csbp.models", "specforge_csbp.plugin.launch",
         "specforge_csbp.eval.load", "specforge_csbp.eval.run")  # fmt: skip  (packages: and their modules)


def test_building_the_parser_leaves_the_heavy_modules_unimported():
    code = (
        "import sys, json\n"
        "from specforge_csbp.cli.main import build_parser\n"
        "parser = build_parser()\n"
        "parser.parse_args(['eval', '--drafter', 'd', '--target', 't', '--prompts', 'p'])\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
