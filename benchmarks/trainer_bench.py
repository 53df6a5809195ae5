#!/usr/bin/env python
"""Trainer-level benchmark: stock `specforge train` (strategy dflash) against `specforge train --csbp`
(dflash-csbp, cp_size 1) on one GPU, on identical bytes, with the same drafter, anchors and block size,
over ONE pass of 8 distinct samples by default - the pass users train in, where every step reads its
sample for the first time.

    python3 benchmarks/trainer_bench.py --draft-config drafter_configs/qwen3.6-27b-dflash.json \
        --context 64K --samples 8 --passes 2 --work /tmp/trainer --out $OUT/trainer.jsonl

    WORK/draft.json            the drafter both trainers train (--no-dflash2: the config without conv/selector)
    WORK/target/               head-only random target (config, embeddings, LM head: benchmarks/plugin_setup.py)
    WORK/records/rows_0-2000/  SpecForge 0.2.0 offline DFlash records, data_{i}.ckpt (random features)
    WORK/store/                the same records imported with the project's import-specforge (the user's path)
    WORK/data.json             what the data is (context, samples, seed, target shape): --reuse-data checks it
    WORK/{specforge,csbp,csbp-trust}/  each run's run.yaml, peak.json; output/ (checkpoint) deleted
                               after each run (the trace is copied out first)
    <--out's folder>/trainer_logs/<run>_<context>_<cache>-cache.log  each launch's output, streamed as it runs

    order   records -> stock `specforge train` -> import (each record deleted once stored, unless
            --keep-data) -> `specforge train --csbp` once per --store-verify value
            (disk: one copy of the data at a time, plus the target; --keep-data keeps both copies,
            --keep-store the target and the store for a later --reuse-data launch)

Steps. Steps 1 and 2 (--warmup, default 2) compile and are in no median (`left_out_steps`, `left_out_reason`):
step 1 builds the kernels for the first shapes (torch.compile, FlexAttention, cuBLAS), step 2 the
dynamic-shape kernels torch.compile builds when a length first changes (automatic dynamic shapes: each
sample has its own number of context rows; static kernels first because they are the faster ones while
shapes repeat). `first_pass_step_ms` / `first_pass_p90_ms`:
median and p90 of the other steps of the first pass; `later_pass_step_ms`: the median of the later passes
(--passes > 1), leaving out each epoch's first step (the data loader restarts, the plugin's look-ahead has no
previous batch: `epoch_first_step_ms`) and the --profile-steps profiled ones at the end; `first_vs_later` is
their ratio. `step_ms` is the first-pass median (the later passes' when the first pass has no timed step).

The data. Before each trainer run its data files are evicted from the page cache (--cache cold: fsync +
posix_fadvise DONTNEED, plus /proc/sys/vm/drop_caches as root; `cache_prepared_by` says which ran) or read
once (--cache warm). `data_bytes_per_step`: the data file bytes one step reads (one sample's file per
sample: one rank reads every row); `read_gbps_needed`: that over the first-pass step; `disk_read_gbps`: one
cold sequential read of a sample file in the same launch, `disk_read_gbps_parallel`: the same file read cold by
8 threads at once (the disk at queue depth); `read_ms_at_disk_rate`: the step's bytes at the better of the two;
`read_bound`: cold, and that read takes longer than the step with its bytes in memory (the later passes'
median; not judged without a later pass). --store-verify lazy,trust runs the plugin with the store's
per-chunk checks on and off in the same launch, in the order given (`store_verify`; a record's workload names
its page cache, -cold-cache or -warm-cache, and the check-off record's ends in -store-trust); a value may
repeat to alternate the pair (trust,lazy,trust,lazy: `verify_launch` is each record's place in the list, logs
end in -<place>; the first launch on a fresh machine also compiles what later launches load from the
compiler's cache, so pair launches after it).

What is measured is what the trainers log themselves: both run SpecForge's TrainerController, which prints
`step N: {...}` per optimizer step (training.log_interval 1) with perf/optimizer_step_time_s (wall time of
the step's window: data, compute, logging, acks), perf/data_wait_time_s and perf/train_compute_time_s
(forward + backward + optimizer step). Each trainer's final checkpoint is skipped (after the last step;
--checkpoint keeps it). Neither trainer logs memory: a child wrapper around each trainer's own entry point
writes torch.cuda.max_memory_allocated() (CPU: peak RSS) when it exits. The GPU's free memory as each
trainer starts is recorded (`gpu_free_gib`: this process gives back what generating the data took, so a
launch finds the whole device), and the plugin's start-up choice of keeping its logits (`keep_logits`:
kept / recomputed, sized from that free memory; docs/performance.md, "csbp.keep_logits_gib by default").

Each trainer's step broken down (record field `breakdown_ms`, per optimizer step; needs --profile-steps):

    data            perf/data_wait_time_s           (SpecForge's timer around next(batch))
    forward+backward perf/train_compute_time_s - optimizer
    optimizer       "Optimizer.step#..." ranges of the profiled steps (torch.profiler marks every
                    torch.optim step), + zero_grad
    host_syncs      count and time of cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize
                    and aten::_local_scalar_dense (.item()) in the profiled steps
    logging         perf/optimizer_step_time_s - data - train compute - durable acks (logging, checkpoint
                    bookkeeping, the controller's own work)

The profile is SpecForge's own window (`profiling.enabled`, its StepProfiler), over the last
--profile-steps steps of each run; its chrome trace is copied to --trace-dir when it is at most 16 MiB.
`gpu_kernels_ms`: the profiled steps' kernel time per step (the GPU's busy share of the step).

Records (design.md section 8): workload "trainer-<config file name>[-batch<B>]-<cold|warm>-cache[-store-trust]"
(a DFlash2 file trained with --no-dflash2: "-as-dflash" after the name; `trained_config` names it), modes "specforge" and "csbp", world_size 1,
`tokens_per_s` = supervised tokens (anchors x (block size - 1)) per second; extras: the fields above,
data_wait_ms, train_compute_ms, steps_ms (every step), timed_steps, peak_reserved_gib, gpu_free_gib,
keep_logits, breakdown_ms, host_syncs_per_step, item_calls_per_step, gpu_kernels_ms.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import gzip
import json
import math
import os
import re
import shlex
import shutil
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("specforge", "csbp")
STORE_VERIFY = ("lazy", "trust")
#: why the first --warmup steps are in no median (recorded as `left_out_reason`)
LEFT_OUT_REASON = ("compile steps: step 1 builds the kernels for the first shapes (torch.compile, FlexAttention, "
                   "cuBLAS); step 2 the dynamic-shape kernels torch.compile builds at the first change of length "
                   "(each sample has its own number of context rows)")
TRACE_LIMIT_BYTES = 16 << 20  # the GPU machine brings back files up to 16 MiB
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
NO_CHECKPOINT_ENV = "TRAINER_BENCH_NO_CHECKPOINT"
_STEP_LINE = re.compile(r"^step (\d+): (\{.*\})$", flags=re.MULTILINE)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft-config", required=True, help="drafter config.json (drafter_configs/)")
    p.add_argument("--no-dflash2", action="store_true",
                   help="train the config as DFlash v1 (no conv, no selector): stock SpecForge 0.2.0 trains v1 only")  # fmt: skip
    p.add_argument("--context", default="64K", help="tokens per sample (64K, 128K, ...)")
    p.add_argument("--samples", type=int, default=8, help="distinct samples in the data (one pass reads each once)")
    p.add_argument("--passes", type=int, default=1,
                   help="passes over the samples (1: the first pass, as users train; more: later-pass steps beside it)")  # fmt: skip
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per trainer (default --passes x samples / --batch-size)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=1,
                   help="samples per optimizer step (training.batch_size; --samples must hold at least one batch)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2,
                   help="first steps left out of every median: they compile (step 1 the first shapes' kernels, "
                   "step 2 the dynamic-shape ones)")  # fmt: skip
    p.add_argument("--profile-steps", type=int, default=0, help="last steps of each run profiled (0: none)")
    p.add_argument("--cache", choices=("cold", "warm"), default="cold",
                   help="page cache before each trainer run: cold evicts its data files (posix_fadvise, + drop_caches "
                        "as root), warm reads them once")  # fmt: skip
    p.add_argument("--fadvise-only", action="store_true",
                   help="--cache cold without /proc/sys/vm/drop_caches (which drops every file's pages on the machine)")  # fmt: skip
    p.add_argument("--store-verify", default="lazy",
                   help="comma list of lazy, trust, in order, repeats allowed: one csbp run each (csbp.store_verify: the store's checks on / off)")  # fmt: skip
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--modes", default="specforge,csbp", help="comma list of specforge, csbp")
    p.add_argument("--work", required=True, help="scratch directory (records, store, run outputs)")
    p.add_argument("--out", required=True, help="records file (JSON lines)")
    p.add_argument("--trace-dir", default=None, help="copy each run's profile (chrome trace, <= 16 MiB) here")
    p.add_argument("--keep-data", action="store_true", help="keep the records and the store (checkpoints never)")
    p.add_argument("--keep-store", action="store_true", help="keep the target and the store (the records go)")
    p.add_argument("--reuse-data", action="store_true",
                   help="train on WORK's target and store (and records, if kept) from an earlier launch with the same "
                        "--context, --samples, --seed and target shape, instead of writing them")  # fmt: skip
    p.add_argument("--checkpoint", action="store_true", help="let each trainer save its final checkpoint")
    p.add_argument("--timeout", type=int, default=540, help="seconds per trainer run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one trainer in this process
    p.add_argument("trainer_argv", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is None:
        bad = sorted(set(args.modes.split(",")) - set(MODES))
        if bad:
            p.error(f"--modes: unknown {', '.join(bad)}; allowed: {', '.join(MODES)}")
        verify = args.store_verify.split(",")
        if set(verify) - set(STORE_VERIFY):
            p.error(f"--store-verify: {args.store_verify!r}; allowed: a comma list of {', '.join(STORE_VERIFY)}")
        for name in ("samples", "passes", "anchors", "batch_size"):
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
        if args.samples < args.batch_size:
            p.error(f"--samples {args.samples} holds no batch of --batch-size {args.batch_size}")
        if args.steps is None:
            args.steps = args.passes * batches_per_epoch(args)
        if args.steps < 1:
            p.error(f"--steps must be >= 1; got {args.steps}")
        if args.warmup < 0 or args.profile_steps < 0:
            p.error("--warmup and --profile-steps must be >= 0")
        if not timed_steps(args):
            p.error(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup} and "
                    f"--profile-steps {args.profile_steps}")  # fmt: skip
    # one launch of this script: its records pair side by side (bench/compare.py match_key), and a later launch
    # of the same command is a newer measurement, not more repeats of this one
    args.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return args


# -- the child: one trainer's own entry point, in this process, peak memory written at exit ----------------
def run_child(peak_path: str, argv: list[str]) -> int:
    """`specforge train ...` (SpecForge's main) or `specforge train --csbp ...` (the plugin's launcher, as the
    start-up hook routes it); one rank runs in this process, so its peak memory is this process's."""
    import resource

    import torch

    if os.environ.get(NO_CHECKPOINT_ENV):
        # the final checkpoint (SpecForge's Trainer.fit saves one after the last step: 23 GB and a minute
        # for the 27B shape) is written after every timed step; skipping it changes no step's time
        from specforge.training.trainer import Trainer

        Trainer.save_checkpoint = lambda self: None
    try:
        if "--csbp" in argv:
            from specforge_csbp.plugin.launch import train_main

            rc = train_main(argv[1:], prog="specforge train")
        else:
            from specforge.cli import main

            rc = main(argv)
    finally:
        peak = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        if torch.cuda.is_available():
            peak.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                        peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30)  # fmt: skip
        tmp = peak_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(peak, f)
        os.replace(tmp, peak_path)
    return int(rc or 0)


