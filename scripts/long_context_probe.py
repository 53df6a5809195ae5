#!/usr/bin/env python
"""Why a drafter of the long-context study stays on the unigram plateau (docs/long_context.md): layer 0's
attention over the context (normalised entropy, mass on the nearest context positions) and the gradient norm
per layer of one training step, for drafters at init and trained, on a sample of each store.

    python scripts/long_context_probe.py --scale cpu --run RUN --drafters short,long --near 64
    python scripts/long_context_probe.py --scale gpu --run runs/long_context/gpu --drafters short,long --near 256 \
        --device cuda --blocks 32

RUN needs target/, store-short/ and/or store-long/ (a store not captured is left out) and the exports
drafter-NAME/ (the study's capture and train stages); "init" is each drafter's config with freshly initialised
weights (seed 0). Writes RUN/probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--drafters", default="short,long", help="exports in RUN to probe (drafter-NAME)")
    p.add_argument("--near", type=int, default=64, help="context positions before the anchor counted as near")
    p.add_argument("--blocks", type=int, default=64, help="blocks of the sample whose attention is measured "
                   "(evenly spaced over its anchors; memory: heads x blocks x block size x context float64)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    import torch  # lazy: a fast --help
    from transformers import AutoModelForCausalLM

    from specforge_csbp.data.store import FeatureStore
    from specforge_csbp.eval.load import load_drafter
    from specforge_csbp.models.dflash.features import DrafterSample
    from specforge_csbp.objectives.dflash import DFlashObjective, sample_anchors
    from specforge_csbp.outputs import write_json_atomic
    from specforge_csbp.studies.long_context.probe import context_attention, layer_grad_norms
    from specforge_csbp.studies.long_context.study import SCALES

    scale = SCALES[args.scale]
    target = AutoModelForCausalLM.from_pretrained(os.path.join(args.run, "target"), dtype=torch.float32)
    embed = target.get_input_embeddings().weight.detach().to(args.device)
    head = target.get_output_embeddings().weight.detach().to(args.device)
    batches = {}
    for kind, count in (("short", scale.ratio), ("long", 1)):  # one training step's samples of each store
        path = os.path.join(args.run, f"store-{kind}")
        if not os.path.exists(os.path.join(path, "manifest.json")):  # a run that captured only what its drafters need
            print(f"probe: {path} not captured: the {kind} store is left out", flush=True)
            continue
        store = FeatureStore(path, verify="trust")
        samples = []
        for sid in store.sample_ids[:count]:
            ids, mask = store.read_tokens(sid)
            samples.append(DrafterSample(ids, mask, store.read_intervals(sid, [(0, len(ids))]).float()))
        anchors = scale.anchors_long // (scale.ratio if kind == "short" else 1)
        batches[kind] = (samples, DFlashObjective(num_anchors=anchors, gamma=4.0 if scale.block_size <= 8 else 7.0))
    if not batches:
        raise SystemExit(f"--run: {args.run} has neither store-short/ nor store-long/ (run the study's capture stage)")
    rows = []
    for name in args.drafters.split(","):
        for state in ("init", "trained"):
            model, _ = load_drafter(os.path.join(args.run, f"drafter-{name}"), untrained=state == "init",
                                    dtype="float32", device=torch.device(args.device))  # fmt: skip
            model.train()
            for kind, (samples, objective) in batches.items():
                first = samples[0]
                anchors = sample_anchors(first.loss_mask, objective, block_size=model.block_size)
                anchors = anchors[torch.linspace(0, len(anchors) - 1, min(args.blocks, len(anchors))).long()]
                grads = layer_grad_norms(model, samples, objective=objective, head_weight=head, embed_weight=embed)
                row = {"drafter": name, "state": state, "store": kind, "near": args.near,
                       **context_attention(model, first, anchors, embed, args.near), "loss": grads.pop("loss"),
                       **{f"grad_{k}": v for k, v in grads.items()}}  # fmt: skip
                rows.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)  # fmt: skip
    write_json_atomic(os.path.join(args.run, "probe.json"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
