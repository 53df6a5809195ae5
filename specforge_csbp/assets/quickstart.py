"""Build the quickstart's target and data: `python -m specforge_csbp.assets.quickstart --out runs/quickstart`.

Writes (each reused when its recipe is unchanged, so a rerun costs seconds):

    OUT/target/        the tiny Qwen3 trained on the synthetic grammar (`target.py`): a Hugging Face
                       checkpoint + tokenizer + build.json (the recipe and the final training loss)
    OUT/data/train.jsonl    grammar prompts with the TARGET'S OWN greedy answers (regenerated responses):
                            the drafter learns exactly what the target says
    OUT/data/prompts.jsonl  held-out grammar prompts (user turn only, another seed) for `eval`

Training data and evaluation prompts come from disjoint seeds of one distribution, as a user's own split
would.
"""

from __future__ import annotations

import argparse
import json
import os

from ..outputs import write_text_atomic
from ..progress import quiet_library_bars
from .grammar import conversations
from .target import TargetRecipe, build_target, greedy_answers

__all__ = ["build_data", "main"]

_TRAIN_SEED_OFFSET = 1_000  # grammar seeds: train prompts seed + 1000, eval prompts seed + 2000
_EVAL_SEED_OFFSET = 2_000


def _dump(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def build_data(
    target_dir: str, data_dir: str, *, seed: int, train_samples: int, eval_prompts: int, max_new_tokens: int
) -> tuple[str, str]:
    """(train.jsonl, prompts.jsonl) under `data_dir`; rewritten only when the target or the counts change."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(target_dir, "build.json")) as f:
        target_key = json.load(f)["key"]
    recipe = {"target": target_key, "seed": seed, "train_samples": train_samples,
              "eval_prompts": eval_prompts, "max_new_tokens": max_new_tokens}  # fmt: skip
    names = ("train.jsonl", "prompts.jsonl", "build.json")
    train, prompts, stamp = (os.path.join(data_dir, n) for n in names)
    if os.path.isfile(stamp) and os.path.isfile(train) and os.path.isfile(prompts):
        with open(stamp) as f:
            if json.load(f) == recipe:
                print(f"data: reusing {data_dir}")
                return train, prompts
    os.makedirs(data_dir, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(target_dir, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    asked = conversations(seed + _TRAIN_SEED_OFFSET, train_samples, with_answer=False)
    answered = greedy_answers(model, tokenizer, asked, max_new_tokens=max_new_tokens)
    write_text_atomic(train, _dump(answered))
    held_out = conversations(seed + _EVAL_SEED_OFFSET, eval_prompts, with_answer=False)
    write_text_atomic(prompts, _dump(held_out))
    write_text_atomic(stamp, json.dumps(recipe, indent=2) + "\n")
    print(f"data: {train_samples} samples answered by the target -> {train}; "
          f"{eval_prompts} held-out prompts -> {prompts}")  # fmt: skip
    return train, prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specforge_csbp.assets.quickstart", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", required=True, help="run directory (target/ and data/ are written under it)")
    p.add_argument("--seed", type=int, default=0, help="seed of the target, its data, the prompts")
    p.add_argument("--target-steps", type=int, default=TargetRecipe().steps, help="target training steps")
    p.add_argument("--train-samples", type=int, default=48, help="target-answered samples for the drafter")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for eval")
    p.add_argument("--max-new-tokens", type=int, default=160, help="longest target answer, in tokens")
    args = p.parse_args(argv)
    for name in ("target_steps", "train_samples", "eval_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    quiet_library_bars()  # transformers' save / load bars would leave carriage returns in a log
    recipe = TargetRecipe(seed=args.seed, steps=args.target_steps)
    target = build_target(os.path.join(args.out, "target"), recipe)
    build_data(
        target, os.path.join(args.out, "data"), seed=args.seed, train_samples=args.train_samples,
        eval_prompts=args.eval_prompts, max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
