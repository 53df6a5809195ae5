"""What the feature store's read threads cost the trainer's own thread while a sample is prefetched.

In the first pass every step's sample is read (and, with the store's checks on, hashed) by the prefetch
worker's read threads while the step runs. The step's thread launches its kernels from Python, so what a
read costs it is GIL hand-overs and CPU time, not bandwidth. This bench measures exactly that: a "trainer"
thread runs a loop of tiny tensor ops (kernel launches on a GPU, small CPU ops otherwise) while the main
thread reads every sample of a warm store whole, as the prefetch worker does (`read_pieces`, page-locked
pieces copied to the device), then the loop alone; per reader:

    trust          the store's checks off: one positioned read per piece
    lazy           the store's checks on (the default): one read per piece, then one hash call per chunk
    lazy-sub<N>    reference only, not the store's order: each chunk read in N MiB sub-reads, each hashed
                   as it lands (`--sub-read-mib`): 2 x 4 / N calls per 4 MiB chunk, each taking the GIL back,
                   against 1.25 (one read per 16 MiB piece, one hash per chunk)

Readers alternate round by round (`--rounds`), so drift hits each alike. One record per reader (workload
"store-contention"; mode "csbp", "reference" for lazy-sub<N>): `step_ms` the median read of one sample,
`trainer_share` the median of the loop's rate while reading over its rate alone (1.0: untouched), and
`trainer_lost_ms_per_gb` what the reads took from the loop per GB read ((1 - share) x read time / GB).

    python benchmarks/store_contention_bench.py --context 16K --width 25600 --samples 2 --work /tmp/contention \\
        --out benchmarks/results/store_contention_<machine>_<date>.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from specforge_csbp.bench.grid import parse_size  # noqa: E402
from specforge_csbp.bench.page_cache import warm  # noqa: E402
from specforge_csbp.bench.records import BenchRecord, write_records  # noqa: E402
from specforge_csbp.data import FeatureStore, FeatureStoreWriter, TargetInfo  # noqa: E402
from specforge_csbp.data.checksums import _hash_object, read_bytes  # noqa: E402

__all__ = ["main"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", default="16K", help="rows per sample (e.g. 64K)")
    p.add_argument("--width", type=int, default=25600, help="features per row (target layers x hidden size)")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--read-threads", type=int, default=8)
    p.add_argument("--sub-read-mib", type=float, default=1.0, help="the reference reader's sub-read size")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--work", required=True)
    p.add_argument("--out", default=None, help="records file (.jsonl); none: print only")
    args = p.parse_args(argv)
    for name in ("samples", "read_threads", "rounds", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.sub_read_mib <= 0:
        p.error(f"--sub-read-mib must be > 0; got {args.sub_read_mib}")
    return args


class SubReadStore(FeatureStore):
    """The reference order: each checked chunk read in sub-reads of `sub_bytes`, each hashed as it lands."""

    sub_bytes = 1 << 20

    def _fill(self, entry, fd, hidden, p, q, buf) -> None:
        start, row_bytes, rows = hidden.start + p * self._row_bytes, self._row_bytes, self._chunk_rows
        view = memoryview(buf.numpy())
        new = _hash_object(self.manifest.chunk_hash)
        for k in range(p // rows, -(-q // rows)):
            lo, hi = (max(p, k * rows) - p) * row_bytes, (min(q, k * rows + rows) - p) * row_bytes
            h = new()
            for at in range(lo, hi, self.sub_bytes):
                part = view[at : min(hi, at + self.sub_bytes)]
                read_bytes(fd, start + at, part)
                h.update(part)
            self._check_chunk(entry, k, h.hexdigest())
        self._count(buf.numel(), buf.numel())


def write_store(args, root: str, length: int) -> None:
    if os.path.exists(os.path.join(root, "manifest.json")):
        return
    g = torch.Generator().manual_seed(0)
    with FeatureStoreWriter(root, target=TargetInfo(name="random"), target_layer_ids=[0], hidden_size=args.width,
                            dtype="bfloat16", overwrite=True) as w:  # fmt: skip
        for i in range(args.samples):
            hidden = torch.randn(length, args.width, generator=g, dtype=torch.float32).to(torch.bfloat16)
            w.add(f"s{i}", torch.arange(length), torch.ones(length, dtype=torch.long), hidden)


def trainer_loop(stop: threading.Event, device: torch.device, out: list) -> None:
    """Tiny ops back to back: on a GPU each is a kernel launch from Python, as the step's thread issues them."""
    x, n = torch.ones(8, device=device), 0
    while not stop.is_set():
        for _ in range(50):
            x = x * 1.0001
        n += 50
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out.append(n)


