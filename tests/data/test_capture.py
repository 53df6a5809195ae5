"""Feature capture from a transformers target: layer-id convention, chunked prefill, loss masks, the CLI."""

import json
import os
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specforge_csbp.assets import TINY_DATASET, TINY_TARGET_DIR, materialize_tiny_target
from specforge_csbp.cli.main import main
from specforge_csbp.data import (
    FeatureStore,
    TargetFeatures,
    config_hash,
    random_target,
    read_jsonl,
    tokenize_sample,
)


@pytest.fixture(scope="module")
def tiny64():
    return random_target(AutoConfig.from_pretrained(TINY_TARGET_DIR), seed=3, dtype="float64").eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TARGET_DIR)


def _reference(model, input_ids, layer_ids):
    """SpecForge's `extract_context_feature`: hidden_states[k + 1] for each id, concatenated in id order."""
    with torch.no_grad():
        out = model(input_ids=input_ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[k + 1][0] for k in layer_ids], dim=-1)


def test_layer_id_k_is_the_output_of_decoder_layer_k(tiny64):
    ids = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(0))
    for layer_ids in ([1, 2, 3], [4, 0], [2]):
        feats = TargetFeatures(tiny64, layer_ids)
        got = feats(ids)
        assert got.shape == (45, 64 * len(layer_ids)) and got.dtype == torch.float64
        assert torch.equal(got, _reference(tiny64, ids, layer_ids))


def test_chunked_prefill_matches_the_whole_sequence(tiny64):
    ids = torch.randint(0, 512, (61,), generator=torch.Generator().manual_seed(1))
    whole = TargetFeatures(tiny64, [1, 3, 4])(ids)
    for chunk in (1, 7, 16, 60, 61, 100):
        got = TargetFeatures(tiny64, [1, 3, 4], chunk_size=chunk)(ids)
        assert (got - whole).abs().max() / whole.abs().max() <= 1e-12, chunk


def test_target_layer_ids_out_of_range(tiny64):
    for bad in ([5], [-1], [1, 1], []):
        with pytest.raises(
            ValueError, match=r"target_layer_ids: need unique ids in \[0, 4\] for a target with 6"
        ):
            TargetFeatures(tiny64, bad)


def test_chat_loss_mask_is_the_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Hi again."},
    ]
    ids, mask = tokenize_sample(tokenizer, {"messages": messages}, max_length=1000)
    supervised = tokenizer.decode(ids[mask.bool()])
    assert supervised == "Hi there.<|im_end|>Hi again.<|im_end|>"
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    ids8, mask8 = tokenize_sample(tokenizer, {"messages": messages}, max_length=8)
    assert torch.equal(ids8, ids[:8]) and torch.equal(mask8, mask[:8])
    t_ids, t_mask = tokenize_sample(tokenizer, {"text": "plain words"}, max_length=1000)
    assert tokenizer.decode(t_ids) == "plain words" and bool(t_mask.all())


def test_template_without_generation_tags_gives_the_same_mask(tokenizer):
    """Released templates (Qwen3, Llama 3) have no {% generation %}; the search fallback must agree."""
    plain = AutoTokenizer.from_pretrained(TINY_TARGET_DIR)
    plain.chat_template = tokenizer.chat_template.replace("{%- generation -%}", "").replace(
        "{%- endgeneration -%}", ""
    )
    checked = 0
    for _, record in read_jsonl(TINY_DATASET):
        if "messages" in record:
            a = tokenize_sample(tokenizer, record, max_length=4096)
            b = tokenize_sample(plain, record, max_length=4096)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            checked += 1
    assert checked == 24


