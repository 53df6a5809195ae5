"""`specforge-csbp capture`: fill a feature store with a transformers target's hidden states over a jsonl.

    specforge-csbp capture --target Qwen3-8B/ --data train.jsonl --out store/ \\
        --draft-config drafter.json --max-length 131072 --dtype bfloat16 --device cuda --chunk-size 16384

`--data` records are chat (`messages`), `text`, or token ids (`input_ids`, used as they are).
`--target` is a checkpoint directory, or a config (config.json / a directory without weights) for a random
target seeded by `--seed` (the tiny quickstart target; `--save-target DIR` writes those weights so training
loads the same ones). Target layer ids come from `--target-layer-ids 1,3,5` or from the drafter config's
`dflash_config.target_layer_ids`; id k is the output of decoder layer k (SpecForge/SGLang convention).
Samples with no two consecutive supervised tokens are skipped (a DFlash anchor needs its next token).
`--eval-fraction F` holds out a deterministic share F of the samples (by sample id: data/split.py) in a second
store `OUT-eval`, for `data.eval_hidden_states_path`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass


from ..errors import load_json
from ..preflight import check_input_file, check_writable_dir
from ..progress import progress_bar
from ..values import parse_ints, size_arg

__all__ = ["layer_ids_from_draft_config", "parse_layer_ids", "register", "run"]

_DTYPES = ("float32", "bfloat16", "float16", "float64")


def parse_layer_ids(text: str) -> list[int]:
    return parse_ints(text, field="--target-layer-ids")


def layer_ids_from_draft_config(path: str) -> list[int]:
    cfg = load_json(path, "--draft-config")
    if not isinstance(cfg, dict):
        raise ValueError(f"--draft-config: {path} must hold a JSON object (a drafter config)")
    ids = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    if not ids:
        raise ValueError(f"--draft-config: {path} has no dflash_config.target_layer_ids")
    if not isinstance(ids, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise ValueError(f"--draft-config: {path}: dflash_config.target_layer_ids must be a list of integers, got {ids}")
    return list(ids)


def resolve_layer_ids(args: argparse.Namespace) -> list[int]:
    if (args.target_layer_ids is None) == (args.draft_config is None):
        raise ValueError("target layers: give exactly one of --target-layer-ids or --draft-config")
    if args.target_layer_ids is not None:
        return parse_layer_ids(args.target_layer_ids)
    return layer_ids_from_draft_config(args.draft_config)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="capture target hidden states into a feature store (DFlash drafters)")
    p.add_argument("--target", required=True, help="checkpoint dir, or config.json / weightless dir (random)")
    p.add_argument("--tokenizer", help="tokenizer dir (default: the target's directory)")
    p.add_argument("--data", required=True, help='jsonl: {"messages": [...]} or {"text": ...} per line')
    p.add_argument("--out", required=True, help="feature store directory to create")
    p.add_argument("--target-layer-ids", help="comma-separated target layer ids, e.g. 1,9,17,25,33")
    p.add_argument("--draft-config", help="drafter config JSON with dflash_config.target_layer_ids")
    p.add_argument("--max-length", type=size_arg("--max-length"), default=4096, help="truncate samples to this many tokens")
    p.add_argument("--num-samples", type=int, default=None, help="stop after this many stored samples")
    p.add_argument("--dtype", choices=_DTYPES, default="float32", help="target compute dtype")
    p.add_argument(
        "--store-dtype", choices=_DTYPES, default=None, help="feature dtype on disk (default --dtype)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--chunk-size", type=size_arg("--chunk-size", minimum=0), default=0, help="prefill chunk in tokens (0 = whole sample)")
    p.add_argument("--seed", type=int, default=0, help="seed of a random-weight target")
    p.add_argument("--save-target", help="also write the instantiated target (weights + tokenizer) here")
    p.add_argument("--attn-implementation", default="sdpa", help="transformers attention (sdpa, eager, ...)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store at --out")
    p.add_argument("--resume", action="store_true", help="append to the store at --out, skipping ids it has")
    p.add_argument("--eval-fraction", type=float, default=0.0, metavar="F",
                   help="hold out this share of samples (by sample id, deterministic) in the store OUT-eval, "
                   "for data.eval_hidden_states_path (default 0: none)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


class _Terminated(Exception):
    """SIGTERM during a capture: unwinds through the writer, which keeps the finished samples."""


def _record_sha256(record: dict, max_length: int) -> str:
    """A sample's identity for --resume: its record and the truncation, not its line number."""
    blob = json.dumps(record, sort_keys=True, ensure_ascii=False) + f"|max_length={max_length}"
    return hashlib.sha256(blob.encode()).hexdigest()


