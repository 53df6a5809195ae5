"""The long-context study's stages. Each stage reads the previous stage's files under the run directory and
skips work whose output is already there (so a stage cut by a time limit is run again, not restarted):

    target    train the study's target (target.py), resumable     -> RUN/target/, RUN/accuracy.json
    capture   long documents and the same tokens cut into short windows, held-out prompts (jsonl), then
              `specforge-csbp capture` into two feature stores     -> RUN/store-long/, RUN/store-short/
    train     `python -m specforge_csbp train --csbp` under one budget per drafter of the grid (grid.py):
                  long:  batch 1 x long documents,  A anchors each
                  short: batch r x short windows,   A / r anchors each   (r = long / short length)
              same tokens, steps, supervised tokens and anchors per token; only the context length differs.
              A warm start (short-then-long, short-then-short) loads its source's exported weights and trains
              the same budget again (fresh optimizer, the schedule's warm-up again).
              Each drafter is then exported as SGLang serves it       -> RUN/output-NAME/ (checkpoints),
                                                                        RUN/drafter-NAME/ (exports)
    eval      `specforge-csbp eval` of every export on two held-out sets, tau per context-position bucket
              (--bucket-edges): prompts cut inside far repeats, and prompts followed by local filler
                                                                     -> RUN/eval-NAME.json, RUN/eval-NAME-local.json
    report    records (workload "longctx"), the plot of every drafter's curves and the target's accuracy by
              distance, the result tables and the recipe table (report.py)
                                                                     -> RUN/records.jsonl, RUN/long_context.png,
                                                                        RUN/long_context_tables.md,
                                                                        RUN/long_context_recipe.md

`drafters` (scripts/long_context_study.py --drafters a,b) picks the grid entries a call trains and evaluates
(warm-start sources added); the report covers every drafter evaluated so far. A stage needs only the files
named above: eval runs from the target and the exports (14 MB each at GPU scale), so a fresh machine
continues the study without the stores, which capture writes again only while a chosen drafter is not exported.

Commands run as subprocesses of this interpreter and are logged (they are the records' `command`).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace

from ...cli.main import main as cli_main
from ...outputs import write_json_atomic, write_text_atomic
from .documents import DocSpec, eval_prompts, local_prompts, make_document
from .grid import ARCHS, DRAFTERS, DrafterRun, drafter_config_name, layer_types, select
from .recipe import recipe_table
from .report import (EVAL_SETS, eval_path, load_runs, plot_study, span, study_records, tables_markdown,
                     update_docs)  # fmt: skip
from .target import HELD_OUT_BASE, TargetScale, accuracy_by_distance, train_target

__all__ = ["SCALES", "STAGES", "Scale", "carry_paths", "run_stage"]

K = 1024
_START = time.monotonic()  # log lines carry the seconds since this stage started: which step costs what


@dataclass(frozen=True)
class Scale:
    """Everything a scale fixes: target, documents, drafter, training budget, evaluation."""

    name: str
    target: "object"  # target.TargetScale
    long_len: int
    short_len: int
    train_docs: int  # long documents captured (the short store holds the same tokens in windows)
    anchors_long: int  # anchors per long document; a short window gets anchors_long * short / long
    epochs: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    drafter_layers: int
    nproc: int
    cp_size: int
    device: str
    dtype: str
    attention_backend: str
    eval_docs: int
    cuts_per_doc: int
    max_new_tokens: int
    bucket_edges: tuple[int, ...]
    distance_edges: tuple[int, ...]
    accuracy_docs: int
    lr: float = 3e-3
    min_distance: int = 64
    target_minutes: float | None = None
    window: int = 2048  # the sliding window of the swa architectures (grid.py)
    drafters: str | None = None  # the grid entries of this call (grid.select): None = all
    plateau_steps: int | None = None  # csbp.plateau_steps of the drafters' runs (None: the plugin's default)

    @property
    def ratio(self) -> int:
        return self.long_len // self.short_len


def _scales() -> dict[str, Scale]:
    cpu = Scale(
        name="cpu",
        target=TargetScale(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=128, rope_theta=10000.0,
                           max_position=4096, phases=((256, 8, 2), (2048, 2, 1)), lr=3e-3, warmup=2, dense_steps=4),
        long_len=2048, short_len=256, train_docs=2, anchors_long=64, epochs=2, block_size=4,
        target_layer_ids=(0, 1), drafter_layers=2, window=128, nproc=1, cp_size=1, device="cpu", dtype="float32",
        attention_backend="sdpa", eval_docs=2, cuts_per_doc=2, max_new_tokens=12, plateau_steps=4,
        bucket_edges=(0, 256, 512, 1024), distance_edges=(0, 256, 1024), accuracy_docs=1,
    )  # fmt: skip
    gpu = Scale(
        name="gpu",
        target=TargetScale(layers=6, hidden=384, heads=6, kv_heads=2, intermediate=1024, rope_theta=1_000_000.0,
                           max_position=131072,
                           phases=((2048, 3000, 16), (8192, 800, 4), (32768, 250, 1), (65536, 200, 1)),
                           lr=1.5e-3, warmup=100, dense_steps=2000),
        long_len=65536, short_len=4096, train_docs=48, anchors_long=2048, epochs=8, block_size=8,
        target_layer_ids=(1, 3, 4), drafter_layers=2, nproc=1, cp_size=1, device="cuda", dtype="bfloat16",
        attention_backend="flex_attention", eval_docs=2, cuts_per_doc=8, max_new_tokens=48,
        bucket_edges=(0, 4 * K, 8 * K, 16 * K, 32 * K), distance_edges=(0, 256, 1 * K, 4 * K, 16 * K),
        accuracy_docs=8, lr=1e-3, min_distance=256, target_minutes=9.0,
    )  # fmt: skip
    return {"cpu": cpu, "gpu": gpu}


SCALES = _scales()
STAGES = ("target", "capture", "train", "eval", "report")


def drafters(scale: Scale) -> tuple[DrafterRun, ...]:
    """The grid entries this call trains and evaluates."""
    return select(scale.drafters)


def doc_spec(scale: Scale, length: int, seed: int):
    return DocSpec(length=length, vocab_size=scale.target.vocab_size, seed=seed, min_distance=scale.min_distance)


def _log(run: str, line: str) -> None:
    line = f"[{time.monotonic() - _START:6.0f} s] {line}"
    print(line, flush=True)
    with open(os.path.join(run, "study.log"), "a") as f:
        f.write(line + "\n")


def _call(run: str, argv: list[str], env: dict | None = None, *, in_process: bool = False) -> str:
    """Run one `python -m specforge_csbp ...` command of the study, log it, fail with its exit status.
    `in_process`: through cli.main in this interpreter (capture, eval: no second start of torch and
    transformers); training always gets its own process (SpecForge's launcher owns the process group)."""
    cmd = shlex.join(argv)
    _log(run, f"$ {cmd}")
    t0 = time.monotonic()
    if in_process:
        rc = cli_main(argv[3:])
    else:
        full = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        rc = subprocess.run([sys.executable, *argv[1:]], env=full).returncode
    if rc != 0:
        raise SystemExit(f"long-context study: `{cmd}` exited with status {rc}")
    _log(run, f"  done in {time.monotonic() - t0:.0f} s: {argv[3]}")
    return cmd


def _write_jsonl(path: str, rows: list[dict]) -> None:
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def _commands(run: str) -> dict:
    path = os.path.join(run, "commands.json")
    return json.load(open(path)) if os.path.isfile(path) else {}


def _note_command(run: str, key: str, cmd: str) -> None:
    cmds = _commands(run)
    cmds[key] = cmd
    write_json_atomic(os.path.join(run, "commands.json"), cmds)


# -- stages -------------------------------------------------------------------------------------------
def stage_target(run: str, scale: Scale, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    done = train_target(run, scale.target, doc_spec(scale, scale.long_len, seed), device=scale.device,
                        minutes=scale.target_minutes, workers=8 if scale.device == "cuda" else 0,
                        log=lambda s: _log(run, s))  # fmt: skip
    if not done:
        raise SystemExit(3)  # not finished: run the stage again (it resumes)
    acc_path = os.path.join(run, "accuracy.json")
    if os.path.isfile(acc_path):
        return
    model = AutoModelForCausalLM.from_pretrained(os.path.join(run, "target")).to(scale.device).eval()
    rows = accuracy_by_distance(model, doc_spec(scale, scale.long_len, seed),
                                range(HELD_OUT_BASE, HELD_OUT_BASE + scale.accuracy_docs), scale.distance_edges,
                                device=scale.device)  # fmt: skip
    write_json_atomic(acc_path, {"context": scale.long_len, "docs": scale.accuracy_docs, "device": _device_name(scale),
                                 "date": datetime.date.today().isoformat(), "rows": rows})  # fmt: skip
    for r in rows:
        end = "+" if r["end"] is None else f"-{r['end']}"
        _log(run, f"target accuracy {r['kind']:6s} distance {r['start']}{end}: {r['accuracy']:.3f} ({r['count']})")


def drafter_config(scale: Scale, arch: str = "full") -> dict:
    """The drafter config of an architecture of the grid (full: the study's first drafters, unchanged)."""
    t = scale.target
    types = layer_types(arch, scale.drafter_layers)
    window = {"use_sliding_window": False} if arch == "full" else {
        "use_sliding_window": True, "sliding_window": scale.window}  # fmt: skip
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": t.hidden,
        "intermediate_size": t.intermediate, "num_hidden_layers": scale.drafter_layers,
        "num_attention_heads": t.heads, "num_key_value_heads": t.kv_heads, "head_dim": t.hidden // t.heads,
        "hidden_act": "silu", "vocab_size": t.vocab_size, "rms_norm_eps": 1e-6,
        "max_position_embeddings": t.max_position,
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta},
        "layer_types": types, **window,
        "attention_bias": False, "tie_word_embeddings": False, "block_size": scale.block_size,
        "num_target_layers": t.layers,
        "dflash_config": {"block_size": scale.block_size, "mask_token_id": 3,
                          "target_layer_ids": list(scale.target_layer_ids)},
    }  # fmt: skip


