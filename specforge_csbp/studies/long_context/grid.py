"""The study's drafter grid: architecture x recipe (x anchor sampling where it matters), one entry per name.

    architecture   full      every layer full attention over the context (the study's first drafters)
                   swa       every layer a sliding window (Scale.window: 2048 on GPU, as SpecForge's DFlash2
                             config), so a block sees the last `window` context positions only - far context
                             still reaches it through the target's features, which are full attention
                   swa-full  sliding windows on every layer but a last full-attention one (z-lab's layout)
    recipe         short             from scratch on the short store (windows of Scale.short_len)
                   long              from scratch on the long store (whole documents of Scale.long_len)
                   short-then-long   the arch's `short` export's weights (only: fresh optimizer, the LR
                                     schedule's warm-up again), then the same budget on the long store
                   short-then-short  the same, on the short store (the control: more training, no long context)
    anchors        uniform (default) | locality (csbp.anchor_sampling: runs of nearby anchors)
    plateau sweep  long-lr3x, long-warmup25: `long` at 3x the learning rate, or with a 25% warm-up instead of
                   5% - does the from-scratch long drafter leave the unigram plateau when only the schedule
                   changes? (the probe, probe.py, measures where its attention and gradients go)

The full-attention names are unchanged (`short`, `long`, `short-then-short`, `short-then-long`); the other
architectures prefix theirs (`swa-short`, `swa-full-short-then-long`, ...), locality variants end in `-locality`.
`select("a,b")` picks a subset by name and adds the warm-start sources a pick needs (a source already
exported is skipped by the train stage, so carrying its export is enough).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHS", "DRAFTERS", "DrafterRun", "drafter_config_name", "layer_types", "select"]

#: architecture -> what its layers are (the label's words; {w}: the window)
ARCHS = {"full": "full attention", "swa": "sliding window {w}", "swa-full": "sliding window {w} + last full layer"}


@dataclass(frozen=True)
class DrafterRun:
    """One drafter of the study: its architecture, the store it trains on, the drafter whose export it starts
    from, and how its anchors are drawn."""

    name: str
    store: str  # "short" | "long"
    warm_start: str | None = None
    arch: str = "full"
    anchor_sampling: str = "uniform"
    lr_scale: float = 1.0  # x Scale.lr
    warmup_ratio: float = 0.05

    def label(self, short_len: int, long_len: int, window: int) -> str:
        length = long_len if self.store == "long" else short_len
        recipe = f"trained at {length} tokens" if self.warm_start is None else (
            f"trained at {short_len}, then at {length} tokens")  # fmt: skip
        arch = "" if self.arch == "full" else ARCHS[self.arch].format(w=window) + ", "
        anchors = "" if self.anchor_sampling == "uniform" else f", {self.anchor_sampling} anchors"
        lr = "" if self.lr_scale == 1.0 else f", lr x{self.lr_scale:g}"
        warmup = "" if self.warmup_ratio == 0.05 else f", warm-up {self.warmup_ratio:.0%}"
        return f"{arch}{recipe}{anchors}{lr}{warmup}"


def _grid() -> tuple[DrafterRun, ...]:
    runs = []
    for arch in ARCHS:
        p = "" if arch == "full" else f"{arch}-"
        runs += [DrafterRun(f"{p}short", "short", arch=arch), DrafterRun(f"{p}long", "long", arch=arch)]
        if arch == "full":  # the control of the first study, and the plateau sweep
            runs += [DrafterRun("short-then-short", "short", "short"), DrafterRun("long-lr3x", "long", lr_scale=3.0),
                     DrafterRun("long-warmup25", "long", warmup_ratio=0.25)]  # fmt: skip
        runs.append(DrafterRun(f"{p}short-then-long", "long", f"{p}short", arch=arch))
        if arch != "full":  # locality anchors share sliding windows between blocks: the warm-start recipes' choice
            runs.append(DrafterRun(f"{p}short-then-long-locality", "long", f"{p}short", arch=arch,
                                   anchor_sampling="locality"))  # fmt: skip
    return tuple(runs)


#: in training order: a warm start's source comes before it
DRAFTERS = _grid()
_BY_NAME = {d.name: d for d in DRAFTERS}


def layer_types(arch: str, layers: int) -> list[str]:
    """The drafter config's `layer_types` of an architecture with `layers` layers."""
    if arch == "full":
        return ["full_attention"] * layers
    if arch == "swa":
        return ["sliding_attention"] * layers
    if layers < 2:
        raise ValueError(f"architecture swa-full needs >= 2 drafter layers; got {layers}")
    return ["sliding_attention"] * (layers - 1) + ["full_attention"]


def drafter_config_name(arch: str) -> str:
    """The run directory's drafter config file of an architecture (`drafter.json`: full attention)."""
    return "drafter.json" if arch == "full" else f"drafter-{arch}.json"


def select(names: str | None) -> tuple[DrafterRun, ...]:
    """The drafters named in a comma-separated list (None or "all": the whole grid) plus their warm-start
    sources, in training order; an unknown name is a one-line error listing the grid."""
    if names is None or names.strip() == "all":
        return DRAFTERS
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in _BY_NAME]
    if unknown or not wanted:
        raise ValueError(f"--drafters: unknown drafter {', '.join(unknown) or repr(names)}; allowed: all or a "
                         f"comma-separated list of {', '.join(_BY_NAME)}")  # fmt: skip
    keep = set(wanted)
    for n in wanted:
        while _BY_NAME[n].warm_start is not None:
            n = _BY_NAME[n].warm_start
            keep.add(n)
    return tuple(d for d in DRAFTERS if d.name in keep)