def test_bad_records_are_one_line_errors(tokenizer):
    for record, match in [
        ({"prompt": "x"}, "needs exactly one of 'messages' \\(chat\\) or 'text'"),
        ({"messages": [], "text": "x"}, "needs exactly one of"),
        ({"messages": []}, "messages: .* must be a non-empty list"),
        ({"text": 3}, "text: .* must be a string"),
        ({"input_ids": [1, "a"]}, "input_ids: line 3 of d.jsonl must be a non-empty list of non-negative integers"),
        ({"input_ids": [], "text": "x"}, "needs exactly one of"),
    ]:
        with pytest.raises(ValueError, match=match):
            tokenize_sample(tokenizer, record, max_length=10, where="line 3 of d.jsonl")


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_capture_cli_on_the_tiny_target(tmp_path, capsys):
    out, saved = str(tmp_path / "store"), str(tmp_path / "target")
    code, stdout, _ = _run(
        capsys, "capture", "--target", TINY_TARGET_DIR, "--data", TINY_DATASET, "--out", out,
        "--target-layer-ids", "1,2,3", "--max-length", "96", "--seed", "5", "--chunk-size", "40",
        "--save-target", saved, "--no-progress",
    )  # fmt: skip
    assert code == 0 and "wrote 36 samples" in stdout and "random weights, seed 5" in stdout
    store = FeatureStore(out, verify="full")
    m = store.manifest
    assert (m.target_layer_ids, m.hidden_size, m.dtype, len(store)) == ([1, 2, 3], 64, "float32", 36)
    assert m.target.config_sha256 == config_hash(AutoConfig.from_pretrained(TINY_TARGET_DIR))
    assert m.target.random_init_seed == 5 and m.target.num_hidden_layers == 6
    assert max(s.length for s in m.samples) == 96 and min(s.length for s in m.samples) < 96
    # the saved target (same seed) and the assets helper reproduce the stored features
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    helper = AutoModelForCausalLM.from_pretrained(
        materialize_tiny_target(str(tmp_path / "t2"), seed=5)
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(saved)
    for line, record in list(read_jsonl(TINY_DATASET))[:4]:
        sid = f"{line:08d}"
        ids, mask = tokenize_sample(tokenizer, record, max_length=96)
        got_ids, got_mask = store.read_tokens(sid)
        assert torch.equal(got_ids, ids) and torch.equal(got_mask, mask)
        rows = store.read_intervals(sid, [(0, len(ids))])
        for target in (model, helper):
            ref = _reference(target, ids, [1, 2, 3])
            assert (rows - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_capture_cli_reads_layer_ids_from_a_drafter_config(tmp_path, capsys):
    cfg = tmp_path / "drafter.json"
    cfg.write_text(json.dumps({"dflash_config": {"target_layer_ids": [0, 4], "mask_token_id": 3}}))
    out = str(tmp_path / "store")
    code, stdout, _ = _run(
        capsys, "capture", "--target", os.path.join(TINY_TARGET_DIR, "config.json"), "--tokenizer",
        TINY_TARGET_DIR, "--data", TINY_DATASET, "--out", out, "--draft-config", str(cfg),
        "--max-length", "32", "--num-samples", "3", "--store-dtype", "bfloat16", "--no-progress",
    )  # fmt: skip
    assert code == 0 and "wrote 3 samples" in stdout
    store = FeatureStore(out)
    assert store.target_layer_ids == [0, 4] and store.dtype == torch.bfloat16 and len(store) == 3


def test_capture_cli_resumes_an_interrupted_run(tmp_path, capsys):
    def capture(out, *extra, layers="2,4"):
        argv = ["capture", "--target", TINY_TARGET_DIR, "--data", TINY_DATASET, "--out", out,
                "--max-length", "48", "--target-layer-ids", layers, "--no-progress", *extra]  # fmt: skip
        return _run(capsys, *argv)

    out, fresh = str(tmp_path / "store"), str(tmp_path / "fresh")
    assert capture(out, "--num-samples", "5")[0] == 0 and len(FeatureStore(out)) == 5
    code, stdout, _ = capture(out, "--resume")
    assert code == 0 and "kept 5 from an earlier run" in stdout
    assert capture(fresh)[0] == 0
    a, b = FeatureStore(out, verify="full"), FeatureStore(fresh)
    assert a.sample_ids == b.sample_ids and len(a) > 5
    for sid in a.sample_ids:
        n = a.length(sid)
        assert torch.equal(a.read_intervals(sid, [(0, n)]), b.read_intervals(sid, [(0, n)]))
    code, _, err = capture(out, "--resume", layers="1,2")
    assert code == 2 and "resume: target_layer_ids of the store" in err


def test_capture_cli_errors_are_one_line(tmp_path, capsys):
    base = ["capture", "--target", TINY_TARGET_DIR, "--data", TINY_DATASET, "--no-progress"]
    cases = [
        (["--out", str(tmp_path / "a")], "give exactly one of --target-layer-ids or --draft-config"),
        (
            ["--out", str(tmp_path / "b"), "--target-layer-ids", "1,x"],
            "--target-layer-ids: expected comma-separated",
        ),
        (
            ["--out", str(tmp_path / "c"), "--target-layer-ids", "1,5"],
            r"target_layer_ids: need unique ids in \[0, 4\]",
        ),
        (
            ["--out", TINY_TARGET_DIR, "--target-layer-ids", "1", "--overwrite"],
            "holds no manifest.json; refusing",
        ),
    ]
    for extra, match in cases:
        code, _, err = _run(capsys, *base, *extra)
        assert code == 2 and len(err.strip().splitlines()) == 1
        assert re.search(match, err), err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    code, _, err = _run(capsys, "capture", "--target", TINY_TARGET_DIR, "--data", str(bad), "--out",
                        str(tmp_path / "d"), "--target-layer-ids", "1", "--no-progress")  # fmt: skip
    assert code == 2 and f"--data: {bad}:2 is not valid JSON (Expecting value)" in err and len(err.strip().splitlines()) == 1


def test_input_ids_records(tmp_path, tokenizer, capsys):
    """Token-id records are stored as they are, every token supervised; an id outside the vocabulary is one line."""
    ids, mask = tokenize_sample(tokenizer, {"input_ids": [5, 9, 7, 300]}, max_length=3)
    assert ids.tolist() == [5, 9, 7] and mask.tolist() == [1, 1, 1]
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(4, 40))}) + "\n")
    code, _, _ = _run(capsys, "capture", "--target", TINY_TARGET_DIR, "--data", str(data), "--out",
                      str(tmp_path / "store"), "--target-layer-ids", "1", "--no-progress")  # fmt: skip
    assert code == 0
    store = FeatureStore(str(tmp_path / "store"))
    assert store.read_tokens(store.sample_ids[0])[0].tolist() == list(range(4, 40))
    data.write_text(json.dumps({"input_ids": [4, 512]}) + "\n")
    code, _, err = _run(capsys, "capture", "--target", TINY_TARGET_DIR, "--data", str(data), "--out",
                        str(tmp_path / "store2"), "--target-layer-ids", "1", "--no-progress")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"input_ids: line 1 of {data} has token id 512, outside the target's vocabulary [0, 512)" in err
