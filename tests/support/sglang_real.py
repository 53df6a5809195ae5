"""SGLang's own DFLASH / DFLASH2 drafter code, imported from an unpacked wheel with the GPU-only layers stubbed.

    side dir (scripts/setup_env.sh: pip install --no-deps --target .venv/side/sglang-X)
      sglang/srt/models/dflash.py            REAL: DFlashDraftModel, DFlash2DraftModel, load_weights
      sglang/srt/speculative/dflash_utils.py REAL: parse_dflash_draft_config, layer types, sliding window
      everything else under sglang.*         STUB: linear / norm / attention layers at TP = 1, no kernels

What is stubbed is what needs a GPU or SGLang's server state; what the export has to satisfy - config
parsing, the model's parameter tree, the name mapping and fusing in `load_weights` - is SGLang's code.
The stubbed layers keep SGLang's TP = 1 semantics: a fused `qkv_proj` / `gate_up_proj` places shard q|k|v
or 0|1 at its rows, every other loader copies a tensor of exactly the parameter's shape (SGLang asserts the
same). Every write is recorded, so `load_export` reports what SGLang's loader skips without a word:

    ignored   a tensor of the export that reached no weight loader
    missing   a parameter of SGLang's model that no tensor reached
    partial   a fused parameter with rows no shard wrote
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["LoadResult", "SGLangDFlash", "import_sglang_dflash", "side_dir"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_REAL = ("sglang.srt.models.dflash", "sglang.srt.speculative.dflash_utils")


def side_dir(version: str) -> str:
    """Where scripts/setup_env.sh unpacks sglang==version (--no-deps, beside the venv)."""
    return os.path.join(
        os.environ.get("SPECFORGE_CSBP_SIDE", os.path.join(ROOT, ".venv", "side")), f"sglang-{version}"
    )


# -- stubs ---------------------------------------------------------------------------------------------
class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _dummy(name)


class _Dummy(metaclass=_Meta):
    """Anything SGLang names at import time but the loader never uses (kernels, server state, types)."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Dummy()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _dummy(name)


def _dummy(name: str) -> type:
    return _Meta(name, (_Dummy,), {})


class _Log:
    """Rows of each parameter written by a weight loader, and the loader calls per exported tensor."""

    def __init__(self) -> None:
        self.rows: dict[int, list[tuple[int, int]]] = {}
        self.calls = 0

    def write(self, param: torch.Tensor, loaded: torch.Tensor, lo: int | None = None) -> None:
        target = param.data if lo is None else param.data.narrow(0, lo, loaded.shape[0])
        if tuple(target.shape) != tuple(loaded.shape):  # SGLang asserts the same
            raise AssertionError(
                f"shape {tuple(loaded.shape)} does not fit parameter rows {tuple(target.shape)}"
            )
        target.copy_(loaded)
        lo = 0 if lo is None else lo
        self.rows.setdefault(id(param), []).append((lo, lo + (loaded.shape[0] if loaded.dim() else 1)))
        self.calls += 1


def _nan(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.full(shape, float("nan"), dtype=torch.float64), requires_grad=False)