# -- data: one set of random bytes in both formats -----------------------------------------------------------
def drafter_config(args, work: str):
    """The drafter config both trainers train, written to WORK/draft.json."""
    from specforge_csbp.models.dflash.configuration import DFlashConfig, plain_dflash

    with open(args.draft_config) as f:
        raw = json.load(f)
    if args.no_dflash2:
        raw = plain_dflash(raw)
    path = os.path.join(work, "draft.json")
    with open(path, "w") as f:
        json.dump(raw, f, indent=1)
    return path, DFlashConfig.from_json_file(path)


def write_records(config, root: str, length: int, samples: int, generator, device) -> list[str]:
    """SpecForge 0.2.0 offline DFlash records (data/specforge_import.py describes the format)."""
    import torch
    from plugin_setup import random_sample
    from tqdm import tqdm

    folder = os.path.join(root, "rows_0-2000")
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i in tqdm(range(samples), desc="records", unit="sample"):
        ids, mask, feats = random_sample(config, length, generator, device, dtype=feature_dtype(device))
        path = os.path.join(folder, f"data_{i:06d}.ckpt")
        torch.save({"input_ids": ids, "loss_mask": mask, "hidden_states": feats[None]}, path)
        paths.append(path)
        del feats
    return paths


def import_store(config, records: str, store: str, target: str, *, delete_records: bool = False) -> None:
    """The records imported as a user does (`specforge-csbp import-specforge`'s library call);
    `delete_records`: each record goes once its sample is stored (one copy of the data on disk at a time:
    8 samples of 64K for the 27B shape are 27 GB each way)."""
    from transformers import AutoConfig

    from specforge_csbp.data.manifest import target_info
    from specforge_csbp.data.specforge_import import import_specforge_records

    info = target_info(target, AutoConfig.from_pretrained(target))
    import_specforge_records(records, store, target_layer_ids=list(config.dflash["target_layer_ids"]),
                             hidden_size=int(config.hidden_size), target=info, overwrite=True,
                             after_each=os.remove if delete_records else None)  # fmt: skip


