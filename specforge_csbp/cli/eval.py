"""`specforge-csbp eval`: acceptance length (tau) of a drafter against its target, by greedy speculative decoding.

    specforge-csbp eval --drafter PATH --target PATH (--prompts FILE.jsonl | --store STORE [--split eval])
        [--num-prompts N] [--max-new-tokens M] [--device cpu|cuda|auto] [--dtype auto|float32|bfloat16|...]
        [--untrained] [--prefill-chunk TOKENS] [--seed S] [--ignore-eos] [--bucket-edges 0,4K,16K,...]
        [--out FILE.json] [--plot FILE.png]

--drafter: a training output directory (its latest checkpoint), one checkpoint, or an export
(`specforge-csbp export --to sglang`). --target: a Hugging Face checkpoint directory. Prints a progress bar,
then `tau=... verify_steps=... generated=...`; --out writes the JSON (docs/eval.md lists its fields) and,
unless --plot names another file, the PNG of tau against context position beside it.
"""

from __future__ import annotations

import argparse
import os

from ..outputs import write_json_atomic
from ..preflight import check_writable_file

from ..eval.choices import DEVICES, DTYPES
from ..values import size_arg

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="acceptance length (tau) of a drafter against its target (greedy speculative decoding)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--drafter", required=True, help="training output dir, checkpoint dir, or export dir")
    p.add_argument("--target", required=True, help="Hugging Face checkpoint directory of the target")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="JSONL of {input_ids} | {text} | {messages} records")
    src.add_argument("--store", help="feature store directory (its samples' prompts)")
    p.add_argument("--split", default=None, help="held-out split of --store (default: every sample)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=size_arg("--max-new-tokens"), default=64)
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--untrained", action="store_true",
                   help="a freshly initialised drafter of the same config (seeded): the baseline")  # fmt: skip
    p.add_argument("--prefill-chunk", type=size_arg("--prefill-chunk", minimum=0), default=8192, help="prefill chunk in tokens (0: one pass)")
    p.add_argument("--seed", type=int, default=0, help="seed of --untrained and of a weightless target")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop a prompt at the target's EOS")
    p.add_argument("--bucket-edges", default=None,
                   help="context-position bucket starts, e.g. 0,256,1K (default 0,4K,16K,64K,256K; last is open)")
    p.add_argument("--out", default=None, help="JSON summary file")
    p.add_argument("--plot", default=None, help="PNG of tau against context position (default: beside --out)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # lazy: CLI start-up
    from ..eval.metrics import BUCKET_EDGES, parse_bucket_edges
    from ..eval.prompts import jsonl_prompts, store_prompts
    from ..eval.run import EvalOptions, evaluate, plot_tau, prepare, summary_line

    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1; got {args.num_prompts}")
    if args.split is not None and args.store is None:
        raise ValueError("--split: only with --store (a split of a feature store)")
    edges = BUCKET_EDGES if args.bucket_edges is None else parse_bucket_edges(args.bucket_edges)
    plot = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    for flag, path in (("--out", args.out), ("--plot", plot)):
        if path:  # before the decoding that fills them
            check_writable_file(path, flag)
    if args.plot and args.out and os.path.abspath(args.plot) == os.path.abspath(args.out):
        raise ValueError(f"--plot: {args.plot} is also --out; give the PNG its own file")
    options = EvalOptions(
        drafter=args.drafter, target=args.target, max_new_tokens=args.max_new_tokens, device=args.device,
        dtype=args.dtype, untrained=args.untrained, prefill_chunk=args.prefill_chunk, seed=args.seed,
        ignore_eos=args.ignore_eos, progress=not args.no_progress, bucket_edges=edges,
    )  # fmt: skip
    prepared = prepare(options)  # the drafter against the target, before any prompt is read
    if args.prompts is not None:
        prompts = jsonl_prompts(args.prompts, args.target, args.num_prompts)
    else:
        prompts = store_prompts(args.store, args.split, args.num_prompts, target=(args.target, prepared.target_config))
    summary = evaluate(options, prompts, prepared)
    summary["prompts"] = os.path.abspath(args.prompts or args.store)
    summary["split"] = args.split
    print(summary_line(summary))
    if args.out:
        write_json_atomic(args.out, summary)
        print(f"  json: {os.path.abspath(args.out)}")
    if plot:
        plot_tau(summary, plot)
        print(f"  plot: {os.path.abspath(plot)}")
    return 0
