"""DFlash and DFlash2 draft models (transformers conventions, SGLang parameter names).

    target features [Nc, K*H] --fc--> hidden_norm --> context c        (no queries; K/V per layer)
    draft blocks    [anchor, MASK x (S-1)] --target embedding--> x     (the only queries)

    per layer:  x += o_proj(attn(q(x), [k(c); k(x)], [v(c); v(x)]))    (DFlash2: conv around attn)
                x += mlp(x)                                            (DFlash2: conv around mlp)
    out = norm(x)  -> the target's frozen LM head (objectives/dflash.py)

Who sees what is the one visibility rule (masks/visibility.py): a block's queries see context positions
< anchor and their own block; sliding layers add a window and (unless is_causal = false) causality inside
the block. The attention itself is a callable per layer type, `attend(q, k, v) -> (out, lse)` over the
kv rows [selected context rows ; block rows] - a `ShardedAttention` of the step's plan (sharding.py), so
the same model runs the reference, DP, CP and CSBP. The caller always hands it in (layer_attention.py): the
single-process one is `sharding.reference_attention`; the model never builds a plan for itself.

The token-wise chains between the GEMMs - per-head q/k RMSNorm + RoPE (over every context row of every
layer), the decoder's and the context's RMSNorms, SiLU-and-multiply, DFlash2's block-causal conv - are
eager by default and compiled in place by `compile_token_wise()` (the trainer does it on GPUs): eager, each
is a chain of elementwise passes over its rows in forward and backward; compiled, one kernel each way.

Index inputs (position ids, context positions, `LayerAttention.ctx_index`) are used where they are when
they already live on the computation's device - a prepared step stages them there ahead of time
(prefetch.py) - and copied otherwise (the reference path, direct calls with host tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RotaryEmbedding, rotate_half

from .configuration import DFLASH2_ARCH, DFLASH_ARCH, DFlashConfig
from ...devices import compiled_once
from .conv import DFlashGroupedConv, block_causal_conv
from .layer_attention import Attend, LayerAttention, LayerContext
from .selector import CandidateSelector

__all__ = ["DFlash2DraftModel", "DFlashDraftModel", "DFlashPreTrainedModel", "LayerAttention", "LayerContext"]


def _on(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An index input on `device`: as it is when staged there already, else copied (unprepared callers)."""
    return index if index.device == device else index.to(device)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, N, D]; cos/sin [B, N, D]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def _normed_rope_heads(
    t: torch.Tensor, weight: torch.Tensor, eps: float | None, heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """A q or k projection [B, N, heads*D] -> per-head RMSNorm, RoPE -> [B, heads, N, D]."""
    t = t.unflatten(-1, (heads, -1))
    t = F.rms_norm(t, (t.shape[-1],), weight, eps).transpose(1, 2)
    return _rope(t, cos, sin)


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.head_dim = int(config.head_dim)
        self.num_heads, self.num_kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.normed_rope_heads = _normed_rope_heads  # compiled in place by compile_token_wise()

    def _heads(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)  # [B, heads, N, D]

    def context_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The [k | v] projection of context rows as one linear map: (weight, bias)."""
        weight = torch.cat([self.k_proj.weight, self.v_proj.weight])
        bias = None if self.k_proj.bias is None else torch.cat([self.k_proj.bias, self.v_proj.bias])
        return weight, bias

    def context_kv(
        self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of context rows (one GEMM for both): k-norm and RoPE at the context positions."""
        return self.context_kv_from(F.linear(ctx, *self.context_weight()), cos, sin)

    def context_kv_from(
        self, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of context rows from their [k | v] projection `kv` (`context_weight`)."""
        k, v = kv.split(self.num_kv_heads * self.head_dim, dim=-1)
        k = self.normed_rope_heads(k, self.k_norm.weight, self.k_norm.eps, self.num_kv_heads, cos, sin)
        return k, self._heads(v, self.num_kv_heads)

    def forward(self, x, ctx, rope_q, rope_ctx, attend: Attend, context: LayerContext | None = None) -> torch.Tensor:
        """`context`: this layer's context K/V computed ahead (then `ctx` / `rope_ctx` are not used; the
        drafter's forward always hands them in, from one GEMM per layer type)."""
        q = self.normed_rope_heads(self.q_proj(x), self.q_norm.weight, self.q_norm.eps, self.num_heads, *rope_q)
        k = self.normed_rope_heads(self.k_proj(x), self.k_norm.weight, self.k_norm.eps, self.num_kv_heads, *rope_q)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        if context is None:
            context = LayerContext(*self.context_kv(ctx, *rope_ctx))
        extra = {} if context.gathered is None else {"gathered": context.gathered}
        out, _ = attend(q, torch.cat([context.k, k], dim=2), torch.cat([context.v, v], dim=2), **extra)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if config.is_dflash2:
            args = (
                config.hidden_size,
                config.draft_block_size,
                config.dflash2_field("conv_kernel_size"),
                config.dflash2_field("conv_group_size"),
            )
            self.attention_conv, self.mlp_conv = DFlashGroupedConv(*args), DFlashGroupedConv(*args)

    def forward(self, x, ctx, rope_q, rope_ctx, attend: Attend, context: LayerContext | None = None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.attention_conv is not None:
            h, coef = self.attention_conv.prepare(h)
        h = self.self_attn(h, ctx, rope_q, rope_ctx, attend, context)
        if self.attention_conv is not None:
            h = self.attention_conv.finish(h, coef)
        x = x + h
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            h, coef = self.mlp_conv.prepare(h)
        h = self.mlp(h)
        if self.mlp_conv is not None:
            h = self.mlp_conv.finish(h, coef)
        return x + h


def _init():
    try:  # transformers >= 5: init functions that skip weights loaded from a checkpoint
        from transformers import initialization

        return initialization
    except ImportError:  # pragma: no cover - transformers 4.x
        from types import SimpleNamespace

        def copy_(t, other):
            with torch.no_grad():
                return t.copy_(other)

        return SimpleNamespace(
            normal_=nn.init.normal_, zeros_=nn.init.zeros_, ones_=nn.init.ones_, copy_=copy_
        )


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "model"
    _no_split_modules = ("DFlashDecoderLayer",)
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        init, std = _init(), self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DFlashGroupedConv):  # children (kernel_projection) are initialised first
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            init.copy_(module.base_kernel, identity)
            init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):
            init.normal_(module.predecessor_codebook, mean=0.0, std=std)
            init.zeros_(module.successor_codebook)
        else:  # buffers such as rotary_emb.inv_freq are (re)computed by transformers' own init
            super()._init_weights(module)


class DFlashDraftModel(DFlashPreTrainedModel):
    """DFlash drafter. `forward` returns the final-normed hidden states of the draft-block rows."""

    _architecture = DFLASH_ARCH

    def __init__(self, config: DFlashConfig):
        if not isinstance(config, DFlashConfig):
            config = DFlashConfig(**config.to_dict())
        config.validate_dflash()
        if config.architecture != self._architecture:
            raise ValueError(
                f"architectures: {type(self).__name__} needs [{self._architecture!r}]; got {config.architectures}"
            )
        super().__init__(config)
        h = config.hidden_size
        self.block_size = config.draft_block_size
        self.target_layer_ids = config.target_layer_ids
        self.mask_token_id = config.mask_token_id
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if config.is_dflash2:
            self.candidate_selector = CandidateSelector(
                h,
                config.vocab_size,
                config.dflash2_field("selector_rank"),
                config.dflash2_field("selector_top_k"),
            )
        self.post_init()

    def compile_token_wise(self) -> int:
        """torch.compile the token-wise chains in place (module docstring); the GEMMs, the attention seam and
        its collectives stay eager. Idempotent. Returns how many modules and functions now run compiled.

            decoder layer, eager:  norm | q,k,v proj | q/k norm + RoPE | attention | o_proj | norm | MLP
            compiled:             [norm]            [ one graph each  ]                    [norm][graph]
            context:               k/v proj of every layer of a type (one GEMM) | per layer [k norm + RoPE];  hidden_norm: [norm]
        """
        count = 0
        inside_attention = {id(n) for a in self.modules() if isinstance(a, DFlashAttention) for n in (a.q_norm, a.k_norm)}
        for m in self.modules():
            if isinstance(m, DFlashAttention):
                m.normed_rope_heads = compiled_once(_normed_rope_heads)
                count += 1
            elif isinstance(m, DFlashGroupedConv):
                m.block_causal_conv = compiled_once(block_causal_conv)
                count += 1
            elif isinstance(m, (Qwen3MLP, nn.RMSNorm)) and id(m) not in inside_attention:
                m.compile(dynamic=None)
                count += 1
        return count

    @property
    def layer_types(self) -> list[str]:
        return [layer.layer_type for layer in self.layers]

    def check_features(self, features: torch.Tensor) -> None:
        width = len(self.target_layer_ids) * self.config.hidden_size
        if features.shape[-1] != width:
            raise ValueError(
                f"features: last dim {features.shape[-1]} != len(dflash_config.target_layer_ids) = "
                f"{len(self.target_layer_ids)} x hidden_size = {self.config.hidden_size} = {width}"
            )

    def project_context(self, features: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """[B, Nc, K*H] target features (or consecutive pieces of them, e.g. one per stored interval, which
        avoids copying the widest tensor of the step) -> [B, Nc, H] context states (fc + hidden_norm)."""
        if isinstance(features, torch.Tensor):
            features = [features]
        for part in features:
            self.check_features(part)
        projected = [self.hidden_norm(self.fc(part.to(self.fc.weight.dtype))) for part in features]
        return projected[0] if len(projected) == 1 else torch.cat(projected, dim=1)

    def forward(
        self,
        noise_embedding: torch.Tensor,
        position_ids: torch.Tensor,
        target_hidden: torch.Tensor | Sequence[torch.Tensor],
        context_position_ids: torch.Tensor,
        attention: Mapping[str, LayerAttention],
    ) -> torch.Tensor:
        """noise_embedding [B, N*S, H] (target embeddings of [anchor, MASK...] per block), position_ids [N*S],
        target_hidden [B, Nc, K*H] context features (or its consecutive pieces) at context_position_ids [Nc]
        -> hidden [B, N*S, H].

        `attention` maps each layer type to its LayerAttention: the step's plan (sharding.plan_attention) or
        the single-process reference (sharding.reference_attention(config, position_ids[::block_size],
        context_position_ids)).
        """
        if noise_embedding.shape[1] % self.block_size:
            raise ValueError(
                f"noise_embedding rows ({noise_embedding.shape[1]}) must be whole blocks of {self.block_size}"
            )
        ctx = self.project_context(target_hidden)
        x = noise_embedding
        rope_q = self.rotary_emb(x, _on(position_ids, x.device).reshape(1, -1))
        rope_ctx_all = self.rotary_emb(ctx, _on(context_position_ids, ctx.device).reshape(1, -1))
        selected: dict[str, tuple] = {}

        def context_rows(kind: str) -> tuple:  # context rows (and their RoPE) per layer type, once
            if kind not in selected:
                spec = attention[kind]
                if spec.ctx_index is None:
                    selected[kind] = (ctx, rope_ctx_all)
                else:
                    idx = _on(spec.ctx_index, ctx.device)
                    selected[kind] = (ctx.index_select(1, idx), tuple(t.index_select(1, idx) for t in rope_ctx_all))
            return selected[kind]

        projected: dict[str, dict[int, torch.Tensor]] = {}

        def context_projection(i: int) -> torch.Tensor:
            # layer i's [k | v] context projection; one GEMM per layer type for all its layers: their
            # gradients into the shared context rows come out of one GEMM instead of being summed layer by layer
            kind = self.layers[i].layer_type
            if kind not in projected:
                members = [j for j, layer in enumerate(self.layers) if layer.layer_type == kind]
                maps = [self.layers[j].self_attn.context_weight() for j in members]
                weight = torch.cat([w for w, _ in maps])
                bias = None if maps[0][1] is None else torch.cat([b for _, b in maps])
                kv = F.linear(context_rows(kind)[0], weight, bias)
                projected[kind] = dict(zip(members, kv.split(maps[0][0].shape[0], dim=-1)))
            return projected[kind][i]

        def layer_context(i: int, begin: bool) -> LayerContext:  # layer i's context K/V (and its gather, begun)
            layer = self.layers[i]
            k_ctx, v_ctx = layer.self_attn.context_kv_from(context_projection(i), *context_rows(layer.layer_type)[1])
            return LayerContext(k_ctx, v_ctx, attention[layer.layer_type].attend.begin(k_ctx, v_ctx) if begin else None)

        def ahead(i: int) -> LayerContext | None:  # layer i's context K/V and its gather, started now
            if i >= len(self.layers) or not attention[self.layers[i].layer_type].gather_ahead:
                return None
            return layer_context(i, begin=True)

        upcoming = ahead(0)
        for i, layer in enumerate(self.layers):
            current, upcoming = upcoming, ahead(i + 1)  # layer i + 1's gather runs behind layer i
            if current is None:
                current = layer_context(i, begin=False)
            ctx_l, rope_ctx = context_rows(layer.layer_type)
            x = layer(x, ctx_l, rope_q, rope_ctx, attention[layer.layer_type].attend, current)
        return self.norm(x)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: grouped dynamic convolutions around every sublayer and a candidate selector."""

    _architecture = DFLASH2_ARCH