def release_gpu(device) -> None:
    """Give the GPU memory that generating the data took back to the device: the trainers run beside this
    process, and a plugin launch sizes `csbp.keep_logits_gib` from the GPU's free memory (the cached blocks
    of a 64K sample's generation, 16 GiB held here, once made it recompute its logits on an H100)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def gpu_free_gib(device) -> float | None:
    """The device's free memory as a trainer launched now finds it (every process's allocations counted)."""
    import torch

    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return round(free / 2**30, 2)


def keep_logits_choice(log: str) -> str | None:
    """'kept' / 'recomputed' from the plugin's start-up line (`csbp.keep_logits_gib auto -> ...`); None where
    the log has none (stock SpecForge, or the value given)."""
    found = re.search(r"csbp\.keep_logits_gib auto -> .*\b(kept|recomputed)\)", log)
    return found.group(1) if found else None


def feature_dtype(device):
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


# -- one trainer run ---------------------------------------------------------------------------------------
def run_config(args, mode: str, work: str, draft: str, data: str, length: int, on_gpu: bool,
               dflash2: bool = False) -> dict:  # fmt: skip
    """One trainer's run.yaml: strategy dflash (dflash2 for a DFlash2 drafter; `--csbp` makes either the
    plugin's)."""
    steps = args.steps
    training = {
        "strategy": "dflash2" if dflash2 else "dflash", "fsdp_sharding": "NO_SHARD", "batch_size": args.batch_size, "accumulation_steps": 1,
        "num_epochs": math.ceil(steps / batches_per_epoch(args)), "max_steps": steps, "num_anchors": args.anchors,
        "learning_rate": 1e-4, "warmup_ratio": 0.0, "log_interval": 1, "seed": args.seed,
        "attention_backend": "flex_attention" if on_gpu else "sdpa",
    }  # fmt: skip
    run = {
        "model": {"target_model_path": os.path.join(work, "target"), "draft_model_config": draft,
                  "torch_dtype": "bfloat16" if on_gpu else "float32"},
        "data": {"hidden_states_path": data, "max_length": length},
        "training": training,
        "deployment": {"trainer": {"nproc_per_node": 1}},
        "run_id": f"bench-{mode}", "output_dir": os.path.join(work, mode, "output"),
    }  # fmt: skip
    if args.profile_steps:
        run["profiling"] = {"enabled": True, "start_step": steps - args.profile_steps,
                            "num_steps": args.profile_steps}  # fmt: skip
    return run


