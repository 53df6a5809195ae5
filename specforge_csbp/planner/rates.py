"""Rates of the work a training step actually runs, measured for `calibrate` (planner/profile.py).

One 8192^3 GEMM is the best case of a GPU; a decoder layer in eager PyTorch wraps its GEMMs in
memory-bound passes (RMSNorms, q/k-norm, RoPE, SwiGLU products, residual adds, transposes), and the
vocabulary loss adds fp32 logits, log-sum-exp and softmax passes. These measurements time that real code
and divide the FLOPs the cost model charges for it (cost.py), so a rate is "useful FLOP/s as counted":

    layer_tflops      transformers' Qwen3DecoderLayer (the BDLM's layer; the drafter's layer runs the same
                      projections, norms, RoPE and SwiGLU MLP), forward + backward (input and weight
                      gradients) of `rows` token rows, in sequences of `seq` rows so the attention core is a
                      negligible part (< 0.5% of the FLOPs at the GPU size; its time stays in, uncounted):
                          FLOPs = rows x 2 x layer params x 3                 (forward 1 + backward 2)
    loss_tflops       objectives/linear_ce.py `linear_cross_entropy` with a trainable LM head (the BDLM's
                      loss): FLOPs = rows x 2 h V x 4   (forward, recompute, dH, dW)
    loss_topk_tflops  objectives/linear_ce_topk.py `linear_ce_topk` with a frozen LM head and the top-k
                      logits carrying gradient (the DFlash2 drafter's loss): rows x 2 h V x 3
    loss_top1_tflops  the same with top-1 and no selector gradient (the DFlash drafter's loss, a cheaper
                      compiled per-chunk path: objectives/ce_chunk.py): rows x 2 h V x 3
    adamw_gbps        one fused AdamW step over fp32 parameters (GPU; foreach on CPU):
                      ADAMW_BYTES_PER_PARAM = 28 bytes per parameter (read weight, grad, two moments;
                      write weight, two moments) / time

Drafter attention (`measure_drafter_attention`, sizes `DRAFTER_ATTN_SIZES`): a DFlash drafter's queries
are draft blocks of S rows, each over its own keys - a 2048-key window in sliding layers, the context
before its anchor in full layers - so its kernels visit mostly partial tiles and run far below the dense
BDLM block mask's attn_tflops. One reference plan (`drafter_plans`, anchors from the training sampler)
with a sliding and a full layer type, each run through its `ShardedAttention` (the seam; flex on CUDA,
dense on CPU, GQA packing decided as in training), forward + backward, masks built in the warm-up calls
(the drafter benchmark times them apart, as `prep_ms`):

    attn_window_tflops  sliding-window layer: FLOPs = visible pairs x 4 H D x 3.5   (forward 1 + backward 2.5)
    attn_draft_tflops   full-context layer:   the same count
                        (pairs: `count_visible` over the layer's Visibility - exact, what cost.py charges)

The sliding rate depends on how far apart anchors lie (a 128-row query tile holds 8 blocks whose windows
overlap less the sparser the anchors): the GPU size, 512 anchors over 128K (one every 256 positions),
sits mid-way in the benchmarked 64K..1M at 512 anchors.

BDLM decoder layer at a model's own shape (`measure_bdlm_layer`, `BDLMLayerSpec`, rows `BDLM_LAYER_SIZES`):
layer_tflops times a Qwen3-8B-width layer in pure bf16, the drafters' case. A BDLM trains its own model -
e.g. Qwen3-1.7B, hidden 2048 - with fp32 master weights under bf16 autocast (fp32 residual stream and
norms, a bf16 cast of every projection's input) and activation checkpointing. The memory-bound passes
around the GEMMs scale with the width (h, I), the GEMMs with its square, so at half the width they weigh
about twice as much, and the fp32 stream adds casts and wider reads. `plan --calibrate --model M` (BDLM
workloads) therefore also times M's layer as the BDLM runs it:

    bdlm_layer_tflops   transformers' Qwen3DecoderLayer of M's hidden / intermediate / heads / KV heads /
                        head dim, fp32 weights, fp32 input rows, forward under bf16 autocast (or fp32), under
                        torch.utils.checkpoint (non-reentrant, as the BDLM's layers) when checkpointing,
                        backward outside autocast, fp32 weight gradients:
                            FLOPs = rows x 2 x layer params x (3 + 1 if checkpointing)   (cost.py's count)
    bdlm_layer_shape    `BDLMLayerSpec.key`: the widths, the precision and checkpointing it ran with; the
                        cost model charges a BDLM's token-wise work at bdlm_layer_tflops only when the
                        planned model and options give the same key (else layer_tflops, as before)

Sizes (`WORK_SIZES`): GPU - the hidden/intermediate/heads of Qwen3-8B (the drafters' width), 8192 rows,
the vocabulary of Qwen3 (151936), the CE chunks of the BDLM and drafter benchmarks (4096, 2048), 128M
AdamW parameters; CPU - toy sizes in float32 that run in about a second. fp32 matmuls run at the
precision training sets on GPUs ("high": TF32 tensor cores, training/trainer.py), restored afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..objectives.dflash import DFlashObjective, sample_anchors
from ..objectives.linear_ce import linear_cross_entropy
from ..objectives.linear_ce_topk import linear_ce_topk
from ..parallel.options import AttentionOptions
from .pairs import count_visible

if TYPE_CHECKING:
    from .shapes import ModelShape

__all__ = [
    "ADAMW_BYTES_PER_PARAM",
    "BDLM_LAYER_SIZES",
    "DRAFTER_ATTN_SIZES",
    "WORK_SIZES",
    "BDLMLayerSpec",
    "drafter_attention_anchors",
    "measure_bdlm_layer",
    "measure_drafter_attention",
    "measure_work_rates",
    "qwen3_layer",
    "timed",
]

ADAMW_BYTES_PER_PARAM = 28  # fp32: read weight, grad, exp_avg, exp_avg_sq (16); write weight and moments (12)

WORK_SIZES: dict[str, dict] = {
    "cuda": dict(hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, rows=8192, seq=128,
                 vocab=151936, ce_chunk=4096, topk_chunk=2048, top_k=16, adamw_params=128 << 20,
                 dtype=torch.bfloat16, reps=8),
    "cpu": dict(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, rows=256, seq=32,
                vocab=2048, ce_chunk=128, topk_chunk=64, top_k=4, adamw_params=1 << 20,
                dtype=torch.float32, reps=3),
}  # fmt: skip

DRAFTER_ATTN_SIZES: dict[str, dict] = {
    "cuda": dict(context=131072, anchors=512, block=16, window=2048, heads=32, kv_heads=8, head_dim=128,
                 dtype=torch.bfloat16, reps=8),  # shape a of the drafter benchmark (qwen3.6-27b-dflash)
    "cpu": dict(context=512, anchors=16, block=4, window=32, heads=4, kv_heads=2, head_dim=16,
                dtype=torch.float32, reps=3),
}  # fmt: skip


# Rows of the BDLM layer measurement (the width is the model's): on GPU 32768 rows, the rows a rank runs at
# the smallest benchmarked SFT point (32K context on 2 GPUs), in sequences of 128 so the sdpa core is < 1%
# of the FLOPs; on CPU a handful of rows (a real model's width is what is measured, so keep rows small).
BDLM_LAYER_SIZES: dict[str, dict] = {
    "cuda": dict(rows=32768, seq=128, reps=8),
    "cpu": dict(rows=64, seq=16, reps=3),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds per call (after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def qwen3_layer(device: torch.device, z: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' Qwen3DecoderLayer of the sizes `z` (sdpa attention) and its rotary embedding."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    cfg = Qwen3Config(
        hidden_size=z["hidden"], intermediate_size=z["intermediate"], num_attention_heads=z["heads"],
        num_key_value_heads=z["kv_heads"], head_dim=z["head_dim"], num_hidden_layers=1,
        max_position_embeddings=z["seq"], vocab_size=z["vocab"],
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    with torch.device(device):  # initialise on the device (a CPU init of 200M weights takes seconds)
        layer = Qwen3DecoderLayer(cfg, 0).to(z["dtype"])
        rope = Qwen3RotaryEmbedding(cfg)
    return layer, rope


def _layer_tflops(device: torch.device, z: dict) -> float:
    layer, rope = qwen3_layer(device, z)
    x = torch.randn(z["rows"] // z["seq"], z["seq"], z["hidden"], device=device, dtype=z["dtype"])
    x.requires_grad_(True)
    cos_sin = rope(x, torch.arange(z["seq"], device=device)[None])
    grad = torch.randn_like(x)
    # FLOPs as the cost model counts them: 2 x the layer's weights per row (shapes.ModelShape.layer_params
    # counts the same q, k, v, o, gate, up, down; tests/planner/test_work_rates.py checks they agree).
    weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x, position_embeddings=cos_sin).backward(grad)

    rows = x.shape[0] * x.shape[1]
    return rows * 2 * weights * 3 / timed(step, device, z["reps"]) / 1e12


def _loss_tflops(device: torch.device, z: dict) -> tuple[float, float, float]:
    n, h, V = z["rows"], z["hidden"], z["vocab"]
    hidden = torch.randn(n, h, device=device, dtype=z["dtype"], requires_grad=True)
    head = (torch.randn(V, h, device=device, dtype=z["dtype"]) * h**-0.5).requires_grad_(True)
    targets = torch.randint(V, (n,), device=device)

    def trainable_head():  # BDLM: tied / trainable LM head, summed CE
        hidden.grad = head.grad = None
        linear_cross_entropy(hidden, head, targets, chunk_size=z["ce_chunk"]).backward()

    frozen = head.detach()

    def frozen_head_topk():  # drafter: the target's frozen head, per-row CE and top-k logits (selector)
        hidden.grad = None
        nll, top_v, _ = linear_ce_topk(hidden, frozen, targets, top_k=z["top_k"], chunk_size=z["topk_chunk"])
        (nll.sum() + top_v.sum()).backward()

    def frozen_head_top1():  # DFlash drafter: no selector - per-row CE, the top-1 only counts accuracy
        hidden.grad = None
        nll, _, _ = linear_ce_topk(hidden, frozen, targets, top_k=1, chunk_size=z["topk_chunk"])
        nll.sum().backward()

    pass_flops = n * 2 * h * V
    loss = pass_flops * 4 / timed(trainable_head, device, z["reps"]) / 1e12
    loss_topk = pass_flops * 3 / timed(frozen_head_topk, device, z["reps"]) / 1e12
    loss_top1 = pass_flops * 3 / timed(frozen_head_top1, device, z["reps"]) / 1e12
    return loss, loss_topk, loss_top1


def _adamw_gbps(device: torch.device, z: dict) -> float:
    parts = 4  # a few tensors, as a model has (one fused launch covers them all)
    size = z["adamw_params"] // parts
    params = [torch.zeros(size, device=device, requires_grad=True) for _ in range(parts)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True if device.type == "cuda" else None)
    n = sum(p.numel() for p in params)
    return n * ADAMW_BYTES_PER_PARAM / timed(opt.step, device, z["reps"]) / 1e9


def measure_work_rates(device: torch.device) -> dict[str, float]:
    """layer_tflops, loss_tflops, loss_topk_tflops, loss_top1_tflops, adamw_gbps of this device (module
    docstring)."""
    z = WORK_SIZES["cuda" if device.type == "cuda" else "cpu"]
    precision = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as training sets it (trainer.py, bdlm_bench.py)
    try:
        layer = _layer_tflops(device, z)
        loss, loss_topk, loss_top1 = _loss_tflops(device, z)
        adamw = _adamw_gbps(device, z)
    finally:
        torch.set_float32_matmul_precision(precision)
    return dict(
        layer_tflops=layer, loss_tflops=loss, loss_topk_tflops=loss_topk, loss_top1_tflops=loss_top1, adamw_gbps=adamw
    )


# -- drafter attention ----------------------------------------------------------------------------


def drafter_attention_anchors(z: dict) -> torch.Tensor:
    """The calibration's anchors: the training sampler (uniform, seed 0) over a fully supervised context."""
    objective = DFlashObjective(num_anchors=z["anchors"], seed=0)
    return sample_anchors(torch.ones(z["context"]), objective, block_size=z["block"])


