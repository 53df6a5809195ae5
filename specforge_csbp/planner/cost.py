"""Step time, tokens/s and peak memory of one layout (DP x CP degree x mode), from exact per-rank work.

    step = max over ranks of (token-wise FLOPs / token rate + attention FLOPs / attention rate
                              + loss FLOPs / loss rate + exposed attention communication)
           + launch overhead + exposed gradient all-reduce + optimizer step

FLOP counts (multiply-add = 2; training = forward 1 + backward 2, attention backward 2.5, and one more
forward per recomputed layer under activation checkpointing):

    GEMMs       rows x 2 x layer params per layer                 (rows = the rank's token rows)
    attention   visible pairs x 4 H D per layer                   (pairs: pairs.py, exact for the layout)
    loss        supervised rows x 2 h V                           (chunked CE: forward, recompute, grads)
    drafter     + fc over the rank's context rows (F x h_t -> h), + context K/V projections per layer

Rates (profile.py; each optional rate falls back - token and loss rates to the GEMM rate, drafter attention
rates to attn_tflops - so older profiles predict as before):

    token rate      layer_tflops: a whole eager decoder layer (GEMMs + norms, RoPE, SwiGLU) - GEMMs,
                    drafter fc and context K/V projections; BDLM layers: bdlm_layer_tflops when the profile
                    measured this model's own layer at this precision and checkpointing (the key
                    rates.BDLMLayerSpec.key), else layer_tflops
    attention rate  attn_tflops (BDLM); drafter layers: attn_window_tflops (draft blocks over a sliding
                    window) / attn_draft_tflops (over the whole context), each falling back to attn_tflops
    loss rate       loss_tflops (trainable head: BDLM) / loss_topk_tflops (frozen head + top-k: drafter) /
                    loss_top1_tflops (frozen head, no selector: DFlash drafter)
    optimizer       trainable params x 28 bytes / adamw_gbps (Options.optimizer_step; none without a rate)

Communication per layer (bytes / measured bandwidth; ring: a rank sends (P-1) segments):

    csbp   all-gather of the clean (context) K/V shard, reduce-scatter of its gradient; overlapped with
           the rank's local attention (BDLM) or block-local work (drafter); sliding-window drafter layers
           receive only the windows their anchors need
    cp     BDLM: the same collectives over both copies; drafter: partial (out, lse) of every block
           exchanged for the LSE merge (not overlappable)
    bp/dp  no attention communication (BP recomputes the clean prefix / context its blocks need)
    all    gradient all-reduce over the G GPUs, overlapped with backward (exposed only beyond it)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .memory import MemoryBreakdown, bdlm_step_memory, drafter_step_memory
from .pairs import bdlm_rank_stats, drafter_rank_stats
from .profile import MachineProfile
from .rates import ADAMW_BYTES_PER_PARAM, BDLMLayerSpec
from .shapes import ModelShape

__all__ = ["WORKLOADS", "Layout", "Options", "Prediction", "bdlm_layer", "predict"]

WORKLOADS = ("sft", "convert", "drafter")
KERNELS_PER_LAYER = 80  # launches of one decoder layer's forward + backward (order of magnitude)
GRAD_BYTES = 4  # gradients are all-reduced in fp32


@dataclass(frozen=True, order=True)
class Layout:
    dp: int
    cp: int
    mode: str  # "dp" when cp == 1, else cp | bp | csbp

    @property
    def gpus(self) -> int:
        return self.dp * self.cp

    @property
    def label(self) -> str:
        return f"dp{self.dp}" if self.cp == 1 else f"dp{self.dp} x {self.mode}{self.cp}"


@dataclass(frozen=True)
class Options:
    block_size: int = 16
    anchors: int = 512  # drafter: draft blocks per sequence
    checkpointing: bool | None = None  # default: on for full BDLMs, off for drafters
    state_bytes_per_param: float = 16.0  # fp32 weights + fp32 grads + two AdamW moments
    ce_chunk: int = 4096  # rows per chunk of the linear cross-entropy
    clean_within_block: str = "causal"
    sft_mask_fraction: float = 0.5  # E[t]: share of tokens masked (supervised) per SFT view
    autocast: bool | None = None  # fp32 weights + bf16 autocast (fp32 residual stream); default: on for BDLMs
    optimizer_step: bool = True  # an AdamW step per training step (costed only with a measured adamw_gbps)
    # drafter: keep the vocabulary loss's logits for backward when they fit in this many GiB
    # (objectives/linear_ce_topk.py): two [rows, V] GEMMs per row instead of three, the logits held
    keep_logits_gib: float = 0.0


@dataclass
class Prediction:
    layout: Layout
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_gib: float | None = None
    fits: bool = False
    reason: str = ""  # why the layout cannot run (shape) or does not fit (memory)
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    memory: MemoryBreakdown | None = None


def bdlm_layer(shape: ModelShape, opt: Options) -> BDLMLayerSpec:
    """The decoder layer a BDLM plan runs (BDLM defaults: fp32 weights under bf16 autocast, checkpointing):
    its key selects the profile's bdlm_layer_tflops, and `plan --calibrate --model` measures it."""
    autocast = True if opt.autocast is None else opt.autocast
    checkpointing = True if opt.checkpointing is None else opt.checkpointing
    return BDLMLayerSpec.of(shape, autocast=autocast, checkpointing=checkpointing)