def launch(args, mode: str, run: dict, work: str, verify: str = "lazy", tag: str = "") -> tuple[str, dict, int, float]:
    """(stdout + stderr, peak memory, return code, wall seconds) of one trainer in a child process.

    The child's output streams into `<--out's folder>/trainer_logs/<run>_<context>.log` as it runs, so a
    launch stopped from outside (a scenario's limit) still leaves how far it got; the child runs in a
    process group of its own and `--timeout` stops all of it (compile workers included)."""
    import yaml

    from specforge_csbp.bench.processes import run_group

    folder = os.path.join(work, run_name(mode, verify))
    os.makedirs(folder, exist_ok=True)
    cfg_path, peak_path = os.path.join(folder, "run.yaml"), os.path.join(folder, "peak.json")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(run, f)
    trainer = ["train", "-c", cfg_path]
    if mode == "csbp":
        trainer += ["--csbp", "csbp.cp_size=1", f"csbp.store_verify={verify}"]
    cmd = [sys.executable, "-u", os.path.abspath(__file__), "--draft-config", args.draft_config, "--work", work,
           "--out", args.out, "--child", peak_path, "--", *trainer]  # fmt: skip
    env = dict(os.environ, SPECFORGE_CSBP_DISABLE="1", **({NO_CHECKPOINT_ENV: "1"} if not args.checkpoint else {}),
               PYTHONPATH=os.pathsep.join(
        [os.path.abspath(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))  # fmt: skip
    log_path = launch_log_path(args, mode, verify, tag)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    print(f"== {run_name(mode, verify)}: {shlex.join(['specforge', *trainer])} (log: {log_path})", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as out:
        rc, timed_out = run_group(cmd, args.timeout, grace_s=5.0, stdout=out, env=env)
    wall_s = time.perf_counter() - start
    with open(log_path) as f:
        log = f.read()
    if timed_out:
        log, rc = log + f"\ntrainer_bench: {mode} ran past --timeout {args.timeout}s", 124
    peak = {}
    if os.path.exists(peak_path):
        with open(peak_path) as f:
            peak = json.load(f)
    return log, peak, rc, wall_s


def launch_log_path(args, mode: str, verify: str = "lazy", tag: str = "") -> str:
    """Where one launch's output goes: beside the records file, so it comes back with them (`tag`: "-<k>" for
    the k-th csbp launch when --store-verify repeats a value)."""
    folder = os.path.join(os.path.dirname(os.path.abspath(args.out)), "trainer_logs")
    return os.path.join(folder, f"{run_name(mode, verify)}{tag}_{args.context}_{args.cache}-cache.log")


def run_name(mode: str, verify: str = "lazy") -> str:
    """The run's folder under WORK: csbp, csbp-trust (the store's checks off), specforge."""
    return f"{mode}-trust" if mode == "csbp" and verify == "trust" else mode


def step_metrics(log: str) -> dict[int, dict[str, float]]:
    """{optimizer step: the metrics SpecForge's controller printed for it}."""
    out = {}
    for step, payload in _STEP_LINE.findall(log):
        try:
            out[int(step)] = ast.literal_eval(payload)
        except (ValueError, SyntaxError):
            continue
    return out


def batches_per_epoch(args) -> int:
    """Optimizer steps per epoch (SpecForge drops the last incomplete batch)."""
    return args.samples // args.batch_size


def first_pass_steps(args) -> list[int]:
    """Steps (1-based, as SpecForge counts) of the first pass over the samples, each reading its samples
    for the first time: all but the --warmup compile steps and any profiled step."""
    last = min(batches_per_epoch(args), args.steps - args.profile_steps)
    return list(range(args.warmup + 1, last + 1))


def later_pass_steps(args) -> list[int]:
    """Steps of the later passes: after the first pass and the warm-up, before the profiled ones, and not
    the first of an epoch (a new epoch restarts the data loader, and the plugin's look-ahead starts with the
    epoch's second batch: plugin/lookahead.py) unless every step is one."""
    steps = list(range(max(batches_per_epoch(args), args.warmup) + 1, args.steps - args.profile_steps + 1))
    inner = [s for s in steps if (s - 1) % batches_per_epoch(args)]
    return inner or steps


def timed_steps(args) -> list[int]:
    """The steps `step_ms` is the median of: the first pass when it has a timed step, else the later ones."""
    return first_pass_steps(args) or later_pass_steps(args)


def epoch_first_steps(args) -> list[int]:
    bpe = batches_per_epoch(args)
    return [s for s in range(max(bpe, args.warmup) + 1, args.steps - args.profile_steps + 1) if not (s - 1) % bpe]


def p90(values: list[float]) -> float:
    """The 90th percentile (linear between order statistics; the value itself for one)."""
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def _metric(m: dict, name: str) -> float | None:
    for key in (name, f"train/{name}"):
        if key in m:
            return float(m[key])
    return None


# -- the profiled steps ------------------------------------------------------------------------------------
def _union_ms(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total length (ms) of a union of [start, end) intervals (us) and the merged intervals."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return sum(b - a for a, b in merged) / 1e3, merged


def _overlap_ms(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length (ms) of the intersection of two merged interval lists (us)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        i, j = (i + 1, j) if a[i][1] < b[j][1] else (i, j + 1)
    return total / 1e3


def trace_summary(path: str, steps: int) -> dict[str, float]:
    """Per-step optimizer time, host syncs and GPU streams from a chrome trace of `steps` optimizer steps.

    The compute stream is the one with the most kernel time; every other stream's work (the prefetcher's
    feature copies and index staging) is `side_stream_ms`, and `side_stream_hidden` the share of it that
    ran while the compute stream was busy (1.0: entirely off the critical path). `compute_idle_ms`: gaps
    in the compute stream between its first and last kernel of the profiled window."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    opt_ms = zero_ms = sync_ms = kernel_ms = 0.0
    syncs = items = 0
    busy: dict[object, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        name, dur = str(e.get("name", "")), float(e.get("dur", 0.0)) / 1e3
        if name.startswith("Optimizer.step#"):
            opt_ms += dur
        elif name.startswith("Optimizer.zero_grad#"):
            zero_ms += dur
        elif name in SYNC_CALLS:
            syncs, sync_ms = syncs + 1, sync_ms + dur
        elif name == "aten::_local_scalar_dense":
            items += 1
        if e.get("cat") == "kernel":
            kernel_ms += dur
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            start = float(e.get("ts", 0.0))
            busy.setdefault((e.get("args") or {}).get("stream"), []).append((start, start + float(e.get("dur", 0.0))))
    n = max(1, steps)
    out = {"optimizer": (opt_ms + zero_ms) / n, "host_sync_ms": sync_ms / n, "host_syncs": syncs / n,
           "item_calls": items / n, "gpu_kernels_ms": kernel_ms / n}  # fmt: skip
    if busy:
        unions = {stream: _union_ms(iv) for stream, iv in busy.items()}
        compute = max(unions, key=lambda st: unions[st][0])
        compute_ms, compute_iv = unions[compute]
        side = [iv for st, ivs in busy.items() if st != compute for iv in ivs]
        side_ms, side_iv = _union_ms(side)
        window = (compute_iv[-1][1] - compute_iv[0][0]) / 1e3
        out.update(compute_idle_ms=(window - compute_ms) / n, side_stream_ms=side_ms / n,
                   side_stream_hidden=_overlap_ms(side_iv, compute_iv) / side_ms if side_ms else 1.0)  # fmt: skip
    return out


def newest_trace(output_dir: str) -> str | None:
    found = []
    for root, _dirs, names in os.walk(output_dir):
        found += [os.path.join(root, n) for n in names if ".trace.json" in n]
    return max(found, key=os.path.getmtime) if found else None


# -- records -----------------------------------------------------------------------------------------------
def _step_s(metrics: dict, steps: list[int]) -> list[float]:
    got = [_metric(metrics[s], "perf/optimizer_step_time_s") for s in steps if s in metrics]
    return [x for x in got if x is not None]


def data_fields(args, data_bytes_per_step: int, disk_gbps: tuple[float, float] | None, step_ms: float | None,
                in_memory_step_ms: float | None = None) -> dict:  # fmt: skip
    """What the data costs a step: the bytes it reads, the rate that needs, the disk's rates (one stream, several
    streams at once), how long the bytes take at the better of them, bound or not.

    Cold, every first-pass byte comes from the disk, so a step is bound by reading when its bytes take longer
    at the disk's best rate than the step takes with them in memory (`in_memory_step_ms`: the later passes'
    median, whose samples the first pass left in the page cache); without a later pass it is not judged."""
    needed = data_bytes_per_step / (step_ms / 1e3) / 1e9 if step_ms else None
    sequential, parallel = disk_gbps or (None, None)
    best = max(sequential or 0, parallel or 0)
    read_ms = data_bytes_per_step / (best * 1e9) * 1e3 if best else None
    bound = None
    if args.cache == "warm":
        bound = False
    elif read_ms and in_memory_step_ms:
        bound = read_ms > in_memory_step_ms
    return dict(
        data_bytes_per_step=data_bytes_per_step, read_gbps_needed=float(f"{needed:.4g}") if needed else None,
        disk_read_gbps=float(f"{sequential:.4g}") if sequential else None,
        disk_read_gbps_parallel=float(f"{parallel:.4g}") if parallel else None,
        read_ms_at_disk_rate=round(read_ms, 1) if read_ms else None, read_bound=bound,
    )  # fmt: skip


def make_record(args, mode, length, block_size, log, peak, rc, device_name, name, trace, *, verify="lazy",
                cache=None, data_bytes_per_step=0, disk_gbps=None) -> dict:  # fmt: skip
    from specforge_csbp.bench.provenance import library_digest

    metrics = step_metrics(log)
    want, first, later = timed_steps(args), first_pass_steps(args), later_pass_steps(args)
    step_s, first_s, later_s = _step_s(metrics, want), _step_s(metrics, first), _step_s(metrics, later)
    firsts = _step_s(metrics, epoch_first_steps(args))
    ms = lambda xs: round(statistics.median(xs) * 1e3, 2) if xs else None  # noqa: E731
    workload = f"trainer-{name}" + (f"-batch{args.batch_size}" if args.batch_size > 1 else "")
    workload += f"-{args.cache}-cache" + ("-store-trust" if verify == "trust" else "")
    record = dict(
        workload=workload, mode=mode, world_size=1, context_len=length, block_size=block_size,
        device=device_name, date=datetime.date.today().isoformat(), code=library_digest(),
        command=(command := shlex.join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])),
        launch=f"{command} (started {args.started})", trained_config=name, anchors=args.anchors, dflash2=not args.no_dflash2, samples=args.samples,
        steps=args.steps, passes=args.passes, batch_size=args.batch_size, warmup=args.warmup,
        timed_steps=len(step_s), step_ms_of="first pass" if first else "later passes",
        first_pass_step_ms=ms(first_s), first_pass_p90_ms=round(p90(first_s) * 1e3, 2) if first_s else None,
        first_pass_steps=first, later_pass_step_ms=ms(later_s), later_pass_steps=later,
        first_vs_later=round(statistics.median(first_s) / statistics.median(later_s), 4) if first_s and later_s else None,
        left_out_steps=list(range(1, args.warmup + 1)), left_out_reason=LEFT_OUT_REASON,
        profiled_steps=list(range(args.steps - args.profile_steps + 1, args.steps + 1)),
        page_cache=args.cache, cache_prepared_by=cache, store_verify=verify if mode == "csbp" else None,
        epoch_first_step_ms=ms(firsts), keep_logits=keep_logits_choice(log),
        steps_ms=[round(float(_metric(metrics[s], "perf/optimizer_step_time_s") or 0) * 1e3, 2) for s in sorted(metrics)],
        status="ok",
    )  # fmt: skip
    if rc != 0 or len(step_s) < len(want):
        oom = "out of memory" in log.lower()
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or [f"exit {rc}"]
        record.update(status="oom" if oom else "error", error=tail[0][:300])
        if not step_s:
            return record
    med = lambda key: statistics.median(  # noqa: E731
        [_metric(metrics[s], key) or 0.0 for s in want if s in metrics]
    )
    step_ms = statistics.median(step_s) * 1e3
    data_ms, compute_ms = med("perf/data_wait_time_s") * 1e3, med("perf/train_compute_time_s") * 1e3
    ack_ms = med("perf/durable_ack_time_s") * 1e3
    record.update(data_fields(args, data_bytes_per_step, disk_gbps, record["first_pass_step_ms"] or step_ms,
                              record["later_pass_step_ms"]))  # fmt: skip
    record.update(
        step_ms=round(step_ms, 2),
        tokens_per_s=round(args.batch_size * args.anchors * (block_size - 1) / (step_ms / 1e3), 1),
        data_wait_ms=round(data_ms, 2), train_compute_ms=round(compute_ms, 2),
        peak_mem_gib=round(peak.get("peak_allocated_gib", peak.get("peak_rss_gib", 0.0)), 3) or None,
        peak_mem_kind="cuda max_memory_allocated" if "peak_allocated_gib" in peak else "host peak RSS",
    )  # fmt: skip
    if "peak_reserved_gib" in peak:
        record["peak_reserved_gib"] = round(peak["peak_reserved_gib"], 3)
    if trace is not None:
        prof = trace_summary(trace, args.profile_steps)
        record["breakdown_ms"] = {
            "data": round(data_ms, 2),
            "forward_backward": round(compute_ms - prof["optimizer"], 2),
            "optimizer": round(prof["optimizer"], 2),
            "host_syncs": round(prof["host_sync_ms"], 2),
            "logging": round(step_ms - data_ms - compute_ms - ack_ms, 2),
        }
        record.update(host_syncs_per_step=prof["host_syncs"], item_calls_per_step=prof["item_calls"],
                      gpu_kernels_ms=round(prof["gpu_kernels_ms"], 2))  # fmt: skip
        record.update({k: round(prof[k], 3) for k in ("compute_idle_ms", "side_stream_ms", "side_stream_hidden")
                       if k in prof})  # fmt: skip
    return record


def write(path: str, record: dict) -> None:
    from specforge_csbp.bench.records import BenchRecord, write_records

    write_records(path, [BenchRecord(**record)])


def data_files(path: str) -> list[str]:
    """Every file under a records or store directory (what a run reads)."""
    return sorted(os.path.join(r, n) for r, _d, names in os.walk(path) for n in names)


def sample_files(path: str) -> list[str]:
    """The per-sample files under a records or store directory (records' .ckpt, the store's .safetensors)."""
    return [f for f in data_files(path) if f.endswith((".ckpt", ".safetensors"))]


def prepare_cache(args, files: list[str]) -> str:
    """Set the page cache for a run's data files as --cache asks; returns how."""
    from specforge_csbp.bench.page_cache import evict, warm

    if args.cache == "cold":
        return evict(files, drop_caches=not args.fadvise_only)
    warm(files)
    return "read once"


def data_stamp(args, config, length: int) -> dict:
    return {"context": length, "samples": args.samples, "seed": args.seed, "hidden_size": int(config.hidden_size),
            "vocab_size": int(config.vocab_size), "target_layer_ids": list(config.dflash["target_layer_ids"])}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return run_child(args.child, args.trainer_argv)
    import torch

    from plugin_setup import write_target
    from specforge_csbp.bench.grid import parse_size
    from specforge_csbp.bench.page_cache import parallel_read_gbps, sequential_read_gbps

    modes = [m for m in MODES if m in args.modes.split(",")]
    verifies = args.store_verify.split(",")  # in the order given, repeats alternate the pair
    repeated = len(set(verifies)) < len(verifies)
    length = parse_size(args.context)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    draft, config = drafter_config(args, work)
    if config.is_dflash2 and "specforge" in modes:
        raise SystemExit(f"--modes specforge: stock SpecForge 0.2.0 trains plain DFlash only; {args.draft_config} is "
                         "DFlash2 - add --no-dflash2 or use --modes csbp")  # fmt: skip
    # records are named after the config file trained; a DFlash2 file trained as plain DFlash says so
    name = os.path.splitext(os.path.basename(args.draft_config))[0]
    with open(args.draft_config) as f:
        from_dflash2 = "DFlash2DraftModel" in (json.load(f).get("architectures") or [])
    name += "-as-dflash" if args.no_dflash2 and from_dflash2 else ""
    block_size = int(config.draft_block_size)
    target_dir, records, store = (os.path.join(work, n) for n in ("target", "records", "store"))
    stamp_path, stamp = os.path.join(work, "data.json"), data_stamp(args, config, length)
    if args.reuse_data:
        old = json.load(open(stamp_path)) if os.path.exists(stamp_path) else None
        if old != stamp:
            raise SystemExit(f"--reuse-data: {work} holds no data of this shape ({stamp_path}: {old}, this run: {stamp})")
        if "specforge" in modes and not os.path.isdir(records):
            raise SystemExit(f"--reuse-data --modes specforge: {records} is gone (keep it with --keep-data)")
        if not os.path.isdir(records) and not os.path.exists(os.path.join(store, "manifest.json")):
            raise SystemExit(f"--reuse-data: neither {store} nor {records} is left (keep them with --keep-store)")
        target = target_dir
    else:
        generator = torch.Generator(device=device).manual_seed(args.seed)
        target = write_target(config, target_dir, generator, device)
        shutil.rmtree(records, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
        began = time.perf_counter()
        write_records(config, records, length, args.samples, generator, device)
        del generator
        release_gpu(device)
        print(f"trainer_bench: target and {args.samples} records written in {time.perf_counter() - began:.0f} s", flush=True)
        with open(stamp_path, "w") as f:
            json.dump(stamp, f)
    disk_gbps = None
    failed = 0
    for mode in modes:
        if mode == "csbp" and not os.path.exists(os.path.join(store, "manifest.json")):
            began = time.perf_counter()
            import_store(config, records, store, target, delete_records=not args.keep_data)
            print(f"trainer_bench: store imported in {time.perf_counter() - began:.0f} s", flush=True)
            if not args.keep_data:
                shutil.rmtree(records, ignore_errors=True)
        data = records if mode == "specforge" else store
        files = sample_files(data)
        if disk_gbps is None:  # the disk itself: one cold sequential read of a sample file
            disk_gbps = (sequential_read_gbps(files[0]), parallel_read_gbps(files[0]))
        per_step = round(sum(os.path.getsize(f) for f in files) / len(files) * args.batch_size)
        for k, verify in enumerate(verifies if mode == "csbp" else ["lazy"], 1):
            tag = f"-{k}" if mode == "csbp" and repeated else ""
            run = run_config(args, mode, work, draft, data, length, on_gpu, dflash2=config.is_dflash2)
            run["output_dir"] = os.path.join(work, run_name(mode, verify), "output")
            cache = prepare_cache(args, data_files(data))
            free_gib = gpu_free_gib(device)
            log, peak, rc, wall_s = launch(args, mode, run, work, verify, tag)
            trace = newest_trace(run["output_dir"]) if args.profile_steps else None
            record = make_record(args, mode, length, block_size, log, peak, rc, device_name, name, trace,
                                 verify=verify, cache=cache, data_bytes_per_step=per_step, disk_gbps=disk_gbps)  # fmt: skip
            record.update(launch_s=round(wall_s, 1), gpu_free_gib=free_gib)
            if mode == "csbp":
                record["verify_launch"] = k  # its place in --store-verify: which launches compiled, which loaded
            write(args.out, record)
            if trace is not None and args.trace_dir and os.path.getsize(trace) <= TRACE_LIMIT_BYTES:
                os.makedirs(args.trace_dir, exist_ok=True)
                shutil.copy(trace, os.path.join(args.trace_dir, f"trainer_{run_name(mode, verify)}_{args.context}.trace.json.gz"))
            failed += record["status"] != "ok"
            shown = {k: record.get(k) for k in ("status", "step_ms", "first_pass_step_ms", "first_pass_p90_ms",
                                                 "later_pass_step_ms", "data_wait_ms", "read_gbps_needed",
                                                 "disk_read_gbps", "disk_read_gbps_parallel", "read_bound", "peak_mem_gib", "breakdown_ms", "launch_s",
                                                 "error") if k in record}  # fmt: skip
            print(f"trainer_bench {run_name(mode, verify)}{tag} {args.context}: {json.dumps(shown)}", flush=True)
            shutil.rmtree(run["output_dir"], ignore_errors=True)  # the checkpoint (23 GB for the 27B shape)
    if not args.keep_data:
        shutil.rmtree(records, ignore_errors=True)
        if not args.keep_store:
            shutil.rmtree(store, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
