"""Machine profile: the measured rates the cost model divides by, and `calibrate`, which measures them here.

    gemm_tflops          dense matmul in the training dtype
    attn_tflops          useful attention FLOP/s (visible pairs only) of forward + backward through the seam
    allgather_gbps       bytes a rank sends per second in an all-gather (ring: (P-1) segments)
    reduce_scatter_gbps  same for reduce-scatter;  allreduce_gbps: 2(P-1)/P x bytes / time
    launch_overhead_us   cost of one tiny kernel launch (dominates tiny problems only)
    layer_tflops         GEMM FLOPs / time of a whole eager decoder layer, forward + backward (rates.py)
    loss_tflops          FLOPs / time of the chunked linear CE with a trainable LM head (BDLM loss)
    loss_topk_tflops     the same for linear_ce_topk with a frozen head and top-k logits (drafter loss)
    loss_top1_tflops     the same with top-1 and no selector (DFlash drafter loss; profiles before
                         h200x2-2026-11-30-c lack it and use loss_topk_tflops)
    adamw_gbps           bytes / time of one fused AdamW step (28 bytes per fp32 parameter)
    attn_window_tflops   useful attention FLOP/s of DFlash draft blocks over a sliding window (rates.py)
    attn_draft_tflops    the same for draft blocks over the whole context (full-attention drafter layers)
    bdlm_layer_tflops    GEMM FLOPs / time of one BDLM decoder layer at a model's own widths and precision
                         (fp32 weights under bf16 autocast, checkpointing recompute counted; rates.py),
    bdlm_layer_shape     ... and which layer that was (`rates.BDLMLayerSpec.key`); measured by
                         `calibrate(bdlm_layer=...)` = `plan --calibrate --model M` for sft / convert

The last eight are optional (None in profiles calibrated before they existed: the cost model then charges
that work at gemm_tflops, drafter attention at attn_tflops, BDLM layers at layer_tflops (also when the
planned model's layer is not the one measured), and no optimizer time, exactly as those profiles always
predicted).

A profile is JSON (`MachineProfile`); `calibrate` writes one. Collectives need >= 2 ranks: run it under
torchrun on GPUs, or let it spawn gloo ranks on CPU. Sizes are tiny on CPU, realistic on GPU.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..bench.provenance import library_digest
from ..distributed.launch import init_from_env, spawn
from ..errors import load_json, one_line
from ..layout.plans import bdlm_plan
from ..parallel.sharded_attention import ShardedAttention
from .pairs import count_visible
from .rates import BDLMLayerSpec, measure_bdlm_layer, measure_drafter_attention, measure_work_rates, timed

__all__ = ["BUILTIN_PROFILES", "MachineProfile", "calibrate", "load_profile"]

BUILTIN_PROFILES = ("h200-nominal", "h200x2-2026-11-29", "h200x2-2026-11-30", "h200x2-2026-11-30-b", "h200x2-2026-11-30-c")


class MachineProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str
    date: str
    measured: bool = True  # False for a nominal (spec-sheet) profile
    world_size: int = Field(ge=1, description="ranks the collectives were measured on")
    dtype: str = "bfloat16"
    attention_backend: str = "flex"
    gemm_tflops: float = Field(gt=0)
    attn_tflops: float = Field(gt=0)
    allgather_gbps: float | None = Field(default=None, gt=0)
    reduce_scatter_gbps: float | None = Field(default=None, gt=0)
    allreduce_gbps: float | None = Field(default=None, gt=0)
    launch_overhead_us: float = Field(default=0.0, ge=0)
    layer_tflops: float | None = Field(default=None, gt=0, description="whole decoder layer, fwd + bwd")
    loss_tflops: float | None = Field(default=None, gt=0, description="linear CE, trainable head")
    loss_topk_tflops: float | None = Field(default=None, gt=0, description="linear CE + top-k, frozen head")
    loss_top1_tflops: float | None = Field(default=None, gt=0, description="linear CE + top-1, frozen head")
    adamw_gbps: float | None = Field(default=None, gt=0, description="fused AdamW step, 28 B per parameter")
    attn_window_tflops: float | None = Field(default=None, gt=0, description="draft blocks, sliding window")
    attn_draft_tflops: float | None = Field(default=None, gt=0, description="draft blocks, whole context")
    bdlm_layer_tflops: float | None = Field(default=None, gt=0, description="BDLM layer at bdlm_layer_shape")
    bdlm_layer_shape: str | None = Field(default=None, min_length=1, description="BDLMLayerSpec.key measured")
    calibration_s: float | None = Field(default=None, ge=0, description="wall seconds the calibration took")
    gpus_per_node: int = Field(default=8, ge=1)
    internode_gbps: float | None = Field(default=None, gt=0, description="per-GPU bandwidth across nodes")
    reserved_gib: float = Field(default=0.0, ge=0, description="memory tensors cannot use (context, slack)")
    command: str = ""
    code: str | None = Field(default=None, description="library digest of the calibrating code (bench/provenance.py)")

    @model_validator(mode="after")
    def _bdlm_layer_pair(self) -> MachineProfile:
        if (self.bdlm_layer_tflops is None) != (self.bdlm_layer_shape is None):
            raise ValueError(
                "bdlm_layer_tflops and bdlm_layer_shape: give both (the rate and the layer it measured) "
                "or neither"
            )
        return self

    @property
    def elem_bytes(self) -> int:
        return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    @property
    def token_tflops(self) -> float:
        """Rate of token-wise work (decoder-layer GEMMs with their norms/RoPE/SwiGLU, projections)."""
        return self.layer_tflops or self.gemm_tflops

    def bdlm_layer_rate(self, layer_key: str) -> float:
        """Rate of a BDLM's token-wise work: bdlm_layer_tflops when it was measured for exactly this layer
        (`BDLMLayerSpec.key`: widths, precision, checkpointing), else token_tflops (as before it existed)."""
        if self.bdlm_layer_tflops is not None and self.bdlm_layer_shape == layer_key:
            return self.bdlm_layer_tflops
        return self.token_tflops

    def loss_rate_tflops(self, frozen_head_topk: bool, top1: bool = False) -> float:
        """Rate of the vocabulary loss: the drafter's (frozen head + top-k, or `top1`: DFlash without a
        selector) or the BDLM's (trainable head); falls back to the top-k rate, the other loss rate, then
        the GEMM rate."""
        topk, full = self.loss_topk_tflops, self.loss_tflops
        if frozen_head_topk and top1 and self.loss_top1_tflops is not None:
            return self.loss_top1_tflops
        return (topk or full if frozen_head_topk else full or topk) or self.gemm_tflops

    def drafter_attn_tflops(self, window: int | None) -> float:
        """Attention rate of a drafter layer: draft blocks over a sliding window of `window` keys, or over
        the whole context (None); falls back to the BDLM-measured attn_tflops."""
        return (self.attn_draft_tflops if window is None else self.attn_window_tflops) or self.attn_tflops

    def bandwidth(self, op: str, group_size: int) -> float:
        """Bytes/s of `op` ("allgather" | "reduce_scatter" | "allreduce") for a group of this many GPUs;
        groups larger than a node run at the inter-node rate."""
        if group_size <= 1:
            return float("inf")
        measured = getattr(self, f"{op}_gbps")
        if measured is None:
            raise ValueError(
                f"profile {self.device}: {op}_gbps was not measured (profile from {self.world_size} rank); "
                "calibrate on >= 2 ranks"
            )
        rate = measured
        if group_size > self.gpus_per_node:
            rate = min(rate, self.internode_gbps or rate)
        return rate * 1e9

    def summary(self) -> str:
        def g(x):
            return "n/a" if x is None else f"{x:.3g}"

        kind = "measured" if self.measured else "NOMINAL (not measured)"
        inter = f", inter-node {g(self.internode_gbps)} GB/s" if self.internode_gbps else ""
        work = ""  # only profiles that measured them say so (older summaries stay as they were)
        if self.layer_tflops is not None:
            work += f", decoder layer {g(self.layer_tflops)} TFLOP/s"
        if self.loss_tflops is not None or self.loss_topk_tflops is not None:
            top1 = f" / top-1 {g(self.loss_top1_tflops)}" if self.loss_top1_tflops is not None else ""
            work += f", loss {g(self.loss_tflops)} / top-k {g(self.loss_topk_tflops)}{top1} TFLOP/s"
        if self.adamw_gbps is not None:
            work += f", AdamW {g(self.adamw_gbps)} GB/s"
        if self.attn_window_tflops is not None or self.attn_draft_tflops is not None:
            work += (f", drafter attention window {g(self.attn_window_tflops)} / full "
                     f"{g(self.attn_draft_tflops)} TFLOP/s")  # fmt: skip
        if self.bdlm_layer_tflops is not None:
            work += f", BDLM layer {g(self.bdlm_layer_tflops)} TFLOP/s ({self.bdlm_layer_shape})"
        return (
            f"{self.device}, {kind} {self.date} on {self.world_size} rank(s), {self.dtype}/{self.attention_backend}: "
            f"GEMM {g(self.gemm_tflops)} TFLOP/s, attention {g(self.attn_tflops)} TFLOP/s, all-gather "
            f"{g(self.allgather_gbps)} GB/s, reduce-scatter {g(self.reduce_scatter_gbps)} GB/s, all-reduce "
            f"{g(self.allreduce_gbps)} GB/s{inter}{work}, launch {self.launch_overhead_us:.3g} us"
        )


def load_profile(name_or_path: str | os.PathLike) -> MachineProfile:
    """A profile JSON file, or a built-in name (BUILTIN_PROFILES)."""
    from pydantic import ValidationError

    if str(name_or_path) in BUILTIN_PROFILES:
        data = json.loads(resources.files(__package__).joinpath(f"profiles/{name_or_path}.json").read_text())
    else:
        if not Path(name_or_path).exists():
            raise ValueError(
                f"profile: {name_or_path} is neither a file nor a built-in ({', '.join(BUILTIN_PROFILES)})"
            )
        data = load_json(name_or_path, "profile")
    try:
        return MachineProfile.model_validate(data)
    except ValidationError as err:
        raise ValueError(f"profile: {name_or_path}: {one_line(err)}") from None


# -- calibration ----------------------------------------------------------------------------------


def _sizes(device: torch.device) -> dict:
    if device.type == "cuda":
        return dict(n=8192, L=16384, S=16, H=32, Hk=8, D=128, comm_bytes=256 << 20, dtype=torch.bfloat16, reps=10)
    return dict(n=256, L=128, S=16, H=4, Hk=2, D=32, comm_bytes=4 << 20, dtype=torch.float32, reps=5)


def _measure_compute(device: torch.device, bdlm_layer: BDLMLayerSpec | None = None) -> dict:
    """Every compute rate: the kernels below, then the drafter's attention and the work a step runs
    (rates.py), then a BDLM model's own layer when asked - each after the previous one's tensors are freed."""
    values = {**_measure_kernels(device), **measure_drafter_attention(device), **measure_work_rates(device)}
    if bdlm_layer is not None:
        values.update(measure_bdlm_layer(device, bdlm_layer))
    return values


def _measure_kernels(device: torch.device) -> dict:
    z = _sizes(device)
    n, dt = z["n"], z["dtype"]
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    gemm = 2 * n**3 / timed(lambda: a @ b, device, z["reps"]) / 1e12

    L, S, H, Hk, D = z["L"], z["S"], z["H"], z["Hk"], z["D"]
    plan = bdlm_plan("reference", L, S, 1)[0]
    attn = ShardedAttention(plan, S)
    q = torch.randn(1, H, 2 * L, D, device=device, dtype=dt, requires_grad=True)
    k = torch.randn(1, Hk, 2 * L, D, device=device, dtype=dt, requires_grad=True)
    v = torch.randn(1, Hk, 2 * L, D, device=device, dtype=dt, requires_grad=True)

    def step():
        out, _ = attn(q, k, v)
        out.backward(torch.ones_like(out))

    pairs = count_visible(plan.q_tokens, plan.kv_tokens, S)
    attn_tflops = pairs * 4 * H * D * 3.5 / timed(step, device, z["reps"]) / 1e12  # fwd 1 + bwd 2.5

    x = torch.zeros(1, device=device)
    launches = 200
    launch_us = timed(lambda: [x.add_(1) for _ in range(launches)], device, 3, warmup=1) / launches * 1e6
    return dict(gemm_tflops=gemm, attn_tflops=attn_tflops, launch_overhead_us=launch_us, dtype=str(dt).split(".")[-1],
                attention_backend="flex" if device.type == "cuda" else "dense")  # fmt: skip


def _measure_comm(device: torch.device, group=None) -> dict:
    world = dist.get_world_size(group)
    z = _sizes(device)
    shard = torch.randn(z["comm_bytes"] // 4, device=device, dtype=torch.float32)
    full = shard.new_empty(world * shard.numel())
    nbytes = shard.numel() * shard.element_size()

    def ag():
        dist.all_gather_into_tensor(full, shard, group=group)

    def rs():
        dist.reduce_scatter_tensor(shard, full, group=group)

    def ar():
        dist.all_reduce(shard, group=group)

    t_ag, t_rs, t_ar = (timed(f, device, z["reps"]) for f in (ag, rs, ar))
    return dict(
        allgather_gbps=(world - 1) * nbytes / t_ag / 1e9,
        reduce_scatter_gbps=(world - 1) * nbytes / t_rs / 1e9,
        allreduce_gbps=2 * (world - 1) / world * nbytes / t_ar / 1e9,
    )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine() or 'unknown'})"


def _calibrate_rank(rank: int, world: int, out_path: str, bdlm_layer: BDLMLayerSpec | None = None) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    start = time.perf_counter()
    values = _measure_compute(device, bdlm_layer)
    if device.type == "cuda":  # CUDA context and other users now, plus 5% allocator slack
        torch.cuda.empty_cache()  # blocks the measurements cached are usable by tensors: not reserved
        free, total = torch.cuda.mem_get_info(device)
        values["reserved_gib"] = ((total - free) + 0.05 * total) / (1 << 30)
    values.update(_measure_comm(device) if world > 1 else {})
    values["calibration_s"] = time.perf_counter() - start
    gathered: list = [None] * world
    dist.all_gather_object(gathered, values)
    if rank == 0:  # the slowest rank sets the pace of a synchronous step
        merged = {k: (min(g[k] for g in gathered) if isinstance(v, float) else v) for k, v in values.items()}
        for key in ("launch_overhead_us", "reserved_gib", "calibration_s"):  # costs: the largest rank's
            if key in values:
                merged[key] = max(g[key] for g in gathered)
        merged["device"] = _device_name(device)
        with open(out_path, "w") as f:
            json.dump(merged, f)


def calibrate(
    world_size: int = 2, *, command: str = "", bdlm_layer: BDLMLayerSpec | None = None
) -> MachineProfile:
    """Measure this machine. Under torchrun (RANK set) every rank takes part and all return the profile;
    otherwise `world_size` gloo ranks are spawned on the CPU (1 = compute only, no collective rates).
    `bdlm_layer`: also measure that BDLM layer (bdlm_layer_tflops / bdlm_layer_shape; rates.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "profile.json")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            init_from_env()
            world = dist.get_world_size()
            _calibrate_rank(dist.get_rank(), world, out, bdlm_layer)
            obj = [None]
            if dist.get_rank() == 0:
                obj = [Path(out).read_text()]
            dist.broadcast_object_list(obj, src=0)
            data = json.loads(obj[0])
        elif world_size == 1:
            world = 1
            start = time.perf_counter()
            data = _measure_compute(torch.device("cpu"), bdlm_layer)
            data["calibration_s"] = time.perf_counter() - start
            data["device"] = _device_name(torch.device("cpu"))
        else:
            world = world_size
            spawn(_calibrate_rank, world_size, out, bdlm_layer)
            data = json.loads(Path(out).read_text())
    gpus_per_node = torch.cuda.device_count() if torch.cuda.is_available() else world
    return MachineProfile(
        date=_dt.datetime.now(_dt.timezone.utc).date().isoformat(), world_size=world,
        gpus_per_node=max(gpus_per_node, 1), command=command, code=library_digest(), **data,
    )  # fmt: skip
