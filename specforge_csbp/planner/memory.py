"""Peak memory of one rank: one attention layer (checked against CPU measurements) and a training step.

Attention layer (forward + backward of `ShardedAttention` for one rank's plan): the largest of its phases,

    forward   local call (gathered buffer in flight) -> remote call (local out saved) -> LSE merge
    backward  merge -> remote call (both outs saved, two grads) -> local call (gathered-K/V grad in flight)

each phase = what is alive across it + its own working set: outputs and gradients [B, H, Nq, D], repeated
K/V for GQA, the gathered K/V buffer (P x segment rows), and with the dense backend three score-sized
[B, H, Nq, Nk] buffers (attention/dense.py: masked scores, scores - lse, probabilities; in backward
probabilities, dP - rowsum, dS) plus the cached boolean masks. FlexAttention has no score-sized buffer.

tests/planner/test_attention_memory_vs_measured.py compares this with the peak of torch's CPU allocations (profiler) on gloo
ranks; the stated tolerance is 5% (measured: within 3.2%).

Training step: see `bdlm_step_memory` and `drafter_step_memory` (GPU, bf16, FlexAttention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .pairs import DrafterRankStats, RankStats
from .shapes import ModelShape

__all__ = [
    "ATTENTION_BACKENDS",
    "MemoryBreakdown",
    "attention_bytes_per_row",
    "attention_layer_peak_bytes",
    "bdlm_step_memory",
    "decoder_layer_bytes_per_row",
    "drafter_step_memory",
    "layer_activation_bytes_per_row",
    "loss_chunk_bytes",
]

ATTENTION_BACKENDS = ("flex", "dense")
GiB = float(1 << 30)


def attention_layer_peak_bytes(
    stats: RankStats,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    elem_bytes: int,
    acc_bytes: int,
    backend: str,
    schedule: str = "fused",
) -> int:
    """Peak bytes one rank allocates for forward + backward of one attention layer (inputs excluded).

    The maximum over the phases of `ShardedAttention`, each phase = what is alive across it + its own
    working set. Schedule "fused": the gathered K/V, their concatenation with the local K/V, one call.
    Schedule "overlap": local call, one remote call per other rank's segment, LSE merges; backward in reverse.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {backend!r}")
    if schedule not in ("fused", "overlap"):
        raise ValueError(f"schedule must be one of fused, overlap; got {schedule!r}")
    B, H, Hk, D = batch, heads, kv_heads, head_dim
    nq, nk_l, nk_r = stats.q_rows, stats.kv_rows, stats.gathered_rows
    dense = backend == "dense"
    out = B * H * nq * D * acc_bytes  # one [B, H, Nq, D] output / gradient
    lse = B * H * nq * acc_bytes

    def scores(nk: int) -> int:  # attention/dense.py: three score-sized buffers at its peak
        return 3 * B * H * nq * nk * acc_bytes if dense else 0

    def rep(nk: int) -> int:  # dense: repeat_interleave copy of K (or V) for GQA (a copy even for MHA)
        return B * H * nk * D * acc_bytes if dense else 0

    mask_l = nq * nk_l if dense else 0
    if not nk_r:  # no communication: one call, forward then backward
        fwd = mask_l + scores(nk_l) + rep(nk_l)
        bwd = mask_l + out + lse + out + scores(nk_l) + 2 * rep(nk_l)  # saved out, dout, K and V copies
        return max(fwd, bwd)
    gathered = 2 * B * Hk * nk_r * D * elem_bytes  # K and V of every rank's shared rows
    if schedule == "fused":
        nk = nk_l + nk_r - stats.gather_width  # the own (all-PAD) segment is left out of the call
        mask = nq * nk if dense else 0
        cat = 2 * B * Hk * nk * D * elem_bytes  # [local ++ other ranks' segments] K and V, saved for backward
        fwd = mask + gathered + cat + scores(nk) + rep(nk)
        bwd = mask + cat + out + lse + out + scores(nk) + 2 * rep(nk)
        return max(fwd, bwd)
    # one remote call per other rank, over that rank's segment (gather_width rows), one after another; the
    # merged partials of earlier calls stay saved for backward
    w, calls = stats.gather_width, stats.world - 1
    chain = (calls - 1) * (2 * out + 2 * lse)
    mask_r = calls * nq * w if dense else 0  # every remote call's dense mask is cached on its visibility
    fwd_l = mask_l + gathered + scores(nk_l) + rep(nk_l)
    fwd_r = mask_l + mask_r + gathered + chain + out + lse + scores(w) + rep(w)
    merge = mask_l + mask_r + gathered + chain + 5 * out + 4 * lse  # out_a, out_b, merged, 2 grads
    # + the gathered buffer's gradient, stacked from the segments' gradients (collectives.py segments())
    bwd_r = mask_l + mask_r + 2 * gathered + chain + 4 * out + 2 * lse + scores(w) + 2 * rep(w)
    bwd_l = mask_l + gathered + 3 * out + 2 * lse + scores(nk_l) + 2 * rep(nk_l)  # + gathered-K/V grad
    return max(fwd_l, fwd_r, merge, bwd_r, bwd_l)


