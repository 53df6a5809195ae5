"""Target hidden states for DFlash context features, from a Hugging Face transformers causal LM.

Layer-id convention (SpecForge 0.2.0 and SGLang, checked in their sources): target layer id k means the
output of decoder layer k (0-based), i.e. `model(..., output_hidden_states=True).hidden_states[k + 1]` -
SpecForge's `extract_context_feature` uses offset 1, and SGLang's `set_dflash_layers_to_capture` captures
"before layer k + 1" (hidden + residual). Features of one token are the layers' states concatenated in
`target_layer_ids` order:

    row p = [ h_{ids[0]}(p) | h_{ids[1]}(p) | ... ]          width len(ids) * hidden_size

Ids run from 0 to num_hidden_layers - 2: the last layer's output is not a capture point SGLang has (there
is no layer after it), and transformers' hidden_states[-1] has the final norm applied.

Instead of `output_hidden_states` (which keeps every layer's [L, hidden] alive - tens of GB at 128K+),
forward hooks on the chosen layers copy their outputs straight into one [L, W] buffer on the host, and the
forward stops after the deepest chosen layer (no later layers, no LM head). `chunk_size` runs the prefill
in chunks with transformers' cache, so activation memory is per chunk; the features equal the
whole-sequence ones up to the target kernels' numerics (float64 Qwen3: ~1e-15; linear-attention layers,
whose chunked and recurrent kernels differ, ~1e-8).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

import torch

from .manifest import target_info

__all__ = ["TargetFeatures", "check_target_layer_ids", "has_weights", "load_target", "random_target"]

_DTYPES = ("float32", "float64", "bfloat16", "float16")


class _StopForward(Exception):
    """Raised by the deepest hook: nothing after it is needed."""


def has_weights(path: str) -> bool:
    return os.path.isdir(path) and any(
        name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))
        for name in os.listdir(path)
    )


def check_target_layer_ids(target_layer_ids: Sequence[int], num_hidden_layers: int) -> list[int]:
    ids = [int(i) for i in target_layer_ids]
    top = num_hidden_layers - 2
    if not ids or len(set(ids)) != len(ids) or any(not 0 <= i <= top for i in ids):
        raise ValueError(
            f"target_layer_ids: need unique ids in [0, {top}] for a target with {num_hidden_layers} layers "
            f"(id k = output of decoder layer k; the last layer is not a capture point), got {ids}"
        )
    return ids


def random_target(config, seed: int, dtype: str = "float32"):
    """AutoModelForCausalLM with random weights: initialized in float32 under `seed`, then cast, so the
    same seed gives the same weights whatever dtype is asked for."""
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(getattr(torch, dtype))


def load_target(
    path: str, *, dtype: str, device: str = "cpu", seed: int = 0, attn_implementation: str = "sdpa"
):
    """(model, TargetInfo). `path` is a checkpoint directory, or a config (a .json file or a directory
    without weights) for a randomly initialized target with `seed`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    if not os.path.exists(path):
        raise ValueError(f"target: {path} does not exist (give a checkpoint directory or a config.json)")
    config = AutoConfig.from_pretrained(path)
    info = target_info(path, config)
    config._attn_implementation = attn_implementation
    if has_weights(path):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
        )
    else:
        model = random_target(config, seed, dtype)
        info.random_init_seed = seed
    return model.to(device).eval(), info


class TargetFeatures:
    """Callable: input_ids [L] -> features [L, len(target_layer_ids) * hidden_size] on the host."""

    def __init__(
        self, model, target_layer_ids: Sequence[int], *, chunk_size: int = 0, out_dtype=None
    ) -> None:
        text_config = model.config.get_text_config()
        self.hidden_size = int(text_config.hidden_size)
        self.target_layer_ids = check_target_layer_ids(target_layer_ids, int(text_config.num_hidden_layers))
        if chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0 (0 = whole sequence), got {chunk_size}")
        self.model, self.chunk_size = model, chunk_size
        self.out_dtype = out_dtype or next(model.parameters()).dtype
        # the text decoder that owns the layers (also for hybrid/multimodal targets such as Qwen3.5)
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        if not hasattr(self.base, "layers"):
            raise ValueError(f"target: {type(model).__name__} has no decoder `layers` to hook")
        self._buffer: torch.Tensor | None = None
        self._span = (0, 0)
        # transformers renamed `past_key_values` to `cache` (5.2x); pass whichever this version takes.
        params = inspect.signature(self.base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def _hook(self, column: int, last: bool):
        lo_col, hi_col = column * self.hidden_size, (column + 1) * self.hidden_size

        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            lo, hi = self._span
            self._buffer[lo:hi, lo_col:hi_col].copy_(hidden[0])
            if last:
                raise _StopForward

        return hook

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        length = int(input_ids.shape[0])
        self._buffer = torch.empty(length, self.width, dtype=self.out_dtype)
        deepest = max(self.target_layer_ids)
        handles = [
            self.base.layers[k].register_forward_hook(self._hook(col, k == deepest))
            for col, k in enumerate(self.target_layer_ids)
        ]
        device = next(self.model.parameters()).device
        step = self.chunk_size or length
        cache = DynamicCache(config=self.model.config) if step < length else None
        try:
            for lo in range(0, length, step):
                hi = min(lo + step, length)
                self._span = (lo, hi)
                chunk = input_ids[lo:hi].to(device)[None]
                try:
                    if cache is None:
                        self.base(input_ids=chunk, use_cache=False)
                    else:
                        self.base(input_ids=chunk, use_cache=True, **{self._cache_kw: cache})
                except _StopForward:
                    pass
        finally:
            for h in handles:
                h.remove()
        out, self._buffer = self._buffer, None
        return out