def _records(path: str):
    """(line, record, sample id) of every record (streamed: a large file is never held in memory)."""
    # lazy: CLI start-up
    from ..data.samples import read_jsonl, sample_id_of

    for line, record in read_jsonl(path, "--data"):
        yield line, record, sample_id_of(line, record)


def _scan(path: str) -> list[str]:
    """Every record of the data file before anything is loaded: JSON, shape and unique ids (one line each);
    returns the sample ids in file order."""
    seen: dict[str, int] = {}
    for line, record, sid in _records(path):
        if sum(k in record for k in ("messages", "text", "input_ids")) != 1:
            raise ValueError(
                f"--data: line {line + 1} of {path} needs exactly one of 'messages' (chat), 'text' or 'input_ids', "
                f"got keys {sorted(record)}"
            )
        if sid in seen:
            raise ValueError(
                f"--data: line {line + 1} of {path} repeats the sample id {sid!r} of line {seen[sid] + 1}; "
                "sample ids must be unique (drop the duplicate or give it its own \"id\")"
            )
        seen[sid] = line
    if not seen:
        raise ValueError(f"--data: {path} has no records (one JSON object per line)")
    return list(seen)


def _stored_ids(root: str) -> list[str]:
    """Sample ids a store at `root` already holds (complete or not), [] when there is none."""
    # lazy: CLI start-up
    from ..data.manifest import MANIFEST_NAME, StoreManifest

    path = os.path.join(root, MANIFEST_NAME)
    if not os.path.isfile(path):
        return []
    return [e.id for e in StoreManifest.model_validate(load_json(path, "--resume")).samples]


def _check_split(args: argparse.Namespace, ids: list[str], fraction: float) -> None:
    """The held-out split must hold something, and a resumed capture must keep the split it started with
    (a sample id's side is a pure function of the id and --eval-fraction, data/split.py): checked before
    the target loads, so no sample lands in both stores and no empty eval store is advertised."""
    # lazy: CLI start-up
    from ..data.split import eval_store_dir, held_out

    if fraction > 0:
        considered, kept = [], 0
        for sid in ids:  # --num-samples counts the training store's samples: the ids capture would reach
            considered.append(sid)
            kept += not held_out(sid, fraction)
            if args.num_samples is not None and kept >= args.num_samples:
                break
        if not any(held_out(sid, fraction) for sid in considered):
            raise ValueError(
                f"--eval-fraction: {fraction} holds out none of the {len(considered)} samples of {args.data} this "
                f"capture reaches (the split is by sample id); raise it (about {1 / len(considered):.2g} or more "
                "holds one out) or leave it out"
            )
    if not args.resume:
        return
    for root, held in ((args.out, False), (eval_store_dir(args.out), True)):
        for sid in _stored_ids(root):
            if held_out(sid, fraction) != held:
                side = "held out for eval" if held else "kept for training"
                raise ValueError(
                    f"--resume: the store at {root} has sample {sid!r} {side}, which --eval-fraction {fraction} "
                    "would put in the other store; resume with the --eval-fraction the capture started with, or "
                    "recapture with --overwrite"
                )