def _drafter_attention_tflops(device: torch.device, z: dict) -> dict[str, float]:
    # lazy: heavy dependency (models.dflash loads transformers); the cost model imports without it
    from ..models.dflash import drafter_plans, make_dflash_config, plan_attention

    H, Hk, D, S = z["heads"], z["kv_heads"], z["head_dim"], z["block"]
    # only the attention fields matter; the rest are placeholders the config validation asks for
    config = make_dflash_config(
        hidden_size=H * D, intermediate_size=H * D, num_hidden_layers=2, num_attention_heads=H,
        num_key_value_heads=Hk, head_dim=D, vocab_size=S + 1, mask_token_id=S, num_target_layers=1,
        target_layer_ids=[0], block_size=S, layer_types=["sliding_attention", "full_attention"],
        sliding_window=z["window"],
    )  # fmt: skip
    plan = drafter_plans("reference", z["context"], drafter_attention_anchors(z), config, 1)[0]
    backend = "flex" if device.type == "cuda" else "dense"
    # pack_gqa None: decided per mask, as in training
    attention = plan_attention(plan, options=AttentionOptions(backend=backend))
    fields = {"sliding_attention": "attn_window_tflops", "full_attention": "attn_draft_tflops"}
    out = {}
    for kind, layer in attention.items():
        attend, shard = layer.attend, plan.layers[kind].shard
        (vis,) = attend.visibilities  # one process: one seam call over the layer's keys
        pairs = count_visible(vis.q, vis.k, S, vis.clean_within_block, window=vis.window,
                              noisy_causal=vis.noisy_causal)  # fmt: skip
        q = torch.randn(1, H, len(shard.q_tokens), D, device=device, dtype=z["dtype"], requires_grad=True)
        k = torch.randn(1, Hk, len(shard.kv_tokens), D, device=device, dtype=z["dtype"], requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        grad = torch.randn_like(q)

        def step(attend=attend, q=q, k=k, v=v, grad=grad):
            q.grad = k.grad = v.grad = None  # fresh gradients, as the projections' outputs get in training
            out_, _ = attend(q, k, v)
            out_.backward(grad)

        step.__name__ = f"{kind}_step"
        out[fields[kind]] = pairs * 4 * H * D * 3.5 / timed(step, device, z["reps"]) / 1e12  # fwd 1 + bwd 2.5
    return out


def measure_drafter_attention(device: torch.device) -> dict[str, float]:
    """attn_window_tflops, attn_draft_tflops of this device (module docstring)."""
    return _drafter_attention_tflops(device, DRAFTER_ATTN_SIZES["cuda" if device.type == "cuda" else "cpu"])


# -- BDLM decoder layer at the model's own shape and precision -----------------------------------------


@dataclass(frozen=True)
class BDLMLayerSpec:
    """One decoder layer of a BDLM as the trainer and benchmarks/bdlm_bench.py run it: the model's widths,
    fp32 weights under bf16 autocast (`autocast`) or plain fp32, and activation checkpointing."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    autocast: bool = True
    checkpointing: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "heads", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"bdlm layer {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def of(cls, shape: ModelShape, *, autocast: bool, checkpointing: bool) -> BDLMLayerSpec:
        return cls(shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim,
                   bool(autocast), bool(checkpointing))  # fmt: skip

    @property
    def key(self) -> str:
        """What the profile's `bdlm_layer_shape` says, and what cost.py compares it with."""
        precision = "fp32 weights + bf16 autocast" if self.autocast else "fp32"
        checkpointing = "on" if self.checkpointing else "off"
        return (f"hidden {self.hidden}, intermediate {self.intermediate}, heads {self.heads}/{self.kv_heads} "
                f"x {self.head_dim}, {precision}, checkpointing {checkpointing}")  # fmt: skip

    @property
    def passes(self) -> int:
        """Forward-equivalents of GEMM work per step: forward 1 + backward 2 (+ 1 recomputed forward)."""
        return 3 + int(self.checkpointing)


def _bdlm_layer_tflops(device: torch.device, spec: BDLMLayerSpec, z: dict) -> float:
    import torch.utils.checkpoint

    dims = dict(hidden=spec.hidden, intermediate=spec.intermediate, heads=spec.heads, kv_heads=spec.kv_heads,
                head_dim=spec.head_dim, seq=z["seq"], vocab=2, dtype=torch.float32)  # fmt: skip
    layer, rope = qwen3_layer(device, dims)  # fp32 master weights, as BDLMModel.from_config(dtype=float32)
    layer.train()
    # the residual stream between layers is fp32 (fp32 embeddings; autocast leaves adds and norms in fp32)
    x = torch.randn(z["rows"] // z["seq"], z["seq"], spec.hidden, device=device, dtype=torch.float32)
    x.requires_grad_(True)
    cos_sin = rope(x, torch.arange(z["seq"], device=device)[None])  # fp32, computed once per forward
    grad = torch.randn_like(x)
    weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))

    def bdlm_layer_step():
        layer.zero_grad(set_to_none=True)  # fp32 .grad written afresh, as after optimizer.zero_grad
        x.grad = None
        amp = torch.autocast(device.type, dtype=torch.bfloat16) if spec.autocast else nullcontext()
        with amp:  # forward under autocast, backward outside it (training/step.py)
            if spec.checkpointing:  # what transformers' activation checkpointing wraps around each layer
                out = torch.utils.checkpoint.checkpoint(
                    layer, x, position_embeddings=cos_sin, use_reentrant=False
                )
            else:
                out = layer(x, position_embeddings=cos_sin)
        out.backward(grad)

    rows = x.shape[0] * x.shape[1]
    return rows * 2 * weights * spec.passes / timed(bdlm_layer_step, device, z["reps"]) / 1e12


def measure_bdlm_layer(device: torch.device, spec: BDLMLayerSpec) -> dict[str, float | str]:
    """bdlm_layer_tflops of this device for the layer `spec` and bdlm_layer_shape = spec.key (module
    docstring)."""
    z = BDLM_LAYER_SIZES["cuda" if device.type == "cuda" else "cpu"]
    precision = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as training sets it (fp32 runs: TF32 tensor cores)
    try:
        rate = _bdlm_layer_tflops(device, spec, z)
    finally:
        torch.set_float32_matmul_precision(precision)
    return dict(bdlm_layer_tflops=rate, bdlm_layer_shape=spec.key)