def _grad_sync_ms(shape: ModelShape, gpus: int, profile: MachineProfile) -> float:
    if gpus <= 1:
        return 0.0
    nbytes = 2 * (gpus - 1) / gpus * shape.trainable_params * GRAD_BYTES
    return nbytes / profile.bandwidth("allreduce", gpus) * 1e3


def _bdlm(shape, workload, context, layout, profile, opt) -> Prediction:
    S, P = opt.block_size, layout.cp
    views = 2 if workload == "convert" else 1  # conversion: two complementary views, batch doubled
    layer = bdlm_layer(shape, opt)
    ckpt, autocast = layer.checkpointing, layer.autocast
    stats = bdlm_rank_stats("dp" if layout.mode == "dp" else layout.mode, context, S, P, opt.clean_within_block)
    e = profile.elem_bytes
    # token-wise work at the rate of this model's own layer when the profile measured it (same widths,
    # precision and checkpointing), else at layer_tflops (a Qwen3-8B-width bf16 layer) as before
    gemm, attn = profile.bdlm_layer_rate(layer.key) * 1e12, profile.attn_tflops * 1e12
    loss_rate = profile.loss_rate_tflops(frozen_head_topk=False) * 1e12
    fpp = shape.attention_flops_per_pair()
    kv_row = 2 * shape.kv_heads * shape.head_dim * e
    nl = shape.layers
    per_rank = []
    for s in stats:
        g = views * s.q_rows * nl * shape.layer_gemm_flops_per_row() * (3 + ckpt) / gemm
        a = views * s.pairs * nl * fpp * (3.5 + ckpt) / attn
        sup = views * s.noisy_rows * (opt.sft_mask_fraction if workload == "sft" else 0.5)
        loss = sup * 2 * shape.hidden * shape.vocab * 4 / loss_rate
        exposed = 0.0
        if s.gathered_rows:
            nbytes = (s.world - 1) * s.gather_width * kv_row
            t_ag = nbytes / profile.bandwidth("allgather", P)
            t_rs = nbytes / profile.bandwidth("reduce_scatter", P)
            local_fwd = s.pairs_local * fpp / attn
            exposed = views * nl * ((1 + ckpt) * max(0.0, t_ag - local_fwd) + max(0.0, t_rs - 2.5 * local_fwd))
        per_rank.append((g + a + loss + exposed, {"gemm": g, "attention": a, "loss": loss, "exposed_comm": exposed}))
    worst = max(range(len(per_rank)), key=lambda r: (per_rank[r][0], -r))
    compute_s, parts = per_rank[worst]
    mem = max(
        (bdlm_step_memory(shape, s, views=views, elem_bytes=e, state_bytes=opt.state_bytes_per_param,
                          checkpointing=ckpt, ce_chunk=opt.ce_chunk, reserved_gib=profile.reserved_gib,
                          residual_bytes=4 if autocast else e)
         for s in stats),
        key=lambda m: m.total,
    )  # fmt: skip
    # tokens/s counts the sequence's tokens, as the trainer (BDLMWorkload.tokens_per_step) and
    # benchmarks/bdlm_bench.py do - not the E[t] share the loss supervises
    return _finish(shape, layout, profile, opt, compute_s, parts, mem, context, nl)


