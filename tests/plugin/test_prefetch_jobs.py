"""PrefetchJobs (plugin/prefetch_jobs.py) against a recording stand-in for StepPrefetcher: job numbering,
look-ahead hits and misses, and the lifetime rule - a micro-step's prepared steps are dropped only after the
outstanding build (the look-ahead) has been taken."""

from __future__ import annotations

from specforge_csbp.plugin.prefetch_jobs import PrefetchJobs


class Worker:
    """StepPrefetcher's contract: take(n) returns job n's build and starts job n + 1."""

    def __init__(self, jobs: PrefetchJobs, fail: set[int] = frozenset()) -> None:
        self.jobs, self.fail, self.log = jobs, fail, []

    def submit(self, n: int) -> None:
        self.log.append(("submit", n))

    def take(self, n: int):
        self.log.append(("take", n, len(self.jobs._held)))  # what is still held while job n is waited for
        key = self.jobs.job(n)
        self.submit(n + 1)
        if n in self.fail:
            raise RuntimeError(f"job {n} failed")
        return ("worker", n, key)


def _run(jobs, worker, samples, step, look_ahead=None):
    return list(jobs.micro_step(worker, samples, (step, "g"), look_ahead, lambda key: ("here", key)))


def test_look_ahead_hit_miss_and_when_held_steps_are_dropped():
    jobs = PrefetchJobs()
    worker = Worker(jobs)
    # nothing outstanding: sample 0 built here, sample 1 by the worker while sample 0 runs
    first = _run(jobs, worker, [10, 11], 0, look_ahead=((12,), 1, "g"))
    assert first == [(("here", ((10,), 0, "g")), 0), (("worker", 2, ((11,), 0, "g")), 0)]
    assert jobs._held == [p for p, _ in first]
    # the look-ahead built (12, step 1): taken, counted as used; the previous steps dropped after that take
    second = _run(jobs, worker, [12], 1, look_ahead=((13,), 2, "g"))
    assert second == [(("worker", 3, ((12,), 1, "g")), 0)]
    assert worker.log[-2] == ("take", 3, 2)  # both steps of the first micro-step still held while waiting
    assert (jobs.ahead_used, jobs.ahead_discarded) == (1, 0) and jobs._held == [p for p, _ in second]
    # announced (13, 2) but (99, 2) runs: the stale build is waited for and dropped, 99 is built here,
    # the job after the stale one stays unregistered (it builds nothing)
    third = _run(jobs, worker, [99, 98], 2)
    assert third == [(("here", ((99,), 2, "g")), 0), (("worker", 7, ((98,), 2, "g")), 0)]
    assert ("take", 4, 1) in worker.log and jobs.job(5) is None
    assert (jobs.ahead_used, jobs.ahead_discarded) == (1, 1)
    assert sorted(jobs._jobs) == [7]  # jobs before this micro-step's first are forgotten


def test_a_look_ahead_of_several_samples_serves_them_as_items_of_one_build():
    jobs = PrefetchJobs()
    worker = Worker(jobs)
    _run(jobs, worker, [1], 0, look_ahead=((2, 3, 4), 1, "g"))  # job 2 builds the next micro-step's 2, 3, 4
    got = _run(jobs, worker, [2, 3, 4, 5], 1, look_ahead=((6, 7), 2, "g"))
    build = ("worker", 2, ((2, 3, 4), 1, "g"))
    assert got == [(build, 0), (build, 1), (build, 2), (("worker", 3, ((5,), 1, "g")), 0)]
    assert jobs.job(4) == ((6, 7), 2, "g") and jobs.ahead_used == 1
    # the next micro-step runs (6, 8): not what was built (6, 7) - a miss, sample 6 built here alone
    again = _run(jobs, worker, [6, 8], 2)
    assert again[0] == (("here", ((6,), 2, "g")), 0) and again[1][0][2] == ((8,), 2, "g")
    assert jobs.ahead_discarded == 1


def test_a_failed_stale_build_is_not_this_micro_steps_error_and_reset_forgets_the_jobs():
    jobs = PrefetchJobs()
    worker = Worker(jobs, fail={2})
    _run(jobs, worker, [1], 0, look_ahead=((2,), 1, "g"))  # job 2 is the look-ahead
    assert _run(jobs, worker, [5], 1) == [(("here", ((5,), 1, "g")), 0)]  # miss: job 2 raised, ignored
    assert jobs.ahead_discarded == 1
    jobs.reset()
    assert jobs.job(6) is None and jobs._outstanding is None
    assert _run(jobs, worker, [7], 2) == [(("here", ((7,), 2, "g")), 0)]