def _norm_bytes(shape: ModelShape, width: int, in_bytes: int) -> int:
    """What one transformers RMSNorm over `width` saves per row (it computes in fp32 whatever its input):
    the fp32 input (a copy unless the input is fp32), the fp32 1/rms, and the normalised value its weight
    multiplies - cast back to the input dtype ("llama": Llama, Qwen) or kept in fp32 ("gemma": (1 + w))."""
    return 4 * width + 4 + (4 if shape.norm_kind == "gemma" else in_bytes) * width


def attention_bytes_per_row(shape: ModelShape, *, gemm_bytes: int, gqa_packed: bool = False) -> int:
    """Bytes one token row of a decoder layer's attention saves for backward, as FlexAttention saves it:
    q, k, v, out in the GEMM dtype and the fp32 log-sum-exp, e (2 H + 2 Hk) D + 4 H; with GQA packing
    (flex, H > Hk; attention/packing.py) out is copied back to [B, H, N, D] for o_proj: + e H D. Also what a
    checkpointed layer keeps when its attention is not recomputed (models/bdlm/routing.py)."""
    H, Hk, hd, e = shape.heads, shape.kv_heads, shape.head_dim, gemm_bytes
    return e * (2 * H + 2 * Hk) * hd + 4 * H + (e * H * hd if gqa_packed and H > Hk else 0)


def decoder_layer_bytes_per_row(
    shape: ModelShape, layer: int = 0, *, gemm_bytes: int, residual_bytes: int, gqa_packed: bool = False
) -> int:
    """Bytes one token row of a transformers decoder layer saves for backward (no checkpointing), the
    attention kernel counted as FlexAttention saves it (q, k, v, out in the GEMM dtype, fp32 log-sum-exp).

    gemm_bytes: the projections' output dtype (the autocast dtype, else the weights'); residual_bytes: the
    hidden stream's (the weights' dtype: fp32 under autocast). The layer, per row (h hidden, H / Hk heads of
    D, I MLP width; e = gemm_bytes, r = residual_bytes; norm(w) = `_norm_bytes`):

        hidden norms   2 x norm(h) on the layer input and the residual sum (Llama, Qwen); Gemma 3: 4, the
                       post-attention / post-MLP ones on the e-byte sublayer outputs
        GEMM inputs    under autocast (r != e) every projection casts its r-byte input itself:
                       q, k, v, gate, up (MoE: router) -> 5 e h; else one e h per norm output: 2 e h
        q/k norms      norm(D) per head of q and k (Qwen3, Gemma 3) on the e-byte projections
        attention      q, k, v, out (e) and lse (fp32): e (2 H + 2 Hk) D + 4 H; GQA packing (flex, H > Hk;
                       attention/packing.py) copies out back to [B, H, N, D] for o_proj: + e H D
        dense MLP      gate, up, act(gate), act(gate) * up: 4 e I
        MoE MLP        router softmax (fp32) 4 E, top-k index / weights / sums 32 k + 4 k + 4 + e k, and
                       the k expert rows in the weights' dtype (transformers' grouped_mm casts to it):
                       gathered input, gate|up, act, product, output: r k (2 h + 4 I_e)

    The rotary cos / sin are shared by every layer; Gemma's embedding scale saves nothing per row.
    tests/planner/test_decoder_layer_memory_vs_measured.py measures every supported family's layer with
    saved-tensor hooks on the CPU under bf16 autocast over fp32 weights and without autocast."""
    h, hd, H, Hk = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads
    e, r = gemm_bytes, residual_bytes
    norms = 2 * _norm_bytes(shape, h, r)
    if shape.hidden_norms == 4:  # Gemma 3: post-attention and post-feedforward norms on sublayer outputs
        norms += 2 * _norm_bytes(shape, h, e)
    sparse = shape.is_sparse(layer)
    gemm_in = (4 if sparse else 5) * e * h if r != e else 2 * e * h  # MoE: the experts take the r-byte rows
    qk = _norm_bytes(shape, H * hd, e) + _norm_bytes(shape, Hk * hd, e) + 4 * (H + Hk) - 8 if shape.qk_norm else 0
    attn = attention_bytes_per_row(shape, gemm_bytes=e, gqa_packed=gqa_packed)
    if sparse:
        k, E = shape.experts_per_token, shape.experts
        mlp = 4 * E + 36 * k + 4 + e * k + r * k * (2 * h + 4 * shape.expert_intermediate)
    else:
        mlp = 4 * e * shape.intermediate
    return norms + gemm_in + qk + attn + mlp