def kept_logits_bytes(shape: ModelShape, rows: int, elem_bytes: int, opt: Options) -> int:
    """Bytes of the drafter loss's logits kept for backward (0: recomputed), as linear_ce_topk decides it:
    all of this rank's rows' [rows, V] logits at once, or none."""
    nbytes = rows * shape.vocab * elem_bytes
    return nbytes if 0 < nbytes <= opt.keep_logits_gib * 2**30 else 0


def _drafter(shape, context, layout, profile, opt) -> Prediction:
    S, P, N = opt.block_size, layout.cp, opt.anchors
    mode = layout.mode
    windows = sorted(set(shape.windows), key=lambda w: (w is not None, w or 0))
    per_window = {w: drafter_rank_stats(mode, context, N, S, P, w) for w in windows}
    e = profile.elem_bytes
    gemm = profile.token_tflops * 1e12
    attn = {w: profile.drafter_attn_tflops(w) * 1e12 for w in windows}  # per layer's window (None = full)
    # a drafter without a selector takes the top-1 path (objectives/ce_chunk.py), with one the top-k path
    loss_rate = profile.loss_rate_tflops(frozen_head_topk=True, top1=not shape.selector_top_k) * 1e12
    fpp = shape.attention_flops_per_pair()
    kv_row = 2 * shape.kv_heads * shape.head_dim * e
    ranks = len(next(iter(per_window.values())))
    per_rank = []
    for r in range(ranks):
        st = {w: per_window[w][r] for w in windows}
        ctx = max(x.context_rows for x in st.values())
        block_rows = st[windows[0]].block_rows
        fc = 2 * ctx * shape.features * shape.target_hidden * shape.hidden * 2 / gemm  # forward + dW
        kvp = 2 * ctx * shape.hidden * 2 * shape.kv_heads * shape.head_dim * 3 * shape.layers / gemm
        layer_gemm = block_rows * shape.layer_gemm_flops_per_row() / gemm  # one layer, forward
        blocks = 3 * layer_gemm * shape.layers
        a, exposed = 0.0, 0.0
        for w in shape.windows:
            x = st[w]
            a += x.pairs * fpp * 3.5 / attn[w]
            if mode == "csbp" and x.received_rows:
                nbytes = x.received_rows * kv_row
                overlap = layer_gemm + x.pairs_local * fpp / attn[w]  # block-local work of the layer
                t_ag = nbytes / profile.bandwidth("allgather", P)
                t_rs = nbytes / profile.bandwidth("reduce_scatter", P)
                exposed += max(0.0, t_ag - overlap) + max(0.0, t_rs - 2 * overlap)
            elif mode == "cp" and P > 1:  # all-gather of every block row's partial (out, lse)
                nbytes = (P - 1) * block_rows * shape.heads * (shape.head_dim * e + 4)
                exposed += nbytes / profile.bandwidth("allgather", P)
        rows = st[windows[0]].anchors * (S - 1)
        gemms = 2 if kept_logits_bytes(shape, rows, e, opt) else 3  # logits, (recompute,) d hidden
        loss = rows * 2 * shape.hidden * shape.vocab * gemms / loss_rate
        per_rank.append((fc + kvp + blocks + a + loss + exposed,
                         {"gemm": fc + kvp + blocks, "attention": a, "loss": loss, "exposed_comm": exposed}))  # fmt: skip
    worst = max(range(ranks), key=lambda r: (per_rank[r][0], -r))
    compute_s, parts = per_rank[worst]
    mem = max(
        (drafter_step_memory(shape, {w: per_window[w][r] for w in windows}, elem_bytes=e,
                             state_bytes=opt.state_bytes_per_param, ce_chunk=opt.ce_chunk,
                             reserved_gib=profile.reserved_gib,
                             kept_logits=kept_logits_bytes(shape, per_window[windows[0]][r].anchors * (S - 1), e, opt))
         for r in range(ranks)),
        key=lambda m: m.total,
    )  # fmt: skip
    return _finish(shape, layout, profile, opt, compute_s, parts, mem, N * (S - 1), shape.layers)


