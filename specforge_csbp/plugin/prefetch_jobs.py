"""The prefetch worker's numbered jobs across micro-steps, and the lifetime of what they built.

One worker (models/dflash/prefetch.StepPrefetcher) builds job after job: `take(job)` returns job's
PreparedStep and starts job + 1. A job builds one or more samples (its key's store indices). A micro-step of
n samples whose first k were built by the look-ahead registers its other samples as consecutive jobs of one
sample each, and - when the look-ahead (plugin/lookahead.py) announced the next micro-step - one job for the
next micro-step's first samples after them:

    jobs:                  micro-step i: first (samples 0..k-1), first+1 .. first+n-k (one each)
                           look-ahead:   first+n-k+1 (the next micro-step's first samples)
    micro-step i + 1:      its (samples, step) == the look-ahead's?  yes: take it (built while i ran)
                                                                     no:  wait for it, drop it, build
                                                                          sample 0 here (k = 1)

Lifetime (a PreparedStep's masks and indices live on the worker's side stream and are read on the main
one; freed, the allocator hands their memory to the side stream at once):
  1. a micro-step's PreparedSteps stay referenced until the next micro-step starts - after the caller
     launched their backward;
  2. they are dropped only once the build submitted before that backward - the look-ahead - has finished
     (taken, or waited for and dropped). Every build still running was submitted after it, so the side
     stream already waits for the backward's kernels (StepPrefetcher makes each build wait for the main
     stream's queued work first).
`PrefetchJobs.micro_step` is the only place either happens, in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence

__all__ = ["AHEAD_TOKENS", "PrefetchJobs"]

#: tokens of the next micro-step's samples its look-ahead builds at most (always at least its first sample):
#: 16 samples of 4K are built in one go, a 64K sample alone
AHEAD_TOKENS = 1 << 16

#: what a job builds: (store indices, global step, anything else the builder needs); jobs match on the first two
Key = tuple[Hashable, ...]


class PrefetchJobs:
    """Numbered jobs of one StepPrefetcher (`job(number)` is its builder's lookup) and the PreparedSteps of
    the current micro-step, held by the rules of the module docstring."""

    def __init__(self) -> None:
        self._jobs: dict[int, Key] = {}
        self._outstanding: int | None = None  # the newest submitted job nobody has taken yet
        self._held: list = []  # this micro-step's PreparedSteps (rule 1)
        self.ahead_used = 0  # micro-steps whose first samples the look-ahead had built
        self.ahead_discarded = 0  # look-ahead builds for other (samples, step), waited for and dropped

    def job(self, number: int) -> Key | None:
        """What job `number` builds (the worker's thread); None: never registered, it builds nothing."""
        return self._jobs.get(number)

    def _take(self, prefetcher, job: int):
        try:
            return prefetcher.take(job)
        finally:
            self._outstanding = job + 1  # take() started job + 1

    def micro_step(
        self, prefetcher, samples: Sequence[Hashable], rest: tuple, look_ahead: Key | None,
        build_here: Callable[[Key], object],
    ) -> Iterator[tuple[object, int]]:  # fmt: skip
        """(PreparedStep, work item) of each of `samples` in order, built for `rest` = (step, ...): the first
        ones from the look-ahead's build or `build_here`, each later one from the worker (built while the one
        before runs); `look_ahead` (the next micro-step's first samples) is built after the last."""
        outstanding = self._outstanding
        built = None if outstanding is None else self._jobs.get(outstanding)
        k = 0 if built is None else len(built[0])  # samples the look-ahead built
        hit = built is not None and tuple(built[0]) == tuple(samples[:k]) and built[1] == rest[0]
        k = k if hit else 1  # a miss builds sample 0 here
        # a miss leaves outstanding + 1 unregistered: taking the stale job starts it, and it builds nothing
        first = outstanding if hit else (-1 if outstanding is None else outstanding) + 2
        later = samples[k:]
        for j, sample in enumerate(later, 1):  # registered before any take: take(job) starts job + 1 at once
            self._jobs[first + j] = ((sample,), *rest)
        if look_ahead is not None:
            self._jobs[first + len(later) + 1] = look_ahead
        prepared = self._claim(prefetcher, outstanding, hit, stale=built is not None)
        self._held = []  # rule 2: the build submitted before the last backward has finished (claimed above)
        if prepared is None:
            prefetcher.submit(first + 1)  # sample 1, or the look-ahead: built while sample 0 runs
            self._outstanding = first + 1
            prepared = build_here(((samples[0],), *rest))
        for number in [n for n in self._jobs if n < first]:
            del self._jobs[number]
        self._held.append(prepared)  # rule 1: kept until the next micro-step
        for item in range(k):
            yield prepared, item
        for j in range(1, len(later) + 1):  # built while the sample before ran; job first + j + 1 starts now
            prepared = self._take(prefetcher, first + j)
            self._held.append(prepared)
            yield prepared, 0

    def _claim(self, prefetcher, outstanding: int | None, hit: bool, *, stale: bool):
        """The outstanding build: taken when it is this micro-step's first sample (returned), else waited
        for and dropped (it may still be allocating; None is returned)."""
        if hit:
            self.ahead_used += 1
            return self._take(prefetcher, outstanding)
        if outstanding is not None:
            self.ahead_discarded += stale
            try:
                self._take(prefetcher, outstanding)
            except Exception:  # noqa: BLE001, S110 - the error of a sample that does not run is not this one's
                pass
        return None

    def reset(self) -> None:
        """The worker was closed: no job is outstanding, none registered (held steps stay until replaced)."""
        self._jobs.clear()
        self._outstanding = None