def _stub_layers(log: _Log) -> dict[str, dict[str, object]]:
    def default_weight_loader(param, loaded_weight, *args) -> None:
        log.write(param, loaded_weight)

    class _Linear(nn.Module):
        def __init__(self, input_size: int, output_size: int, bias: bool = True, *args, **kwargs):
            super().__init__()
            self.input_size, self.output_size = int(input_size), int(output_size)
            self.weight = _nan(self.output_size, self.input_size)
            self.weight.weight_loader = self.weight_loader
            if bias:
                self.bias = _nan(self.output_size)
                self.bias.weight_loader = self.weight_loader

        def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
            if shard_id is None:
                log.write(param, loaded_weight)
            else:
                lo = self.shard_offsets()[shard_id]
                log.write(param, loaded_weight, lo)

    class QKVParallelLinear(_Linear):
        def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=True,
                     *args, **kwargs):  # fmt: skip
            kv = total_num_kv_heads if total_num_kv_heads is not None else total_num_heads
            self.q, self.kv = int(total_num_heads) * int(head_size), int(kv) * int(head_size)
            super().__init__(hidden_size, self.q + 2 * self.kv, bias)

        def shard_offsets(self):
            return {"q": 0, "k": self.q, "v": self.q + self.kv}

    class MergedColumnParallelLinear(_Linear):
        def __init__(self, input_size, output_sizes, bias=True, *args, **kwargs):
            self.sizes = [int(s) for s in output_sizes]
            super().__init__(input_size, sum(self.sizes), bias)

        def shard_offsets(self):
            return {i: sum(self.sizes[:i]) for i in range(len(self.sizes))}

    class RMSNorm(nn.Module):
        def __init__(self, hidden_size: int, eps: float = 1e-6, *args, **kwargs):
            super().__init__()
            self.weight = _nan(int(hidden_size))
            self.weight.weight_loader = default_weight_loader

    class RadixAttention(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()
            self.kwargs = kwargs

    class _NoParams(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    AttentionType = enum.Enum("AttentionType", "DECODER ENCODER_ONLY ENCODER_DECODER DECODER_BIDIRECTIONAL")

    def set_weight_attrs(weight, attrs):
        for key, value in (attrs or {}).items():
            setattr(weight, key, value)

    parallel = types.SimpleNamespace(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, pp_size=1)
    return {
        "sglang.srt.layers.linear": {
            "QKVParallelLinear": QKVParallelLinear, "MergedColumnParallelLinear": MergedColumnParallelLinear,
            "RowParallelLinear": _Linear, "ColumnParallelLinear": _Linear, "ReplicatedLinear": _Linear,
        },
        "sglang.srt.layers.layernorm": {"RMSNorm": RMSNorm, "GemmaRMSNorm": RMSNorm},
        "sglang.srt.layers.radix_attention": {"RadixAttention": RadixAttention, "AttentionType": AttentionType},
        "sglang.srt.layers.activation": {"SiluAndMul": _NoParams},
        "sglang.srt.layers.rotary_embedding": {"get_rope": lambda *a, **k: _NoParams()},
        "sglang.srt.model_loader.weight_utils": {
            "default_weight_loader": default_weight_loader,
            "sharded_weight_loader": lambda *a, **k: default_weight_loader,
        },
        "sglang.srt.runtime_context": {"get_parallel": lambda: parallel, "get_spec": lambda: _Dummy()},
        "sglang.srt.server_args": {"get_global_server_args": lambda: _Dummy()},
        "sglang.srt.utils": {"is_npu": lambda: False, "is_cuda": lambda: False, "is_hip": lambda: False,
            "is_musa": lambda: False, "set_weight_attrs": set_weight_attrs},
        "sglang.srt.utils.common": {"get_compiler_backend": lambda: "inductor"},
        "sglang.srt.utils.hf_transformers_utils": {
            "get_rope_config": lambda config: (getattr(config, "rope_theta", 10000.0), None)
        },
    }  # fmt: skip


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str, stubs: dict[str, dict[str, object]], tops: tuple[str, ...]) -> None:
        self.root, self.stubs, self.tops = root, stubs, tops

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.tops:
            return None
        if name in _REAL:
            file = os.path.join(self.root, *name.split(".")) + ".py"
            return importlib.util.spec_from_file_location(name, file)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__dict__.update(self.stubs.get(spec.name, {}))
        module.__getattr__ = lambda attr: _dummy(attr) if not attr.startswith("__") else None
        return module

    def exec_module(self, module):
        pass


@dataclass
class LoadResult:
    params: dict[str, torch.Tensor]  # SGLang's parameters after load_weights
    ignored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)
    model: nn.Module | None = None

    @property
    def ok(self) -> bool:
        return not (self.ignored or self.missing or self.partial)

    def summary(self) -> str:
        return f"ignored {self.ignored[:4]}, missing {self.missing[:4]}, partial {self.partial[:4]}"


