#!/usr/bin/env python
"""`specforge-csbp train-bdlm` itself as the benchmark: run a recipe for a few steps and turn the trainer's own
step lines (step time, tokens/s, MFU, peak memory, max over ranks) into records (design.md section 8).

    python3 benchmarks/train_bdlm_bench.py --recipe benchmarks/configs/bdlm_gemma3-1b_32k.yaml --steps 5 \\
        --warmup 2 --out $OUT/bdlm.jsonl [-- extra.overrides=...]

One record per recipe: workload "sft" or "convert" (the recipe's objective), mode "reference" on one rank else the
recipe's parallel.mode, `step_ms` / `tokens_per_s` / `mfu` the medians of the steps after `--warmup`, `peak_mem_gib`
their maximum, `model` the recipe's model_type, plus the per-step values. No checkpoint is written
(`train.output_dir=null`). Under a GPU count > 1 the trainer starts its own torchrun (cli/train_bdlm.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specforge_csbp.bench.provenance import library_digest  # noqa: E402
from specforge_csbp.bench.runner import OOM_PATTERN  # noqa: E402
from specforge_csbp.models.bdlm.recipe import BDLMRecipe  # noqa: E402
from specforge_csbp.training.config import load_recipe  # noqa: E402

STEP_LINE = re.compile(
    r"step (\d+)/\d+ .*?\| tok/s ([\d,.]+) \| mfu ([\d.]+%?|n/a) \| peak_mem ([\d.]+) GiB \| ([\d.]+) s"
)


#: the trainer's line saying what `auto` chose (training/checkpointing.py)
CHOICE_LINE = re.compile(r"specforge-csbp: (train\.(?:activation_checkpointing|recompute_attention) auto -> .*)")

#: a line naming an error: `SomeError: ...`, `StepOutOfMemory: ...`, argparse's `...: error: ...`, a timeout
ERROR_LINE = re.compile(r"(Error|Exception|OutOfMemory)\w*:|\berror:|^timeout:")


def parse_steps(text: str) -> list[dict]:
    """The trainer's step lines (training/metrics.format_step) as dicts."""
    steps = []
    for m in STEP_LINE.finditer(text):
        mfu = m.group(3)
        steps.append({
            "step": int(m.group(1)), "tokens_per_s": float(m.group(2).replace(",", "")),
            "mfu": None if mfu == "n/a" else float(mfu.rstrip("%")) / (100 if mfu.endswith("%") else 1),
            "peak_mem_gib": float(m.group(4)), "step_s": float(m.group(5)),
        })  # fmt: skip
    return steps


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="a train-bdlm recipe (YAML)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (compiles)")
    p.add_argument("--timeout", type=int, default=500, help="seconds for the run")
    p.add_argument("--out", required=True, help="records file (JSON lines, appended)")
    p.add_argument("--log", default=None,
                   help="the trainer's whole output (default: beside --out, named after the recipe)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps must be > --warmup; got {args.steps} and {args.warmup}")
    overrides = [f"train.steps={args.steps}", "train.output_dir=null", "train.progress=false", "train.log_every=1"]
    overrides += extra
    recipe = load_recipe(BDLMRecipe, args.recipe, overrides)
    cmd = [sys.executable, "-m", "specforge_csbp", "train-bdlm", "-c", args.recipe, *overrides]
    print("+", shlex.join(cmd), flush=True)
    returncode: int | None = None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
        text, returncode = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        text = "".join(_text(x) for x in (err.stdout, err.stderr)) + f"\ntimeout: no exit within {args.timeout} s\n"
    log = args.log or f"{os.path.splitext(args.out)[0]}_{os.path.splitext(os.path.basename(args.recipe))[0]}.log"
    with open(log, "w") as f:
        f.write("+ " + shlex.join(cmd) + "\n" + text)
    print(text[-3000:], flush=True)
    status, error = classify(text, returncode)
    steps = parse_steps(text)
    timed = [s for s in steps if s["step"] > args.warmup]
    world = int(os.environ.get("WORLD_SIZE", 0)) or recipe.parallel.world_size
    mode = "reference" if recipe.parallel.cp_degree == 1 and world <= 1 else recipe.parallel.mode
    med = (lambda k: statistics.median(s[k] for s in timed) if timed and timed[0][k] is not None else None)
    record = {
        "workload": recipe.objective.kind, "mode": mode, "world_size": max(world, 1),
        "context_len": recipe.data.max_length, "block_size": recipe.model.block_size,
        "step_ms": None if not timed else med("step_s") * 1e3, "tokens_per_s": med("tokens_per_s"),
        "peak_mem_gib": max((s["peak_mem_gib"] for s in timed), default=None),
        "status": status if timed or status != "ok" else "error",
        "device": _device(), "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python3", "benchmarks/train_bdlm_bench.py", *sys.argv[1:]]),
        "code": library_digest(), "mfu": med("mfu"), "trainer": "specforge-csbp train-bdlm",
        "model": (recipe.model.config or {}).get("model_type", recipe.model.pretrained),
        "activation_checkpointing": recipe.train.activation_checkpointing,
        "recompute_attention": recipe.train.recompute_attention, "compile": recipe.train.compile,
        "steps": steps,
    }  # fmt: skip
    choices = CHOICE_LINE.findall(text)  # what auto chose, as the trainer printed it (the last: what ran)
    if choices:
        record["checkpointing_choice"] = choices[-1]
    record["step_downs"] = text.count("auto decides again")  # steps retried after running out of memory
    if record["status"] != "ok":
        record["error"] = error or "no step line: see the log"
        record["log"] = log
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "steps"}), flush=True)
    return 0 if record["status"] == "ok" else 1


def classify(text: str, returncode: int | None) -> tuple[str, str | None]:
    """(status, the trainer's own error line) of one run: "oom" when it ran out of device memory, "error"
    for any other failure or a timeout (returncode None), else "ok". The error line is the last one that
    names an error, skipping the launcher's (torchrun's ChildFailedError and elastic lines), so a failed
    point says why it failed."""
    if returncode == 0:
        return "ok", None
    status = "oom" if OOM_PATTERN.search(text) else "error"  # the sweep runner's pattern
    lines = [ln.strip() for ln in text.splitlines()]
    named = [ln for ln in lines if ERROR_LINE.search(ln) and "ChildFailedError" not in ln and "elastic" not in ln]
    error = (named or [ln for ln in lines if ln])[-1:] if lines else []
    return status, (error[0][:500] if error else None)


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
