"""specforge-csbp: context-sharded block parallelism (CSBP) for block-diffusion training.

Package map (each layer only imports the ones above it):

    layout      pure index math: zigzag clean shards, dual-end block ownership, per-rank token plans
    masks       the one visibility rule -> dense masks, FlexAttention mask_mod / block masks
    attention   the partial-attention seam (q, k, v, visibility) -> (out, lse) and the LSE merge
    distributed collectives with autograd + byte accounting, gloo/NCCL process launch
    parallel    one sharded-attention strategy that runs the reference, CP, BP and CSBP plans
    objectives  chunked linear CE, BDLM SFT / conversion, the DFlash objective
    models      full BDLMs (HF causal LMs) and DFlash / DFlash2 drafters on that strategy
    data        feature store, capture; assets: tiny bundled target and dataset
    bench       benchmark records, sweeps, reports; planner: layout cost and memory model
    training    the generic trainer; export: SGLang / HF; eval: speculative decoding; plugin: SpecForge
    cli         `specforge-csbp` entry points; studies: end-to-end studies driven through them

(the whole order, and the top-level leaves errors / preflight / outputs / devices: docs/architecture.md)
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
