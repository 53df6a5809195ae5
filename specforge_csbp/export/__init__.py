"""Export trained drafters: `specforge-csbp export --to sglang|vllm|hf CHECKPOINT OUT`.

checkpoint.py        read a drafter from a SpecForge checkpoint (plugin strategies) or a saved drafter
sglang_contract.py   SGLang's DFLASH / DFLASH2 loader contract, and the check that replays it
vllm_contract.py     vLLM's DFlash / DFlash2 loader contract (its own prefixing and fusing), and its check
writer.py            write OUT (config.json, model.safetensors, provenance.json) atomically; dtype, server
                     version floors, serve commands
"""

__all__: list[str] = []
