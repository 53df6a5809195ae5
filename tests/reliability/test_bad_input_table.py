"""The bad-input table of docs/reliability.md: every row is a case here (or names the existing test that
covers it), and every case fails with one line naming the field and what is allowed, before anything is
written to train.output_dir.

Cases run `specforge-csbp train-bdlm` in this process (one rank: no process start); `empty-dataset` runs
2 gloo ranks, so its error is raised inside the ranks and comes back as one line too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specforge_csbp.cli.main import main
from specforge_csbp.training.checkpoint import save_checkpoint
from tests.support.reliability_runs import SFT

ROOT = Path(__file__).resolve().parents[2]
ONE = ["parallel.world_size=1", "parallel.cp_degree=1"]

# id -> (overrides, fixture, expected text: the field and what is allowed)
CASES: dict[str, tuple[list[str], str | None, str]] = {
    "world-size": (["parallel.world_size=3"], None, "parallel: dp_degree x cp_degree = 1 x 2 must equal the world size 3"),
    "dp-degree": (["parallel.dp_degree=2"], None, "parallel: dp_degree x cp_degree = 2 x 2 must equal the world size 2"),
    "cp-degree": (["parallel.cp_degree=0"], None, "parallel.cp_degree: Input should be greater than or equal to 1"),
    "unknown-mode": (["parallel.mode=ring"], None, "parallel.mode: Input should be 'csbp', 'cp', 'bp' or 'reference'"),
    "reference-cp": (["parallel.mode=reference"], None, "parallel: mode 'reference' needs cp_degree 1, got 2"),
    "attention-backend": (["parallel.attention_backend=triton"], None,
                          "parallel.attention_backend: Input should be 'auto', 'dense' or 'flex'"),
    "timeout": (["parallel.timeout_s=0"], None, "parallel.timeout_s: Input should be greater than 0"),
    "length-multiple": (["data.max_length=60"], None, "data.max_length (60) must be a multiple of model.block_size (8)"),
    "too-few-blocks": (["data.max_length=8"], None, ("data.max_length / model.block_size vs parallel.cp_degree: "
                       "seq_len/block_size = 1 blocks < world_size = 2: every rank needs at least one block")),
    "block-size": (["model.block_size=0"], None, "model.block_size: Input should be greater than or equal to 1"),
    "clean-rule": (["model.clean_within_block=full"], None,
                   "model.clean_within_block: Input should be 'causal' or 'bidirectional'"),
    "model-source": (["model.pretrained=/x"], None,
                     "model: set exactly one of model.config (random weights) and model.pretrained"),
    "model-type": (["model.config.model_type=nope"], None,
                   "model.config.model_type: Unrecognized model identifier: nope. Should contain one of"),
    "unroutable-model": (["model.config.model_type=bloom"], None,
                         "model: BloomForCausalLM does not route attention through transformers' AttentionInterface"),
    "mask-token-range": (["objective.mask_token_id=128"], None, "objective.mask_token_id must be in [0, 128) (the vocab)"),
    "mask-token-missing": ([], "no_mask_token", "objective.mask_token_id: Field required"),
    "pad-token": (["data.pad_token_id=500"], None, "data.pad_token_id must be in [0, 128); got 500"),
    "objective-kind": (["objective.kind=dpo"], None, "objective.kind: Input should be 'sft' or 'convert'"),
    "noise-eps": (["objective.eps=1.5"], None, "objective.eps: Input should be less than 1"),
    "precision": (["train.precision=float16"], None,
                  "train.precision: Input should be 'auto', 'float32', 'bfloat16' or 'float64'"),
    "recompute-attention": (["train.recompute_attention=sometimes"], None,
                            "train.recompute_attention: must be true, false or 'auto' (got 'sometimes')"),
    "compile": (["train.compile=fast"], None,
                "train.compile: must be true, false, 'auto', 'layers' or 'norms' (got 'fast')"),
    "checkpointing": (["train.activation_checkpointing=2"], None,
                      "train.activation_checkpointing: must be true, false or 'auto' (got 2)"),
    "lr": (["train.lr=0"], None, "train.lr: Input should be greater than 0"),
    "warmup": (["train.warmup_steps=50"], None, "train.warmup_steps (50) must be <= train.steps (20)"),
    "betas": (["train.betas=[0.9,1.5]"], None, "train.betas must both be in [0, 1); got [0.9, 1.5]"),
    "unknown-field": (["train.lrr=1"], None, "train.lrr: Extra inputs are not permitted"),
    "override-syntax": (["train.lr"], None, "override 'train.lr' must look like section.field=value"),
    "jsonl-path": (["data.source=jsonl"], None, "data: data.path is required for source 'jsonl'"),
    "jsonl-unreadable": (ONE + ["data.source=jsonl", "data.path={tmp}/missing.jsonl"], None,
                         "data.path: {tmp}/missing.jsonl does not exist"),
    "empty-dataset": (["data.source=jsonl", "data.path={tmp}/empty.jsonl"], "jsonl",
                      "data.path: {tmp}/empty.jsonl has no records"),
    "token-range": (ONE + ["data.source=jsonl", "data.path={tmp}/oov.jsonl"], "jsonl",
                    "data.path: {tmp}/oov.jsonl:1 has token ids outside [0, 128)"),
    "loss-mask-length": (ONE + ["data.source=jsonl", "data.path={tmp}/len.jsonl"], "jsonl",
                         "data.path: {tmp}/len.jsonl:1 loss_mask has 2 entries, input_ids 3"),
    "all-masked-record": (ONE + ["data.source=jsonl", "data.path={tmp}/masked.jsonl"], "jsonl",
                          ("data.path: {tmp}/masked.jsonl:1 has no supervised token within data.max_length=64 "
                           "(loss_mask all 0 after truncation)")),
    "output-dir-file": (ONE, "out_is_file", "train.output_dir: {out} is a file; it must be a directory"),
    "output-dir-taken": (ONE + ["train.resume=false"], "checkpoint",
                         ("train.output_dir: {out} already holds checkpoints (step_00000002) and train.resume is "
                          "false; set train.resume=true to continue that run or use a new train.output_dir")),
    "latest-incomplete": (ONE, "incomplete", ("train.output_dir: {out}/latest names step_00000002, which is "
                          "incomplete (optimizer.pt is missing); point it at a complete step_* directory")),
    "resume-seed": (ONE + ["train.seed=1"], "checkpoint",
                    "train.seed: 1 differs from the seed 0 of {out}/step_00000002; a resumed run must keep the seed"),
    "resume-batch": (ONE + ["train.micro_batch_size=1"], "checkpoint",
                     ("train.micro_batch_size x train.grad_accum x dp_degree = 1 x 1 x 1 = 1 sequences per step, "
                      "but {out}/step_00000002 was trained with 2; a resumed run must keep the global batch")),
    "resume-steps": (ONE + ["train.steps=1", "train.warmup_steps=0"], "checkpoint",
                     "train.steps: 1 is below the step 2 of the checkpoint {out}/step_00000002; it must be >= 2"),
    "window-below-block": (["model.config.use_sliding_window=true", "model.config.sliding_window=4",
                            "model.config.max_window_layers=0"], None,
                           "model: config.sliding_window=4 < model.block_size=8; a corrupted block must fit"),
    "unroutable-layer-type": (["model.config.layer_types=[linear_attention,full_attention]"], None,
                              "model: Qwen3ForCausalLM config.layer_types has ['linear_attention']: a recurrent state"),
    "router-aux-dense": (["objective.router_aux_loss_coef=0.01"], None,
                         "objective.router_aux_loss_coef: Qwen3ForCausalLM has no mixture-of-experts router"),
    "pretrained-not-a-model": (["model.config=null", "model.pretrained={tmp}/empty"], "empty_dir",
                               "model.pretrained: {tmp}/empty is not a save_pretrained directory"),
    "lr-inf": (["train.lr=.inf"], None, "train.lr: Input should be a finite number (got inf)"),
    "eps-nan": (["train.adam_eps=.nan"], None, "train.adam_eps: Input should be a finite number"),
    "yaml-syntax": ([], "bad_yaml", "config: {tmp}/recipe.yaml is not valid YAML: line 3 column 7: expected ',' or ']'"),
    "yaml-not-utf8": ([], "latin1_yaml", "config: {tmp}/recipe.yaml:2 is not UTF-8 text"),
    "jsonl-not-utf8": (ONE + ["data.source=jsonl", "data.path={tmp}/latin1.jsonl"], "jsonl",
                       "data.path: {tmp}/latin1.jsonl:2 is not UTF-8 text"),
    "jsonl-directory": (ONE + ["data.source=jsonl", "data.path={tmp}"], None, "data.path: {tmp} is a directory; give a file"),
    "float-token-ids": (ONE + ["data.source=jsonl", "data.path={tmp}/float.jsonl"], "jsonl",
                        "data.path: {tmp}/float.jsonl:1 input_ids must be integers; got [1, 2.7, 3]"),
    "loss-mask-values": (ONE + ["data.source=jsonl", "data.path={tmp}/mask2.jsonl"], "jsonl",
                         "data.path: {tmp}/mask2.jsonl:1 loss_mask must hold 0 or 1; got [1, 2, 1]"),
    "output-dir-under-file": (ONE, "out_parent_file",
                              "train.output_dir: {out}/run cannot be created: {out} is a file, not a directory"),
    "pretrained-missing": (["model.config=null", "model.pretrained={tmp}/nope"], None,
                           "model.pretrained: {tmp}/nope does not exist (a local path; a hub model is written as org/name)"),
    "checkpoint-corrupted": (ONE, "corrupted", ("train.output_dir: checkpoint file {out}/step_00000002/optimizer.pt is "
                             "corrupted (sha256 differs from its manifest.json)")),
}  # fmt: skip


def _fixture(kind: str | None, tmp: Path, out: Path) -> list[str]:
    """Prepare what a case needs; returns extra command-line arguments."""
    (tmp / "empty.jsonl").write_text("")
    (tmp / "oov.jsonl").write_text('{"input_ids": [1, 2, 300]}\n')
    (tmp / "len.jsonl").write_text('{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}\n')
    (tmp / "masked.jsonl").write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}\n')
    if kind == "no_mask_token":
        text = Path(SFT).read_text()
        recipe = tmp / "recipe.yaml"
        recipe.write_text(re.sub(r"\n  mask_token_id: .*", "", text))
        return ["-c", str(recipe)]
    (tmp / "latin1.jsonl").write_bytes(b'{"input_ids": [1, 2, 3]}\n{"input_ids": [1], "note": "caf\xe9"}\n')
    (tmp / "float.jsonl").write_text('{"input_ids": [1, 2.7, 3]}\n')
    (tmp / "mask2.jsonl").write_text('{"input_ids": [1, 2, 3], "loss_mask": [1, 2, 1]}\n')
    if kind in ("bad_yaml", "latin1_yaml"):
        recipe = tmp / "recipe.yaml"
        text = Path(SFT).read_text()
        if kind == "bad_yaml":  # an unclosed flow sequence: the error is at the line after it
            recipe.write_text("# recipe\nmodel: [1, 2\nbroken: {\n" + text)
        else:
            recipe.write_bytes(b"# recipe\n# caf\xe9 (latin-1)\n" + text.encode())
        return ["-c", str(recipe)]
    if kind == "out_is_file":
        out.write_text("not a directory")
    if kind == "empty_dir":  # exists, but holds no config.json / weights
        (tmp / "empty").mkdir()
    if kind == "out_parent_file":
        out.write_text("not a directory")
        return ["-c", SFT, f"train.output_dir={out}/run"]
    if kind in (
        "checkpoint",
        "incomplete",
        "corrupted",
    ):  # a complete checkpoint of a 1-rank run (seed 0, 2 sequences/step)
        layout = {
            "seed": 0,
            "global_batch": 2,
            "world_size": 1,
            "dp_degree": 1,
            "cp_degree": 1,
            "mode": "reference",
        }
        save_checkpoint(out, 2, write_model=lambda p: (p / "model.safetensors").write_bytes(b"x"),
                        optimizer_state={}, trainer_state={"step": 2, "layout": layout})  # fmt: skip
        if kind == "incomplete":
            (out / "step_00000002" / "optimizer.pt").unlink()
        if kind == "corrupted":  # one flipped byte, same size: only the content hash tells
            victim = out / "step_00000002" / "optimizer.pt"
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
    return ["-c", SFT]


def _snapshot(path: Path) -> dict | None:
    if not path.exists():
        return None
    if path.is_file():
        return {".": path.read_bytes()}
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))
    }


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, tmp_path, capsys):
    overrides, kind, expected = CASES[case]
    out = tmp_path / "out"
    config = _fixture(kind, tmp_path, out)
    before = _snapshot(out)
    args = [a.format(tmp=tmp_path, out=out) for a in overrides]
    if kind == "out_parent_file":  # the output_dir override comes with the fixture
        args, config = args + [config[-1]], config[:-1]
        rc = main(["train-bdlm", *config, *args, "train.progress=false"])
    else:
        rc = main(["train-bdlm", *config, *args, f"train.output_dir={out}", "train.progress=false"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("specforge-csbp train-bdlm: error: "), err
    assert expected.format(tmp=tmp_path, out=out) in err, err
    if "parallel.world_size=1" not in overrides and kind == "jsonl":  # raised inside 2 spawned ranks
        assert re.match(r"specforge-csbp train-bdlm: error: rank [01]: data.path", err), err
    assert _snapshot(out) == before  # nothing written to the output directory


def _table_rows() -> list[tuple[str, str]]:
    """(id, test) of every row of the bad-input table in docs/reliability.md."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    table = text.split("## Bad inputs", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| `")]
    return [(r[0].strip().strip("`"), r[-1].strip()) for r in rows]


def test_the_docs_table_lists_every_case_and_only_existing_tests():
    rows = _table_rows()
    assert len(rows) >= 25
    ours = [i for i, test in rows if "tests/reliability/test_bad_input_table.py" in test]
    assert sorted(ours) == sorted(CASES)  # every case is documented, every documented case is tested
    for row_id, test in rows:
        for ref in re.findall(r"`(tests/[\w/]+\.py)::(\w+)", test):
            source = (ROOT / ref[0]).read_text()
            assert f"def {ref[1]}(" in source, (row_id, ref)