def layer_activation_bytes_per_row(shape: ModelShape, elem_bytes: int) -> int:
    """Bytes one token row keeps for the backward of one DFlash draft layer (no checkpointing): RMSNorm inputs
    and outputs (4h), q/k/v before and after q/k-norm + RoPE and the attention output (3H + 3Hk) D, SwiGLU
    gate, up, act(gate), product (4I); fp32 log-sum-exp per head.

    DFlash2 (models/dflash/conv.py) wraps each of the two sublayers in a grouped dynamic convolution whose
    products save their operands: the broadcast coefficients (taps x h) of the input and of the output
    convolution, the convolved input (the sublayer's new GEMM input, h) and the sublayer output (h):
    2 x (2 taps + 2) h per layer."""
    h, hd = shape.hidden, shape.head_dim
    conv = 2 * (2 * shape.conv_taps + 2) * h if shape.conv_taps else 0
    return elem_bytes * (4 * h + 3 * (shape.heads + shape.kv_heads) * hd + 4 * shape.intermediate + conv) + 4 * shape.heads


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak GiB of one rank by component."""

    states: float  # weights, gradients, optimizer states (trainable) + frozen weights
    activations: float  # saved for backward (checkpointed layer inputs + one layer's working set)
    buffers: float  # gathered K/V buffers and their gradients, drafter context features
    loss: float  # chunked cross-entropy logits (fp32) and their gradient
    reserved: float  # not available to tensors (CUDA context, allocator slack), from the profile

    @property
    def total(self) -> float:
        return self.states + self.activations + self.buffers + self.loss + self.reserved


def bdlm_step_memory(
    shape: ModelShape,
    s: RankStats,
    *,
    views: int,
    elem_bytes: int,
    state_bytes: float,
    checkpointing: bool,
    ce_chunk: int,
    reserved_gib: float,
    residual_bytes: int | None = None,
    gqa_packed: bool | Sequence[bool] = True,
    attention_kept: bool = False,
) -> MemoryBreakdown:
    """One rank of a full-BDLM step (SFT / conversion): every layer runs on the rank's 2L rows.

    residual_bytes: bytes per element of the residual stream between layers (the checkpointed layer
    inputs) - 4 under autocast with fp32 weights (embeddings, norms and residual adds stay fp32; only the
    GEMMs run in bf16), else elem_bytes. Each layer saves `decoder_layer_bytes_per_row` per row;
    gqa_packed: count FlexAttention's GQA packing copy, for every layer or per layer (it packs whenever that
    visits fewer tiles, e.g. every layer of the Gemma-3-1B recipe at 32K, none of Qwen3-1.7B's at 64K;
    counting it where a layer does not pack is e H D per row over). attention_kept (with checkpointing):
    every checkpointed layer also keeps its attention's saved tensors and gathered K/V (no attention in the
    recompute, models/bdlm/routing.py)."""
    rows = views * s.q_rows
    res = residual_bytes or elem_bytes
    packed = [gqa_packed] * shape.layers if isinstance(gqa_packed, bool) else list(gqa_packed)
    if len(packed) != shape.layers:
        raise ValueError(f"gqa_packed: one flag per layer ({shape.layers}); got {len(packed)}")
    per_layer = [decoder_layer_bytes_per_row(shape, i, gemm_bytes=elem_bytes, residual_bytes=res,
                                             gqa_packed=packed[i]) for i in range(shape.layers)]  # fmt: skip
    kv_row = 2 * shape.kv_heads * shape.head_dim * elem_bytes
    if checkpointing:  # layer inputs kept; one layer's activations live while it is recomputed
        act = shape.layers * rows * shape.hidden * res + rows * max(per_layer)
        buf = views * s.gathered_rows * kv_row * 2  # one layer's gathered K/V + gradient
        if attention_kept:  # + every layer's attention tensors and gathered K/V
            act += rows * sum(attention_bytes_per_row(shape, gemm_bytes=elem_bytes, gqa_packed=p) for p in packed)
            buf = views * s.gathered_rows * kv_row * (shape.layers + 1)
    else:
        act = rows * sum(per_layer)
        buf = views * s.gathered_rows * kv_row * (shape.layers + 1)  # every layer keeps its buffer
    loss = 2 * min(ce_chunk, max(views * s.noisy_rows, 1)) * shape.vocab * 4
    return MemoryBreakdown(
        states=shape.trainable_params * state_bytes / GiB, activations=act / GiB, buffers=buf / GiB,
        loss=loss / GiB, reserved=reserved_gib,
    )  # fmt: skip


def loss_chunk_bytes(vocab: int, chunk_rows: int, elem_bytes: int, top_k: int) -> int:
    """Peak bytes of one chunk of `linear_ce_topk` with its arithmetic compiled (objectives/ce_chunk.py, the
    GPU path): the logits in the GEMM dtype and their gradient in it, plus, for a top-k with k > 1, the fp32
    copy the top-k reads (forward) / the fp32 gradient the top-k scatter needs (backward)."""
    return chunk_rows * vocab * (2 * elem_bytes + (4 if top_k > 1 else 0))


def drafter_step_memory(
    shape: ModelShape,
    per_window: dict[int | None, DrafterRankStats],
    *,
    elem_bytes: int,
    state_bytes: float,
    ce_chunk: int,
    reserved_gib: float,
    kept_logits: int = 0,
) -> MemoryBreakdown:
    """One rank of a DFlash drafter step (no activation checkpointing: the drafter is a few layers).

    Context rows, per layer (models/dflash/modeling.py `context_kv` and the attention call): the fused K|V
    projection output (k-norm saves its input, a view that keeps the whole output alive) and the K/V of
    `cat([context, block])` that the attention saves: 2 x (2 Hk D) per row. Sliding-window layer types
    select their context rows once (`index_select`, saved as the K/V projection's input): h per row - an
    upper bound, since a type whose windows leave out little of the shard keeps it whole, without the copy
    (models/dflash/sharding.py `WHOLE_SHARD_MAX_LEFT_OUT`). Loss (`linear_ce_topk` with the per-chunk arithmetic compiled, as on a GPU: objectives/ce_chunk.py):
    the chunk's logits in the GEMM dtype and their gradient - in the GEMM dtype too, unless the selector's
    top-k (k > 1) needs an fp32 copy of the logits in forward and an fp32 gradient (the top-k scatter at
    full precision) cast back for the GEMM in backward: [chunk, V] x (2 e) or (e + 4 + e) bytes; plus
    `kept_logits` bytes when the logits are kept for backward. (Before the per-chunk arithmetic was compiled the chunk
    took three fp32 buffers, 12 bytes per element; older predictions used that.)

    The gather one layer ahead (the default, `LayerAttention.gather_ahead`) adds no term: layer i + 1's
    gathered rows are in flight while layer i runs, before layer i + 1's saved concatenation (counted in
    `gathered` for every layer) exists, so the forward never holds more than the sum here."""
    any_stats = next(iter(per_window.values()))
    ctx = max(st.context_rows for st in per_window.values())
    kv_row = 2 * shape.kv_heads * shape.head_dim * elem_bytes
    feats = ctx * shape.features * shape.target_hidden * elem_bytes
    fc = 2 * ctx * shape.hidden * elem_bytes  # fc output and its norm (the K/V projections' input)
    ctx_kv = 0
    gathered = 0
    for w in shape.windows:
        st = per_window[w]
        ctx_kv += st.context_rows * kv_row * 2  # K|V projection output + the concatenated K/V
        gathered += st.received_rows * kv_row  # the other ranks' rows in the saved concatenation
    selected = sum(per_window[w].context_rows for w in set(shape.windows) if w is not None)
    ctx_kv += selected * shape.hidden * elem_bytes
    biggest = max((st.received_rows + st.gather_width) * kv_row for st in per_window.values())
    blocks = shape.layers * any_stats.block_rows * layer_activation_bytes_per_row(shape, elem_bytes)
    loss = loss_chunk_bytes(shape.vocab, min(ce_chunk, max(any_stats.block_rows, 1)), elem_bytes, shape.selector_top_k)
    loss += kept_logits
    states = shape.trainable_params * state_bytes + shape.frozen_params * elem_bytes
    return MemoryBreakdown(
        states=states / GiB, activations=(fc + ctx_kv + blocks) / GiB, buffers=(feats + gathered + biggest) / GiB,
        loss=loss / GiB, reserved=reserved_gib,
    )  # fmt: skip