def stage_capture(run: str, scale: Scale, seed: int) -> None:
    data = os.path.join(run, "data")
    os.makedirs(data, exist_ok=True)
    for arch in ARCHS:
        write_json_atomic(os.path.join(run, drafter_config_name(arch)), drafter_config(scale, arch))
    long_rows, short_rows = [], []
    spec = doc_spec(scale, scale.long_len, seed)
    base = 2 * HELD_OUT_BASE  # the drafters' documents: neither the target's stream nor the held-out ones
    for i in range(scale.train_docs):
        tokens = make_document(spec, base + i).tokens.tolist()
        long_rows.append({"id": f"long-{i:05d}", "input_ids": tokens})
        for w in range(scale.ratio):
            piece = tokens[w * scale.short_len : (w + 1) * scale.short_len]
            short_rows.append({"id": f"short-{i:05d}-{w:03d}", "input_ids": piece})
    _write_jsonl(os.path.join(data, "long.jsonl"), long_rows)
    _write_jsonl(os.path.join(data, "short.jsonl"), short_rows)
    prompts = write_prompts(run, scale, seed)
    _log(run, f"capture: {len(long_rows)} long documents of {scale.long_len}, {len(short_rows)} windows of "
              f"{scale.short_len}, held-out prompts: {prompts['far']} far, {prompts['local']} local")  # fmt: skip
    for kind, length in (("long", scale.long_len), ("short", scale.short_len)):
        store = os.path.join(run, f"store-{kind}")
        users = [d.name for d in drafters(scale) if d.store == kind]
        if all(_exported(run, name) for name in users):
            why = f"{', '.join(users)} trained and exported" if users else "no chosen drafter trains on it"
            _log(run, f"capture: {why}; {store} not needed")
            continue
        if os.path.isfile(os.path.join(store, "manifest.json")) and os.path.isfile(os.path.join(store, "DONE")):
            _log(run, f"capture: {store} exists; skipped")
            continue
        argv = ["python", "-m", "specforge_csbp", "capture", "--target", os.path.join(run, "target"),
                "--data", os.path.join(data, f"{kind}.jsonl"), "--draft-config", os.path.join(run, "drafter.json"),
                "--max-length", str(length), "--dtype", scale.dtype, "--device", scale.device, "--out", store,
                "--overwrite", "--no-progress"]  # fmt: skip
        if scale.device == "cuda":
            argv += ["--chunk-size", "16384"]
        _note_command(run, f"capture-{kind}", _call(run, argv, in_process=True))
        open(os.path.join(store, "DONE"), "w").close()


