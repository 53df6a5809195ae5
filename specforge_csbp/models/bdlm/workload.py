"""BDLM training as a `Workload` of the generic trainer (training/workload.py).

Per step and micro batch, every rank of a CP group builds the same clean sequences and samples the same
noise (seeded by (seed, step, global sequence id)), builds the full 2L batch, and keeps its own rows:

    clean [n, L] ──objective.build──► 2L batch [n', 2L] ──shard(plan)──► this rank's rows ──► model ──► CE
                   (noise from seeds)                     (q_rows; replicas carry no loss)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...layout.cost import bdlm_visible_pairs
from ...objectives.convert import ConvertObjective
from ...objectives.noise import BDLMBatch, sequence_seed
from ...objectives.router_aux import ROUTER_AUX_TOKENS, router_aux_numerator, router_aux_rows
from ...objectives.sft import SFTObjective
from .adapter import BDLMModel
from .data import TokenSource
from .routing import config_windows

__all__ = ["BDLMMicroBatch", "BDLMWorkload", "bdlm_model_flops"]


@dataclass
class BDLMMicroBatch:
    batch: BDLMBatch  # this rank's rows, on the training device
    denominator: float  # this rank's share of the global denominator


def _matmul_params(model: BDLMModel) -> float:
    """Parameters one row multiplies with: every linear weight but the embeddings / head, with MoE experts
    counted at top_k / num_experts (a row visits top_k experts). transformers 5 stores experts as stacked
    [E, ...] parameters under an `experts` module, 4.x as a ModuleList of linears: both are counted here."""
    cfg = model.config
    embeddings = {id(model.lm.get_input_embeddings().weight), id(model.lm.get_output_embeddings().weight)}
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    in_experts: set[int] = set()
    expert_params = 0
    if experts and top_k:
        for name, module in model.lm.named_modules():
            if name.endswith("experts"):
                for p in module.parameters():
                    if id(p) not in in_experts and p.dim() >= 2:
                        in_experts.add(id(p))
                        expert_params += p.numel()
    dense = sum(
        m.weight.numel()
        for m in model.lm.modules()
        if isinstance(m, nn.Linear) and id(m.weight) not in embeddings and id(m.weight) not in in_experts
    )
    gates = sum(  # transformers 5 routers are bare [E, H] parameters
        m.weight.numel() for n, m in model.lm.named_modules()
        if n.endswith("gate") and not isinstance(m, nn.Linear)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
    )  # fmt: skip
    return float(dense + gates) + (expert_params * top_k / experts if in_experts else 0.0)


def bdlm_model_flops(model: BDLMModel, *, seq_len: int, sequences: int, supervised_rows: float) -> float:
    """Model FLOPs (fwd + bwd, no recompute) of `sequences` 2L sequences: 6 x matmul params x rows (MoE:
    the active experts), the visible attention pairs of each layer (its sliding window, if any; 4 x pairs
    x head_dim x heads forward, twice that backward) and the LM head on the supervised rows only."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    windows = model.layer_windows or tuple(config_windows(cfg)) or (None,) * cfg.num_hidden_layers
    pairs = sum(
        bdlm_visible_pairs(seq_len, model.block_size, model.clean_within_block, w if w and w < seq_len else None)
        for w in windows
    )
    rows = 2 * seq_len * sequences
    vocab, hidden = model.lm.get_output_embeddings().weight.shape
    return (
        6.0 * _matmul_params(model) * rows
        + 12.0 * pairs * head_dim * heads * sequences
        + 6.0 * vocab * hidden * supervised_rows
    )


