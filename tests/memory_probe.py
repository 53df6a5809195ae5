"""Peak bytes a function allocates on the CPU, from torch's profiler (every allocation and free recorded,
profile_memory=True): exact and repeatable, unlike the process's resident set."""

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak
