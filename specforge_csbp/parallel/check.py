"""Exactness check of one mode against the single-process reference (used by `verify` and the tests).

Every rank draws the same full inputs from one seed, runs its plan, and sends its rows to rank 0, which
scatters them back into 2L order (outputs from each row's unique owner; gradients summed over replicas,
which is what BP's replicated clean prefix contributes) and compares with the float64 reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..distributed.collectives import CommStats
from ..layout.plans import bdlm_plan, check_bdlm_shape
from .options import AttentionOptions
from .sharded_attention import ShardedAttention

__all__ = ["DTYPES", "TOLERANCES", "CheckCase", "CheckResult", "run_check"]

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Max relative error (max |x - ref| / max |ref|) allowed against the float64 reference.
TOLERANCES = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-2}
TENSORS = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class CheckCase:
    mode: str
    seq_len: int
    block_size: int
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    dtype: str = "float64"
    clean_within_block: str = "causal"
    batch: int = 1
    seed: int = 0
    schedule: str | None = None  # None: the executor's default (fused; overlap when regather)
    regather: bool = False
    pack_gqa: bool | None = None  # the seam's GQA head packing (None: decided per call)

    def validate(self, world_size: int) -> None:
        check_bdlm_shape(self.mode, self.seq_len, self.block_size, world_size)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        for name in ("heads", "kv_heads", "head_dim", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")


@dataclass
class CheckResult:
    errors: dict[str, float]
    bytes_sent: list[dict[str, int]] = field(default_factory=list)  # per rank, by collective
    tolerance: float = 0.0

    @property
    def ok(self) -> bool:
        return all(e <= self.tolerance for e in self.errors.values())


def _inputs(case: CheckCase):
    g = torch.Generator().manual_seed(case.seed)
    n = 2 * case.seq_len
    shape_q = (case.batch, case.heads, n, case.head_dim)
    shape_kv = (case.batch, case.kv_heads, n, case.head_dim)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in (shape_q, shape_kv, shape_kv))
    g_out = torch.randn(shape_q, generator=g, dtype=torch.float64)
    g_lse = torch.randn(shape_q[:3], generator=g, dtype=torch.float64)
    # Round inputs to the checked dtype once, so the reference sees exactly what the mode sees.
    dt = DTYPES[case.dtype]
    return [t.to(dt).to(torch.float64) for t in (q, k, v)], g_out, g_lse


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(x)):
        return float("inf")
    scale = ref[finite].abs().max().clamp_min(1e-300)
    return float(((x[finite] - ref[finite]).abs().max() / scale).item()) if finite.any() else 0.0


def _run_rank(case: CheckCase, plan, group, device, stats: CommStats):
    (q, k, v), g_out, g_lse = _inputs(case)
    dt = DTYPES[case.dtype]
    rows_q, rows_kv = plan.q_rows, plan.kv_rows
    lq, lk, lv = (
        t[:, :, rows].to(device=device, dtype=dt).requires_grad_()
        for t, rows in ((q, rows_q), (k, rows_kv), (v, rows_kv))
    )
    attn = ShardedAttention(
        plan, case.block_size, clean_within_block=case.clean_within_block, group=group,
        options=AttentionOptions(stats=stats, schedule=case.schedule, regather=case.regather, pack_gqa=case.pack_gqa),
    )  # fmt: skip
    out, lse = attn(lq, lk, lv)
    primary = plan.q_primary.to(device)
    w_out = g_out[:, :, rows_q].to(device) * primary[None, None, :, None]
    w_lse = g_lse[:, :, rows_q].to(device) * primary[None, None, :]
    loss = (out.double() * w_out).sum() + (lse.double() * w_lse).sum()
    loss.backward()
    return {
        "q_rows": rows_q, "kv_rows": rows_kv, "primary": plan.q_primary,
        "out": out.detach().double().cpu(), "lse": lse.detach().double().cpu(),
        "dq": lq.grad.double().cpu(), "dk": lk.grad.double().cpu(), "dv": lv.grad.double().cpu(),
    }  # fmt: skip


def _reference(case: CheckCase, device: torch.device | str = "cpu"):
    """Dense float64 reference, on `device` (rank 0's GPU under torchrun: far faster than one CPU thread)."""
    (q, k, v), g_out, g_lse = _inputs(case)
    q, k, v, g_out, g_lse = (t.to(device) for t in (q, k, v, g_out, g_lse))
    plan = bdlm_plan("reference", case.seq_len, case.block_size, 1)[0]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    attn = ShardedAttention(
        plan, case.block_size, clean_within_block=case.clean_within_block, options=AttentionOptions(backend="dense")
    )
    out, lse = attn(q, k, v)
    ((out * g_out).sum() + (lse * g_lse).sum()).backward()
    result = {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {name: t.cpu() for name, t in result.items()}


def _assemble(case: CheckCase, parts: list[dict]) -> dict[str, torch.Tensor]:
    n = 2 * case.seq_len
    full = {
        "out": torch.full((case.batch, case.heads, n, case.head_dim), float("nan"), dtype=torch.float64),
        "lse": torch.full((case.batch, case.heads, n), float("nan"), dtype=torch.float64),
        "dq": torch.zeros(case.batch, case.heads, n, case.head_dim, dtype=torch.float64),
        "dk": torch.zeros(case.batch, case.kv_heads, n, case.head_dim, dtype=torch.float64),
        "dv": torch.zeros(case.batch, case.kv_heads, n, case.head_dim, dtype=torch.float64),
    }
    for p in parts:
        rows = p["q_rows"][p["primary"]]
        full["out"][:, :, rows] = p["out"][:, :, p["primary"]]
        full["lse"][:, :, rows] = p["lse"][:, :, p["primary"]]
        full["dq"].index_add_(2, p["q_rows"], p["dq"])
        full["dk"].index_add_(2, p["kv_rows"], p["dk"])
        full["dv"].index_add_(2, p["kv_rows"], p["dv"])
    return full


def run_check(case: CheckCase, *, group=None, device: torch.device | str = "cpu") -> CheckResult | None:
    """Collective over `group` (or a single process); returns the result on rank 0, None elsewhere."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    case.validate(world)
    plan = bdlm_plan(case.mode, case.seq_len, case.block_size, world)[rank]
    stats = CommStats()
    part = _run_rank(case, plan, group, device, stats)
    part["bytes"] = dict(stats.bytes_sent)
    parts: list[dict] | None = [None] * world if rank == 0 else None  # type: ignore[list-item]
    if world > 1:
        dist.gather_object(part, parts, dst=dist.get_global_rank(group, 0) if group else 0, group=group)
    else:
        parts = [part]
    if rank != 0:
        return None
    full = _assemble(case, parts)
    ref = _reference(case, device)
    errors = {name: _rel(full[name], ref[name]) for name in TENSORS}
    return CheckResult(errors, [p["bytes"] for p in parts], TOLERANCES[case.dtype])
