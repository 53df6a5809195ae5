"""`specforge-csbp verify`: exactness pre-flight of one mode against the single-process reference.

On CPU it spawns P gloo ranks; under torchrun with GPUs it joins the launch and uses NCCL. It prints one
line per tensor (out, lse, dq, dk, dv) with the max relative error against a float64 reference, the bytes
each rank sent in attention collectives, and exits 1 when an error is over the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict

import torch

from ..distributed.launch import init_from_env, spawn
from ..layout.plans import MODES
from ..masks.visibility import CLEAN_RULES
from ..parallel.check import DTYPES, CheckCase, CheckResult, run_check
from ..parallel.sharded_attention import SCHEDULES
from ..values import size_arg

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a parallel mode against the single-device reference")
    p.add_argument("--mode", choices=[m for m in MODES if m != "reference"], default="csbp")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn on CPU (ignored under torchrun)")
    p.add_argument("--seq-len", type=size_arg("--seq-len"), default=256, help="clean tokens L (a multiple of --block-size)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=list(DTYPES), default="float64")
    p.add_argument("--clean-within-block", choices=CLEAN_RULES, default="causal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", choices=SCHEDULES, default="fused",
                   help="one fused call after the gather (default), or overlap the gather with local attention")
    p.set_defaults(func=run)


def _case(args: argparse.Namespace) -> CheckCase:
    return CheckCase(
        mode=args.mode, seq_len=args.seq_len, block_size=args.block_size, heads=args.heads,
        kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
        clean_within_block=args.clean_within_block, batch=args.batch, seed=args.seed, schedule=args.schedule,
    )  # fmt: skip


def _rank_main(rank: int, world: int, case: CheckCase, out_path: str) -> None:
    on_gpu = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    result = run_check(case, device=device)
    if rank == 0 and result is not None:
        with open(out_path, "w") as f:
            json.dump(asdict(result), f)


def _report(case: CheckCase, world: int, result: CheckResult) -> int:
    print(
        f"verify mode={case.mode} P={world} L={case.seq_len} S={case.block_size} H={case.heads} "
        f"K={case.kv_heads} D={case.head_dim} dtype={case.dtype} clean={case.clean_within_block}"
    )
    for name, err in result.errors.items():
        flag = "ok" if err <= result.tolerance else "FAIL"
        print(f"  {name:<4} max_rel_err={err:.3e}  tol={result.tolerance:.0e}  {flag}")
    for r, sent in enumerate(result.bytes_sent):
        parts = ", ".join(f"{op}={n}" for op, n in sorted(sent.items())) or "none"
        print(f"  rank {r} sent {sum(sent.values())} bytes in attention collectives ({parts})")
    print("verify: PASS" if result.ok else "verify: FAIL")
    return 0 if result.ok else 1


def run(args: argparse.Namespace) -> int:
    case = _case(args)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world_size
    case.validate(world)  # fail before any process starts
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        if under_torchrun:
            rank, world = init_from_env()
            _rank_main(rank, world, case, out_path)
            torch.distributed.destroy_process_group()
            if rank != 0:
                return 0
        else:
            spawn(_rank_main, world, case, out_path)
        with open(out_path) as f:
            data = json.load(f)
    result = CheckResult(data["errors"], data["bytes_sent"], data["tolerance"])
    return _report(case, world, result)
