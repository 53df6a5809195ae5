"""`specforge-csbp export`: a trained CSBP drafter as a directory SGLang (or transformers) loads.

    specforge-csbp export --to sglang CHECKPOINT OUT [--dtype bfloat16] [--overwrite] [--target MODEL]

CHECKPOINT is a SpecForge run root (its `*-latest`), a `<run_id>-stepN` directory, a `training_state.pt`,
or a saved drafter directory. OUT gets config.json, model.safetensors and provenance.json; `--to sglang`
first replays SGLang's DFLASH / DFLASH2 loader on the export and refuses to write one it would misload.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="export a trained drafter for SGLang (--to sglang) or transformers (--to hf)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--to", choices=("sglang", "hf"), required=True)
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weight dtype of the export (default: as trained)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is an earlier export")
    p.add_argument(
        "--target", default="<TARGET_MODEL>", help="target model path, for the printed serve command"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..export.writer import export_drafter, serve_command

    result = export_drafter(args.checkpoint, args.out, to=args.to, overwrite=args.overwrite, dtype=args.dtype)
    out = os.path.abspath(result.out)
    print(f"specforge-csbp export: {result.architecture} ({result.num_tensors} tensors) -> {out}")
    if result.contract:
        print(f"  SGLang loader contract: OK ({result.contract})")
    print(f"  provenance: {os.path.join(out, 'provenance.json')}")
    if args.to == "sglang":
        print("  serve with SGLang:")
        print(f"    {serve_command(out, result.block_size, args.target)}")
    return 0
