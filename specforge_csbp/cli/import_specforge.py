"""`specforge-csbp import-specforge`: convert SpecForge 0.2.0 offline DFlash records into a feature store.

    specforge-csbp import-specforge cache/hidden_states/sharegpt_qwen3-8b store/ \\
        --draft-config configs/qwen3-8b-dflash.json --target Qwen/Qwen3-8B-dir

SpecForge's records hold no layer ids or hidden size: give the drafter config that drove the capture (or
`--target-layer-ids`) and the target (a config.json or a directory; only its config is read) or
`--hidden-size`. Sample i of the store is SpecForge's "offline:{i:08d}" (same sorted-path order).
"""

from __future__ import annotations

import argparse
import os

from ..preflight import check_writable_dir
from ..values import size_arg
from .capture import resolve_layer_ids

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import-specforge", help="import SpecForge offline DFlash records into a feature store"
    )
    p.add_argument("src", help="SpecForge --output-path (rows_*/data_*.ckpt[.gz]) or one record file")
    p.add_argument("out", help="feature store directory to create")
    p.add_argument("--target-layer-ids", help="comma-separated target layer ids the records were captured at")
    p.add_argument("--draft-config", help="drafter config JSON with dflash_config.target_layer_ids")
    p.add_argument("--target", help="target config.json or model directory (hidden size, name, config hash)")
    p.add_argument("--hidden-size", type=int, help="target hidden size (when --target is not given)")
    p.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32", "float64"), help="default: as stored"
    )
    p.add_argument("--max-length", type=size_arg("--max-length"), default=None, help="truncate like SpecForge's max_len")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # lazy: CLI start-up
    from ..data.manifest import TargetInfo, target_info
    from ..data.specforge_import import import_specforge_records
    from ..data.store import check_out_dir

    layer_ids = resolve_layer_ids(args)
    if (args.target is None) == (args.hidden_size is None):
        raise ValueError("target: give exactly one of --target or --hidden-size")
    if args.hidden_size is not None and args.hidden_size < 1:
        raise ValueError(f"--hidden-size must be >= 1, got {args.hidden_size}")
    check_writable_dir(args.out, "out")
    check_out_dir(args.out, args.overwrite)
    if args.target is not None:
        from transformers import AutoConfig

        if not os.path.exists(args.target):
            raise ValueError(f"--target: {args.target} does not exist")
        config = AutoConfig.from_pretrained(args.target)
        text = config.get_text_config()
        hidden_size = int(text.hidden_size)
        target = target_info(args.target, config)
    else:
        hidden_size = args.hidden_size
        target = TargetInfo(name="unknown (imported from SpecForge records)")
    manifest = import_specforge_records(
        args.src, args.out, target_layer_ids=layer_ids, hidden_size=hidden_size, target=target,
        dtype=args.dtype, max_length=args.max_length, overwrite=args.overwrite, progress=not args.no_progress,
    )  # fmt: skip
    tokens = sum(s.length for s in manifest.samples)
    print(
        f"import-specforge: wrote {len(manifest.samples)} samples ({tokens} tokens, {manifest.dtype}) "
        f"to {args.out}"
    )
    return 0
