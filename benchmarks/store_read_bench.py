"""The feature store's first read from a cold page cache, against the disk's own rates, in one launch.

A drafter run's first pass reads every sample's context features from disk (trainer_bench.py's cold-cache
records: at 64K on one H200 the plugin's step is bound by that read). This bench isolates the read: a store
of `--samples` samples of `--context` rows x `--width` features (bf16) is written once, and each reader below
reads every sample whole with the store's files evicted from the page cache before it (fsync +
posix_fadvise DONTNEED, + drop_caches as root):

    store-lazy     the plugin's prefetch path: `load_context` over the store's `SampleRows` - pieces of
                   PIECE_BYTES on --read-threads threads (2 x threads in flight), each read by one positioned
                   read and hashed chunk by chunk, in page-locked buffers, each piece copied to the GPU
                   as it arrives
    store-trust    the same with the checks off
    mapped-lazy    the store's earlier reader, kept here as the reference: the file memory-mapped, the
                   covering chunks hashed over --read-threads (the page faults are the reads), then copied
                   out in PIN_CHUNK_BYTES pieces through pinned memory
    disk-sequential   one thread, 16 MiB reads (bench/page_cache.sequential_read_gbps)
    disk-parallel     --streams threads at once (parallel_read_gbps): the disk at queue depth

One record per reader and thread count (workload "store-read"; mode "csbp" for the store's readers,
"reference" for the mapped reader and the disk's), with `read_gbps` (bytes over the median of the samples' read times), `step_ms`
(that median per sample) and the p90. A store reader well below disk-parallel is a reader that leaves the
disk idle; one near disk-sequential but below disk-parallel wants more requests in flight.

    python benchmarks/store_read_bench.py --context 64K --width 25600 --samples 3 --work /tmp/store_read \\
        --out benchmarks/results/store_read_h200_<date>.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from specforge_csbp.bench.grid import parse_size  # noqa: E402
from specforge_csbp.bench.page_cache import evict, parallel_read_gbps, sequential_read_gbps  # noqa: E402
from specforge_csbp.bench.records import BenchRecord, write_records  # noqa: E402
from specforge_csbp.values import parse_ints  # noqa: E402
from specforge_csbp.data import FeatureStore, FeatureStoreWriter, TargetInfo  # noqa: E402
from specforge_csbp.data.checksums import hasher, tensor_spans  # noqa: E402
from specforge_csbp.models.dflash.features import PIN_CHUNK_BYTES, DrafterSample, copy_rows_chunked, load_context  # noqa: E402

__all__ = ["main"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", default="64K", help="rows per sample (e.g. 64K)")
    p.add_argument("--width", type=int, default=25600, help="features per row (target layers x hidden size)")
    p.add_argument("--samples", type=int, default=3, help="samples in the store (each read once per reader)")
    p.add_argument("--read-threads", default="4,8,16", help="the store readers' thread counts (comma-separated)")
    p.add_argument("--streams", default="8,16", help="disk-parallel's thread counts (comma-separated)")
    p.add_argument("--work", required=True, help="directory of the store (reused when its shape matches)")
    p.add_argument("--out", required=True, help="records (JSON lines, appended)")
    p.add_argument("--fadvise-only", action="store_true",
                   help="evict with posix_fadvise alone, without /proc/sys/vm/drop_caches (which drops every file's "
                   "pages on the machine)")  # fmt: skip
    args = p.parse_args(argv)
    if args.samples < 1 or args.width < 1:
        p.error("--samples and --width must be >= 1")
    try:
        args.read_threads = parse_ints(args.read_threads, field="--read-threads", minimum=1)
        args.streams = parse_ints(args.streams, field="--streams", minimum=1)
        args.rows = parse_size(args.context, field="--context")
    except ValueError as err:
        p.error(str(err))
    return args


def write_store(root: str, rows: int, width: int, samples: int) -> FeatureStore:
    """The store, written once: random bf16 rows (reused when its shape matches)."""
    try:
        store = FeatureStore(root, verify="trust")
        if len(store) == samples and store.feature_width == width and all(store.length(s) == rows for s in store.sample_ids):
            return store
    except ValueError:
        pass
    # Drawn on the GPU where there is one: one CPU thread draws ~0.2 GB/s, minutes for a 64K store.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device).manual_seed(0)
    with FeatureStoreWriter(root, target=TargetInfo(name="store-read-bench"), target_layer_ids=[0],
                            hidden_size=width, dtype="bfloat16", overwrite=True) as w:  # fmt: skip
        for i in range(samples):
            hidden = torch.empty(rows, width, dtype=torch.bfloat16, device=device).normal_(generator=g).cpu()
            w.add(f"s{i}", torch.zeros(rows, dtype=torch.long), torch.ones(rows, dtype=torch.long), hidden)
    return FeatureStore(root, verify="trust")


def read_with_store(store: FeatureStore, sample_id: str, out: torch.Tensor, pin: bool) -> int:
    """One sample's rows to `out`'s device as the prefetch worker reads them (load_context over SampleRows)."""
    n = store.length(sample_id)
    sample = DrafterSample(torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long), store.rows(sample_id))
    (rows,) = load_context(sample, [(0, n)], out.device, out.dtype, out.shape[1], pin=pin)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return rows.numel() * rows.element_size()


def read_mapped(store: FeatureStore, sample_id: str, out: torch.Tensor, pin: bool, threads: int) -> int:
    """The store's earlier reader: map the file, hash its chunks over `threads` (the page faults read them),
    then copy the rows out through pinned memory in PIN_CHUNK_BYTES pieces."""
    entry = store.entry(sample_id)
    path = os.path.join(store.root, entry.file)
    with open(path, "rb") as f:
        hidden = tensor_spans(f, path)["hidden_states"]
    data = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
    region = data[hidden.start : hidden.end]
    row_bytes = store.feature_width * store.dtype.itemsize
    chunk = store.manifest.chunk_rows * row_bytes
    digest = hasher(store.manifest.chunk_hash)
    spans = range(0, region.numel(), chunk)

    def check(k: int) -> None:
        if digest(memoryview(region[k * chunk : k * chunk + chunk].numpy())) != entry.chunk_digests[k]:
            raise ValueError(f"{path}: chunk {k} differs")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(check, range(len(spans))))
    rows = region.view(store.dtype).view(entry.length, store.feature_width)
    copy_rows_chunked(rows, out, PIN_CHUNK_BYTES, pin=pin)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return rows.numel() * rows.element_size()


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = args.rows
    root = os.path.join(os.path.abspath(args.work), "store")
    store = write_store(root, rows, args.width, args.samples)
    files = [os.path.join(root, e.file) for e in store.manifest.samples]
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    out = torch.empty(rows, args.width, dtype=torch.bfloat16, device=device)
    command = "python benchmarks/store_read_bench.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    base = dict(workload="store-read", world_size=1, context_len=rows, block_size=0, device=device_name,
                date=datetime.date.today().isoformat(), command=command, width=args.width, samples=args.samples,
                page_cache="cold")  # fmt: skip
    records = []

    def record(mode: str, reader: str, seconds: list[float], nbytes: int, **extra) -> None:
        median = statistics.median(seconds)
        p90 = sorted(seconds)[min(len(seconds) - 1, int(0.9 * len(seconds)))]
        rec = BenchRecord(mode=mode, reader=reader, step_ms=round(median * 1e3, 2), p90_ms=round(p90 * 1e3, 2),
                          read_gbps=round(nbytes / median / 1e9, 3), bytes_per_sample=nbytes, **base, **extra)  # fmt: skip
        records.append(rec)
        print(f"store_read_bench: {reader} {extra or ''}: {rec.read_gbps} GB/s ({rec.step_ms} ms a sample, p90 {p90 * 1e3:.1f})", flush=True)

    for verify in ("lazy", "trust"):
        for threads in args.read_threads:
            reader = FeatureStore(root, verify=verify, read_threads=threads)
            seconds, nbytes = [], 0
            for sid, path in zip(reader.sample_ids, files):
                prepared_by = evict([path], drop_caches=not args.fadvise_only)
                start = time.perf_counter()
                nbytes = read_with_store(reader, sid, out, pin=on_gpu)
                seconds.append(time.perf_counter() - start)
            record("csbp", f"store-{verify}", seconds, nbytes, read_threads=threads, cache_prepared_by=prepared_by,
                   bytes_hashed=reader.bytes_hashed)  # fmt: skip
    for threads in args.read_threads:
        seconds, nbytes = [], 0
        for sid, path in zip(store.sample_ids, files):
            prepared_by = evict([path], drop_caches=not args.fadvise_only)
            start = time.perf_counter()
            nbytes = read_mapped(store, sid, out, on_gpu, threads)
            seconds.append(time.perf_counter() - start)
        record("reference", "mapped-lazy", seconds, nbytes, read_threads=threads, cache_prepared_by=prepared_by)
    size = os.path.getsize(files[0])
    sequential = [size / (sequential_read_gbps(f, limit=size) * 1e9) for f in files]
    record("reference", "disk-sequential", sequential, size, read_threads=1)
    for streams in args.streams:
        parallel = [size / (parallel_read_gbps(f, streams=streams, limit=size) * 1e9) for f in files]
        record("reference", "disk-parallel", parallel, size, read_threads=streams)
    write_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
