"""vLLM's DFlash / DFlash2 loader contract, read out of the wheel's own source (not imported, not copied).

vLLM's `qwen3_dflash*.py` cannot be imported apart from vLLM's GPU runtime (its model classes derive from
`Qwen3ForCausalLM`, take a `VllmConfig`, and load through `AutoWeightsLoader` in models/utils.py, which pulls
in most of vLLM), so this module parses the files with `ast` and reads:

    prefix     DFlashQwen3ForCausalLM.load_weights: `name = "<prefix>" + name` unless "lm_head" in name
    stacked    DFlashQwen3Model.hf_to_vllm_mapper: orig_to_new_stacked {".q_proj": (".qkv_proj", "q"), ...}
    the parameter tree: `self.<attr> = <Class>(...)` in every __init__ of the model, its layers, attention,
    MLP (qwen2.Qwen2MLP), convolution and candidate selector classes, following `model_cls`,
    `decoder_layer_cls`, base classes and `nn.ModuleList([... for ...])`

so the test checks export names against what the release in .venv/side actually builds.
"""

from __future__ import annotations

import ast
import os

__all__ = ["VLLMSource", "side_dir"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FILES = ("qwen3_dflash", "qwen3_dflash2", "qwen2")
WEIGHTED = {
    "QKVParallelLinear",
    "RowParallelLinear",
    "MergedColumnParallelLinear",
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "RMSNorm",
    "Linear",
}  # fmt: skip  (layers holding .weight [/ .bias])
WEIGHTLESS = {"Attention", "LogitsProcessor", "SiluAndMul"}
# parameters the drafter does not ship: the target's embedding / head, optional extras
SHARED = {"embed_tokens", "lm_head", "mask_embedding", "draft_id_to_target_id"}


def side_dir(version: str) -> str:
    return os.path.join(
        os.environ.get("SPECFORGE_CSBP_SIDE", os.path.join(ROOT, ".venv", "side")), f"vllm-{version}"
    )


class VLLMSource:
    def __init__(self, version: str) -> None:
        models = os.path.join(side_dir(version), "vllm", "model_executor", "models")
        if not os.path.isfile(os.path.join(models, "qwen3_dflash.py")):
            raise FileNotFoundError(f"{models}/qwen3_dflash.py is missing: run scripts/setup_env.sh")
        self.classes: dict[str, ast.ClassDef] = {}
        self.aliases: dict[str, str] = {}
        for stem in _FILES:
            with open(os.path.join(models, f"{stem}.py"), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, node)
                elif isinstance(node, ast.ImportFrom):
                    for a in node.names:
                        if a.asname:
                            self.aliases[a.asname] = a.name

    # -- the two tables --------------------------------------------------------------------------------
    def stacked(self) -> dict[str, tuple[str, object]]:
        for node in ast.walk(self.classes["DFlashQwen3Model"]):
            if isinstance(node, ast.keyword) and node.arg == "orig_to_new_stacked":
                return ast.literal_eval(node.value)
        raise LookupError("DFlashQwen3Model.hf_to_vllm_mapper has no orig_to_new_stacked")

    def prefix(self) -> str:
        """The string load_weights puts before every non-lm_head name."""
        method = self._method("DFlashQwen3ForCausalLM", "load_weights")
        guarded = any(
            isinstance(n, ast.Compare) and isinstance(n.left, ast.Constant) and n.left.value == "lm_head"
            and isinstance(n.ops[0], ast.NotIn) for n in ast.walk(method)
        )  # fmt: skip
        for n in ast.walk(method):
            if (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) and isinstance(n.left, ast.Constant)
                    and isinstance(n.right, ast.Name) and n.right.id == "name" and guarded):  # fmt: skip
                return n.left.value
        raise LookupError(
            "DFlashQwen3ForCausalLM.load_weights: no `<prefix> + name` under `lm_head not in name`"
        )

    # -- the parameter tree ----------------------------------------------------------------------------
    def _method(self, cls: str, name: str) -> ast.FunctionDef:
        for c in self._mro(cls):
            for node in c.body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return node
        raise LookupError(f"{cls}.{name}")

    def _mro(self, cls: str) -> list[ast.ClassDef]:
        out, todo = [], [cls]
        while todo:
            name = todo.pop(0)
            name = self.aliases.get(name, name)
            if name in self.classes:
                out.append(self.classes[name])
                todo += [b.id for b in self.classes[name].bases if isinstance(b, ast.Name)]
        return out

    def _class_attr(self, cls: str, attr: str) -> str:
        for c in self._mro(cls):
            for node in c.body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == attr for t in node.targets):
                    return node.value.id
        raise LookupError(f"{cls}.{attr}")

    def _callee(self, cls: str, call: ast.Call) -> tuple[str, bool]:
        """(class name built, built as a ModuleList of them)."""
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "ModuleList":
            (arg,) = call.args
            elt = arg.elt if isinstance(arg, ast.ListComp) else arg.elts[0]
            return self._callee(cls, elt)[0], True
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            return self._class_attr(cls, func.attr), False
        name = func.attr if isinstance(func, ast.Attribute) else func.id
        return self.aliases.get(name, name), False

    def children(self, cls: str) -> dict[str, tuple[str, bool]]:
        """attr -> (class, is_list) for every `self.attr = Call(...)` in the __init__ of cls and its bases."""
        out: dict[str, tuple[str, bool]] = {}
        for c in reversed(self._mro(cls)):
            for node in c.body:
                if not (isinstance(node, ast.FunctionDef) and node.name == "__init__"):
                    continue
                for n in ast.walk(node):
                    if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Attribute)
                            and getattr(n.targets[0].value, "id", None) == "self" and isinstance(n.value, ast.Call)):  # fmt: skip
                        out[n.targets[0].attr] = self._callee(cls, n.value)
        return out

    def parameters(self, top: str, num_layers: int, bias: bool = False) -> set[str]:
        """Every parameter name vLLM's `top` builds, but the target-shared ones (SHARED)."""
        out: set[str] = set()

        def walk(cls: str, path: str) -> None:
            for attr, (child, is_list) in self.children(cls).items():
                if attr in SHARED or child in WEIGHTLESS or not child[:1].isupper():
                    continue
                for sub in (
                    [f"{path}{attr}.{i}." for i in range(num_layers)] if is_list else [f"{path}{attr}."]
                ):
                    if child == "Parameter":
                        out.add(sub[:-1])
                    elif child in WEIGHTED:
                        out.add(sub + "weight")
                        if bias and attr in ("qkv_proj", "o_proj"):
                            out.add(sub + "bias")
                    elif child in self.classes or self.aliases.get(child) in self.classes:
                        walk(child, sub)
                    else:
                        raise LookupError(f"{cls}.{attr} builds {child}, which this reader does not know")

        walk(top, "")
        return out
