"""The quickstart's target: the tiny Qwen3 (`tiny_qwen3/config.json`) trained on the synthetic grammar.

A random target has nothing a drafter can learn, so the quickstart first trains the tiny target for a
few seconds on CPU on conversations from `grammar.py` (an endless seeded stream, next-token loss on every
token), then writes the target's own greedy answers as the drafter's training data, the way drafters are
trained on regenerated responses: what the drafter sees in training is exactly what the target says when
`eval` verifies its guesses.

Deterministic: one seed fixes the initial weights, the data stream and the update order, and the build
runs single-threaded (a thread count changes how float sums are split), so the same seed and step count
give the same weight bytes on one machine. The result is cached: `build_target` returns at once when
`out_dir/build.json` records the same recipe, so rerunning the quickstart does not train the target again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Sequence

import torch

from ..outputs import staged_dir
from . import TINY_TARGET_DIR
from .grammar import TOPICS, conversations

__all__ = ["TargetRecipe", "build_target", "greedy_answers", "train_target"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_ROW = 128  # tokens per packed training row


class TargetRecipe:
    """What fixes the trained weights; its `key` is stored in build.json and compared on reuse."""

    def __init__(self, seed: int = 0, steps: int = 120, batch_size: int = 8, lr: float = 1e-2):
        if steps < 0 or batch_size < 1 or not lr > 0:
            raise ValueError(
                f"target recipe: need steps >= 0, batch_size >= 1, lr > 0; got {steps}, {batch_size}, {lr}"
            )
        self.seed, self.steps, self.batch_size, self.lr = seed, steps, batch_size, lr

    def as_dict(self) -> dict:
        return {
            "seed": self.seed, "steps": self.steps, "batch_size": self.batch_size, "lr": self.lr,
            "grammar": ["chain-to-end", *TOPICS], "row_tokens": _ROW,
            "config_sha256": _file_sha256("config.json"), "tokenizer_sha256": _file_sha256("tokenizer.json"),
            "version": 1,
        }  # fmt: skip

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _file_sha256(name: str) -> str:
    with open(os.path.join(TINY_TARGET_DIR, name), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _batch(tokenizer, samples: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels) of whole conversations, -100 on padding (held-out
    checks of a trained target; training itself packs rows, `_packed_rows`)."""
    rows = [
        list(tokenizer.apply_chat_template(s["messages"], tokenize=True, return_dict=True)["input_ids"])
        for s in samples
    ]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _packed_rows(tokenizer, seed: int, rows: int) -> torch.Tensor:
    """[rows, _ROW] token ids: rendered grammar conversations end to end, cut into rows (no padding).

    Rows start mid-conversation and attend across conversation ends; the end-of-turn token and the
    next <|im_start|> tell the model where one ends, as in packed pre-training."""
    rng = random.Random(seed)
    stream: list[int] = []
    while len(stream) < rows * _ROW:
        (sample,) = conversations(rng.getrandbits(32), 1)
        rendered = tokenizer.apply_chat_template(sample["messages"], tokenize=True, return_dict=True)
        stream += rendered["input_ids"]
    return torch.tensor(stream[: rows * _ROW]).view(rows, _ROW)


def train_target(recipe: TargetRecipe, *, log=print):
    """(model, tokenizer, final_loss): the tiny target trained per `recipe`, in float32 on CPU.

    Warm-up of 10 steps, then cosine decay to a tenth of `lr`; AdamW, gradient norm clipped at 1.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET_DIR)
    config = AutoConfig.from_pretrained(TINY_TARGET_DIR)
    config._attn_implementation = "sdpa"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
            warmup = min(10, recipe.steps)

            def lr_at(step: int) -> float:
                if step < warmup:
                    return (step + 1) / warmup
                frac = (step - warmup) / max(1, recipe.steps - warmup)
                return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))

            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
            rng_seed = random.Random(recipe.seed).getrandbits(32)
            loss = float("nan")
            start = time.perf_counter()
            for step in range(recipe.steps):
                ids = _packed_rows(tokenizer, rng_seed + step, recipe.batch_size)
                out = model(input_ids=ids, labels=ids)
                opt.zero_grad(set_to_none=True)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                loss = float(out.loss.detach())
                if log is not None and ((step + 1) % 40 == 0 or step + 1 == recipe.steps):
                    log(f"target: step {step + 1}/{recipe.steps} loss {loss:.3f} "
                        f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return model.eval(), tokenizer, loss


def build_target(out_dir: str, recipe: TargetRecipe | None = None, *, log=print) -> str:
    """Train the target into `out_dir` (a Hugging Face checkpoint + tokenizer + build.json), or reuse it
    when `out_dir/build.json` has the same recipe key. The directory appears whole or not at all."""
    recipe = recipe or TargetRecipe()
    stamp = os.path.join(out_dir, "build.json")
    if os.path.isfile(stamp):
        with open(stamp) as f:
            if json.load(f).get("key") == recipe.key:
                if log is not None:
                    log(f"target: reusing {out_dir} (same recipe {recipe.key})")
                return out_dir
    model, _, loss = train_target(recipe, log=log)
    with staged_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        for name in _TOKENIZER_FILES:
            shutil.copyfile(os.path.join(TINY_TARGET_DIR, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "build.json"), "w") as f:
            json.dump({"key": recipe.key, "recipe": recipe.as_dict(), "final_loss": loss}, f, indent=2)
            f.write("\n")
    return out_dir


@torch.no_grad()
def greedy_answers(
    model, tokenizer, prompts: Sequence[dict], *, max_new_tokens: int = 256, batch_size: int = 32
) -> list[dict]:
    """Each prompt ({"messages": [...]} ending with a user turn) plus the target's greedy assistant answer.

    Answers stop at the end-of-turn token or after `max_new_tokens`; the text is decoded without special
    tokens, so the chat template adds the end-of-turn token back when the sample is captured.
    """
    out: list[dict] = []
    eos = tokenizer.eos_token_id
    for lo in range(0, len(prompts), batch_size):
        chunk = prompts[lo : lo + batch_size]
        rows = [
            list(tokenizer.apply_chat_template(p["messages"], tokenize=True, add_generation_prompt=True,
                                               return_dict=True)["input_ids"])
            for p in chunk
        ]  # fmt: skip
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):  # left padding: every row's next token is at the same column
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
        )[:, width:]  # fmt: skip
        for p, row in zip(chunk, gen.tolist()):
            if eos in row:
                row = row[: row.index(eos)]
            text = tokenizer.decode(row, skip_special_tokens=True)
            out.append({"messages": [*p["messages"], {"role": "assistant", "content": text}]})
    return out
