"""A CSBP run's configuration: SpecForge's validated `Config` plus the plugin's own `csbp:` section.

    run.yaml                                     command line
    ---------------------------------------      ---------------------------------------------------
    model: ..., data: ..., training: ...    <-   section.field=value overrides (SpecForge's, unchanged)
      training.strategy: dflash2-csbp       <-   --csbp  (dflash -> dflash-csbp, dflash2 -> dflash2-csbp)
    csbp:             # read by the plugin only
      cp_size: 2                            <-   --cp-size 2      or  csbp.cp_size=2
      dp_replicas: 1                        <-   --dp-replicas 1  or  csbp.dp_replicas=1
      mode: csbp      # csbp | cp (the conventional context-parallel baseline)
      gather_ahead: true # layer i + 1's context K/V gathered while layer i runs
      regather: false # true: re-gather context K/V in backward (memory at 512K-1M)
      pack_gqa: null  # GQA head packing: true / false force it, null: decided per call from the block masks
      keep_logits_gib: auto # kept loss logits budget; auto: from the GPU's free memory (plugin/keep_logits.py)
      compile: auto   # torch.compile the drafter's token-wise chains (norms, RoPE, MLP, conv); auto: on GPUs
      plateau_steps: 300 # est_tau still < 1.1 after this many steps: one line with the cause and the recipe
      store_verify: lazy # per-chunk checksums of the rows each read reads (data/checksums.py); trust: none

SpecForge's schema forbids unknown fields, so the `csbp:` section is taken out of the file before SpecForge
validates the rest, and `csbp.*` overrides are applied here. World size = deployment.trainer.nnodes x
nproc_per_node = cp_size x dp_replicas. Errors are one line and name the flag or field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ..errors import load_config
from ..parallel.options import AttentionOptions
from ..preflight import check_finite
from ..values import parse_override
from .data import check_store_path
from .keep_logits import resolve_keep_logits

if TYPE_CHECKING:
    import torch

__all__ = [
    "CSBP_OF",
    "CSBP_STRATEGIES",
    "PLUGIN_STRATEGIES",
    "SEAM_BACKENDS",
    "CSBPOptions",
    "PreparedRun",
    "attention_options",
    "compiles_drafter",
    "one_line",
    "prepare_run",
]

#: `--csbp` maps a DFlash-family strategy to its CSBP variant
CSBP_OF = {"dflash": "dflash-csbp", "dflash2": "dflash2-csbp", "dflash-csbp": "dflash-csbp",
           "dflash2-csbp": "dflash2-csbp"}  # fmt: skip
CSBP_STRATEGIES = ("dflash-csbp", "dflash2-csbp")
#: everything the plugin registers: the CSBP variants plus plain data-parallel DFlash2 (the reference)
PLUGIN_STRATEGIES = ("dflash-csbp", "dflash2-csbp", "dflash2")
_DFLASH_FAMILY_NOT_IN_CSBP = ("domino", "dspark")
#: training.attention_backend -> the attention seam's backend (parallel/options.py)
SEAM_BACKENDS = {"flex_attention": "flex", "sdpa": "auto", "eager": "dense"}


class CSBPOptions(BaseModel):
    """The `csbp:` section of a run config."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    cp_size: int | None = Field(default=None, ge=1, description="ranks sharing one sample's context")
    dp_replicas: int | None = Field(default=None, ge=1, description="data-parallel copies of the CP group")
    mode: Literal["csbp", "cp"] = Field(
        default="csbp",
        description="csbp, or cp: conventional context parallelism (every anchor on every rank)",
    )
    # drafter objective knobs SpecForge's schema has no field for (the rest map from `training.*`)
    anchor_sampling: Literal["uniform", "locality"] = "uniform"
    selector_alpha: float = Field(default=1.0, ge=0.0, description="DFlash2 selector CE weight")
    selector_warmup_steps: int = Field(
        default=0, ge=0, description="steps over which the selector weight ramps"
    )
    keep_logits_gib: float = Field(
        default=0.0, ge=0.0,
        description="keep the vocabulary loss's logits for backward when this rank's fit in this many GiB: one "
        "[rows, vocab] GEMM fewer per chunk (docs/performance.md); 0 = recompute; unset (or auto): "
        "chosen per rank from the GPU's free memory and the planner's memory model (plugin/keep_logits.py)",
    )  # fmt: skip
    compile: bool | Literal["auto"] = Field(
        default="auto",
        description="torch.compile the drafter's token-wise chains in place - q/k RMSNorm + RoPE, RMSNorms, "
        "SiLU-and-multiply, DFlash2's conv (DFlashDraftModel.compile_token_wise; GEMMs and attention stay as "
        "they are); auto: on GPUs, eager on the CPU",
    )
    prefetch_features: bool = Field(
        default=True,
        description="read the next sample's context features from the store and copy them to the GPU while "
        "the current one trains (one more sample's features in GPU memory: 13.4 GB per rank at 512K for a "
        "5 x 5120 target); false: read and copy them at the start of each sample",
    )
    store_verify: Literal["lazy", "trust"] = Field(
        default="lazy",
        description="how the training store's reads are checked: lazy verifies the per-chunk checksums of "
        "exactly the rows each read reads, in the reading thread (the prefetch worker); trust checks nothing "
        "(data/store.py FeatureStore)",
    )
    bucket: int = Field(default=1, ge=1, description="pad planned row counts to a multiple (static shapes)")
    attention_schedule: Literal["fused", "overlap"] | None = Field(
        default=None,
        description="context attention after the all-gather in one call (fused), or overlapped with attention "
        "over local rows (overlap); default fused, overlap when regather",
    )
    gather_ahead: bool = Field(
        default=True,
        description="start each drafter layer's context K/V all-gather while the layer before runs (CSBP; the "
        "gather hides behind a whole layer, docs/performance.md); false: gather in front of each layer",
    )
    regather: bool = Field(
        default=False,
        description="free each layer's gathered context K/V after forward and gather it again in backward "
        "(less memory at 512K-1M tokens, one more all-gather per layer)",
    )

    pack_gqa: bool | None = Field(
        default=None,
        description="GQA head packing of the drafter's attention: true / false force it on / off; unset: "
        "decided per call from the block masks (flex only)",
    )
    plateau_steps: int = Field(
        default=300, ge=0,
        description="after this many optimizer steps, a training est_tau still below 1.1 (the drafter proposes "
        "next to no right token) is reported in one line with its likely cause and the recipe "
        "(plugin/reporting.py PlateauCheck); 0: never",
    )  # fmt: skip

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_choice(cls, value: Any) -> bool | str:
        choices = {"true": True, "false": False, "auto": "auto"}
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in choices:
            return choices[value.strip().lower()]
        raise ValueError(f"must be one of true, false, auto; got {value!r}")

    @field_validator("regather")
    @classmethod
    def _regather_needs_overlap(cls, regather: bool, info: ValidationInfo) -> bool:
        if regather and info.data.get("attention_schedule") == "fused":
            raise ValueError("needs csbp.attention_schedule: overlap (the fused schedule keeps the concatenated K/V)")
        return regather


