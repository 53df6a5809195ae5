"""`train`: SpecForge's own launch pipeline with the plugin's registry and this package as the worker.

    specforge train --csbp -c run.yaml [overrides]        (or: specforge-csbp train --csbp -c run.yaml ...)
      prepare_run            SpecForge Config + csbp section + flags     -> one-line errors, nothing started
      preflight              store manifest vs drafter config            -> one-line errors, nothing started
      resolve_run(cfg, registry=builtin + plugin)                           (SpecForge's composition root)
      build_launch_plan(..., worker_prefix=[python -m specforge_csbp], torchrun_prefix=[torchrun --no-python])
        1 rank:   runs the worker below in this process
        W ranks:  python -m torch.distributed.run --no-python --standalone --nproc_per_node W \\
                      python -m specforge_csbp train --config run.yaml --role all <forwarded overrides>
      worker: init_distributed (SpecForge's groups) -> CSBP groups -> build_application_run(...).run()

The forwarded overrides carry what the flags decided (`training.strategy=dflash2-csbp`, `csbp.cp_size=N`),
so every worker re-derives the same run from the same file without the hook.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..compat import check_disjoint, check_pair, drafter_side, read_target_config, store_side, target_side
from ..data.fingerprint import weights_fingerprint
from ..data.manifest import config_hash
from ..data.store import FeatureStore
from ..distributed import relay
from ..errors import is_user_error, load_json, one_line
from ..outputs import naming_full_disk
from ..preflight import check_flex_backend_on_cpu, check_local_path, check_store_trainable, check_writable_dir
from .arguments import add_train_arguments
from .checkpoints import check_resume_config, check_resume_target, check_warm_start
from .data import check_store_path
from .options import PreparedRun, prepare_run
from .registry import plugin_registry, trained_target

__all__ = ["TORCHRUN_PREFIX", "WORKER_PREFIX", "add_train_arguments", "preflight", "run", "train_main"]

WORKER_PREFIX = (sys.executable, "-m", "specforge_csbp")
# torchrun's agent, quiet on a rank's failure (its ChildFailedError report would precede the one line below)
TORCHRUN_PREFIX = (sys.executable, "-m", "specforge_csbp.distributed.torchrun", "--no-python")


def train_main(argv: list[str], *, prog: str = "specforge-csbp train") -> int:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_train_arguments(p)
    return run(p.parse_args(argv), prog=prog)


def _has_full_attention(draft: dict | None) -> bool | None:
    """Whether a drafter config has a full-attention layer (no `layer_types`: every layer is; None: no
    config)."""
    if draft is None:
        return None
    return "full_attention" in (draft.get("layer_types") or ["full_attention"])


def _draft_config_dict(path: str) -> dict | None:
    src = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(src):
        return None
    return load_json(src, "model.draft_model_config")


def preflight(prepared: PreparedRun) -> None:
    """Cheap cross-checks in the launching process, so a bad store / config / checkpoint / output directory
    fails before any worker starts (specforge_csbp/preflight.py holds the shared checks)."""
    cfg = prepared.config
    if not torch.cuda.is_available():  # SpecForge's default backend is flex_attention
        check_flex_backend_on_cpu(
            "training.attention_backend", cfg.training.attention_backend, "flex_attention",
            where="this machine has none (it is SpecForge's default)", allowed="sdpa or eager",
        )  # fmt: skip
    check_writable_dir(cfg.output_dir, "output_dir")
    for field, value in (("model.target_model_path", cfg.model.target_model_path),
                         ("model.draft_model_config", cfg.model.draft_model_config),
                         ("model.draft_checkpoint_path", cfg.model.draft_checkpoint_path),
                         ("training.resume_from", cfg.training.resume_from)):  # fmt: skip
        check_local_path(value, field)
    path = cfg.data.hidden_states_path
    check_store_path(path)
    store = FeatureStore(path, verify="trust")
    draft = _draft_config_dict(cfg.model.draft_model_config) if cfg.model.draft_model_config else None
    stores = {"data.hidden_states_path": store}
    if cfg.data.eval_hidden_states_path:  # held-out store: the same checks, before any worker (not in them)
        check_store_path(cfg.data.eval_hidden_states_path, "data.eval_hidden_states_path")
        stores["data.eval_hidden_states_path"] = FeatureStore(cfg.data.eval_hidden_states_path, verify="trust")
    for field, each in stores.items():
        _check_store_fits(field, each.manifest, draft)
        _check_target(cfg.model.target_model_path, each.manifest, field)
    target = cfg.model.target_model_path
    if draft is not None and target and os.path.isfile(os.path.join(target, "config.json")):  # hub names: workers
        check_pair(drafter_side(f"model.draft_model_config={cfg.model.draft_model_config}", draft),
                   target_side(f"model.target_model_path={target}", read_target_config(target, "model.target_model_path")),
                   advice="use the drafter config built for this target (or the target it was built for)")  # fmt: skip
    if len(stores) == 2:
        _check_eval_store(path, store, cfg.data.eval_hidden_states_path, stores["data.eval_hidden_states_path"])
    if "LOCAL_RANK" in os.environ:
        return  # a torchrun worker: its launcher ran the checks below (they read files: once per run)
    check_store_trainable(store, int(cfg.data.max_length))
    if draft is not None:
        if cfg.model.draft_checkpoint_path:
            check_warm_start(cfg.model.draft_checkpoint_path, draft)
        if cfg.training.resume_from:
            check_resume_config(cfg.training.resume_from, draft)
            check_resume_target(cfg.training.resume_from,
                                trained_target(store.manifest.target, cfg.model.target_model_path))  # fmt: skip


def _check_store_fits(field: str, manifest, draft: dict | None) -> None:
    """The store must hold the target layers and hidden size the drafter config reads."""
    ids = (draft or {}).get("dflash_config", {}).get("target_layer_ids")
    if ids is not None and [int(i) for i in ids] != list(manifest.target_layer_ids):
        raise ValueError(
            f"{field}: the feature store holds target layers {list(manifest.target_layer_ids)} but "
            f"model.draft_model_config needs dflash_config.target_layer_ids {[int(i) for i in ids]}"
        )
    hidden = (draft or {}).get("hidden_size")
    if hidden is not None and int(hidden) != manifest.hidden_size:
        raise ValueError(
            f"{field}: the feature store holds hidden size {manifest.hidden_size} but "
            f"model.draft_model_config has hidden_size {hidden}"
        )


def _check_eval_store(train_path: str, train, eval_path: str, held) -> None:
    """The held-out store must come from the training store's target and layers, and share no sample."""
    left = store_side(f"data.eval_hidden_states_path={eval_path}", held.manifest)
    right = store_side(f"data.hidden_states_path={train_path}", train.manifest)
    check_pair(left, right, advice="hold out samples of the same capture (capture --eval-fraction F writes OUT-eval)")
    check_disjoint(left, held.manifest, right, train.manifest,
                   advice="recapture with one --eval-fraction (capture --overwrite), or point at another store")  # fmt: skip


