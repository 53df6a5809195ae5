"""`specforge-csbp eval`'s loop on one GPU: prefill time and verify steps per second at long context.

A Qwen3-shaped target with random weights (default benchmarks/configs/qwen3-1.7b.json, built on the device,
nothing downloaded or written but the records) and a matching random DFlash2 drafter (5 layers, its
target's hidden size, heads and vocabulary; target layers spread as SpecForge spreads them), one prompt
of random tokens per context, greedy speculative decoding of --max-new-tokens tokens (EOS ignored).
One record per context (workload "eval", design.md section 8), written as it is measured:

    context_len         prompt tokens          prefill_s          chunked prefill (features included)
    step_ms             ms per verify step     verify_steps_per_s draft + verify + commit, per second
    tokens_per_s        generated tokens / decode time            tau, verify_steps, generated_tokens
    peak_mem_gib        CUDA peak of the point (models included)

A random drafter accepts almost nothing (tau ~ 1): this measures the loop's speed and memory, not a
drafter's quality. --smoke runs the same code on CPU with the tiny quickstart config and short prompts.

    python benchmarks/eval_bench.py --contexts 32K,128K --max-new-tokens 64 --out $OUT/eval.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specforge_csbp.assets import TINY_TARGET_DIR  # noqa: E402
from specforge_csbp.bench.grid import parse_sizes  # noqa: E402
from specforge_csbp.bench.provenance import library_digest  # noqa: E402
from specforge_csbp.bench.records import BenchRecord, write_records  # noqa: E402
from specforge_csbp.eval import check_pair, run_prompts, summarize  # noqa: E402
from specforge_csbp.models.dflash import build_target_layer_ids, make_dflash_config  # noqa: E402
from specforge_csbp.models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel  # noqa: E402
from specforge_csbp.values import size_arg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "benchmarks/configs/qwen3-1.7b.json"), help="target config")
    p.add_argument("--contexts", default="32K,128K", help="prompt lengths (K = 1024)")
    p.add_argument("--max-new-tokens", type=size_arg("--max-new-tokens"), default=64)
    p.add_argument("--prefill-chunk", type=size_arg("--prefill-chunk", minimum=0), default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--dflash2", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSONL of records (appended)")
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny quickstart target, short prompts")
    args = p.parse_args(argv)
    if args.smoke:
        args.config, args.dtype = str(Path(TINY_TARGET_DIR) / "config.json"), "float32"
        args.contexts = args.contexts if args.contexts != "32K,128K" else "40,100"
        args.block_size, args.drafter_layers = min(args.block_size, 4), min(args.drafter_layers, 2)
        args.max_new_tokens, args.prefill_chunk = min(args.max_new_tokens, 8), min(args.prefill_chunk, 32)
    return args


def build_models(args, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    tcfg = AutoConfig.from_pretrained(args.config)
    tcfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(tcfg, dtype=dtype, attn_implementation="sdpa").eval()
    t = tcfg.get_text_config()
    layers = args.drafter_layers
    dcfg = make_dflash_config(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads, vocab_size=t.vocab_size,
        num_target_layers=t.num_hidden_layers,
        target_layer_ids=build_target_layer_ids(t.num_hidden_layers, layers),
        mask_token_id=t.vocab_size - 1, block_size=args.block_size, dflash2=args.dflash2,
        selector_rank=min(256, t.hidden_size), selector_top_k=16, max_position_embeddings=t.max_position_embeddings,
    )  # fmt: skip
    check_pair(dcfg, tcfg)
    with torch.device(device):
        drafter = (DFlash2DraftModel if args.dflash2 else DFlashDraftModel)(dcfg)
    return target, drafter.to(dtype).eval(), dcfg


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    contexts = parse_sizes(args.contexts)
    t0 = time.perf_counter()
    target, drafter, dcfg = build_models(args, device)
    print(f"models built in {time.perf_counter() - t0:.1f} s on {name}", flush=True)
    command = shlex.join(["python", os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    g = torch.Generator().manual_seed(args.seed)
    for L in contexts:
        prompt = torch.randint(0, int(dcfg.vocab_size) - 1, (L,), generator=g)
        base = {
            "workload": "eval", "mode": "reference", "world_size": 1, "context_len": L,
            "block_size": int(dcfg.draft_block_size), "device": name, "date": datetime.date.today().isoformat(),
            "command": command, "code": library_digest(), "target_config": os.path.basename(args.config),
            "architecture": dcfg.architecture, "drafter_layers": args.drafter_layers, "dtype": args.dtype,
            "max_new_tokens": args.max_new_tokens, "prefill_chunk": args.prefill_chunk, "attention": "sdpa",
        }  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            results = run_prompts(drafter, target, [prompt], args.max_new_tokens, prefill_chunk=args.prefill_chunk)
            s = summarize(results, int(dcfg.draft_block_size))
            steps, decode = s["verify_steps"], s["decode_s"]
            record = BenchRecord(
                **base, step_ms=1e3 * decode / steps if steps else None,
                tokens_per_s=s["generated_tokens"] / decode if decode else None,
                peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                prefill_s=s["prefill_s"], verify_steps_per_s=steps / decode if decode else None, tau=s["tau"],
                verify_steps=steps, generated_tokens=s["generated_tokens"], decode_s=decode,
            )  # fmt: skip
        except Exception as err:  # every failure becomes a record; the next context still runs
            oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
            record = BenchRecord(**base, status="oom" if oom else "error", error=str(err).splitlines()[0][:300])
        write_records(args.out, [record])
        print(json.dumps(record.model_dump(exclude_none=True)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
