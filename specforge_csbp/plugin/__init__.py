"""SpecForge 0.2.0 plugin: CSBP variants of the DFlash-family algorithms, run by `specforge train --csbp`.

    _hook.py            .pth start-up hook: wraps `specforge.cli.main` when (and only when) it is imported
    dispatch.py         routes a `specforge` command line to the CSBP launcher or to SpecForge, unchanged
    options.py          SpecForge Config + the plugin's `csbp:` section, flags, one-line errors
    arguments.py        the `train` command's arguments (no torch: the CLI parser imports them alone)
    launch.py           `train`: registry, SpecForge launch plan with this package's workers, worker lifecycle
    groups.py           CSBP process groups (dp x cp), created right after SpecForge's init_distributed
    registry.py         AlgorithmSpec + providers (make_registration): dflash-csbp, dflash2-csbp, dflash2
    drafts.py           the drafter classes in SpecForge's draft registry (@register_draft)
    data.py             offline reader / normalizer / collator over this project's feature store
    training_model.py   the composite module SpecForge wraps (drafter + frozen target embedding and head)
    lookahead.py        one batch of look-ahead over SpecForge's data stream: next micro-step's masks built early
    strategy.py         CSBPDraftTrainStrategy(DraftTrainStrategy)

Importing this package is free (no torch, no specforge): the start-up hook imports `_hook` on every
interpreter start. Everything else loads on use. See docs/specforge.md.
"""

__all__: list[str] = []
