"""`train.activation_checkpointing: auto` (the default): checkpoint the decoder layers only when a step
would not fit in the device's memory without.

    predicted peak of one rank's step WITHOUT checkpointing      planner/memory.py bdlm_step_memory for
      (states, every layer's saved activations, gathered K/V,    this rank's rows: the workload's sequence
       the loss chunk)                                           length, block size, objective views x
                                                                 micro batch, the CP plan, the precision
      (every layer: what its family's decoder layer saves        decoder_layer_bytes_per_row: norms in fp32,
       per row - measured per family on the CPU,                  GEMM outputs in the autocast dtype, the
       tests/planner/test_decoder_layer_memory_vs_measured.py)    residual stream in the weights' dtype
      + under autocast: the bf16 weight copies autocast caches    2 bytes per parameter
        for the step                                             GQA packing's output copy only in the
                                                                 layers that pack (`layer_packs`)
    + headroom (HEADROOM_GIB + HEADROOM_SHARE of it: fragmentation)
    <= memory this process can use (free + what it already holds: the model's weights)
       -> off: no recompute (a third fewer FLOPs than a checkpointed step's)
       else on, for as few layers as fit: each decoder layer left un-checkpointed adds
       (peak without - peak with checkpointing) / layers; the last k layers keep their activations
       (their backward runs first, so their memory is free again before the recomputes start)

`train.recompute_attention: auto` (the default), once checkpointing is on: a checkpointed layer can keep its
attention's output and saved tensors for the recompute (models/bdlm/routing.py) - attention is most of a
long-context layer's FLOPs (72% at 64K for Qwen3-1.7B), its saved tensors an eighth of the layer's memory:

    peak  none (no checkpointing) > kept (every attention kept) > all (every layer recomputed, attention too)
    off         when none fits
    on          of every split - the last k layers un-checkpointed, then the attention outputs of the others
                with the most FLOPs (full-attention layers before sliding ones) while they fit - the one whose
                recompute saves the most FLOPs (PeakModel.choose; PeakModel.peak is the one formula auto,
                its line and the OOM advice use). true: whole layers only; false: every checkpointed
                layer's attention, whole layers on top as far as they fit

When a step runs out of memory anyway (the model under-counts a family, or fragmentation), every rank
decides again with the predicted peaks scaled so the failed choice no longer fits (`step_down_scale`) and the
trainer runs the step again: auto never loses a run to its own estimate while something smaller is left.

Without a GPU the choice is off (host memory is not what the planner models); a workload without a memory
model (no seq_len / objective / ce_chunk_size, or a model without a config) also gets off, and the line
printed says so. An explicit true / false is never changed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from ..attention.packing import should_pack
from ..layout.cost import bdlm_visible_pairs
from ..layout.plans import bdlm_plan
from ..masks.visibility import Visibility
from ..models.bdlm.routing import config_windows
from ..planner.memory import bdlm_step_memory
from ..planner.pairs import bdlm_rank_stats
from ..planner.shapes import load_shape

__all__ = ["HEADROOM_GIB", "HEADROOM_SHARE", "PACKING_PROBE_TOKENS", "CheckpointingChoice", "PeakModel",
           "available_gib", "bdlm_peak_gib", "bdlm_peaks", "keep_activations", "keep_attention", "layer_packs",
           "models_memory", "needs_checkpointing", "resolve_attention", "resolve_checkpointing",
           "step_down_scale"]  # fmt: skip

GiB = float(1 << 30)
HEADROOM_GIB = 2.0
#: measured peaks on one H200 against this model's prediction (benchmarks/results/bdlm_h200_2026-12-02_*.jsonl,
#: predictions with the per-layer packing guess): Qwen3-1.7B 64K, 27 of 28 layers checkpointed 85.4 GiB / 97.1
#: predicted, every layer with 13 attention outputs kept 89.6 / 102.0, with all 28 kept 112.2 / 124.6 (11-14%
#: over); Gemma-3-1B 32K, 18 of 26 checkpointed with 17 outputs kept 118.0 / 109.5 and 17 of 26 recomputed
#: 117.7 / 108.9 (7% under). The share covers the allocator's fragmentation, not the model's worst under-count:
#: a step that runs out of memory anyway makes auto decide again with the peaks scaled up (`step_down_scale`,
#: the trainer retries the step)
HEADROOM_SHARE = 0.08


@dataclass(frozen=True)
class CheckpointingChoice:
    enabled: bool
    reason: str = ""
    keep_layers: int = 0  # decoder layers (the last ones) that keep their activations when enabled
    layers: int = 0
    attention_layers: tuple[int, ...] = ()  # checkpointed layers whose recompute reuses their attention output

    def line(self, field: str = "train.activation_checkpointing") -> str:
        if not self.enabled:
            what = "off"
        else:
            what = f"on for {self.layers - self.keep_layers} of {self.layers} layers" if self.keep_layers else "on"
            checkpointed = self.layers - self.keep_layers
            if self.attention_layers and len(self.attention_layers) >= checkpointed:
                what += ", attention kept"
            elif self.attention_layers:
                what += f", attention kept in {len(self.attention_layers)} of them"
            else:
                what += ", attention recomputed"
        return f"{field} auto -> {what} ({self.reason})"


def needs_checkpointing(peak_gib: float, available_gib: float) -> bool:
    """Does a step predicted at `peak_gib` (without checkpointing) overflow `available_gib` with headroom?"""
    return peak_gib + HEADROOM_GIB + HEADROOM_SHARE * peak_gib > available_gib


@dataclass(frozen=True)
class PeakModel:
    """The predicted peaks (GiB) a checkpointing setting lies between - each layer adds its share linearly -
    and what each layer's recompute costs (forward FLOPs), to choose what to keep."""

    none: float  # no layer checkpointed
    all: float  # every layer checkpointed, attention recomputed
    kept: float  # every layer checkpointed, every attention output kept
    layers: int
    attention_flops: tuple[float, ...] = ()  # per layer: its attention's forward (what keeping it saves)
    other_flops: float = 0.0  # per layer: the rest of its forward (GEMMs), saved by not checkpointing it

    def scaled(self, factor: float) -> PeakModel:
        """The same model with every peak `factor` times larger (what a step that ran out of memory teaches)."""
        return replace(self, none=self.none * factor, all=self.all * factor, kept=self.kept * factor)

    def peak(self, keep: int = 0, attention: int = 0) -> float:
        """`keep` layers un-checkpointed, `attention` of the checkpointed ones keeping their attention
        outputs: all + keep (none - all) / layers + attention (kept - all) / layers."""
        n = max(1, self.layers)
        return self.all + keep * (self.none - self.all) / n + attention * (self.kept - self.all) / n

    def _by_gain(self, candidates: range) -> list[int]:
        flops = self.attention_flops or (1.0,) * self.layers
        return sorted(candidates, key=lambda i: (-flops[i], -i))  # most FLOPs first, later layers on ties

    def choose(self, available_gib: float, recompute_attention: bool | str = "auto") -> tuple[int, tuple[int, ...]]:
        """(layers un-checkpointed - the last ones -, checkpointed layers keeping their attention outputs)
        within `available_gib`. Every layer when the un-checkpointed step fits. recompute_attention true:
        the most whole layers that fit; false: every checkpointed layer's attention and the most whole
        layers on top; auto: of every split (k whole layers, then the attention outputs with the most FLOPs
        among the others while they fit) the one whose recompute saves the most FLOPs - attention outputs
        are an eighth of a Qwen3 layer's memory for most of a long-context layer's recompute."""
        n = self.layers
        if not needs_checkpointing(self.none, available_gib):
            return n, ()

        def fits(keep: int, attention: int) -> bool:
            return not needs_checkpointing(self.peak(keep, attention), available_gib)

        whole = [k for k in range(n) if fits(k, 0)]
        if recompute_attention is True or not whole:
            return (whole[-1] if whole else 0), ()
        if recompute_attention is False:
            keep = max([k for k in range(n) if fits(k, n - k)], default=0)
            return keep, tuple(range(n - keep))
        flops = self.attention_flops or (1.0,) * n
        best: tuple[float, int, tuple[int, ...]] = (-1.0, 0, ())
        for k in whole:
            a = 0
            while a < n - k and fits(k, a + 1):
                a += 1
            chosen = tuple(sorted(self._by_gain(range(n - k))[:a]))
            saved = k * self.other_flops + sum(flops[n - k :]) + sum(flops[i] for i in chosen)
            if saved > best[0]:
                best = (saved, k, chosen)
        return best[1], best[2]


