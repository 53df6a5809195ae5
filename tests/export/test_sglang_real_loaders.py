"""Exports against SGLang's real DFLASH / DFLASH2 loader code (tests/support/sglang_real.py: the wheel's own
models/dflash.py and speculative/dflash_utils.py, GPU layers stubbed at TP = 1).

For every shipped drafter config (reduced width, the exact layer structure), tiny DFlash / DFlash2 drafters,
and the quickstart's export built by the quickstart's own commands: SGLang builds its model from config.json,
its `load_weights` reads model.safetensors, and nothing is ignored, missing or partially loaded; every
parameter equals the trained one (fused q|k|v, gate|up); block size, feature layers, mask token and each
layer's attention (window, causal or not) are what the trainer trained. Breaking a weight name or a config
field of the writer's output makes the check fail. SGLang 0.5.14 (SpecForge 0.2.0's pin) serves DFlash
and has no DFlash2DraftModel; 0.5.19 is the first release with it.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_csbp.export.writer import SGLANG_FLOORS, export_drafter
from specforge_csbp.models.dflash.configuration import DFlashConfig
from specforge_csbp.models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel
from tests.export.test_sglang_contract import _tiny
from tests.support.sglang_real import import_sglang_dflash

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DFLASH2_FLOOR, NEWEST, SPECFORGE_PIN = "0.5.19", "0.5.23", "0.5.14"
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_SG: dict[str, object] = {}


def sglang(version: str):
    if version not in _SG:
        _SG[version] = import_sglang_dflash(version)
    return _SG[version]


def _trained_value(state: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The trained tensor an SGLang parameter must hold: fused parameters are the row-wise concatenation."""
    for fused, parts in _FUSED.items():
        if f".{fused}." in name:
            pieces = [state.get(name.replace(fused, part)) for part in parts]
            return None if any(p is None for p in pieces) else torch.cat(pieces, 0)
    return state.get(name)


def problems(version: str, export_dir: str, trained) -> list[str]:
    """Everything SGLang `version` would serve differently from `trained` (a CSBP drafter model)."""
    sg = sglang(version)
    try:
        result = sg.load_export(export_dir)
    except Exception as err:  # noqa: BLE001 - SGLang refusing the export is one of the outcomes
        return [f"SGLang {version} refused it: {type(err).__name__}: {str(err).splitlines()[0]}"]
    out = [f"ignored {n}" for n in result.ignored] + [f"missing {n}" for n in result.missing]
    out += [f"partial {n}" for n in result.partial]
    with open(os.path.join(export_dir, "config.json")) as f:
        dtype = getattr(torch, json.load(f)["dtype"])  # the export's dtype: trained values rounded to it
    state = {k: v.detach().to(dtype).to(torch.float64) for k, v in trained.state_dict().items()}
    for name, value in result.params.items():
        want = _trained_value(state, name)
        if want is None or tuple(want.shape) != tuple(value.shape) or not torch.equal(want, value):
            out.append(f"value {name}")
    config, model = trained.config, result.model
    parsed = sg.utils.parse_dflash_draft_config(draft_hf_config=model.config)
    ids = parsed.resolve_target_layer_ids(
        target_num_layers=int(parsed.num_target_layers), draft_num_layers=int(config.num_hidden_layers)
    )
    if list(ids) != list(config.target_layer_ids):
        out.append(f"target_layer_ids {list(ids)} != trained {config.target_layer_ids}")
    if int(model.block_size) != config.draft_block_size:
        out.append(f"block_size {model.block_size} != trained {config.draft_block_size}")
    if parsed.mask_token_id != config.mask_token_id:
        out.append(f"mask_token_id {parsed.mask_token_id} != trained {config.mask_token_id}")
    for i, (layer, kind) in enumerate(zip(model.layers, config.layer_types, strict=True)):
        attn = layer.self_attn.attn.kwargs
        sliding = kind == "sliding_attention"
        # the trainer's window W is W keys up to the query itself (masks/visibility.py); SGLang stores the
        # keys to its left, W - 1 (-1: no window)
        want_window = int(config.sliding_window) - 1 if sliding else -1
        want_causal = config.sliding_layers_causal if sliding else False  # the trainer's rule
        causal = attn["attn_type"].name == "DECODER"
        if int(attn["sliding_window_size"]) != want_window or causal != want_causal:
            out.append(
                f"layer {i} ({kind}): SGLang window {attn['sliding_window_size']} causal {causal}, "
                f"trained window {want_window} causal {want_causal}"
            )
    return out


