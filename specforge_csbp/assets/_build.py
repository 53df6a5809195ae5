"""Regenerate the tiny bundled assets: `python -m specforge_csbp.assets._build`.

Writes, next to this file:
  tiny_chat.jsonl          36 samples (24 chat conversations, 12 plain texts), about 60 to 1000 tokens
  tiny_qwen3/config.json   a 6-layer, hidden-64 Qwen3ForCausalLM config (random weights; nothing to download)
  tiny_qwen3/tokenizer.json, tokenizer_config.json
                           a byte-level BPE (vocab 512) trained on tiny_chat.jsonl, with Qwen-style chat
                           special tokens, a chat template that marks assistant turns with
                           {% generation %} (so transformers can return the assistant mask), and
                           mask token <|MASK|> (SGLang's default DFlash mask token)

Everything is deterministic (fixed seed, single-threaded BPE training), so rerunning reproduces the files.
The assets are meant for the CPU quickstart and the tests, not for learning anything.
"""

from __future__ import annotations

import json
import os
import random

__all__ = ["build_config", "build_dataset", "build_tokenizer", "main"]

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]

# A Qwen-style template. Assistant content and its <|im_end|> are inside {% generation %}, which is what
# SpecForge supervises too (the assistant span runs to the end-of-turn token).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- generation -%}{{ message['content'] + '<|im_end|>' }}{%- endgeneration -%}"
    "{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_TOPICS = {
    "python": [
        "A list comprehension builds a new list by applying an expression to every item of an iterable.",
        "Generators produce values lazily, so a pipeline of them never holds the whole dataset in memory.",
        "The with statement guarantees that a file is closed even when the block raises an exception.",
        "Dictionaries keep insertion order, which makes them a convenient ordered mapping since Python 3.7.",
        "A dataclass writes the constructor, the repr and the comparison methods from the annotated fields.",
        "Type hints are not enforced at run time, but a checker such as mypy reads them before it runs.",
        "Use pathlib to join paths; it handles separators on every operating system.",
    ],
    "attention": [
        "Attention compares every query with every key and mixes the values by the softmax of those scores.",
        "A causal mask lets position p attend only to positions that come before it or equal it.",
        "The log-sum-exp of the scores lets two partial attention results be merged exactly.",
        "Grouped-query attention shares one key and value head among several query heads to save memory.",
        "Rotary position embeddings rotate queries and keys by an angle that grows with the position.",
        "Context parallelism splits a long sequence across devices and exchanges keys and values.",
        "A zigzag layout gives every rank one early chunk and one late chunk, which balances causal work.",
    ],
    "cooking": [
        "Toast the spices in a dry pan until they smell nutty, then grind them while they are warm.",
        "Salt the pasta water generously; it is the only chance to season the pasta itself.",
        "Rest the dough for thirty minutes so the gluten relaxes and the sheet rolls out without shrinking.",
        "A squeeze of lemon at the end brightens a soup that tastes flat.",
        "Brown the onions slowly over low heat; hurrying them only burns the edges.",
        "Keep the oven door closed for the first twenty minutes or the cake will sink.",
    ],
    "math": [
        "The sum of the first n odd numbers is n squared, which a picture of nested squares makes obvious.",
        "A prime number has exactly two divisors: one and itself.",
        "The derivative of the exponential function is the function itself.",
        "Two vectors are orthogonal when their dot product is zero.",
        "The harmonic series grows without bound, but only as fast as the logarithm.",
        "A matrix is invertible exactly when its determinant is not zero.",
    ],
    "travel": [
        "Book the night train early; the sleeper cabins sell out weeks before the summer holidays.",
        "Carry a paper copy of your reservation in case your phone battery dies at the border.",
        "The old town is best explored on foot in the early morning before the tour groups arrive.",
        "Local buses are cheap, but check the timetable because the last one leaves before nine.",
        "Pack light: a small bag makes every staircase and every crowded platform easier.",
    ],
}

_QUESTIONS = {
    "python": [
        "How do I read a large file without loading it all?",
        "What does a dataclass give me?",
        "Why should I use pathlib?",
        "When is a generator better than a list?",
    ],
    "attention": [
        "What does the causal mask do?",
        "How are two partial attention results merged?",
        "Why use grouped-query attention?",
        "What is a zigzag layout for?",
    ],
    "cooking": [
        "How do I keep pasta from tasting bland?",
        "Why does my cake sink?",
        "How should I brown onions?",
        "What makes a soup taste brighter?",
    ],
    "math": [
        "Why is the sum of odd numbers a square?",
        "When is a matrix invertible?",
        "Does the harmonic series converge?",
        "What is special about the exponential function?",
    ],
    "travel": [
        "How early should I book a night train?",
        "What should I pack for a city trip?",
        "When is the old town least crowded?",
        "Are local buses worth it?",
    ],
}


def _paragraph(rng: random.Random, topic: str, n: int) -> str:
    pool = _TOPICS[topic]
    return " ".join(rng.choice(pool) for _ in range(n))


def build_dataset(rng: random.Random) -> list[dict]:
    """24 chat samples (1-3 turns, some with a system prompt) and 12 texts, of varied length."""
    topics = sorted(_TOPICS)
    samples: list[dict] = []
    sizes = [1, 2, 3, 4, 6, 8, 10, 12]  # sentences per assistant answer: short to long
    for i in range(24):
        topic = topics[i % len(topics)]
        messages = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": "You are a concise and careful assistant."})
        for turn in range(1 + i % 3):
            question = rng.choice(_QUESTIONS[topic])
            answer = _paragraph(rng, topic, sizes[(i + turn) % len(sizes)])
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        samples.append({"messages": messages})
    for i in range(12):
        topic = topics[(i * 2) % len(topics)]
        n = [2, 4, 6, 8, 10, 14, 18, 26][i % 8]
        samples.append({"text": _paragraph(rng, topic, n)})
    rng.shuffle(samples)
    return samples


def build_tokenizer(texts: list[str]):
    """Byte-level BPE with `VOCAB_SIZE` entries (specials included), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # single-threaded training is deterministic
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        mask_token="<|MASK|>", chat_template=CHAT_TEMPLATE, model_max_length=32768,
    )  # fmt: skip


def build_config(tokenizer) -> dict:
    """Tiny Qwen3 target: 6 layers so SpecForge's default layer selection (1 .. n-3) has room.

    Written by hand rather than by `Qwen3Config.to_dict()` so it stays readable by transformers 4.x
    (`rope_theta`) and 5.x (`rope_parameters`) alike.
    """
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": "float32",
    }


def _texts(samples: list[dict]) -> list[str]:
    out = []
    for s in samples:
        if "text" in s:
            out.append(s["text"])
        else:
            out.extend(m["content"] for m in s["messages"])
    return out


def main() -> None:
    samples = build_dataset(random.Random(0))
    with open(os.path.join(HERE, "tiny_chat.jsonl"), "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    target = os.path.join(HERE, "tiny_qwen3")
    os.makedirs(target, exist_ok=True)
    tokenizer = build_tokenizer(_texts(samples))
    tokenizer.save_pretrained(target)
    # transformers 5 writes the template to chat_template.jinja; keep it in tokenizer_config.json so the
    # wheel's package data (json/yaml/jsonl) carries it, and so older transformers read it too.
    jinja = os.path.join(target, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    cfg_path = os.path.join(target, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    # the class name every transformers release (4.x and 5.x) resolves to a tokenizers-backed tokenizer
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg.pop("backend", None)
    with open(cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(build_config(tokenizer), f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(samples)} samples and the tiny Qwen3 target to {HERE}")


if __name__ == "__main__":
    main()
