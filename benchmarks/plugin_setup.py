#!/usr/bin/env python
"""Data for timing `specforge train --csbp` itself on a GPU machine that has no target model: a target
checkpoint holding only what the plugin reads of it (config, embeddings, LM head; random) and a feature
store of random target features, both shaped for a drafter config.

    python3 benchmarks/plugin_setup.py --draft-config drafter_configs/qwen3.6-27b-dflash2.json \\
        --context 128K --samples 6 --out /tmp/plugin
    python3 -m specforge_csbp train --csbp -c examples/long_context/qwen3.6-27b-dflash2-256k.yaml \\
        model.target_model_path=/tmp/plugin/target data.hidden_states_path=/tmp/plugin/store \\
        data.max_length=131072 output_dir=/tmp/plugin/output
    # the same drafter, step for step, in the benchmark (its per-step time beside the trainer's log):
    torchrun --nproc-per-node 2 benchmarks/drafter_bench.py --draft-config drafter_configs/qwen3.6-27b-dflash2.json \\
        --modes csbp --contexts 128K --anchors 512

    target/   config.json (a Qwen3 config: the drafter's hidden size and vocabulary, num_target_layers layers)
              model.safetensors (model.embed_tokens.weight, lm_head.weight only: SpecForge's
              TargetEmbeddingsAndHead loads exactly these two)
    store/    one sample per file, features [L, len(target_layer_ids) x hidden] ~ N(0, 1) in bf16, token ids
              uniform over the vocabulary but the mask token, loss mask 1 after a 64-token prompt

Random numbers are drawn on the GPU when there is one (a 128K sample is 3.4G features). The loss of such a run
means nothing; its step time and memory are what it is for (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from safetensors.torch import save_file
from tqdm import tqdm

from specforge_csbp.bench.grid import parse_size
from specforge_csbp.data.manifest import TargetInfo
from specforge_csbp.data.store import FeatureStoreWriter
from specforge_csbp.models.dflash.configuration import DFlashConfig

PROMPT_TOKENS = 64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft-config", required=True, help="drafter config.json (drafter_configs/)")
    p.add_argument("--context", default="128K", help="tokens per sample (64K, 1M, ...)")
    p.add_argument("--samples", type=int, default=6, help="samples in the store (one optimizer step each at dp 1)")
    p.add_argument("--out", required=True, help="directory: target/ and store/ are created in it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error(f"--samples must be >= 1; got {args.samples}")
    return args


def write_target(config: DFlashConfig, root: str, generator: torch.Generator, device: torch.device) -> str:
    """A Qwen3 target config for the drafter's target, with random embeddings and LM head only."""
    from transformers import Qwen3Config

    hidden, vocab = config.hidden_size, config.vocab_size
    target = Qwen3Config(
        hidden_size=hidden, vocab_size=vocab, num_hidden_layers=int(config.num_target_layers),
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, intermediate_size=config.intermediate_size, tie_word_embeddings=False,
        max_position_embeddings=config.max_position_embeddings,
    )  # fmt: skip
    os.makedirs(root, exist_ok=True)
    target.save_pretrained(root)
    weights = {
        name: (torch.randn(vocab, hidden, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()
        for name in ("model.embed_tokens.weight", "lm_head.weight")
    }
    save_file(weights, os.path.join(root, "model.safetensors"))
    return root


def random_sample(
    config: DFlashConfig, length: int, generator: torch.Generator, device: torch.device, dtype=torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [L] int64, loss_mask [L] int64, features [L, F x hidden] dtype) of one random sample on the
    CPU: ids uniform over the vocabulary but the mask token, loss mask 1 after a 64-token prompt."""
    if length <= PROMPT_TOKENS + 2:
        raise SystemExit(f"--context {length}: needs more than {PROMPT_TOKENS + 2} tokens")
    width = len(config.dflash["target_layer_ids"]) * config.hidden_size
    mask_token = config.dflash.get("mask_token_id")
    ids = torch.randint(0, config.vocab_size - 1, (length,), generator=generator, device=device).cpu()
    if mask_token is not None:  # the mask token is the drafter's, never a target token
        ids[ids >= int(mask_token)] += 1
    mask = torch.ones(length, dtype=torch.int64)
    mask[:PROMPT_TOKENS] = 0
    feats = torch.randn(length, width, generator=generator, device=device).to(dtype).cpu()
    return ids, mask, feats


def write_store(config: DFlashConfig, target_root: str, root: str, args, generator, device) -> None:
    layer_ids = list(config.dflash["target_layer_ids"])
    length = parse_size(args.context)
    info = TargetInfo(name=target_root, num_hidden_layers=int(config.num_target_layers))
    with FeatureStoreWriter(root, target=info, target_layer_ids=layer_ids, hidden_size=config.hidden_size,
                            dtype="bfloat16", overwrite=args.overwrite) as writer:  # fmt: skip
        for i in tqdm(range(args.samples), desc="store", unit="sample"):
            ids, mask, feats = random_sample(config, length, generator, device)
            writer.add(str(i), ids, mask, feats)
            del feats


def main(argv=None) -> int:
    args = parse_args(argv)
    config = DFlashConfig.from_json_file(args.draft_config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    target = write_target(config, os.path.join(args.out, "target"), generator, device)
    write_store(config, target, os.path.join(args.out, "store"), args, generator, device)
    print(f"plugin_setup: target {target}, store {os.path.join(args.out, 'store')} "
          f"({args.samples} x {parse_size(args.context)} tokens)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