class BDLMWorkload:
    def __init__(
        self,
        *,
        make_model: Callable[[], BDLMModel],
        objective: SFTObjective | ConvertObjective,
        source: TokenSource,
        seq_len: int,
        exclude_mask_from_softmax: bool = False,
        ce_chunk_size: int = 4096,
        router_aux_loss_coef: float | None = None,
        router_aux_tokens: str = "both",
    ):
        if seq_len % objective.block_size:
            raise ValueError(
                f"data.max_length ({seq_len}) must be a multiple of model.block_size ({objective.block_size})"
            )
        self.make_model, self.objective, self.source, self.seq_len = make_model, objective, source, seq_len
        self.exclude_ids = [objective.mask_token_id] if exclude_mask_from_softmax else None
        self.ce_chunk_size = ce_chunk_size
        if router_aux_tokens not in ROUTER_AUX_TOKENS:
            allowed = ", ".join(ROUTER_AUX_TOKENS)
            raise ValueError(f"objective.router_aux_tokens must be one of {allowed}; got {router_aux_tokens!r}")
        if router_aux_loss_coef is not None and router_aux_loss_coef < 0:
            raise ValueError(f"objective.router_aux_loss_coef must be >= 0; got {router_aux_loss_coef}")
        self.router_aux_loss_coef, self.router_aux_tokens = router_aux_loss_coef, router_aux_tokens
        self.aux_coef = 0.0  # resolved against the model in build_model
        self._aux_rows: torch.Tensor | None = None
        self._group = None
        self._attention = None
        self._model: BDLMModel | None = None

    # -- Workload protocol ------------------------------------------------------------------------------
    def build_model(self, ctx) -> BDLMModel:
        model = self.make_model()
        if model.block_size != self.objective.block_size:
            raise ValueError(
                f"model.block_size {model.block_size} != objective block size {self.objective.block_size}"
            )
        if not 0 <= self.objective.mask_token_id < model.vocab_size:
            raise ValueError(
                f"objective.mask_token_id must be in [0, {model.vocab_size}) (the vocab); "
                f"got {self.objective.mask_token_id}"
            )
        model.backend, model.schedule = ctx.attention_backend, ctx.attention_schedule
        self.bind(model, ctx)
        return model

    def _resolve_aux_coef(self, model: BDLMModel) -> float:
        """objective.router_aux_loss_coef, else the model's own switch: config.router_aux_loss_coef when
        config.output_router_logits (transformers' convention); 0 for dense models."""
        cfg = model.config
        if self.router_aux_loss_coef is None:
            on = model.is_moe and getattr(cfg, "output_router_logits", False)
            return float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0) if on else 0.0
        if self.router_aux_loss_coef > 0 and not model.is_moe:
            raise ValueError(
                f"objective.router_aux_loss_coef: {type(model.lm).__name__} has no mixture-of-experts router"
            )
        return float(self.router_aux_loss_coef)

    def bind(self, model: BDLMModel, ctx, attention=None) -> None:
        """Use `model` with ctx's CP group and mode (or a given executor, e.g. an instrumented one)."""
        self._attention = attention or model.attention(ctx.mode, self.seq_len, ctx.cp_group)
        self._model = model
        self.aux_coef = self._resolve_aux_coef(model)
        self._group = getattr(ctx, "cp_group", None)
        self._aux_rows = router_aux_rows(self._attention.plan, self.router_aux_tokens)

    def microbatches(self, ctx, step: int) -> Sequence[BDLMMicroBatch]:
        assert self._attention is not None, "build_model() first"
        out = []
        for micro in range(ctx.grad_accum):
            ids = [ctx.sequence_index(step, micro, i) for i in range(ctx.micro_batch_size)]
            out.append(self.microbatch(ids, [sequence_seed(ctx.seed, step, i) for i in ids], ctx.device))
        return out

    def microbatch(self, ids: Sequence[int], seeds: Sequence[int], device: torch.device) -> BDLMMicroBatch:
        tokens, loss_mask = self.source.get(ids)
        local = self.objective.build(tokens, loss_mask, seeds).shard(self._attention.plan)
        return BDLMMicroBatch(local.to(device), local.denominator)

    def loss_numerator(self, model: BDLMModel, batch: BDLMMicroBatch, ctx=None) -> torch.Tensor:
        """CE numerator of this rank's supervised rows (+ coef x the router aux numerator, MoE models:
        objectives/router_aux.py; the trainer divides both by the same global denominator)."""
        hidden, router = model.forward_with_router_logits(
            batch.batch.input_ids, self._attention, router_logits=self.aux_coef > 0
        )
        weight, bias = model.head()
        loss = batch.batch.loss_numerator(
            hidden, weight, bias, exclude_ids=self.exclude_ids, chunk_size=self.ce_chunk_size
        )
        return loss + self.aux_numerator(model, batch, router).to(loss.dtype)

    def aux_numerator(self, model: BDLMModel, batch: BDLMMicroBatch, router: tuple) -> torch.Tensor:
        """coef x the router's load-balancing numerator of this rank's rows (0 when the aux loss is off)."""
        if self.aux_coef <= 0:
            return torch.zeros((), device=batch.batch.counts.device)
        if not router:
            raise ValueError(
                f"model: {type(model.lm).__name__} returned no router logits; "
                "set objective.router_aux_loss_coef=0"
            )
        top_k = int(getattr(model.config, "num_experts_per_tok"))
        counts = batch.batch.counts.sum(1)  # this rank's share of each sequence's denominator count
        aux = router_aux_numerator(router, self._aux_rows, counts, top_k=top_k, group=self._group)
        return self.aux_coef * aux

    def tokens_per_step(self, ctx) -> int:
        return ctx.global_batch * self.seq_len

    def flops_per_step(self, ctx) -> float | None:
        """Expected model FLOPs: SFT supervises a fraction E[t] = (1 + eps) / 2 of the tokens, conversion
        every token once (over its two views)."""
        if self._model is None:
            return None
        views = self.objective.batch_factor
        fraction = 1.0 if views == 2 else (1.0 + self.objective.eps) / 2
        return bdlm_model_flops(
            self._model, seq_len=self.seq_len, sequences=ctx.global_batch * views,
            supervised_rows=fraction * ctx.global_batch * self.seq_len,
        )  # fmt: skip

    # -- checkpoints: a loadable Hugging Face directory ---------------------------------------------------
    def save_model(self, model: BDLMModel, path: Path) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the trainer logs its own lines
        model.lm.save_pretrained(path, safe_serialization=True)

    def load_model(self, model: BDLMModel, path: Path) -> None:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(str(f), device=str(next(model.parameters()).device)))
        missing, unexpected = model.lm.load_state_dict(state, strict=False)
        tied = {k for k in missing if _is_tied(model.lm, k)}
        if set(missing) - tied or unexpected:
            raise ValueError(
                f"checkpoint {path}: missing {sorted(set(missing) - tied)}, unexpected {unexpected}"
            )


def _is_tied(lm: nn.Module, key: str) -> bool:
    """True when parameter `key` shares its storage with another parameter that was loaded."""
    params = dict(lm.named_parameters(remove_duplicate=False))
    return key in params and any(p is params[key] and k != key for k, p in params.items())
