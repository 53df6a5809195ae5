"""Export trained drafters: `specforge-csbp export --to sglang|hf CHECKPOINT OUT`.

checkpoint.py        read a drafter from a SpecForge checkpoint (plugin strategies) or a saved drafter
sglang_contract.py   SGLang's DFLASH / DFLASH2 loader contract, and the check that replays it
writer.py            write OUT (config.json, model.safetensors, provenance.json) atomically
"""

__all__: list[str] = []
