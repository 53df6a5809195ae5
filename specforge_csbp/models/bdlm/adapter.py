"""`BDLMModel`: a Hugging Face causal LM run as a block-diffusion LM on the 2L representation.

Each rank feeds only its own rows of the 2L sequence (clean copy x0 then corrupted copy xt, shared
position ids); `plan.q_rows` says which, `plan.q_tokens.pos` gives their positions:

    reference rows:  x0[0] ... x0[L-1] | xt[0] ... xt[L-1]        positions 0..L-1 | 0..L-1
    csbp rank r:     clean zigzag shard of r + corrupted blocks owned by r   (plan.q_rows)

Embeddings, projections, norms, MLPs and the final norm are token-wise and run on the local rows only;
attention goes through `routing.routed_attention` -> `ShardedAttention(plan)`. The output is the final
hidden state of the local rows; the LM head is applied inside the chunked loss (`head()`), never as
[tokens, vocab] logits.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...masks.visibility import CLEAN_RULES
from ...parallel import AttentionOptions, ShardedAttention, bdlm_attention
from ...preflight import check_finite_tensors, check_weights_dir
from .routing import ATTENTION_NAME, ROUTE_KWARG, Route, check_routable, keep_attention_outputs, register_attention

__all__ = ["BDLMModel", "COMPILE_SCOPES"]

#: what `BDLMModel.compile_token_wise` compiles (train.compile)
COMPILE_SCOPES = ("layers", "norms")


def _set_attention(lm: nn.Module, name: str) -> None:
    """Point every (sub-)config of the model at attention implementation `name`."""
    from transformers import PretrainedConfig

    for module in lm.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            config._attn_implementation = name


def _is_moe(config) -> bool:
    """Mixture-of-experts MLPs (Qwen3-MoE `num_experts`, Mixtral `num_local_experts`)."""
    return any(getattr(config, f, None) for f in ("num_experts", "num_local_experts"))


def _is_expert_block(mlp: nn.Module) -> bool:
    """A mixture-of-experts block (experts behind a router), not a dense MLP."""
    return hasattr(mlp, "experts")


def _load_kwargs(config, dtype: torch.dtype | None, experts: str | None = None) -> dict[str, Any]:
    """from_config / from_pretrained keywords: the dtype, and the MoE experts kernel - `experts` if given,
    the per-expert loop for float64 (transformers' default grouped matmul has no float64 kernel; the loop
    computes the same experts)."""
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if _is_moe(config) and (experts is not None or dtype == torch.float64):
        kwargs["experts_implementation"] = experts or "eager"
    return kwargs


def _positions_seen(plan) -> int:
    """1 + the largest position among this rank's keys and gathered keys (the sequence length for CP/CSBP)."""
    pos = torch.cat([plan.kv_tokens.pos, plan.remote_kv_tokens.pos, torch.zeros(1, dtype=torch.long)])
    return int(pos.max()) + 1


