"""specforge-csbp: context-sharded block parallelism (CSBP) for block-diffusion training.

Package map (each layer only imports the ones above it):

    layout      pure index math: zigzag clean shards, dual-end block ownership, per-rank token plans
    masks       the one visibility rule -> dense masks, FlexAttention mask_mod / block masks
    attention   the partial-attention seam (q, k, v, visibility) -> (out, lse) and the LSE merge
    distributed collectives with autograd + byte accounting, gloo/NCCL process launch
    parallel    one sharded-attention strategy that runs the reference, CP, BP and CSBP plans
    models      full BDLMs (HF causal LMs) and DFlash / DFlash2 drafters on that strategy
    objectives  chunked linear CE, BDLM SFT / conversion, the DFlash objective
    data        feature store, capture; assets: tiny bundled target and dataset
    training    the generic trainer; plugin: SpecForge integration; export: SGLang / HF
    bench       benchmark records, sweeps, reports; planner: layout cost model
    cli         `specforge-csbp` entry points
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
