"""Recipe configuration: pydantic sections from YAML, with `section.field=value` command-line overrides.

A recipe is one pydantic model whose fields are sections (model, data, objective, parallel, train, ...);
`ParallelConfig` and `TrainConfig` are the generic ones every workload shares. Unknown fields are errors,
and every error is one line naming the field:

    specforge-csbp train-bdlm -c recipe.yaml train.lr=3e-4 parallel.cp_degree=2
    -> train.lr: Input should be a valid number (got 'x')
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from ..errors import format_validation_error, load_yaml
from ..values import parse_override, size_field

__all__ = [
    "ParallelConfig",
    "Section",
    "Size",
    "TrainConfig",
    "apply_overrides",
    "format_validation_error",
    "load_recipe",
]

R = TypeVar("R", bound=BaseModel)


#: a size field: an int, or a string with a K/M/G suffix (values.parse_size); bounds stay the field's own
Size = Annotated[int, BeforeValidator(size_field)]

class Section(BaseModel):
    """A recipe section: unknown fields are errors, values are validated on assignment too."""

    # allow_inf_nan=False: a bound such as lr > 0 lets inf through; no recipe float may be NaN or inf
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ParallelConfig(Section):
    """DP x CP degrees. `cp_degree` is the CSBP / CP / BP group size; dp_degree defaults to world / cp."""

    mode: Literal["csbp", "cp", "bp", "reference"] = "csbp"
    cp_degree: int = Field(1, ge=1)
    dp_degree: int | None = Field(None, ge=1)
    world_size: int = Field(
        1, ge=1,
        description="ranks to start: gloo ranks on the CPU, or GPU ranks through torchrun (unset on a GPU "
        "machine: one per GPU); ignored under torchrun",
    )  # fmt: skip
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto",
        description="where train-bdlm runs its ranks without torchrun: auto = the GPUs when there are any "
        "(through torchrun), else gloo ranks on the CPU; cuda = GPUs or a one-line error; cpu = gloo ranks",
    )
    attention_backend: Literal["auto", "dense", "flex"] = "auto"
    attention_schedule: Literal["fused", "overlap"] = Field(
        "fused",
        description="CSBP/CP: one attention call after the clean K/V all-gather (fused), or overlap the "
        "gather with attention over local keys and merge (overlap); docs/performance.md has the measurement",
    )  # fmt: skip
    timeout_s: float = Field(
        1800.0, gt=0,
        description="fail fast: a rank blocked this long in a collective that another rank does not join "
        "stops every rank, naming the hung one (also the process-group timeout under torchrun)",
    )  # fmt: skip

    @model_validator(mode="after")
    def _reference_is_one_rank(self) -> ParallelConfig:
        if self.mode == "reference" and self.cp_degree != 1:
            raise ValueError(f"mode 'reference' needs cp_degree 1, got {self.cp_degree}")
        return self

    def degrees(self, world_size: int) -> tuple[int, int]:
        """(dp, cp) for `world_size` ranks; one-line error when they do not multiply to it."""
        dp = self.dp_degree if self.dp_degree is not None else world_size // self.cp_degree
        if world_size % self.cp_degree or dp * self.cp_degree != world_size:
            raise ValueError(
                f"parallel: dp_degree x cp_degree = {dp} x {self.cp_degree} must equal the world size "
                f"{world_size}"
            )
        return dp, self.cp_degree


class TrainConfig(Section):
    steps: int = Field(10, ge=1)
    micro_batch_size: int = Field(1, ge=1, description="sequences per DP replica per micro step")
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(1e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm; null = no clipping")
    activation_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="checkpoint every decoder layer (recompute in backward); auto: only when the planner's "
        "memory model says the step would not fit in the GPU's memory without (training/checkpointing.py)",
    )
    recompute_attention: bool | Literal["auto"] = Field(
        "auto",
        description="with activation checkpointing: true re-runs every layer's attention in the recompute; "
        "false keeps each layer's attention output and saved tensors for it instead (no attention FLOPs or "
        "collectives recomputed, more memory per layer); auto: false when the memory model says it fits",
    )
    compile: bool | Literal["auto", "layers", "norms"] = Field(
        "auto",
        description="torch.compile the token-wise work of every decoder layer in place (one graph per shape "
        "shared by the layers): layers (= true) = attention's projections, q/k norms and RoPE around the "
        "routed attention call, dense MLPs and every RMSNorm; norms = the RMSNorms only; false = eager; "
        "auto: layers on GPUs, eager on the CPU",
    )
    precision: Literal["auto", "float32", "bfloat16", "float64"] = Field(
        "auto",
        description="auto: bf16 autocast on GPU, float32 on CPU; bfloat16 = fp32 weights + bf16 autocast",
    )
    seed: int = 0
    output_dir: str | None = None
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only the last step)")
    keep_checkpoints: int = Field(2, ge=1)
    resume: bool = True
    log_every: int = Field(1, ge=1)
    progress: bool = True
    peak_tflops: float | None = Field(None, gt=0, description="per-device peak for MFU (default: known GPUs)")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.warmup_steps > self.steps:
            raise ValueError(
                f"train.warmup_steps ({self.warmup_steps}) must be <= train.steps ({self.steps})"
            )
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train.betas must both be in [0, 1); got {list(self.betas)}")
        return self


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"override {item!r} must look like section.field=value")
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = parse_override(value)
    return data


def load_recipe(cls: type[R], path: str | Path | None, overrides: list[str] = ()) -> R:
    """YAML file (optional) + overrides -> validated recipe; ValueError with one line on any problem."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = load_yaml(path, "config")  # one line naming the file and the line of a YAML or UTF-8 error
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config: {path} must hold a mapping of sections")
        data = loaded or {}
    apply_overrides(data, list(overrides))
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ValueError(format_validation_error(err)) from None