def _prompts_path(run: str, eval_set: str) -> str:
    return os.path.join(run, "data", "prompts.jsonl" if eval_set == "far" else f"prompts-{eval_set}.jsonl")


def write_prompts(run: str, scale: Scale, seed: int) -> dict[str, int]:
    """Both held-out sets (deterministic: a fresh machine writes the same ones): documents never trained on,
    cut inside far repeats ("far") and before `max_new_tokens` of filler ("local"). Returns their sizes."""
    spec = doc_spec(scale, scale.long_len, seed)
    docs = range(HELD_OUT_BASE + 500, HELD_OUT_BASE + 500 + scale.eval_docs)
    sets = {"far": eval_prompts(spec, docs, scale.cuts_per_doc),
            "local": local_prompts(spec, docs, scale.cuts_per_doc, scale.max_new_tokens)}  # fmt: skip
    os.makedirs(os.path.join(run, "data"), exist_ok=True)
    for name, rows in sets.items():
        _write_jsonl(_prompts_path(run, name), rows)
    return {name: len(rows) for name, rows in sets.items()}


def train_config(run: str, scale: Scale, name: str) -> dict:
    """The SpecForge run config of one drafter (DRAFTERS): the same steps, tokens and anchors per token for
    every drafter; a warm start loads the weights (only) of its source's export."""
    d = next(d for d in DRAFTERS if d.name == name)
    long = d.store == "long"
    model = {"target_model_path": os.path.join(run, "target"),
             "draft_model_config": os.path.join(run, drafter_config_name(d.arch)),
             "torch_dtype": "float32" if scale.device == "cpu" else "bfloat16"}  # fmt: skip
    if d.warm_start is not None:
        model["draft_checkpoint_path"] = _export_dir(run, d.warm_start)
    return {
        "model": model,
        "data": {"hidden_states_path": os.path.join(run, f"store-{d.store}"),
                 "max_length": scale.long_len if long else scale.short_len},
        "training": {"strategy": "dflash", "fsdp_sharding": "NO_SHARD", "attention_backend": scale.attention_backend,
                     "batch_size": 1 if long else scale.ratio, "num_epochs": scale.epochs,
                     "learning_rate": scale.lr * d.lr_scale, "warmup_ratio": d.warmup_ratio, "max_grad_norm": 1.0,
                     "num_anchors": scale.anchors_long if long else scale.anchors_long // scale.ratio,
                     "loss_decay_gamma": 4.0 if scale.block_size <= 8 else 7.0, "log_interval": 4,
                     "save_interval": 0, "seed": 0},
        "deployment": {"trainer": {"nproc_per_node": scale.nproc}},
        "run_id": f"longctx-{scale.name}-{name}",
        "output_dir": os.path.join(run, f"output-{name}"),
        "csbp": {"cp_size": scale.cp_size,
                 **({} if d.anchor_sampling == "uniform" else {"anchor_sampling": d.anchor_sampling}),
                 **({} if scale.plateau_steps is None else {"plateau_steps": scale.plateau_steps})},
    }  # fmt: skip