def _export(tmp_path, model, name="export"):
    model.save_pretrained(tmp_path / f"{name}-trained")
    out = str(tmp_path / name)
    export_drafter(str(tmp_path / f"{name}-trained"), out, to="sglang")
    return out


@pytest.mark.parametrize("version", [DFLASH2_FLOOR, NEWEST])
@pytest.mark.parametrize("dflash2", [True, False])
def test_tiny_exports_load_exactly_in_sglang(tmp_path, version, dflash2):
    model = _tiny(dflash2)
    out = _export(tmp_path, model)
    assert problems(version, out, model) == []
    params = sglang(version).load_export(out).params
    assert (
        "candidate_selector.successor_codebook" in params
    ) is dflash2 and "layers.1.self_attn.qkv_proj.weight" in params


def test_specforge_pin_serves_dflash_but_not_dflash2(tmp_path):
    dflash = _tiny(False)
    assert problems(SPECFORGE_PIN, _export(tmp_path, dflash, "v1"), dflash) == []
    dflash2 = _tiny(True)
    refusal = (
        f"SGLang {SPECFORGE_PIN} refused it: LookupError: sglang {SPECFORGE_PIN} registers no DFlash2DraftModel "
        "(has ['DFlashDraftModel'])"
    )
    assert problems(SPECFORGE_PIN, _export(tmp_path, dflash2, "v2"), dflash2) == [refusal]
    assert "DFlash2DraftModel" in sglang(DFLASH2_FLOOR).entry_classes
    assert SGLANG_FLOORS == {"DFlashDraftModel": SPECFORGE_PIN, "DFlash2DraftModel": DFLASH2_FLOOR}


@pytest.mark.parametrize("version", [DFLASH2_FLOOR, NEWEST])
@pytest.mark.parametrize(
    "layer_types,is_causal",
    [(["sliding_attention", "full_attention"], False), (["sliding_attention", "sliding_attention"], True),
     (["full_attention", "full_attention"], None)],
)  # fmt: skip
def test_sglang_runs_each_layer_as_causal_as_the_trainer(tmp_path, version, layer_types, is_causal):
    """The configs the drafter validation lets through (is_causal false, unset, or true on sliding layers
    only) are served with the trainer's visibility in every layer."""
    config = _causal_config(layer_types, is_causal, dflash2=True)
    torch.manual_seed(0)
    model = DFlash2DraftModel(config)
    assert problems(version, _export(tmp_path, model), model) == []


def _causal_config(layer_types, is_causal, dflash2=False):
    from specforge_csbp.models.dflash.configuration import make_dflash_config

    return make_dflash_config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, num_target_layers=6, target_layer_ids=[1, 3], mask_token_id=5, block_size=4,
        layer_types=layer_types, sliding_window=8, dflash2=dflash2, conv_kernel_size=2, conv_group_size=8,
        selector_rank=4, selector_top_k=4, is_causal=is_causal,
    )  # fmt: skip


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


@pytest.mark.parametrize(
    "dflash2,layer_types,is_causal",
    [(False, ["sliding_attention", "full_attention"], False), (False, ["sliding_attention", "full_attention"], None),
     (True, ["sliding_attention", "full_attention"], False), (False, ["full_attention"] * 2, False)],
)  # fmt: skip
def test_the_floor_in_provenance_is_the_first_release_that_serves_the_export_as_trained(
    tmp_path, dflash2, layer_types, is_causal
):
    """provenance.json's min_versions.sglang serves the export exactly; every tested release below it does not
    (0.5.14-0.5.17 keep a sliding layer causal under is_causal: false; before 0.5.19 there is no DFlash2)."""
    torch.manual_seed(0)
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(
        _causal_config(layer_types, is_causal, dflash2)
    )
    out = _export(tmp_path, model)
    with open(os.path.join(out, "provenance.json")) as f:
        floor = json.load(f)["min_versions"]["sglang"]
    for version in (SPECFORGE_PIN, "0.5.17", "0.5.18", DFLASH2_FLOOR, NEWEST):
        assert (problems(version, out, model) == []) is (_release(version) >= _release(floor)), (
            version,
            floor,
        )