def _load_tokenizer(path: str, given: bool):
    from transformers import AutoTokenizer

    field = "--tokenizer" if given else "--target (its tokenizer; or give --tokenizer)"
    if not os.path.exists(path):
        raise ValueError(f"{field}: {path} does not exist")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{field}: cannot load a tokenizer from {path} ({str(err).splitlines()[0]})") from None


def _check_args(args: argparse.Namespace) -> tuple[list[int], float, str | None]:
    """Every check that needs no model, before the (possibly large) target loads: (layer ids, eval
    fraction, OUT-eval or None)."""
    import torch

    # lazy: CLI start-up
    from ..compat import check_not_a_drafter
    from ..data.split import check_eval_fraction, eval_store_dir
    from ..data.store import check_out_dir

    layer_ids = resolve_layer_ids(args)
    fraction = check_eval_fraction(args.eval_fraction)
    eval_out = eval_store_dir(args.out) if fraction > 0 else None
    if args.max_length < 1:
        raise ValueError(f"--max-length must be >= 1, got {args.max_length}")
    if args.num_samples is not None and args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.chunk_size < 0:
        raise ValueError(f"--chunk-size must be >= 0 (0 = whole sample), got {args.chunk_size}")
    check_input_file(args.data, "--data")
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite: give at most one")
    check_writable_dir(args.out, "--out")
    if args.save_target:
        check_writable_dir(args.save_target, "--save-target")
    for out in (args.out, eval_out) if eval_out else (args.out,):
        if not (args.resume and os.path.isfile(os.path.join(out, "manifest.json"))):
            check_out_dir(out, args.overwrite)  # fail before loading a large target
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device: {args.device} requested but torch.cuda.is_available() is False")
    if not os.path.exists(args.target):
        raise ValueError(f"--target: {args.target} does not exist (give a checkpoint directory or a config.json)")
    check_not_a_drafter(args.target, "--target")
    return layer_ids, fraction, eval_out


@dataclass
class _Counts:
    """What one capture did: samples stored in the training store, skipped, already present (--resume),
    held out (OUT-eval), and the training store's new tokens."""

    stored: int = 0
    skipped: int = 0
    present: int = 0
    held: int = 0
    tokens: int = 0


def _capture(args, bar, writer, eval_writer, fraction: float, tokenizer, features, vocab: int,
             counts: _Counts) -> None:  # fmt: skip
    """Tokenize each record of `bar` (the progress bar over `_records`), run the target and add the sample to
    its store (the eval store when held out); --resume skips a sample already stored under the same id and
    refuses one stored from another record. `counts` is updated in place, so SIGTERM leaves it current."""
    # lazy: CLI start-up
    from ..data.samples import has_consecutive_supervised, tokenize_sample
    from ..data.split import held_out

    for line, record, sid in bar:
        where = f"line {line + 1} of {args.data}"
        identity = _record_sha256(record, args.max_length)
        target = eval_writer if eval_writer is not None and held_out(sid, fraction) else writer
        if target.has(sid):
            old = target.entry(sid).record_sha256
            if old is not None and old != identity:
                raise ValueError(
                    f"--resume: {where} (sample id {sid!r}) is not the record the store at {target.root} "
                    "captured under that id (another data file or --max-length); use --overwrite or a "
                    "new --out"
                )
            counts.present += 1  # --resume: captured by an earlier run
            continue
        input_ids, loss_mask = tokenize_sample(tokenizer, record, max_length=args.max_length, where=where)
        if int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids: {where} has token id {int(input_ids.max())}, outside the target's "
                             f"vocabulary [0, {vocab})")  # fmt: skip
        if not has_consecutive_supervised(loss_mask):
            counts.skipped += 1
            continue
        target.add(sid, input_ids, loss_mask, features(input_ids), record_sha256=identity)
        if target is not writer:  # held out: --num-samples counts the training store's samples
            counts.held += 1
            continue
        counts.stored, counts.tokens = counts.stored + 1, counts.tokens + int(input_ids.numel())
        bar.set_postfix(tokens=str(counts.tokens), skipped=counts.skipped)
        if args.num_samples is not None and counts.stored >= args.num_samples:
            break


