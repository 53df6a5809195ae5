"""Peak bytes a function allocates on the CPU, from torch's profiler (every allocation and free recorded,
profile_memory=True): exact and repeatable, unlike the process's resident set - on one thread. A gloo
collective's worker thread can drop the last reference to a tensor (its free is then not recorded) or
allocate a transient buffer while the caller's peak is on, both depending on timing; `repeats` > 1 takes
the smallest peak of several calls (`reset` before each), which is the step's own."""

from torch.profiler import ProfilerActivity, profile


def _peak(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def peak_allocated_bytes(fn, *, repeats: int = 1, reset=None) -> int:
    peaks = []
    for _ in range(repeats):
        if reset is not None:
            reset()
        peaks.append(_peak(fn))
    return min(peaks)