class BDLMModel(nn.Module):
    """A causal LM (`lm`, e.g. Qwen3ForCausalLM) whose attention follows the BDLM visibility rule."""

    def __init__(
        self,
        lm: nn.Module,
        *,
        block_size: int,
        clean_within_block: str = "causal",
        backend: str = "auto",
        schedule: str | None = None,
    ):
        super().__init__()
        if block_size < 1:
            raise ValueError(f"model.block_size must be >= 1, got {block_size}")
        if clean_within_block not in CLEAN_RULES:
            raise ValueError(
                f"model.clean_within_block must be one of {', '.join(CLEAN_RULES)}; "
                f"got {clean_within_block!r}"
            )
        check_routable(lm)
        register_attention()
        _set_attention(lm, ATTENTION_NAME)
        self.lm = lm
        self.block_size = block_size
        self.clean_within_block = clean_within_block
        self.backend = backend
        self.schedule = schedule  # ShardedAttention's (None: fused)
        self._attention: dict[Any, ShardedAttention] = {}
        self._seq_lens: weakref.WeakKeyDictionary[ShardedAttention, int] = weakref.WeakKeyDictionary()
        self.layer_windows: tuple[int | None, ...] | None = None  # seen in the last forward

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls, config: Any, *, dtype: torch.dtype | None = None, experts_implementation: str | None = None,
        **kwargs: Any,
    ) -> BDLMModel:
        """Random weights from a transformers config or a dict with `model_type` (e.g. tiny Qwen3).
        `experts_implementation`: transformers' MoE experts kernel (None: its default)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if isinstance(config, dict):
            config = dict(config)
            model_type = config.pop("model_type", None)
            if model_type is None:
                raise ValueError("model.config must name its model_type (e.g. qwen3, llama)")
            config = AutoConfig.for_model(model_type, **config)
        load = _load_kwargs(config, dtype, experts_implementation)
        load.pop("dtype", None)  # from_config's dtype sets the default dtype only while building; cast below
        lm = AutoModelForCausalLM.from_config(config, **load)
        if dtype is not None:
            lm = lm.to(dtype)
        return cls(lm, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype | None = None, **kwargs: Any) -> BDLMModel:
        """Weights and config from a `save_pretrained` directory (any family `from_config` takes)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(f"model.pretrained: {path} is not a save_pretrained directory ({first})") from None
        check_weights_dir(path, "model.pretrained")
        try:
            lm = AutoModelForCausalLM.from_pretrained(path, **_load_kwargs(config, dtype))
        except Exception as err:  # a truncated or mismatched weights file (an out of memory stays itself)
            if not isinstance(err, (OSError, ValueError)) and type(err).__name__ != "SafetensorError":
                raise
            first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
            raise ValueError(f"model.pretrained: cannot load the weights of {path} ({first})") from None
        check_finite_tensors(dict(lm.named_parameters()), "model.pretrained", path)
        return cls(lm, **kwargs)

    # -- properties ----------------------------------------------------------------------------------
    @property
    def config(self):
        return self.lm.config

    @property
    def is_moe(self) -> bool:
        """The MLPs are mixtures of experts with a router (Qwen3-MoE, Mixtral-style)."""
        return _is_moe(self.lm.config)

    @property
    def vocab_size(self) -> int:
        """Ids valid for both the input embedding and the LM head."""
        return min(
            self.lm.get_input_embeddings().num_embeddings, self.lm.get_output_embeddings().out_features
        )

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [V, H], bias [V] or None) of the LM head, for the chunked loss."""
        head = self.lm.get_output_embeddings()
        return head.weight, head.bias

    def enable_activation_checkpointing(self, *, keep_attention: bool = False) -> None:
        """Checkpoint every decoder layer (non-reentrant, so keyword inputs such as the route survive).
        keep_attention: the recompute takes each layer's attention output from its forward instead of
        attending again (routing.py; the memory: planner/memory.py attention_bytes_per_row)."""
        enable = getattr(self.lm, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # transformers < 5
            self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if keep_attention:
            self.keep_attention_outputs(range(len(self.lm.base_model.layers)))

    def compile_token_wise(self, scope: str = "layers") -> int:
        """torch.compile the token-wise work of the LM in place (transformers' own forwards), per `scope`:

            "norms"   every RMSNorm module
            "layers"  the norms, and in every decoder layer its attention module - q/k/v projections,
                      q/k norms, RoPE, o_proj, compiled around the routed attention call, which stays
                      eager (`routing.routed_attention` is opaque to dynamo: its executor runs its own
                      compiled kernels and collectives) - and its MLP unless it is a mixture of experts
                      (expert dispatch has data-dependent shapes)

            decoder layer, eager:   norm | q,k,v proj | q/k norm | RoPE | attention | o_proj | norm | MLP
            "layers":              [norm][  one graph: proj, norms, RoPE ][eager ][graph][norm][graph]

        Why: eager, each of these is a chain of elementwise passes over every row (RMSNorm ~6, RoPE ~8 on
        strided views, SiLU-and-multiply 3) in forward, recompute and backward - at long contexts the
        largest cost next to attention and GEMMs; compiled, each chain is one kernel each way. Dynamo
        traces module parameters as inputs, so the layers share one graph per (class, input shape, dtype,
        window). Returns how many modules were compiled."""
        if scope not in COMPILE_SCOPES:
            raise ValueError(f"train.compile: scope must be one of {', '.join(COMPILE_SCOPES)}; got {scope!r}")
        modules = [m for m in self.lm.modules() if type(m).__name__.endswith("RMSNorm")]
        if scope == "layers":
            for layer in self.lm.base_model.layers:
                modules.append(layer.self_attn)
                mlp = getattr(layer, "mlp", None)
                if mlp is not None and not _is_expert_block(mlp):
                    modules.append(mlp)
        for m in modules:
            m.compile(dynamic=None)
        return len(modules)

    def keep_attention_outputs(self, layers) -> int:
        """The decoder layers at these indices, and only these, reuse their attention outputs in their
        checkpoint recompute (routing.py); the others attend again. Returns how many."""
        decoder = self.lm.base_model.layers
        chosen = set(layers)
        keep_attention_outputs([m for i, m in enumerate(decoder) if i not in chosen], keep=False)
        return keep_attention_outputs([decoder[i] for i in sorted(chosen)])

    def attention(
        self, mode: str, seq_len: int, group: dist.ProcessGroup | None = None
    ) -> ShardedAttention:
        """This rank's executor for sequences of `seq_len` clean tokens (cached: masks are built once)."""
        key = (mode, seq_len, group, self.backend, self.schedule)
        if key not in self._attention:
            self._attention[key] = bdlm_attention(
                mode, seq_len, self.block_size, group=group, clean_within_block=self.clean_within_block,
                options=AttentionOptions(backend=self.backend, schedule=self.schedule),
            )  # fmt: skip
            self._seq_lens[self._attention[key]] = seq_len
        return self._attention[key]

    def _fit_experts(self) -> None:
        """float64 MoE weights (exactness checks, e.g. `train.precision: float64` casting after the build):
        transformers' grouped-matmul experts have no float64 kernel, its per-expert loop computes the same."""
        if self.lm.get_input_embeddings().weight.dtype != torch.float64:
            return
        if getattr(self.lm.config, "_experts_implementation", "eager") not in (None, "eager"):
            setter = getattr(self.lm, "set_experts_implementation", None)
            if setter is not None:
                setter("eager")

    # -- forward ---------------------------------------------------------------------------------------
    def clear_attention_cache(self) -> None:
        self._attention.clear()

    def forward(self, input_ids: torch.Tensor, attention: ShardedAttention) -> torch.Tensor:
        """input_ids [B, N_local] (this rank's rows, in plan.q_rows order) -> final hidden [B, N_local, H].

        `attention` is this rank's executor (`attention()`), or anything with its `.plan` and signature."""
        return self.forward_with_router_logits(input_ids, attention, router_logits=False)[0]

    def forward_with_router_logits(
        self, input_ids: torch.Tensor, attention: ShardedAttention, *, router_logits: bool = True
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(final hidden [B, N_local, H], one router-logit tensor [B * N_local, E] per MoE layer - empty
        for dense models or router_logits=False)."""
        plan = attention.plan
        if input_ids.dim() != 2 or input_ids.shape[1] != len(plan.q_rows):
            raise ValueError(
                f"input_ids must be [batch, {len(plan.q_rows)}] (this rank's rows); "
                f"got {tuple(input_ids.shape)}"
            )
        if self.is_moe:
            self._fit_experts()
        route = Route(attention, seq_len=self._seq_lens.get(attention) or _positions_seen(plan))
        positions = plan.q_tokens.pos.to(input_ids.device)[None].expand(input_ids.shape[0], -1)
        extra = {"output_router_logits": True} if router_logits and self.is_moe else {}
        out = self.lm.base_model(
            input_ids=input_ids, position_ids=positions, use_cache=False, **extra, **{ROUTE_KWARG: route}
        )
        layers = getattr(self.lm.config, "num_hidden_layers", None)
        if layers is not None and route.calls != layers:
            raise ValueError(
                f"model: {type(self.lm).__name__} routed {route.calls} of {layers} attention layers through "
                f"{ATTENTION_NAME!r}; its attention cannot be routed"
            )
        self.layer_windows = tuple(route.windows)  # per layer: its sliding window, None for full attention
        logits = tuple(getattr(out, "router_logits", None) or ()) if extra else ()
        return out.last_hidden_state, logits
