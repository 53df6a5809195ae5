"""Benchmark records (design.md section 8) and what is generated from them.

    records.py   the shared record schema (BenchRecord, load_records, write_records)
    compare.py   which records were measured side by side; CSBP's speedup over every other mode
    latest.py    the newest measurement of each configuration; one headline row per problem
    plots.py     PNG plots of one workload (tokens/s, CSBP speedup, peak memory vs context)
    report.py    headline page, every-record page and CSV from records (`specforge-csbp report`)
    grid.py      sweep points and their command lines (the benchmark-script contract)
    isolation.py fresh_point(): every mode of a launch starts from the same compile/allocator state
    runner.py    run a sweep: fresh process per point, oom/error recorded, resumable (`specforge-csbp sweep`)
    scenarios.py named GPU scenarios (benchmarks/scenarios.toml) and their runner (benchmarks/run_scenario.py)
"""

__all__ = ["BenchRecord", "load_records", "write_records"]


def __getattr__(name: str):
    if name in __all__:
        # lazy: optional dependency (pydantic): bench.isolation imports without it, as bdlm_bench.py needs
        from . import records

        return getattr(records, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