#: the longest sequence whose 2L mask the packing guess counts tiles of (0.15 s on a CPU; 64K takes 20 s)
PACKING_PROBE_TOKENS = 8192


@functools.lru_cache(maxsize=64)
def layer_packs(seq_len: int, block_size: int, groups: int, window: int | None, clean_within_block: str) -> bool:
    """Does FlexAttention pack the GQA heads of a layer with this window (attention/packing.py `should_pack`)?
    Decided on the 2L mask of min(seq_len, PACKING_PROBE_TOKENS) tokens (whole blocks), counted on the CPU:
    whether packing visits fewer tiles depends on the block size, the window and G, tile by tile, the same
    along a longer sequence (e.g. never for Qwen3-1.7B's full layers at block 32 - a tie -, every layer for
    Gemma-3-1B's G = 4)."""
    tokens = min(seq_len, max(block_size, PACKING_PROBE_TOKENS // block_size * block_size))
    plan = bdlm_plan("csbp", tokens, block_size, 1)[0]
    vis = Visibility(plan.q_tokens, plan.kv_tokens, block_size, clean_within_block=clean_within_block,
                     window=window if window is not None and window < tokens else None)  # fmt: skip
    return should_pack(vis, groups, "cpu")


def bdlm_peak_gib(workload, model, ctx, *, checkpointing: bool, attention_kept: bool = False) -> float:
    """Predicted peak GiB of this run's largest rank for a BDLM workload (ValueError: no memory model);
    attention_kept: checkpointed layers keep their attention outputs."""
    try:
        seq_len, objective, chunk = workload.seq_len, workload.objective, workload.ce_chunk_size
        config, block, rule = model.config, model.block_size, model.clean_within_block
    except AttributeError as err:
        raise ValueError(f"no memory model for this workload ({err})") from None
    shape = load_shape(config.to_dict())
    stats = bdlm_rank_stats(ctx.mode, seq_len, block, ctx.cp_size, rule)
    param_bytes = torch.tensor([], dtype=ctx.param_dtype).element_size()
    elem = torch.tensor([], dtype=ctx.autocast_dtype).element_size() if ctx.autocast_dtype else param_bytes
    views = objective.batch_factor * ctx.micro_batch_size

    weight_copies = 2 * shape.trainable_params / GiB if ctx.autocast_dtype else 0.0  # autocast's bf16 cache
    groups = shape.heads // max(1, shape.kv_heads)
    packed = [layer_packs(seq_len, block, groups, w, rule) for w in config_windows(config)]
    return max(
        bdlm_step_memory(shape, s, views=views, elem_bytes=elem, state_bytes=4.0 * param_bytes,
                         checkpointing=checkpointing, ce_chunk=chunk, reserved_gib=0.0,
                         residual_bytes=param_bytes, gqa_packed=packed, attention_kept=attention_kept).total
        + weight_copies
        for s in stats
    )  # fmt: skip


def models_memory(ctx) -> bool:
    """Does the memory model decide `auto` for this run? On GPUs; host memory is not what it models."""
    return ctx.device.type == "cuda"


def available_gib(device: torch.device) -> float:
    """Memory this process can use on `device`: free + what it already holds (the model's weights)."""
    free, _total = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_allocated(device)) / GiB


def bdlm_peaks(workload, model, ctx) -> PeakModel:
    """The three predicted peaks of this run and each layer's recompute FLOPs (ValueError: no memory model)."""
    none = bdlm_peak_gib(workload, model, ctx, checkpointing=False)
    every = bdlm_peak_gib(workload, model, ctx, checkpointing=True)
    kept = bdlm_peak_gib(workload, model, ctx, checkpointing=True, attention_kept=True)
    config = model.config
    shape = load_shape(config.to_dict())
    seq_len = workload.seq_len
    attention = tuple(4.0 * shape.heads * shape.head_dim
                      * bdlm_visible_pairs(seq_len, model.block_size, model.clean_within_block, w)
                      for w in config_windows(config))  # fmt: skip
    other = 2.0 * seq_len * shape.layer_gemm_flops_per_row()
    return PeakModel(none, every, kept, shape.layers, attention, other)


def resolve_checkpointing(
    workload, model, ctx, recompute_attention: bool | str = "auto", available: float | None = None,
    scale: float = 1.0,
) -> CheckpointingChoice:
    """The `auto` decision (`available`: the GiB every rank can use - the trainer passes the least over
    ranks, so every rank decides the same; None: this device's). `recompute_attention`:
    train.recompute_attention; `scale`: the predicted peaks times this (`step_down`)."""
    if not models_memory(ctx):
        return CheckpointingChoice(False, "no GPU")
    try:
        peaks = bdlm_peaks(workload, model, ctx).scaled(scale)
    except ValueError as err:
        return CheckpointingChoice(False, str(err))
    available = available_gib(ctx.device) if available is None else available
    n = peaks.layers
    keep, attention = peaks.choose(available, recompute_attention)
    if keep == n:
        return CheckpointingChoice(False, f"predicted {peaks.none:.1f} GiB without it + headroom <= "
                                          f"{available:.1f} GiB", layers=n)  # fmt: skip
    reason = (f"predicted {peaks.none:.1f} GiB without it + headroom > {available:.1f} GiB; {peaks.all:.1f} GiB "
              f"with every layer checkpointed, {peaks.kept:.1f} GiB keeping every attention output; "
              f"{peaks.peak(keep, len(attention)):.1f} GiB as chosen")  # fmt: skip
    return CheckpointingChoice(True, reason + _scaled(scale), keep_layers=keep, layers=n, attention_layers=attention)


def resolve_attention(
    workload, model, ctx, recompute_attention: bool | str = "auto", available: float | None = None,
    scale: float = 1.0,
) -> CheckpointingChoice:
    """Under an explicit `activation_checkpointing: true` (every layer checkpointed): which layers keep
    their attention outputs - train.recompute_attention true: none, false: all, auto: those with the most
    attention FLOPs while they fit (no GPU or no memory model: none, as without this option)."""
    layers = int(getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0)
    if recompute_attention != "auto" or not models_memory(ctx):
        kept = tuple(range(layers)) if recompute_attention is False else ()
        return CheckpointingChoice(True, "as set" if recompute_attention != "auto" else "no GPU", layers=layers,
                                   attention_layers=kept)  # fmt: skip
    try:
        peaks = bdlm_peaks(workload, model, ctx).scaled(scale)
    except ValueError as err:
        return CheckpointingChoice(True, str(err), layers=layers)
    available = available_gib(ctx.device) if available is None else available
    count = 0
    while count < layers and not needs_checkpointing(peaks.peak(0, count + 1), available):
        count += 1
    chosen = tuple(sorted(peaks._by_gain(range(layers))[:count]))
    reason = f"{peaks.peak(0, count):.1f} GiB predicted, {available:.1f} GiB available" + _scaled(scale)
    return CheckpointingChoice(True, reason, layers=layers, attention_layers=chosen)


def _scaled(scale: float) -> str:
    return f"; the memory model's peaks x {scale:.2f} after a step ran out of memory" if scale != 1.0 else ""


def step_down_scale(peaks: PeakModel, choice: CheckpointingChoice, available: float, scale: float) -> float:
    """After a step ran out of memory under `choice` (decided with `peaks` - unscaled - times `scale`): the
    scale to decide again with. The failed choice needed more than `available`, so its peak is scaled to at
    least that - and at least 10% more than before - and no longer fits: every retry asks for less.

        scale' = max(1.1 x scale, available / predicted peak of the failed choice)
    """
    failed = peaks.peak(choice.keep_layers, len(choice.attention_layers)) if choice.enabled else peaks.none
    return max(1.1 * scale, available / max(failed, 1e-9))


def keep_activations(model: torch.nn.Module, keep: int) -> int:
    """After checkpointing was enabled on every layer: the last `keep` checkpointed layers (transformers'
    GradientCheckpointingLayer flag, in module order) keep their activations instead. Returns how many."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in layers[len(layers) - min(keep, len(layers)) :] if keep > 0 else []:
        m.gradient_checkpointing = False
    return min(max(keep, 0), len(layers))


def keep_attention(model: torch.nn.Module, layers: tuple[int, ...]) -> tuple[int, ...]:
    """The decoder layers (indices) whose checkpoint recompute reuses their attention outputs (the model's
    `keep_attention_outputs`, models/bdlm/routing.py). Returns them."""
    mark = getattr(model, "keep_attention_outputs", None)
    if not layers:
        if mark is not None:  # a plan applied again: no layer keeps its output any more
            mark(())
        return ()
    if mark is None:
        raise ValueError(f"train.recompute_attention: {type(model).__name__} cannot keep attention outputs; "
                         "set train.recompute_attention: true")  # fmt: skip
    mark(layers)
    return tuple(layers)