def _trained(out: str) -> bool:
    return os.path.isfile(os.path.join(out, "DONE"))


def _export_dir(run: str, kind: str) -> str:
    return os.path.join(run, f"drafter-{kind}")


def _exported(run: str, kind: str) -> bool:
    return os.path.isfile(os.path.join(_export_dir(run, kind), "model.safetensors"))


def stage_train(run: str, scale: Scale, seed: int) -> None:
    import yaml

    for kind in (d.name for d in drafters(scale)):
        out = os.path.join(run, f"output-{kind}")
        if _exported(run, kind):
            _log(run, f"train: {_export_dir(run, kind)} exists; skipped")
            continue
        if _trained(out):
            _export(run, kind)
            continue
        cfg_path = os.path.join(run, f"{kind}.yaml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(train_config(run, scale, kind), f, sort_keys=False)
        if os.path.isdir(out):
            import shutil

            shutil.rmtree(out)  # an interrupted run: SpecForge would resume a half-written output
        argv = ["python", "-m", "specforge_csbp", "train", "--csbp", "-c", cfg_path]
        _note_command(run, f"train-{kind}", _call(run, argv, env={"PYTHONWARNINGS": "ignore::FutureWarning"}))
        open(os.path.join(out, "DONE"), "w").close()
        _export(run, kind)


def _export(run: str, kind: str) -> None:
    """The trained drafter as SGLang loads it (export checks SGLang's loader contract): what eval measures."""
    argv = ["python", "-m", "specforge_csbp", "export", "--to", "sglang", os.path.join(run, f"output-{kind}"),
            _export_dir(run, kind), "--target", os.path.join(run, "target"), "--overwrite"]  # fmt: skip
    _note_command(run, f"export-{kind}", _call(run, argv, in_process=True))


def carry_paths(run: str) -> list[str]:
    """What a fresh machine needs to continue the study (relative to `run`; the target is carried apart):
    every eval result, the commands, the target's accuracy, the log, the probe's results, and only the exports
    still needed - one
    not yet evaluated on every set, or the warm-start source of a drafter not yet exported. An export both
    evaluated and no longer a source is left behind (its eval results are all the report reads)."""
    pending = {d.warm_start for d in DRAFTERS if d.warm_start is not None and not _exported(run, d.name)}
    keep = [n for n in ("accuracy.json", "commands.json", "study.log", "probe.json")
            if os.path.isfile(os.path.join(run, n))]  # fmt: skip
    for d in DRAFTERS:
        keep += [os.path.basename(eval_path(run, d.name, s)) for s in EVAL_SETS
                 if os.path.isfile(eval_path(run, d.name, s))]  # fmt: skip
        evaluated = all(os.path.isfile(eval_path(run, d.name, s)) for s in EVAL_SETS)
        if _exported(run, d.name) and (not evaluated or d.name in pending):
            keep.append(os.path.basename(_export_dir(run, d.name)))
    return keep


def stage_eval(run: str, scale: Scale, seed: int) -> None:
    """Every chosen drafter on both held-out sets, in this process (cli.main): the device's one-time start-up
    (CUDA context, kernels) is paid once for all of them."""
    if not all(os.path.isfile(_prompts_path(run, s)) for s in EVAL_SETS):
        write_prompts(run, scale, seed)  # a fresh machine from carried state: the same prompts again
    for d in drafters(scale):
        if not _exported(run, d.name):  # e.g. --drafters all after a call that trained some of them
            _log(run, f"eval: {_export_dir(run, d.name)} not there (not trained, or not carried); skipped")
            continue
        for eval_set in EVAL_SETS:
            out = eval_path(run, d.name, eval_set)
            if os.path.isfile(out):
                _log(run, f"eval: {out} exists; skipped")
                continue
            argv = ["python", "-m", "specforge_csbp", "eval", "--drafter", _export_dir(run, d.name),
                    "--target", os.path.join(run, "target"), "--prompts", _prompts_path(run, eval_set),
                    "--max-new-tokens", str(scale.max_new_tokens), "--device", scale.device, "--dtype", scale.dtype,
                    "--ignore-eos", "--bucket-edges", ",".join(map(str, scale.bucket_edges)), "--out", out,
                    "--no-progress"]  # fmt: skip
            key = d.name if eval_set == "far" else f"{d.name}-{eval_set}"
            _note_command(run, f"eval-{key}", _call(run, argv, in_process=True))


def _device_name(scale: Scale) -> str:
    if scale.device == "cuda":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
    return "cpu"


def stage_report(run: str, scale: Scale, seed: int, records_path: str | None = None,
                 docs: str | None = None, from_records: tuple[str, ...] = ()) -> list[dict]:  # fmt: skip
    """Records, plot, tables and recipe table of every drafter evaluated so far; `docs`: also the tables into
    that markdown file's report block (and the recipe table into its recipe block, where it has one) and the
    plot beside it (docs/long_context.md, docs/long_context.png). `from_records`: plot and tables from these
    record files instead (benchmarks/results/longctx_*.jsonl; each file one study run; no records written)."""
    if from_records:
        records = load_runs(from_records)
        path = ", ".join(from_records)
    else:
        records = study_records(run, scale, _device_name(scale), _commands(run))
        path = records_path or os.path.join(run, "records.jsonl")
        _write_jsonl(path, records)
    tables, recipe = tables_markdown(records), recipe_table(records)
    if docs is not None:  # first: a docs file without the block fails before anything is drawn
        update_docs(docs, tables, recipe)
        plot_study(records, os.path.join(os.path.dirname(docs), "long_context.png"))
    plot_study(records, os.path.join(run, "long_context.png"))
    write_text_atomic(os.path.join(run, "long_context_tables.md"), tables)
    write_text_atomic(os.path.join(run, "long_context_recipe.md"), recipe)
    for r in records:
        if r.get("metric") == "tau":
            tau = "n/a" if r["tau"] is None else f"{r['tau']:.2f}"
            _log(run, f"report: {r.get('eval_set', 'far'):5s} {r['drafter']} positions {span(r['bucket_start'], r['bucket_end'])}"
                      f": tau {tau} ({r['verify_steps']} steps)")  # fmt: skip
    _log(run, f"report: {len(records)} records -> {path}; plot -> {os.path.join(run, 'long_context.png')}")
    return records


def run_stage(stage: str, scale_name: str, run: str, *, seed: int = 0, records: str | None = None,
              docs: str | None = None, from_records: tuple[str, ...] = (),
              overrides: dict | None = None) -> None:  # fmt: skip
    """Run one stage (or "all": every stage in order) of the study at `scale_name` under `run`;
    `overrides`: Scale fields (e.g. drafters="swa-short,swa-short-then-long", target_minutes)."""
    if scale_name not in SCALES:
        raise ValueError(f"--scale must be one of {', '.join(SCALES)}; got {scale_name!r}")
    if stage not in (*STAGES, "all"):
        raise ValueError(f"--stage must be one of {', '.join((*STAGES, 'all'))}; got {stage!r}")
    scale = replace(SCALES[scale_name], **(overrides or {}))
    chosen = drafters(scale)  # an unknown name fails here, before any stage runs
    os.makedirs(run, exist_ok=True)
    for s in STAGES if stage == "all" else (stage,):
        _log(run, f"== stage {s} (scale {scale.name}, drafters {','.join(d.name for d in chosen)}) in {run}")
        if s == "report":
            stage_report(run, scale, seed, records, docs, from_records)
        else:
            {"target": stage_target, "capture": stage_capture, "train": stage_train, "eval": stage_eval}[s](
                run, scale, seed
            )