def loop_rate(device: torch.device, work=None, seconds: float = 0.5) -> tuple[float, float]:
    """(ops per second of the trainer loop while `work` runs, or for `seconds` alone; the run's seconds)."""
    stop, out = threading.Event(), []
    t = threading.Thread(target=trainer_loop, args=(stop, device, out))
    t0 = time.perf_counter()
    t.start()
    work() if work else time.sleep(seconds)
    elapsed = time.perf_counter() - t0
    stop.set()
    t.join()
    return out[0] / elapsed, elapsed


def read_all(store: FeatureStore, ids: list[str], length: int, device: torch.device) -> None:
    pin = device.type == "cuda"
    dst = torch.empty(length, store.feature_width, dtype=store.dtype, device=device)
    for sid in ids:
        for offset, rows in store.read_pieces(sid, 0, length, pin=pin):
            dst[offset : offset + len(rows)].copy_(rows, non_blocking=pin)
    if pin:
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    args = parse_args(argv)
    length = parse_size(args.context)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = os.path.join(args.work, "store")
    write_store(args, root, length)
    ids = [f"s{i}" for i in range(args.samples)]
    warm([os.path.join(r, n) for r, _d, names in os.walk(root) for n in names])
    SubReadStore.sub_bytes = int(args.sub_read_mib * (1 << 20))
    sub_name = f"lazy-sub{args.sub_read_mib:g}"
    readers = {"trust": FeatureStore(root, verify="trust", read_threads=args.read_threads),
               "lazy": FeatureStore(root, verify="lazy", read_threads=args.read_threads),
               sub_name: SubReadStore(root, verify="lazy", read_threads=args.read_threads)}  # fmt: skip
    nbytes = sum(readers["trust"].entry(i).nbytes for i in ids)
    loop_rate(device, seconds=0.2)  # the loop's first kernels and the pinned pool, outside every measurement
    shares: dict[str, list[float]] = {n: [] for n in readers}
    times: dict[str, list[float]] = {n: [] for n in readers}
    for _ in range(args.rounds):
        for name, store in readers.items():
            alone, _ = loop_rate(device)
            during, took = loop_rate(device, lambda s=store: read_all(s, ids, length, device))
            shares[name].append(during / alone)
            times[name].append(took / len(ids))
    command = shlex.join(["python", os.path.relpath(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])])
    records = []
    for name in readers:
        share, per_sample = statistics.median(shares[name]), statistics.median(times[name])
        rec = dict(
            workload="store-contention", mode="reference" if name == sub_name else "csbp", world_size=1,
            context_len=length, block_size=0, step_ms=round(per_sample * 1e3, 2),
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            date=datetime.date.today().isoformat(), command=command, reader=name, read_threads=args.read_threads,
            trainer_share=round(share, 4), trainer_shares=[round(s, 4) for s in shares[name]],
            trainer_lost_ms_per_gb=round((1 - share) * per_sample * len(ids) / (nbytes / 1e9) * 1e3, 2),
            read_gbps=round(nbytes / len(ids) / per_sample / 1e9, 3), sample_bytes=nbytes // len(ids),
            bytes_hashed_per_sample=readers[name].bytes_hashed // (args.rounds * len(ids)),
            cpu_count=os.cpu_count(),
        )  # fmt: skip
        records.append(rec)
        print(f"store_contention {name}: {rec['trainer_share']:.3f} of the loop's rate kept, "
              f"{rec['trainer_lost_ms_per_gb']:.1f} ms lost per GB, read {rec['read_gbps']:.2f} GB/s", flush=True)  # fmt: skip
    if args.out:
        write_records(args.out, [BenchRecord(**r) for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