def _check_target(target_path: str, manifest, field: str = "data.hidden_states_path") -> None:
    """The target must be the one the store was captured from: the hash of its config, then the fingerprint
    of its weights (data/fingerprint.py: another fine-tune of the same config gives other features)."""
    if not target_path or not os.path.exists(target_path):
        return  # a hub name: resolved (and checked) in the workers
    if manifest.target.config_sha256 is not None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(target_path)
        except (OSError, ValueError) as err:
            raise ValueError(f"model.target_model_path: cannot read the config of {target_path} ({err})") from None
        if config_hash(config) != manifest.target.config_sha256:
            raise ValueError(
                f"model.target_model_path={target_path}: its config is not the one the feature store "
                f"({field}) was captured from ({manifest.target.name}); use that target or recapture"
            )
    _check_target_weights(target_path, manifest, field)


def _check_target_weights(target_path: str, manifest, field: str) -> None:
    recorded = manifest.target.weights_sha256
    if recorded is None:
        return  # a store written before fingerprints, or imported without --target: config only
    found = weights_fingerprint(target_path)
    if found is not None and found != recorded:
        raise ValueError(
            f"model.target_model_path={target_path}: its weights are not the ones the feature store ({field}) "
            f"was captured from ({manifest.target.name}; weights fingerprint {found[:12]} here, {recorded[:12]} "
            "in the store): the same config with other weights gives other hidden states; use that target or "
            "recapture"
        )


def _layout_line(prepared: PreparedRun) -> str:
    if prepared.is_csbp:
        how = f"{prepared.options.mode} over cp_size={prepared.cp_size} x dp_replicas={prepared.dp_replicas}"
    else:
        how = f"data parallel over {prepared.world_size} rank(s)"
    return f"specforge-csbp: {prepared.strategy} on {prepared.world_size} rank(s): {how}"