def compiles_drafter(options: CSBPOptions, device: torch.device) -> bool:
    """csbp.compile resolved for the device the drafter trains on."""
    return device.type == "cuda" if options.compile == "auto" else bool(options.compile)


def attention_options(options: CSBPOptions, attention_backend: str) -> AttentionOptions:
    """The one place the plugin's settings become the executors' `AttentionOptions` (parallel/options.py):
    `csbp.*` plus SpecForge's `training.attention_backend` (unknown backends: the seam's "auto")."""
    return AttentionOptions(
        backend=SEAM_BACKENDS.get(attention_backend, "auto"), schedule=options.attention_schedule,
        regather=options.regather, pack_gqa=options.pack_gqa, gather_ahead=options.gather_ahead,
    )  # fmt: skip


@dataclass(frozen=True)
class PreparedRun:
    """Everything a launcher or a worker needs; `forward_overrides` re-create it in a worker."""

    config: Any  # specforge.config.Config
    options: CSBPOptions
    world_size: int
    cp_size: int
    dp_replicas: int
    forward_overrides: tuple[str, ...] = field(default_factory=tuple)

    @property
    def strategy(self) -> str:
        return self.config.training.strategy

    @property
    def is_csbp(self) -> bool:
        return self.strategy in CSBP_STRATEGIES


