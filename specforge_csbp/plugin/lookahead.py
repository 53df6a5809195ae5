"""One batch of look-ahead over SpecForge's training data stream: the training model learns the next
micro-step's sample indices and global step while this micro-step runs, and builds its first samples early.

    launcher: run = build_application_run(...); install(run); run.run()
    TrainerController.fit(data)            data = LookAheadLoader(SpecForge's FeatureDataLoader)
      batch k = next(it)                   the wrapper has fetched batch k + 1 already (same batches, same order)
      train_step(batch k, global_step g)
        forward                            current().next_batch(g) -> (batch k + 1's sample_index, its step)
                                           training_model.py builds k + 1's first samples in the prefetch worker
      (optimizer step when the accumulation window closes: the next micro-step runs at g + 1)

The next step number comes from SpecForge's TrainerCore (`accumulation_remainder`, `accumulation_steps`):
during a forward, `accumulation_remainder` micro-steps of the window are done, so this one closes the window
when remainder + 1 == accumulation_steps. Resumption and epochs are the loader's own: `seek`, `set_epoch`,
`close` and every other attribute are forwarded, and iteration yields exactly the loader's batches.

Unknown next batch -> None, and the model builds that micro-step's first sample on its own thread (today's
cost, nothing wrong): at the end of an epoch (the next epoch's order exists only after `set_epoch`), for a
step at `max_steps` (the trainer stops before it), when no wrapper is installed (SpecForge keeps the stream in the private `Trainer._loader`; 0.2.0 has no public hook,
so `install` silently does nothing if that attribute is missing or is a consume-once queue), and in eval
forwards. A wrong announcement costs a rebuild, never a wrong step: the model compares (sample, step) of what
runs with what it built (plugin/training_model.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .data import FEATURE

__all__ = ["LookAheadLoader", "current", "install", "uninstall", "wrap"]

_CURRENT: LookAheadLoader | None = None
_END = object()


class _Failed:
    """An error met while fetching a batch ahead: raised when that batch is due, not before."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class LookAheadLoader:
    """`loader`'s batches, in order, each one fetched one batch early; `core` is SpecForge's TrainerCore;
    `max_steps` the run's cap (a batch fetched for a step at the cap never runs: it is not announced)."""

    def __init__(self, loader: Any, core: Any, max_steps: int | None = None) -> None:
        self._loader, self._core, self._max_steps = loader, core, max_steps
        self._next: Any = None  # the batch the stream yields next, None when unknown

    def __getattr__(self, name: str) -> Any:
        """The loader's own attributes (set_epoch, seek, close, ...): only names not found here arrive."""
        loader = self.__dict__.get("_loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)

    @staticmethod
    def _pull(it: Iterator) -> Any:
        try:
            return next(it)
        except StopIteration:
            return _END
        except Exception as error:  # noqa: BLE001 - re-raised when that batch is due
            return _Failed(error)

    def __iter__(self) -> Iterator:
        it = iter(self._loader)
        try:
            current = self._pull(it)
            while current is not _END:
                if isinstance(current, _Failed):
                    raise current.error
                following = self._pull(it)
                self._next = None if following is _END or isinstance(following, _Failed) else following
                yield current
                current = following
        finally:  # end of the epoch, or the caller stopped iterating (max_steps)
            self._next = None

    def next_batch(self, step: int) -> tuple[torch.Tensor, int] | None:
        """(sample_index of the batch the stream yields next, the global step it will run at), or None.

        Call it from the forward of the micro-step running at `step` (inside TrainerCore.train_step)."""
        batch = self._next
        index = None if batch is None else getattr(batch, "tensors", {}).get(FEATURE)
        if index is None:
            return None
        closes_window = (self._core.accumulation_remainder + 1) % self._core.accumulation_steps == 0
        next_step = int(step) + int(closes_window)
        if self._max_steps is not None and next_step >= self._max_steps:  # the trainer stops before it
            return None
        return index, next_step


def install(run: Any) -> LookAheadLoader | None:
    """Wrap the training stream of SpecForge's `TrainingRun` (before `run.run()`); None, changing nothing,
    when this SpecForge keeps no fixed-refs stream where 0.2.0 does."""
    global _CURRENT
    trainer = getattr(run, "trainer", None)
    loader = getattr(trainer, "_loader", None)
    core = getattr(trainer, "core", None)
    usable = (
        loader is not None
        and getattr(loader, "queue", None) is None  # a consume-once queue is not peeked at
        and hasattr(core, "accumulation_remainder")
        and hasattr(core, "accumulation_steps")
    )
    if not usable:
        _CURRENT = None
        return None
    max_steps = getattr(trainer, "max_steps", None)
    wrapped = LookAheadLoader(loader, core, max_steps if isinstance(max_steps, int) else None)
    try:
        trainer._loader = wrapped
    except (AttributeError, TypeError):  # a read-only trainer: no look-ahead
        _CURRENT = None
        return None
    _CURRENT = wrapped
    return wrapped


def wrap(loader: Any, core: Any, max_steps: int | None = None) -> LookAheadLoader:
    """A look-ahead over `loader` that the training model reads (`current()`); the caller iterates it."""
    global _CURRENT
    _CURRENT = LookAheadLoader(loader, core, max_steps)
    return _CURRENT


def current() -> LookAheadLoader | None:
    return _CURRENT


def uninstall() -> None:
    global _CURRENT
    _CURRENT = None