def run(args: argparse.Namespace, *, prog: str) -> int:
    try:
        prepared = prepare_run(
            args.config, args.overrides, csbp=args.csbp, cp_size=args.cp_size, dp_replicas=args.dp_replicas
        )
        if prepared.strategy not in ("dflash-csbp", "dflash2-csbp", "dflash2"):
            raise ValueError(
                f"training.strategy={prepared.strategy!r} is not a specforge-csbp strategy; run it with plain "
                "`specforge train`, or add --csbp"
            )
        preflight(prepared)
        from specforge.application import resolve_run
        from specforge.launch_plan import build_launch_plan

        resolved = resolve_run(prepared.config, registry=plugin_registry(prepared.options))
        plan = build_launch_plan(
            resolved.config, algorithm=resolved.algorithm, config_path=args.config,
            overrides=list(prepared.forward_overrides), requested_role=args.role, node_rank=args.node_rank,
            worker_prefix=WORKER_PREFIX, torchrun_prefix=TORCHRUN_PREFIX,
        )  # fmt: skip
    except Exception as err:
        if not is_user_error(err):
            raise
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    if args.plan:
        print(_layout_line(prepared))
        print(plan.render())
        return 0
    if plan.kind != "worker":
        print(_layout_line(prepared), flush=True)
        from specforge.launch_plan import run_commands

        with relay.error_dir() as errors:
            rc = run_commands(plan)
            if rc != 0:  # the failed worker's own one line, last (distributed/torchrun.py prints no report)
                print(f"{prog}: error: {relay.root_cause(errors, rc)}", file=sys.stderr, flush=True)
        return rc
    if "LOCAL_RANK" not in os.environ:  # a one-rank run in the launching process (not a torchrun worker)
        print(_layout_line(prepared), flush=True)
    return _run_worker(resolved, plan, prepared, prog)


def _run_worker(resolved, plan, prepared: PreparedRun, prog: str) -> int:
    from specforge.application import bind_run
    from specforge.cli import _config_for_role, _worker_signal_unwind, _WorkerTermination

    for key, value in plan.worker_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        role_config = _config_for_role(resolved.config, plan.role)
        with _worker_signal_unwind():
            _train(bind_run(role_config, resolved.algorithm), prepared)
    except _WorkerTermination as received:
        return 128 + received.signum
    except Exception as err:
        relay.record(err)  # for the launcher, which prints it as the last line
        if not is_user_error(err):
            raise
        if not os.environ.get(relay.ENV):  # else the launcher prints it, once (a RunFault: every rank has it)
            print(f"{prog}: error: {one_line(err)}", file=sys.stderr)  # configuration problems, OOM, NaN: one line
        return 2
    return 0


def _train(resolved, prepared: PreparedRun) -> int:
    """SpecForge's worker lifecycle (specforge.cli._train) plus the CSBP groups."""
    from accelerate.utils import set_seed
    from specforge.application import build_application_run
    from specforge.cli import _bootstrap_single_process_env
    from specforge.distributed import destroy_distributed, init_distributed

    # lazy: optional dependency (optimizer imports SpecForge); worker-only modules
    from . import groups, lookahead, optimizer, reporting

    cfg = resolved.config
    os.environ["FSDP_SHARDING"] = cfg.training.fsdp_sharding
    set_seed(cfg.training.seed)
    _bootstrap_single_process_env()
    cfg.validate_world_size(int(os.environ["WORLD_SIZE"]))
    init_distributed(
        timeout=cfg.training.dist_timeout, tp_size=cfg.training.tp_size,
        sp_ulysses_size=cfg.training.sp_ulysses_size, sp_ring_size=cfg.training.sp_ring_size,
    )  # fmt: skip
    try:
        import torch.distributed as dist

        groups.init_groups(prepared.cp_size)
        if dist.get_rank() != 0 and not os.environ.get("SPECFORGE_CSBP_LOG_ALL_RANKS"):
            # SpecForge prints each step's line on every rank; keep rank 0's (stderr stays on everywhere)
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        with optimizer.install():  # SpecForge's BF16 AdamW, with fused / multi-tensor kernels
            run = build_application_run(resolved)
        # SpecForge's gradient rescale and the non-finite check run inside the optimizer's step (one pass)
        optimizer.connect(run)
        # the next micro-step's first sample is built while this one's last runs (changes nothing if this
        # SpecForge keeps its data stream elsewhere: plugin/lookahead.py)
        lookahead.install(run)
        draft = _draft_config_dict(cfg.model.draft_model_config) if cfg.model.draft_model_config else None
        plateau = reporting.PlateauCheck(prepared.options.plateau_steps, cfg.data.max_length,
                                         cfg.model.draft_checkpoint_path, _has_full_attention(draft))  # fmt: skip
        reporting.install(run, plateau=plateau)  # progress bar, metrics.jsonl, eval/est_tau, the plateau line
        with naming_full_disk(cfg.output_dir):  # a full disk in a save (SpecForge's torch.save): one line
            step = run.run()
        if dist.get_rank() == 0:
            latest = os.path.join(cfg.output_dir, f"{cfg.run_id}-latest")
            print(f"specforge-csbp: trained {step} step(s); checkpoint {latest}", flush=True)
        return step
    finally:
        lookahead.uninstall()
        groups.destroy()
        destroy_distributed()
