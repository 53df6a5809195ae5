"""The study's target: a small full-attention Qwen3 trained on the synthetic documents, saved as a transformers
checkpoint so `specforge-csbp capture` and `eval` read it like any target.

Training is next-token cross-entropy over documents generated on the fly (documents.py), in phases of growing
length (short documents first: the local structure and the copy mechanism are learnt cheaply, the last phase
at the full context). It is resumable: `train_target` saves its state every `save_every` steps and when its
time budget runs out, and a second call continues from there; it writes the checkpoint once every phase is
done. Accuracy by dependency distance is the teacher-forced greedy accuracy (argmax of the next-token
logits == the token) at every dependent position of held-out documents: a query's values and a repeat's
copied tokens, bucketed by how far back their source lies.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch

from .documents import DocSpec, make_document

__all__ = ["TargetScale", "accuracy_by_distance", "target_config", "train_target"]

TRAIN_BASE = 0  # document indices of the target's training stream
HELD_OUT_BASE = 1_000_000  # held-out documents (accuracy, eval prompts)
TOKENIZER_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "tiny_qwen3")


@dataclass(frozen=True)
class TargetScale:
    """Shape and training schedule of the target; phases are (document length, steps, documents per step).

    The first `dense_steps` steps read documents dense in dependencies (`dense_doc` overrides the DocSpec:
    many more repeats and queries, half the filler uniform words that only a copy predicts): the copy
    mechanism gets a strong signal before the long phases, where dependencies are sparse and the local
    structure alone already explains most tokens (a target trained on those alone learns only the latter)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float
    max_position: int
    phases: tuple[tuple[int, int, int], ...]
    lr: float = 1e-3
    warmup: int = 50
    vocab_size: int = 512
    dense_steps: int = 0
    dense_doc: tuple[tuple[str, float], ...] = (
        ("p_repeat", 0.3), ("p_query", 0.1), ("p_record", 0.3), ("random_filler", 0.5))

    @property
    def total_steps(self) -> int:
        return sum(steps for _, steps, _ in self.phases)

    def phase_at(self, step: int) -> tuple[int, int]:
        """(document length, documents per step) of global step `step`."""
        for length, steps, batch in self.phases:
            if step < steps:
                return length, batch
            step -= steps
        return self.phases[-1][0], self.phases[-1][2]


def target_config(scale: TargetScale):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=scale.vocab_size, hidden_size=scale.hidden, intermediate_size=scale.intermediate,
        num_hidden_layers=scale.layers, num_attention_heads=scale.heads, num_key_value_heads=scale.kv_heads,
        head_dim=scale.hidden // scale.heads, max_position_embeddings=scale.max_position,
        rope_parameters={"rope_type": "default", "rope_theta": scale.rope_theta}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=2, use_sliding_window=False,
        architectures=["Qwen3ForCausalLM"],
    )  # fmt: skip


def _lr(scale: TargetScale, step: int) -> float:
    if step < scale.warmup:
        return scale.lr * (step + 1) / scale.warmup
    frac = (step - scale.warmup) / max(1, scale.total_steps - scale.warmup)
    return scale.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


class _Steps(torch.utils.data.Dataset):
    """Item `step` = the documents of that training step (a function of the step alone: resumable, and the same
    with any number of loader workers, which generate the documents off the training loop)."""

    def __init__(self, scale: TargetScale, spec: DocSpec) -> None:
        self.scale, self.spec = scale, spec

    def __len__(self) -> int:
        return self.scale.total_steps

    def __getitem__(self, step: int) -> torch.Tensor:
        length, batch = self.scale.phase_at(step)
        start, s = TRAIN_BASE, 0
        for plen, steps, pbatch in self.scale.phases:  # documents used by the steps before this one
            start += min(steps, max(0, step - s)) * pbatch
            s += steps
        dense = dict(self.scale.dense_doc) if step < self.scale.dense_steps else {}
        spec = DocSpec(**{**self.spec.__dict__, **dense, "length": length})
        return torch.from_numpy(np.stack([make_document(spec, start + i).tokens for i in range(batch)]))


def train_target(
    out_dir: str, scale: TargetScale, spec: DocSpec, *, device: str = "cpu", minutes: float | None = None,
    save_every: int = 200, workers: int = 0, log=print,
) -> bool:  # fmt: skip
    """Train (or resume) the target under `out_dir`; True when the checkpoint `out_dir/target` is written.
    `minutes` bounds this call's training time (the state is saved, the next call continues)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = os.path.join(out_dir, "target")
    if os.path.isfile(os.path.join(final, "config.json")) and os.path.isfile(os.path.join(final, "DONE")):
        log(f"target: {final} exists; skipped")
        return True
    os.makedirs(out_dir, exist_ok=True)
    state_path = os.path.join(out_dir, "train_state.pt")
    dev = torch.device(device)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(target_config(scale), dtype=torch.float32,
                                             attn_implementation="sdpa").to(dev)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=scale.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step = 0
    if os.path.isfile(state_path):
        state = torch.load(state_path, map_location=dev, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        log(f"target: resumed at step {step}/{scale.total_steps}")

    def save_state() -> None:
        tmp = state_path + ".tmp"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
        os.replace(tmp, state_path)

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    t0, model = time.monotonic(), model.train()
    loader = torch.utils.data.DataLoader(
        _Steps(scale, spec), batch_size=None, sampler=range(step, scale.total_steps), num_workers=workers,
        prefetch_factor=4 if workers else None, pin_memory=dev.type == "cuda",
    )  # fmt: skip
    for ids in loader:
        if minutes is not None and time.monotonic() - t0 > 60 * minutes:
            save_state()
            log(f"target: time budget spent at step {step}/{scale.total_steps}; state saved, run the stage again")
            return False
        length = ids.shape[1]
        ids = ids.to(dev, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = _lr(scale, step)
        with autocast:
            logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0 or step == scale.total_steps:
            log(f"target: step {step}/{scale.total_steps} len {length} loss {loss.item():.3f} "
                f"({time.monotonic() - t0:.0f} s)")  # fmt: skip
        if step % save_every == 0:
            save_state()
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.eval().save_pretrained(tmp)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(tmp)
    open(os.path.join(tmp, "DONE"), "w").close()
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    log(f"target: wrote {final}")
    return True


@torch.no_grad()
def accuracy_by_distance(
    model, spec: DocSpec, indices, edges: tuple[int, ...], *, device: str = "cpu"
) -> list[dict]:  # fmt: skip
    """Teacher-forced greedy accuracy at the dependent positions of documents `indices`, per kind ("query",
    "repeat") and dependency-distance bucket [edges[i], edges[i+1]) (the last bucket is open)."""
    hits: dict[tuple[str, int], list[int]] = {}
    dev = torch.device(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    for i in indices:
        d = make_document(spec, i)
        if not d.deps:
            continue
        with autocast:
            logits = model(input_ids=torch.from_numpy(d.tokens)[None].to(dev)).logits[0]
        pred = logits.argmax(-1).cpu().numpy()
        for pos, src, kind in d.deps:
            b = int(np.searchsorted(edges, pos - src, side="right")) - 1
            hits.setdefault((kind, b), []).append(int(pred[pos - 1] == d.tokens[pos]))
    rows = []
    for (kind, b), h in sorted(hits.items()):
        end = edges[b + 1] if b + 1 < len(edges) else None
        rows.append({"kind": kind, "start": edges[b], "end": end, "accuracy": sum(h) / len(h), "count": len(h)})
    return rows
