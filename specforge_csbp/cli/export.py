"""`specforge-csbp export`: a trained CSBP drafter as a directory SGLang (or transformers) loads.

    specforge-csbp export --to sglang CHECKPOINT OUT [--dtype bfloat16] [--overwrite] [--target MODEL]

CHECKPOINT is a SpecForge run root (its `*-latest`), a `<run_id>-stepN` directory, a `training_state.pt`,
or a saved drafter directory. OUT gets config.json, model.safetensors and provenance.json; `--to sglang`
first replays SGLang's DFLASH / DFLASH2 loader on the export and refuses to write one it would misload.
"""

from __future__ import annotations

import argparse
import os
import re

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


_ROTATED = re.compile(r"(.+-step\d+|step_\d{8})$")  # SpecForge's and train-bdlm's rotated checkpoint dirs


def _check_out_location(checkpoint: str, out: str) -> None:
    """OUT must not live inside a checkpoint directory: the trainer's rotation deletes those."""
    from ..preflight import check_outside, check_writable_dir

    check_writable_dir(os.path.dirname(os.path.abspath(out)) or ".", "OUT")
    why = "which the trainer's checkpoint rotation deletes"
    if os.path.isdir(checkpoint) and _ROTATED.match(os.path.basename(os.path.realpath(checkpoint))):
        check_outside(out, "OUT", checkpoint, why)
    parent = os.path.realpath(os.path.abspath(out))
    while parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
        if _ROTATED.match(os.path.basename(parent)):
            check_outside(out, "OUT", parent, f"a checkpoint directory ({why})")


def run(args: argparse.Namespace) -> int:
    from ..export.writer import export_drafter, serve_command

    _check_out_location(args.checkpoint, args.out)
    try:
        result = export_drafter(args.checkpoint, args.out, to=args.to, overwrite=args.overwrite, dtype=args.dtype)
    except Exception as err:
        if type(err).__name__ != "SafetensorError":
            raise
        raise ValueError(f"CHECKPOINT: {args.checkpoint}: a weights file is not a complete safetensors file "
                         f"({str(err).splitlines()[0]}); re-copy or re-save it") from None  # fmt: skip
    out = os.path.abspath(result.out)
    print(f"specforge-csbp export: {result.architecture} ({result.num_tensors} tensors) -> {out}")
    if result.contract:
        print(f"  SGLang loader contract: OK ({result.contract})")
    print(f"  provenance: {os.path.join(out, 'provenance.json')}")
    if args.to == "sglang":
        print("  serve with SGLang:")
        print(f"    {serve_command(out, result.block_size, args.target)}")
    return 0