def run(args: argparse.Namespace) -> int:
    import torch

    # lazy: CLI start-up
    from ..data.capture import TargetFeatures, has_weights, load_target
    from ..data.store import FeatureStoreWriter

    layer_ids, fraction, eval_out = _check_args(args)
    ids = _scan(args.data)
    total = len(ids)
    _check_split(args, ids, fraction)
    tok_path = args.tokenizer or (args.target if os.path.isdir(args.target) else os.path.dirname(args.target))
    tokenizer = _load_tokenizer(tok_path, args.tokenizer is not None)
    model, info = load_target(
        args.target, dtype=args.dtype, device=args.device, seed=args.seed,
        attn_implementation=args.attn_implementation,
    )  # fmt: skip
    features = TargetFeatures(
        model, layer_ids, chunk_size=args.chunk_size, out_dtype=getattr(torch, args.store_dtype or args.dtype)
    )
    kind = "checkpoint" if has_weights(args.target) else f"random weights, seed {args.seed}"
    print(f"capture: target {args.target} ({kind}), layers {layer_ids}, hidden {features.hidden_size}, "
          f"{args.dtype} on {args.device}")  # fmt: skip
    if args.save_target:
        from ..data.fingerprint import weights_fingerprint  # lazy: reads the weights just written

        model.save_pretrained(args.save_target)
        tokenizer.save_pretrained(args.save_target)
        if info.weights_sha256 is None:  # random weights: training names the saved copy as its target
            info.weights_sha256 = weights_fingerprint(args.save_target)
    vocab = int(model.config.get_text_config().vocab_size)
    counts = _Counts()

    def writer_for(out: str) -> FeatureStoreWriter:
        return FeatureStoreWriter(
            out, target=info, target_layer_ids=layer_ids, hidden_size=features.hidden_size,
            dtype=args.store_dtype or args.dtype, overwrite=args.overwrite, resume=args.resume,
        )  # fmt: skip

    def terminate(signum, _frame):
        raise _Terminated(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if main_thread else None
    try:
        with contextlib.ExitStack() as stack:
            writer = stack.enter_context(writer_for(args.out))
            eval_writer = stack.enter_context(writer_for(eval_out)) if eval_out else None
            bar = stack.enter_context(  # closed on the way out: its last line reaches a log file
                progress_bar(
                    _records(args.data), total=total, desc="capture", unit="sample", disable=args.no_progress
                )
            )
            _capture(args, bar, writer, eval_writer, fraction, tokenizer, features, vocab, counts)
            if counts.stored + counts.present + counts.held == 0:
                raise ValueError(
                    f"--data: none of the {total} records of {args.data} has two consecutive supervised "
                    f"tokens within --max-length {args.max_length} (chat records need an assistant turn); "
                    "nothing to capture"
                )
    except _Terminated:
        print(f"capture: stopped by SIGTERM after {counts.stored} new samples; the store at {args.out} is marked "
              "incomplete: rerun with --resume to finish it, or --overwrite to replace it",
              file=sys.stderr)  # fmt: skip
        return 128 + signal.SIGTERM
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    kept = f"; kept {counts.present} from an earlier run" if counts.present else ""
    print(f"capture: wrote {counts.stored} samples ({counts.tokens} tokens) to {args.out}; skipped {counts.skipped} "
          f"without two consecutive supervised tokens{kept}")  # fmt: skip
    if eval_out and counts.held == 0 and not _stored_ids(eval_out):
        raise ValueError(
            f"--eval-fraction: the store at {eval_out} holds no sample (every held-out record was skipped: no two "
            f"consecutive supervised tokens within --max-length {args.max_length}); do not train with it as "
            "data.eval_hidden_states_path - raise --eval-fraction or leave it out"
        )
    if eval_out:
        print(f"capture: held out {counts.held} samples (--eval-fraction {fraction}) in {eval_out}; "
              f"train with data.eval_hidden_states_path={eval_out}")  # fmt: skip
    return 0