def one_line(err: ValidationError, prefix: str = "") -> str:
    """The first pydantic error as `section.field: message`."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    return f"{prefix}{where}: {first['msg']}"


def _trains_here(world: int) -> bool:
    """Does this process build the model (a torchrun worker, or a one-rank run in the launching process)?
    A launcher of several ranks keeps the default 0 for an unset `keep_logits_gib` (it builds no model):
    each worker chooses for its own GPU."""
    return "LOCAL_RANK" in os.environ or world == 1


def _drop_auto(section: dict) -> None:
    """`keep_logits_gib: auto` is the same as leaving it unset (chosen in `prepare_run`)."""
    value = section.get("keep_logits_gib")
    if isinstance(value, str) and value.strip().lower() == "auto":
        del section["keep_logits_gib"]


def _read_raw(path: str) -> dict:
    raw = load_config(path, "--config")
    if not isinstance(raw, dict):
        raise ValueError(f"--config: {path} must hold a mapping with model/data/training sections")  # noqa: TRY004
    return raw


def _apply_csbp_override(section: dict, item: str) -> None:
    key, value = item.split("=", 1)
    name = key[len("csbp.") :]
    if name not in CSBPOptions.model_fields:
        raise ValueError(
            f"override {key!r}: unknown field; the csbp section has {', '.join(CSBPOptions.model_fields)}"
        )
    # read as the same text is in the YAML file (values.parse_override), so the two spellings agree
    section[name] = None if value.strip().lower() in ("null", "none", "") else parse_override(value)


def _translate_strategy(strategy: str) -> str:
    if strategy in CSBP_OF:
        return CSBP_OF[strategy]
    if strategy in _DFLASH_FAMILY_NOT_IN_CSBP:
        raise ValueError(
            f"--csbp: training.strategy={strategy!r} is a DFlash-family algorithm that CSBP does not implement; "
            f"--csbp runs dflash and dflash2 configs"
        )
    raise ValueError(
        f"--csbp: training.strategy={strategy!r} is not a DFlash-family algorithm; "
        f"--csbp runs dflash and dflash2 configs (or set training.strategy to dflash-csbp / dflash2-csbp)"
    )


def prepare_run(
    config_path: str,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    csbp: bool = False,
    cp_size: int | None = None,
    dp_replicas: int | None = None,
) -> PreparedRun:
    """Validate a run config + overrides + plugin flags into a `PreparedRun` (ValueError: one line)."""
    from specforge.config.schema import Config, apply_overrides, migrate_legacy_config

    raw = _read_raw(config_path)
    section = raw.pop("csbp", None) or {}
    if not isinstance(section, dict):
        raise ValueError(f"csbp: must be a mapping with fields {', '.join(CSBPOptions.model_fields)}")  # noqa: TRY004
    section = dict(section)
    _drop_auto(section)
    spec_overrides, csbp_overrides = [], []
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form section.field=value")
        (csbp_overrides if item.startswith("csbp.") else spec_overrides).append(item)
    for item in csbp_overrides:
        _apply_csbp_override(section, item)
    _drop_auto(section)
    if cp_size is not None:
        section["cp_size"] = cp_size
    if dp_replicas is not None:
        section["dp_replicas"] = dp_replicas
    try:
        options = CSBPOptions.model_validate(section)
    except ValidationError as err:
        raise ValueError(one_line(err, "csbp.")) from None

    try:
        cfg = Config.model_validate(migrate_legacy_config(raw))
        if spec_overrides:
            cfg = apply_overrides(cfg, spec_overrides)
    except ValidationError as err:
        raise ValueError(one_line(err)) from None

    check_finite(options.model_dump(), "csbp")
    check_finite(cfg.model_dump())  # pydantic's gt/ge bounds let inf through (learning_rate: inf)
    forward = list(spec_overrides)
    if csbp:
        strategy = _translate_strategy(cfg.training.strategy)
        if strategy != cfg.training.strategy:
            cfg = apply_overrides(cfg, [f"training.strategy={strategy}"])
            forward.append(f"training.strategy={strategy}")
    strategy = cfg.training.strategy
    is_csbp = strategy in CSBP_STRATEGIES
    flag_names = {"cp_size": "--cp-size", "dp_replicas": "--dp-replicas"}
    if not is_csbp:
        for name, flag in flag_names.items():
            if getattr(options, name) is not None:
                raise ValueError(
                    f"{flag}: training.strategy={strategy!r} is not a CSBP strategy; add --csbp or set "
                    f"training.strategy to one of {', '.join(CSBP_STRATEGIES)}"
                )
        if options.mode != "csbp":
            raise ValueError(
                f"csbp.mode={options.mode}: training.strategy={strategy!r} is not a CSBP strategy; add --csbp"
            )
    if strategy in PLUGIN_STRATEGIES and cfg.data.eval_hidden_states_path:
        check_store_path(cfg.data.eval_hidden_states_path, "data.eval_hidden_states_path")
    if strategy in PLUGIN_STRATEGIES and cfg.training.fsdp_sharding != "NO_SHARD":
        raise ValueError(
            f"training.fsdp_sharding={cfg.training.fsdp_sharding!r}: {strategy} replicates the drafter "
            "(CSBP shards the context, not the weights); set training.fsdp_sharding: NO_SHARD"
        )

    forward.extend(i for i in csbp_overrides if not i.startswith(("csbp.cp_size=", "csbp.dp_replicas=")))
    topo = cfg.deployment.trainer
    world = topo.nnodes * topo.nproc_per_node
    where = (
        f"deployment.trainer.nnodes={topo.nnodes} x deployment.trainer.nproc_per_node={topo.nproc_per_node}"
    )
    if is_csbp:
        cp = options.cp_size or (world // options.dp_replicas if options.dp_replicas else world)
        if options.dp_replicas and world % options.dp_replicas:
            raise ValueError(
                f"--dp-replicas {options.dp_replicas} does not divide the world size {world} ({where})"
            )
        if world % cp:
            raise ValueError(f"--cp-size {cp} does not divide the world size {world} ({where})")
        dp = world // cp
        if options.dp_replicas is not None and options.dp_replicas != dp:
            raise ValueError(
                f"--dp-replicas {options.dp_replicas} x --cp-size {cp} = {options.dp_replicas * cp} "
                f"!= the world size {world} ({where})"
            )
        forward.append(f"csbp.cp_size={cp}")
    else:
        cp, dp = 1, world
    if "keep_logits_gib" not in options.model_fields_set and strategy in PLUGIN_STRATEGIES and _trains_here(world):
        choice = resolve_keep_logits(cfg, options, cp, options.mode if is_csbp else "dp")
        options = options.model_copy(update={"keep_logits_gib": choice.keep_logits_gib})
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"specforge-csbp: {choice.line()}", flush=True)
    return PreparedRun(
        config=cfg, options=options, world_size=world, cp_size=cp, dp_replicas=dp,
        forward_overrides=tuple(forward),
    )  # fmt: skip
