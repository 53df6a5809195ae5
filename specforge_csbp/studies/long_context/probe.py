"""Why a drafter stays on the unigram plateau: where its blocks look in the context, and where its gradient goes.

    context_attention(model, sample, anchors, near)   layer 0's draft-block queries over the context keys
                                                      each block sees (positions < anchor; the last W - 1 of
                                                      them in a sliding layer), exact float64 softmax:
                                                        entropy / log(keys seen)  1.0 = uniform over them
                                                        near mass                 attention on the `near`
                                                                                  context positions before the
                                                                                  anchor (uniform: near / seen)
    layer_grad_norms(model, samples, ...)             one reference step (models/dflash/step.drafter_step):
                                                      the gradient norm of fc, each layer and the final norm

Both run where the model is (CPU or a GPU); the attention's memory is heads x blocks x block_size x context
float64 values, so a probe at 64K takes a few dozen of the blocks (`anchors`).

Layer 0 only: its queries are the anchor's and MASK embeddings (through input_layernorm, q_proj, q_norm,
RoPE), so their attention needs no other layer; a later layer's queries depend on layer 0's output. The
block's own keys are left out: the question is how attention spreads over the context.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch

from ...models.dflash.features import DrafterSample
from ...models.dflash.modeling import DFlashDraftModel
from ...models.dflash.step import drafter_step
from ...objectives.dflash import DFlashObjective

__all__ = ["context_attention", "layer_grad_norms"]


@torch.no_grad()
def context_attention(
    model: DFlashDraftModel, sample: DrafterSample, anchors: torch.Tensor, embed_weight: torch.Tensor, near: int
) -> dict[str, float]:
    """Mean over blocks and heads of layer 0's context attention: normalised entropy and near mass (above)."""
    layer = model.layers[0]
    attn = layer.self_attn
    window = model.config.sliding_window if layer.layer_type == "sliding_attention" else None
    S, dt = model.block_size, torch.float64
    m = copy.deepcopy(model).to(dt)  # the oracle's precision, the caller's model untouched
    layer, attn = m.layers[0], m.layers[0].self_attn
    dev = m.fc.weight.device
    feats = sample.features if isinstance(sample.features, torch.Tensor) else sample.features(0, sample.seq_len)
    ctx = m.project_context(feats[None].to(dev, dt))  # [1, L, H]
    pos = torch.arange(sample.seq_len, device=dev)
    anchors = anchors.to(dev)
    k, _ = attn.context_kv(ctx, *m.rotary_emb(ctx, pos[None]))  # [1, KV, L, D]
    mask_id = int(model.config.dflash_config["mask_token_id"])
    block = torch.full((len(anchors), S), mask_id, dtype=torch.long, device=dev)
    block[:, 0] = sample.input_ids.to(dev)[anchors]
    x = embed_weight.to(dev, dt)[block.reshape(1, -1)]  # [1, N*S, H]
    qpos = (anchors[:, None] + torch.arange(S, device=dev)).reshape(1, -1)
    cos, sin = m.rotary_emb(x, qpos)
    h = layer.input_layernorm(x)
    q = attn.normed_rope_heads(attn.q_proj(h), attn.q_norm.weight, attn.q_norm.eps, attn.num_heads, cos, sin)
    k = k.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=1)  # GQA: each query head's kv head
    scores = (q @ k.transpose(-1, -2))[0] / math.sqrt(attn.head_dim)  # [heads, N*S, L]
    a = anchors.repeat_interleave(S)[None, :, None]  # each row's anchor
    seen = pos[None, None, :] < a
    if window is not None:
        seen &= pos[None, None, :] > a - window
    logp = torch.log_softmax(scores.masked_fill(~seen, -math.inf), dim=-1)
    p = logp.exp()
    count = seen.sum(-1).to(dt)
    entropy = -(p * logp.masked_fill(~seen, 0.0)).sum(-1)
    rows = count > 1  # a block with one context key has nothing to spread
    near_mass = (p * (pos[None, None, :] >= a - near)).sum(-1)
    return {
        "entropy_ratio": float((entropy[:, rows[0]] / count[:, rows[0]].log()).mean()),
        "near_mass": float(near_mass.mean()),
        "near_mass_uniform": float((torch.clamp(count, max=near) / count.clamp(min=1)).mean()),
        "keys_seen": float(count.mean()),
        "blocks": int(len(anchors)),
    }


def layer_grad_norms(
    model: DFlashDraftModel, samples: Sequence[DrafterSample], *, objective: DFlashObjective,
    head_weight: torch.Tensor, embed_weight: torch.Tensor, step: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Gradient norm per part of the drafter after one reference step over `samples` (gradients cleared
    before and after): fc (+ hidden_norm), layers.i, final_norm; and the loss of the step."""
    model.zero_grad(set_to_none=True)
    result = drafter_step(model, samples, objective=objective, mode="reference", head_weight=head_weight,
                          embed_weight=embed_weight, step=step)  # fmt: skip
    sums: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        part = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0]
        part = {"hidden_norm": "fc", "norm": "final_norm"}.get(part, part)
        sums[part] = sums.get(part, 0.0) + float(p.grad.double().pow(2).sum())
    model.zero_grad(set_to_none=True)
    return {"loss": result.loss, **{k: math.sqrt(v) for k, v in sorted(sums.items())}}
