"""Bad inputs of `specforge-csbp eval`: each fails with exit code 2 and one line naming the field and what is
allowed, before any model runs or any output is written (docs/reliability.md's bad-input table, rows eval-*)."""

from __future__ import annotations

import json

import pytest

from specforge_csbp.assets import materialize_tiny_target
from specforge_csbp.cli.main import main
from tests.support.eval_fixtures import random_drafter


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_errors")
    materialize_tiny_target(str(root / "target"), seed=0)
    random_drafter(False).save_pretrained(str(root / "ok"))
    random_drafter(False, hidden_size=32, num_attention_heads=2, num_key_value_heads=1).save_pretrained(
        str(root / "hidden")
    )
    random_drafter(False, vocab_size=600).save_pretrained(str(root / "vocab"))
    random_drafter(False, target_layer_ids=[1, 5]).save_pretrained(str(root / "last_layer"))
    random_drafter(False, num_target_layers=8, target_layer_ids=[1, 3]).save_pretrained(str(root / "layers"))
    random_drafter(False).save_pretrained(str(root / "mask"))
    config = json.loads((root / "mask" / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 512
    (root / "mask" / "config.json").write_text(json.dumps(config))
    (root / "prompts.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    (root / "long.jsonl").write_text(json.dumps({"input_ids": [5] * 4080}) + "\n")
    (root / "bad.jsonl").write_text(json.dumps({"tokens": [5]}) + "\n")
    (root / "oov.jsonl").write_text(json.dumps({"input_ids": [5, 512]}) + "\n")
    return root


# id -> (arguments; {root} is the fixture directory, expected text of the one line)
CASES = {
    "eval-hidden-size": (["--drafter", "{root}/hidden"],
                         "--drafter {root}/hidden and --target {root}/target do not belong together: hidden_size "
                         "is 32 in --drafter but 64 in --target"),
    "eval-vocab": (["--drafter", "{root}/vocab"], "vocab_size is 600 in --drafter but 512 in --target"),
    "eval-layer-ids": (["--drafter", "{root}/last_layer"],
                       "dflash_config.target_layer_ids: need unique ids in [0, 4] for a target with 6 layers"),
    "eval-target-layers": (["--drafter", "{root}/layers"], "num_target_layers is 8 in --drafter but 6 in --target"),
    "eval-mask-token": (["--drafter", "{root}/mask"],
                        "dflash_config.mask_token_id = 512 must be in 0..vocab_size-1 = 511"),
    "eval-prompt-length": (["--prompts", "{root}/long.jsonl"],
                           ("prompt 0: 4080 tokens + --max-new-tokens 16 + block_size 4 - 1 = 4099 positions "
                            "exceed the target's max_position_embeddings = 4096")),
    "eval-prompt-token": (["--prompts", "{root}/oov.jsonl"],
                          "prompt 0: token id 512 is outside the target's vocabulary 0..511"),
    "eval-drafter-path": (["--drafter", "{root}/missing"], "--drafter: {root}/missing does not exist"),
    "eval-target-path": (["--target", "{root}/missing"], "--target: {root}/missing does not exist"),
    "eval-prompts-path": (["--prompts", "{root}/missing.jsonl"], "--prompts: {root}/missing.jsonl does not exist"),
    "eval-prompts-record": (["--prompts", "{root}/bad.jsonl"],
                            "--prompts: {root}/bad.jsonl:1 needs one of the fields input_ids, text, messages"),
    "eval-store-path": (["--store", "{root}/missing"], "--store: {root}/missing does not exist"),
    "eval-split": (["--split", "eval"], "--split: only with --store (a split of a feature store)"),
    "eval-max-new-tokens": (["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
    "eval-out-dir": (["--out", "{root}/nowhere/out.json"], "--out: the directory {root}/nowhere does not exist"),
    "eval-bucket-edges": (["--bucket-edges", "0,4K,2K"],
                          "--bucket-edges: expected increasing positions starting at 0, like 0,4K,16K; got '0,4K,2K'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_eval_input(files, case, capsys):
    args, expected = CASES[case]
    given = {"--drafter": f"{files}/ok", "--target": f"{files}/target", "--prompts": f"{files}/prompts.jsonl",
             "--max-new-tokens": "16"}  # fmt: skip
    args = [a.format(root=files) for a in args]
    for flag, value in zip(args[::2], args[1::2]):
        if flag == "--store":
            given.pop("--prompts")
        given[flag] = value
    argv = ["eval", "--no-progress", "--ignore-eos"] + [x for kv in given.items() for x in kv]
    before = sorted(p.name for p in files.iterdir())
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("specforge-csbp eval: error: "), err
    assert expected.format(root=files) in err, err
    assert sorted(p.name for p in files.iterdir()) == before  # nothing written