class SGLangDFlash:
    """One SGLang release's real drafter code, importable side by side with another release's."""

    def __init__(self, version: str, modules: dict[str, types.ModuleType], log: _Log) -> None:
        self.version, self.dflash, self.utils, self._log = version, modules[_REAL[0]], modules[_REAL[1]], log

    @property
    def entry_classes(self) -> dict[str, type]:
        entry = self.dflash.EntryClass
        return {cls.__name__: cls for cls in (entry if isinstance(entry, list) else [entry])}

    def build(self, export_dir: str) -> nn.Module:
        """SGLang's model for config.json, picked from its registry by `architectures` (as the server does)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(export_dir)
        (arch,) = config.architectures
        if arch not in self.entry_classes:
            raise LookupError(f"sglang {self.version} registers no {arch} (has {sorted(self.entry_classes)})")
        default = torch.get_default_dtype()
        torch.set_default_dtype(
            torch.float64
        )  # parameters SGLang builds itself (fc, conv, selector) hold any export exactly
        try:
            return self.entry_classes[arch](config)
        finally:
            torch.set_default_dtype(default)

    def load_export(self, export_dir: str) -> LoadResult:
        """Build SGLang's model from the export and run its own `load_weights` over model.safetensors."""
        from safetensors.torch import load_file

        model = self.build(export_dir)
        weights = load_file(os.path.join(export_dir, "model.safetensors"))
        log, ignored = self._log, []
        log.rows.clear()

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights.items():
                before = log.calls
                yield name, tensor.to(torch.float64)
                if log.calls == before:  # load_weights went on to the next tensor without loading this one
                    ignored.append(name)

        model.load_weights(stream())
        params = dict(model.named_parameters())
        missing = sorted(n for n, p in params.items() if id(p) not in log.rows)
        partial = []
        for name, p in params.items():
            covered = torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.bool)
            for lo, hi in log.rows.get(id(p), []):
                covered[lo:hi] = True
            if id(p) in log.rows and not bool(covered.all()):
                partial.append(f"{name} (rows {int(covered.sum())}/{covered.numel()})")
        return LoadResult({n: p.detach() for n, p in params.items()}, ignored, missing, partial, model)


def import_sglang_dflash(version: str) -> SGLangDFlash:
    """Import `sglang==version`'s dflash.py and dflash_utils.py from its side dir, the rest stubbed; the stubs
    leave sys.modules afterwards, so several releases (and a real sglang, were one installed) do not collide."""
    root = side_dir(version)
    marker = os.path.join(root, "sglang", "srt", "models", "dflash.py")
    if not os.path.isfile(marker):
        raise FileNotFoundError(
            f"{marker} is missing: run scripts/setup_env.sh (it installs sglang=={version} with --no-deps "
            "into .venv/side for this test)"
        )
    tops = ("sglang", "sgl_kernel_npu") + (("triton",) if importlib.util.find_spec("triton") is None else ())
    log = _Log()
    finder = _Finder(root, _stub_layers(log), tops)
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in tops}
    sys.meta_path.insert(0, finder)
    try:
        modules = {name: importlib.import_module(name) for name in reversed(_REAL)}
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k.split(".")[0] in tops]:
            del sys.modules[k]
        sys.modules.update(saved)
    if not os.path.isdir(os.path.join(root, f"sglang-{version}.dist-info")):
        raise RuntimeError(f"{root} does not hold sglang {version} (no sglang-{version}.dist-info)")
    return SGLangDFlash(version, modules, log)


if __name__ == "__main__":  # python tests/support/sglang_real.py VERSION EXPORT_DIR: what SGLang's loader makes of it
    result = import_sglang_dflash(sys.argv[1]).load_export(sys.argv[2])
    print(json.dumps({"ok": result.ok, "ignored": result.ignored, "missing": result.missing,
                      "partial": result.partial, "params": len(result.params)}, indent=2))  # fmt: skip