def _reduced(raw: dict) -> dict:
    """The shipped config at reduced width: the same layers, layer types, heads (GQA), feature layers, block
    size, conv taps, selector top-k, vocabulary and mask token; narrower hidden / head / MLP / selector rank."""
    cfg = copy.deepcopy(raw)
    cfg.update(hidden_size=64, head_dim=8, intermediate_size=96)
    if "selector_rank" in cfg["dflash_config"]:  # DFlash2 (a DFlash v1 config has no conv or selector)
        cfg["dflash_config"].update(selector_rank=8, conv_group_size=16)
    return cfg


@pytest.mark.parametrize("version", [DFLASH2_FLOOR, NEWEST])
@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "drafter_configs", "*.json"))))
def test_shipped_drafter_configs_load_exactly_in_sglang(tmp_path, version, path):
    with open(path) as f:
        raw = _reduced(json.load(f))
    config = DFlashConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    config.validate_dflash()
    torch.manual_seed(0)
    model = (DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = _export(tmp_path, model)
    assert problems(version, out, model) == []


def _rewrite(out: str, tensors=None, config=None) -> None:
    if tensors is not None:
        weights = load_file(os.path.join(out, "model.safetensors"))
        save_file(tensors(weights), os.path.join(out, "model.safetensors"))
    if config is not None:
        path = os.path.join(out, "config.json")
        with open(path) as f:
            data = json.load(f)
        config(data)
        with open(path, "w") as f:
            json.dump(data, f)


def _rename(old, new):
    return lambda w: {k.replace(old, new): v for k, v in w.items()}


def _swap(a, b):
    return lambda w: {k: w[k.replace(a, "@").replace(b, a).replace("@", b)] for k in w}


def _pop(d: dict, *keys):
    for k in keys:
        d.pop(k, None)


@pytest.mark.parametrize(
    "tensors,config,expected",
    [
        (_rename("self_attn.o_proj", "self_attn.out_proj"), None, "ignored layers.0.self_attn.out_proj.weight"),
        (_rename("mlp.up_proj", "mlp.upproj"), None, "partial layers.0.mlp.gate_up_proj.weight (rows 48/96)"),
        (_swap("k_proj", "v_proj"), None, "value layers.0.self_attn.qkv_proj.weight"),
        (_rename("candidate_selector.", "selector."), None, "missing candidate_selector.hidden_projection.weight"),
        (lambda w: {f"draft.{k}": v for k, v in w.items()}, None, "missing fc.weight"),
        (None, lambda c: c["dflash_config"].pop("selector_rank"), "refused it: ValueError"),
        (None, lambda c: c["dflash_config"].update(target_layer_ids=[1]), "refused it: ValueError: DFLASH fc.weight"),
        (None, lambda c: [c.update({k: c["dflash_config"].pop(k) for k in ("conv_kernel_size", "conv_group_size")})],
         "ignored layers.0.attention_conv.base_kernel"),  # SGLang reads the conv fields in dflash_config only
        (None, lambda c: [_pop(c, "block_size"), _pop(c["dflash_config"], "block_size")], "block_size 16 != trained 4"),
        (None, lambda c: c["dflash_config"].update(mask_token_id=7), "mask_token_id 7 != trained 5"),
        (None, lambda c: c.update(layer_types=["full_attention"] * 2), "layer 0 (sliding_attention): SGLang window -1"),
        (None, lambda c: c.update(is_causal=True), "layer 1 (full_attention): SGLang window -1 causal True"),
    ],
)  # fmt: skip
def test_a_broken_writer_output_fails_against_sglang(tmp_path, tensors, config, expected):
    model = _tiny(True)
    out = _export(tmp_path, model)
    assert problems(NEWEST, out, model) == []
    _rewrite(out, tensors, config)
    found = problems(NEWEST, out, model)
    assert any(p.startswith(expected) or expected in p for p in found), found


def _run(*cmd: str, timeout: int = 900) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        list(cmd), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _quickstart_steps() -> list[str]:
    """The target / capture / train / export command lines of scripts/quickstart.sh, as it runs them (its eval
    steps after the export are left out)."""
    with open(os.path.join(ROOT, "scripts", "quickstart.sh")) as f:
        lines = [line.strip() for line in f.read().replace("\\\n", " ").splitlines()]
    steps = [line for line in lines if line.startswith(("$PY -m specforge_csbp", ".venv/bin/specforge train"))]
    names = [" ".join(s.split()[2:4] if s.startswith("$PY") else s.split()[1:2]) for s in steps]
    assert names[:4] == [
        "specforge_csbp.assets.quickstart --out",
        "specforge_csbp capture",
        "train",
        "specforge_csbp export",
    ], names
    assert all(n == "specforge_csbp eval" for n in names[4:]), names
    return steps[:4]


@pytest.mark.slow(reason="the quickstart's target, capture, specforge train --csbp and export commands, each a process")
def test_quickstart_export_loads_exactly_in_sglang(tmp_path):
    """scripts/quickstart.sh's own commands (target, capture, `specforge train --csbp`, export), run into
    tmp_path with one epoch instead of four; its export then goes through SGLang's real loaders."""
    run = str(tmp_path / "quickstart")
    bindir = os.path.dirname(sys.executable)
    stdout = ""
    for step in _quickstart_steps():
        line = step.replace('"', "").replace("$RUN", run).replace(".venv/bin/", bindir + "/")
        line = line.replace("$PY", sys.executable)
        args = line.split()
        if " train " in f" {line} ":
            args += [f"model.target_model_path={run}/target", f"data.hidden_states_path={run}/store",
                     f"output_dir={run}/output", "training.num_epochs=1"]  # fmt: skip
        stdout = _run(*args)
    export = os.path.join(run, "drafter-sglang")
    assert "--speculative-algorithm DFLASH" in stdout and "sglang>=" in stdout
    trained = _load_trained(export)
    for version in (DFLASH2_FLOOR, NEWEST):
        assert problems(version, export, trained) == []
    shutil.rmtree(run)


def _load_trained(export: str):
    """The drafter as the trainer left it: the checkpoint the export's provenance names, in this project's model."""
    from specforge_csbp.export.checkpoint import load_checkpoint

    with open(os.path.join(export, "provenance.json")) as f:
        source = json.load(f)["source"]["path"]
    ckpt = load_checkpoint(source)
    cls = DFlash2DraftModel if ckpt.architecture == "DFlash2DraftModel" else DFlashDraftModel
    model = cls(ckpt.config)
    model.load_state_dict(ckpt.state_dict, strict=True)
    return model


def test_an_export_for_a_bf16_target_is_bf16_in_sglang(tmp_path):
    """The export takes the target's dtype: SGLang reads a bf16 config (its --dtype auto keeps it) and bf16
    weights holding the trained values rounded to bf16."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3", "torch_dtype": "bfloat16", "hidden_size": 32,
                                                    "vocab_size": 64, "num_hidden_layers": 6}))  # _tiny's target
    model = _tiny(True)
    model.save_pretrained(tmp_path / "trained")
    out = str(tmp_path / "export")
    export_drafter(str(tmp_path / "trained"), out, to="sglang", target=str(target))
    assert {v.dtype for v in load_file(os.path.join(out, "model.safetensors")).values()} == {torch.bfloat16}
    assert str(sglang(NEWEST).build(out).config.dtype).replace("torch.", "") == "bfloat16"
    assert problems(NEWEST, out, model) == []