def _optimizer_s(shape: ModelShape, profile: MachineProfile, opt: Options) -> float | None:
    """Seconds of one AdamW step over the trainable parameters (every rank updates all of them); None when
    the profile has no measured AdamW rate (older profiles: no optimizer term, as they always predicted)."""
    if not opt.optimizer_step or profile.adamw_gbps is None:
        return None
    return shape.trainable_params * ADAMW_BYTES_PER_PARAM / (profile.adamw_gbps * 1e9)


def _finish(shape, layout, profile, opt, compute_s, parts, mem, tokens, layers) -> Prediction:
    launch = layers * KERNELS_PER_LAYER * profile.launch_overhead_us * 1e-6
    sync = _grad_sync_ms(shape, layout.gpus, profile) / 1e3
    backward = compute_s * 2 / 3
    exposed_sync = max(0.0, sync - backward)
    optimizer = _optimizer_s(shape, profile, opt)  # after the gradient sync: not overlapped
    step = compute_s + launch + exposed_sync + (optimizer or 0.0)
    breakdown = {k: v * 1e3 for k, v in parts.items()}
    breakdown.update(launch=launch * 1e3, exposed_grad_sync=exposed_sync * 1e3)
    if optimizer is not None:
        breakdown["optimizer"] = optimizer * 1e3
    return Prediction(
        layout=layout, step_ms=step * 1e3, tokens_per_s=layout.dp * tokens / step, peak_gib=mem.total,
        breakdown_ms=breakdown, memory=mem,
    )  # fmt: skip


def predict(
    shape: ModelShape,
    workload: str,
    context: int,
    layout: Layout,
    profile: MachineProfile,
    gpu_mem_gib: float,
    options: Options | None = None,
) -> Prediction:
    """Prediction for one layout; `fits` is False (with the reason) when the shape is invalid for the
    layout or the predicted peak exceeds `gpu_mem_gib`."""
    options = options or Options()
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {workload!r}")
    if (workload == "drafter") != shape.drafter:
        raise ValueError(f"workload {workload!r} does not match model {shape.name} (drafter={shape.drafter})")
    if workload != "drafter" and any(w is not None for w in shape.windows):
        raise ValueError(f"model {shape.name}: sliding-window layers are costed for drafters only")
    for op in ("allgather", "reduce_scatter", "allreduce"):  # a profile without rates fails here, loudly
        profile.bandwidth(op, layout.gpus if op == "allreduce" else layout.cp)
    try:
        if workload == "drafter":
            pred = _drafter(shape, context, layout, profile, options)
        else:
            pred = _bdlm(shape, workload, context, layout, profile, options)
    except ValueError as err:  # the layout cannot hold this shape (e.g. fewer blocks than ranks)
        return Prediction(layout=layout, reason=str(err))
    pred.fits = pred.peak_gib <= gpu_mem_gib
    if not pred.fits:
        pred.reason = f"needs {pred.peak_gib:.1f} GiB > {gpu_mem_gib:g} GiB"
    return pred
