"""`specforge-csbp export`: a trained CSBP drafter as a directory SGLang, vLLM (or transformers) loads.

    specforge-csbp export --to sglang|vllm|hf CHECKPOINT OUT [--target MODEL] [--dtype bfloat16] [--overwrite]

CHECKPOINT is a SpecForge run root (its `*-latest`), a `<run_id>-stepN` directory, a `training_state.pt`,
or a saved drafter directory. OUT gets config.json, model.safetensors and provenance.json; `--to sglang`
first replays SGLang's DFLASH / DFLASH2 loader on the export, `--to vllm` also vLLM's, and refuses to write
one it would misload. The weights take the target's dtype (config.json of `--target`) unless `--dtype` is
given; without either they stay as trained. The serve commands printed name the minimum server releases.
"""

from __future__ import annotations

import argparse
import os
import re

from ..preflight import check_outside, check_writable_dir

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="export a trained drafter for SGLang (--to sglang), vLLM (--to vllm) or transformers (--to hf)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--to", choices=("sglang", "vllm", "hf"), required=True)
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weight dtype of the export (default: the target's, from --target's config.json; "
                        "else as trained)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is an earlier export")
    p.add_argument(
        "--target", default=None,
        help="target model directory: its dtype is the export's default, its path goes into the serve command",
    )  # fmt: skip
    p.set_defaults(func=run)


_ROTATED = re.compile(r"(.+-step\d+|step_\d{8})$")  # SpecForge's and train-bdlm's rotated checkpoint dirs


def _check_out_location(checkpoint: str, out: str) -> None:
    """OUT must not live inside a checkpoint directory: the trainer's rotation deletes those."""
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
    # lazy: CLI start-up
    from ..export.writer import export_drafter, serve_commands

    _check_out_location(args.checkpoint, args.out)
    result = export_drafter(
        args.checkpoint, args.out, to=args.to, overwrite=args.overwrite, dtype=args.dtype, target=args.target
    )
    out = os.path.abspath(result.out)
    print(
        f"specforge-csbp export: {result.architecture} ({result.num_tensors} tensors, {result.dtype}) -> {out}"
    )
    print(f"  dtype from: {result.dtype_source}")
    if args.to != "hf":
        names = {"sglang": "SGLang", "vllm": "vLLM"}
        print(f"  loader contracts met: {', '.join(names[s] for s in result.servers)} ({result.contract})")
    print(f"  provenance: {os.path.join(out, 'provenance.json')}")
    if args.to != "hf":
        target = os.path.abspath(args.target) if args.target else "<TARGET_MODEL>"
        for server, command in serve_commands(out, result.config, target, result.servers).items():
            floor, line = command.split("\n")
            print(f"  serve with {'SGLang' if server == 'sglang' else 'vLLM'} ({floor.lstrip('# ')}):")
            print(f"    {line}")
    return 0
