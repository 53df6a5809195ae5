"""Per-chunk checksums of the feature store: a flipped byte in the rows a rank reads stops that read, naming
the file; rows a rank does not read are not read (nor hashed); no whole-file pass on a read; older stores
load with a notice and the whole-file check; the hash follows what is installed."""

import hashlib
import json
import os
import sys
import threading
import time
import types

import pytest
import torch

import specforge_csbp.data.store as store_mod
from specforge_csbp.data import FeatureStore, FeatureStoreWriter, ShardedFeatureDataset, TargetInfo
from specforge_csbp.data.checksums import chunk_hash_name, hasher, tensor_spans
from specforge_csbp.layout import ZigzagShards

WIDTH, LENGTH, ROWS = 6, 48, 5  # 5-row chunks: not aligned with the 4-token blocks


def _write(root, n=2, chunk_rows=ROWS, dtype="bfloat16"):
    g = torch.Generator().manual_seed(0)
    samples = []
    with FeatureStoreWriter(root, target=TargetInfo(name="t"), target_layer_ids=[0, 1], hidden_size=WIDTH // 2,
                            dtype=dtype, chunk_bytes=chunk_rows * WIDTH * getattr(torch, dtype).itemsize) as w:  # fmt: skip
        for i in range(n):
            ids, mask = torch.randint(0, 99, (LENGTH,), generator=g), torch.ones(LENGTH, dtype=torch.long)
            hidden = torch.randn(LENGTH, WIDTH, generator=g)
            w.add(f"s{i}", ids, mask, hidden)
            samples.append((ids, hidden.to(getattr(torch, dtype))))
    return root, samples


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _hidden_start(path):
    with open(path, "rb") as f:
        return tensor_spans(f, path)["hidden_states"].start


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_flipped_byte_in_any_rows_a_rank_reads_stops_that_read_naming_the_file(tmp_path, world):
    root, samples = _write(str(tmp_path / "store"))
    victim = os.path.join(root, "samples", "00000001.safetensors")
    start, row_bytes = _hidden_start(victim), WIDTH * 2
    clean = open(victim, "rb").read()
    zig = ZigzagShards(LENGTH, 4, world)
    for row in range(0, LENGTH, 3):  # every chunk, several rows of each
        open(victim, "wb").write(clean)
        _flip(victim, start + row * row_bytes + 3)
        store = FeatureStore(root, verify="lazy")
        chunk = row // ROWS
        for rank in range(world):
            ds = ShardedFeatureDataset(store, rank=rank, world_size=world, block_size=4)
            assert torch.equal(ds[0].hidden_states, samples[0][1][zig.rank_positions(rank)])  # other sample: fine
            read_chunks = {c for lo, hi in zig.rank_intervals(rank) for c in range(lo // ROWS, -(-hi // ROWS))}
            if chunk in read_chunks:
                with pytest.raises(ValueError) as err:
                    ds[1]
                lo, hi = chunk * ROWS, min(chunk * ROWS + ROWS, LENGTH) - 1
                assert str(err.value) == (f"corrupted store file {victim}: hidden_states rows {lo}-{hi} (chunk "
                                          f"{chunk}) differ from the manifest's {store.manifest.chunk_hash} checksum")
            else:  # the flipped row is on another rank: this rank reads (and hashes) none of it
                assert torch.equal(ds[1].hidden_states, samples[1][1][zig.rank_positions(rank)])
    with open(victim, "rb") as f:
        spans = tensor_spans(f, victim)
    for offset in (3, 30, spans["input_ids"].start + 1, spans["loss_mask"].end - 8):  # header length, header, ...
        open(victim, "wb").write(clean)
        _flip(victim, offset)
        with pytest.raises(ValueError, match=f"corrupted (or missing )?store file {victim}: (its header|unreadable header)"):
            FeatureStore(root, verify="lazy").read_tokens("s1")


def test_reads_never_pass_over_a_whole_file(tmp_path, monkeypatch):
    root, samples = _write(str(tmp_path / "store"))
    store = FeatureStore(root, verify="lazy", read_threads=3)

    def whole_file(path, *a, **k):
        raise AssertionError(f"whole-file hash of {path} on the read path")

    monkeypatch.setattr(store_mod, "file_sha256", whole_file)
    store.read_tokens("s0")
    tokens = store.bytes_read
    assert store.bytes_hashed == tokens  # header + tokens + mask: every byte outside the rows, once
    rows = store.read_intervals("s0", [(10, 20)])  # chunks 2-3: rows 10..19, nothing else
    assert torch.equal(rows, samples[0][1][10:20])
    assert store.bytes_read - tokens == store.bytes_hashed - tokens == 10 * WIDTH * 2
    rows = store.read_intervals("s1", [(7, 31)])  # rounded out to chunks 1..6 = rows 5..34, over 3 threads
    assert torch.equal(rows, samples[1][1][7:31])
    assert store.bytes_read - tokens == store.bytes_hashed - tokens == (10 + 30) * WIDTH * 2
    size = os.path.getsize(os.path.join(root, "samples", "00000001.safetensors"))
    assert 30 * WIDTH * 2 < size - (18 * WIDTH * 2)  # the read was a part of the file, not all of it


def test_trust_reads_exactly_the_rows_and_hashes_nothing(tmp_path):
    root, samples = _write(str(tmp_path / "store"))
    store = FeatureStore(root, verify="trust")
    assert torch.equal(store.read_intervals("s1", [(7, 31), (40, 41)]), samples[1][1][[*range(7, 31), 40]])
    assert (store.bytes_read, store.bytes_hashed) == (25 * WIDTH * 2, 0)


def test_a_store_from_before_chunk_checksums_loads_with_a_notice_and_the_whole_file_check(tmp_path, capsys):
    root, samples = _write(str(tmp_path / "store"))
    path = os.path.join(root, "manifest.json")
    manifest = json.load(open(path))
    for key in ("chunk_hash", "chunk_rows"):
        del manifest[key]
    for entry in manifest["samples"]:
        del entry["chunk_digests"], entry["other_digest"]
    open(path, "w").write(json.dumps(manifest))
    store = FeatureStore(root, verify="lazy")
    notice = capsys.readouterr().err.strip()
    assert len(notice.splitlines()) == 1 and root in notice and "sha256 at its first read" in notice
    assert torch.equal(store.read_intervals("s0", [(0, LENGTH)]), samples[0][1])
    victim = os.path.join(root, "samples", "00000001.safetensors")
    _flip(victim, _hidden_start(victim) + 40 * WIDTH * 2)
    with pytest.raises(ValueError, match=f"corrupted store file {victim}: sha256 differs from the manifest"):
        store.read_intervals("s1", [(0, 4)])  # the whole-file check runs on the first read, whatever the rows
    FeatureStore(root, verify="trust").read_intervals("s1", [(0, 4)])
    assert capsys.readouterr().err == ""  # trust and full stores say nothing: their check is unchanged


def test_the_hash_follows_what_is_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)  # not installed: the standard library's CRC-32
    assert chunk_hash_name() == "crc32"
    with pytest.raises(ValueError, match="install the `xxhash` package"):
        hasher("xxh3_64")
    with pytest.raises(ValueError, match="chunk_hash must be one of xxh3_64, crc32; got 'md5'"):
        hasher("md5")
    # installed (a stand-in with xxhash's function, so this runs without the package): new stores use it
    fake = types.ModuleType("xxhash")
    fake.xxh3_64 = lambda buf: hashlib.blake2b(buf, digest_size=8)
    monkeypatch.setitem(sys.modules, "xxhash", fake)
    root, samples = _write(str(tmp_path / "store"))
    store = FeatureStore(root, verify="lazy")
    assert store.manifest.chunk_hash == "xxh3_64"
    assert store.manifest.samples[0].chunk_digests[0] == fake.xxh3_64(
        samples[0][1][:ROWS].contiguous().view(torch.uint8).numpy().tobytes()
    ).hexdigest()
    victim = os.path.join(root, "samples", "00000000.safetensors")
    _flip(victim, _hidden_start(victim) + 7 * WIDTH * 2)
    with pytest.raises(ValueError, match="rows 5-9 \\(chunk 1\\) differ from the manifest's xxh3_64 checksum"):
        store.read_intervals("s0", [(6, 8)])


def test_a_manifest_with_the_wrong_number_of_chunk_checksums_is_one_line(tmp_path):
    root, _ = _write(str(tmp_path / "store"))
    path = os.path.join(root, "manifest.json")
    manifest = json.load(open(path))
    manifest["samples"][1]["chunk_digests"].pop()
    open(path, "w").write(json.dumps(manifest))
    with pytest.raises(ValueError, match="sample 's1' has 9 chunk checksums, its 48 rows in chunks of 5 need 10"):
        FeatureStore(root, verify="trust")


def _pieces(store, sid, lo, hi):
    return [(at, rows.clone()) for at, rows in store.read_pieces(sid, lo, hi)]


@pytest.mark.parametrize("verify", ["lazy", "trust"])
def test_read_pieces_tile_the_rows_in_order_over_many_reads_in_flight(tmp_path, monkeypatch, verify):
    root, samples = _write(str(tmp_path / "store"))
    monkeypatch.setattr(store_mod, "PIECE_BYTES", 2 * ROWS * WIDTH * 2)  # 2 chunks a piece: 5 pieces in 48 rows
    store = FeatureStore(root, verify=verify, read_threads=2)  # 4 in flight: the window slides
    for lo, hi in [(0, LENGTH), (7, 31), (10, 20), (3, 4), (12, 12), (44, LENGTH)]:
        before = (store.bytes_read, store.bytes_hashed)
        pieces = _pieces(store, "s1", lo, hi)
        assert [at for at, _ in pieces] == sorted(at for at, _ in pieces)
        assert sum(len(r) for _, r in pieces) == hi - lo
        if hi > lo:
            assert torch.equal(torch.cat([r for _, r in pieces]), samples[1][1][lo:hi])
            assert all(at == sum(len(r) for _, r in pieces[:i]) for i, (at, _) in enumerate(pieces))
            assert all(len(r) <= 2 * ROWS for _, r in pieces)
        covering = (min(-(-hi // ROWS) * ROWS, LENGTH) - lo // ROWS * ROWS) if hi > lo else 0
        read, hashed = store.bytes_read - before[0], store.bytes_hashed - before[1]
        if verify == "lazy":  # the covering chunks, each once; every byte read is hashed
            assert read == hashed == covering * WIDTH * 2
        else:
            assert (read, hashed) == ((hi - lo) * WIDTH * 2, 0)
    with pytest.raises(ValueError, match=r"intervals: \[40, 49\) is not inside sample 's1' of length 48"):
        _pieces(store, "s1", 40, 49)


def test_a_flipped_byte_stops_read_pieces_before_its_piece(tmp_path, monkeypatch):
    root, samples = _write(str(tmp_path / "store"))
    monkeypatch.setattr(store_mod, "PIECE_BYTES", 2 * ROWS * WIDTH * 2)
    victim = os.path.join(root, "samples", "00000000.safetensors")
    _flip(victim, _hidden_start(victim) + 27 * WIDTH * 2)  # row 27: chunk 5, piece 2 (rows 20-29)
    got = []
    with pytest.raises(ValueError) as err:
        for at, rows in FeatureStore(root, verify="lazy", read_threads=3).read_pieces("s0", 0, LENGTH):
            got.append((at, rows.clone()))
    assert str(err.value) == (f"corrupted store file {victim}: hidden_states rows 25-29 (chunk 5) differ from the "
                              f"manifest's {chunk_hash_name()} checksum")
    assert [at for at, _ in got] == [0, 10] and torch.equal(torch.cat([r for _, r in got]), samples[0][1][:20])
    store = FeatureStore(root, verify="trust")
    os.truncate(victim, os.path.getsize(victim) - 10 * WIDTH * 2)  # shortened after the open: the read names it
    with pytest.raises(ValueError, match=f"corrupted or missing store file {victim}: unexpected end of file"):
        _pieces(store, "s0", 0, LENGTH)


def test_a_consumer_that_stops_early_leaves_no_read_running(tmp_path, monkeypatch):
    root, _ = _write(str(tmp_path / "store"))
    monkeypatch.setattr(store_mod, "PIECE_BYTES", ROWS * WIDTH * 2)  # 10 pieces
    store = FeatureStore(root, verify="lazy", read_threads=2)
    fill, running = store._fill, []

    def slow_fill(*args):
        running.append(1)
        time.sleep(0.05)
        fill(*args)
        running.pop()

    monkeypatch.setattr(store, "_fill", slow_fill)
    pieces = store.read_pieces("s0", 0, LENGTH)
    next(pieces)
    pieces.close()  # the generator's cleanup waits for the reads in flight
    assert running == [] and store.bytes_read == 5 * ROWS * WIDTH * 2  # 1 yielded + 4 in flight, no more


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_load_context_over_sample_rows_equals_the_rows(tmp_path, monkeypatch, dtype):
    from specforge_csbp.models.dflash.features import DrafterSample, load_context

    root, samples = _write(str(tmp_path / "store"))
    monkeypatch.setattr(store_mod, "PIECE_BYTES", 2 * ROWS * WIDTH * 2)
    store = FeatureStore(root, verify="lazy", read_threads=2)
    calls = {"pieces": 0, "whole": 0}
    for name in ("read_pieces", "read_intervals"):
        method = getattr(store, name)

        def counted(*a, _m=method, _n=name, **k):
            calls["pieces" if _n == "read_pieces" else "whole"] += 1
            return _m(*a, **k)

        monkeypatch.setattr(store, name, counted)
    ids, hidden = samples[1]
    sample = DrafterSample(ids, torch.ones(LENGTH, dtype=torch.long), store.rows("s1"))
    intervals = [(0, 7), (7, 31), (40, LENGTH)]
    parts = load_context(sample, intervals, "cpu", dtype, WIDTH, pin=True)  # pin on a CPU device: a no-op
    for (lo, hi), part in zip(intervals, parts):
        assert part.shape == (1, hi - lo, WIDTH) and part.dtype == dtype
        assert torch.equal(part[0], hidden[lo:hi].to(dtype))
    # another dtype: copied piece by piece as the pieces arrive; the store's own dtype on the CPU: read whole
    assert calls == ({"pieces": 3, "whole": 0} if dtype != torch.bfloat16 else {"pieces": 0, "whole": 3})


def test_xxh3_digests_are_xxhash_one_shot_digests():
    # stores written when the one-shot function computed the digests must verify alike
    xxhash = pytest.importorskip("xxhash")  # a dependency of the package (pyproject): installed wherever it is
    buf = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    view = memoryview(buf.numpy())
    assert hasher("xxh3_64")(view) == xxhash.xxh3_64_hexdigest(view)


def _longest_stall_of_this_thread(work) -> tuple[float, float]:
    """(longest gap between two iterations of a loop on this thread while `work` runs on another, how long
    `work` ran): a function that holds the GIL stalls this thread for about its whole run."""
    started, done, span = threading.Event(), threading.Event(), []

    def run():
        started.set()
        t0 = time.perf_counter()
        work()
        span.append(time.perf_counter() - t0)
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the worker hands the GIL over within 0.1 ms wherever it runs Python code
    try:
        worker = threading.Thread(target=run)
        worker.start()
        started.wait()
        last = time.perf_counter()
        longest = 0.0
        while not done.is_set():
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        worker.join()
    finally:
        sys.setswitchinterval(old)
    return longest, span[0]


@pytest.mark.parametrize("name", ["crc32", "xxh3_64"])
def test_hashing_a_chunk_leaves_the_training_thread_running(name):
    # The read threads hash every byte a step reads (3.4 GB a step for a 64K sample of a 27B target); a hash
    # that held the GIL would stall the thread that launches the step's kernels for that long.
    if name == "xxh3_64":
        pytest.importorskip("xxhash")
    digest = hasher(name)
    buf = torch.ones(768 << 20, dtype=torch.uint8)  # one call long enough to see (xxh3: ~50-100 ms here)
    view = memoryview(buf.numpy())
    stall, ran = _longest_stall_of_this_thread(lambda: digest(view))
    assert stall < 0.5 * ran, f"{name}: this thread stalled {stall * 1e3:.1f} ms of the hash's {ran * 1e3:.1f} ms"


def _record_reads_and_hashes(monkeypatch, store):
    """Per thread, in order: ("read", file offset, bytes) for each positioned read and ("hash", bytes) for
    each digest of a chunk's bytes."""
    events: dict[int, list] = {}
    preadv = os.preadv

    def counted_preadv(fd, buffers, offset):
        events.setdefault(threading.get_ident(), []).append(("read", offset, sum(len(b) for b in buffers)))
        return preadv(fd, buffers, offset)

    digest = store._digest

    def counted_digest(buf):
        events.setdefault(threading.get_ident(), []).append(("hash", len(buf)))
        return digest(buf)

    monkeypatch.setattr(os, "preadv", counted_preadv)
    monkeypatch.setattr(store, "_digest", counted_digest)
    return events


@pytest.mark.parametrize("chunks_a_piece", [1, 2, 3])
def test_each_piece_is_one_read_and_each_chunk_one_hash_call(tmp_path, monkeypatch, chunks_a_piece):
    # Every call a read thread makes takes the GIL back from the trainer's thread: a piece is read by one
    # positioned read, then each chunk in it is hashed by one call, before the piece is used.
    root, samples = _write(str(tmp_path / "store"))  # 48 rows: the last chunk (45-47) is short, and the last
    store = FeatureStore(root, verify="lazy", read_threads=2)  # piece ends inside a chunk's 5 rows
    row_bytes = WIDTH * 2
    chunk_bytes = ROWS * row_bytes
    start = _hidden_start(os.path.join(root, "samples", "00000001.safetensors"))
    for lo, hi in [(0, LENGTH), (7, 31), (44, LENGTH), (46, 47)]:
        monkeypatch.setattr(store_mod, "PIECE_BYTES", chunks_a_piece * chunk_bytes)
        events = _record_reads_and_hashes(monkeypatch, store)
        before = (store.bytes_read, store.bytes_hashed)
        assert torch.equal(torch.cat([r for _, r in _pieces(store, "s1", lo, hi)]), samples[1][1][lo:hi])
        a, b = lo // ROWS * ROWS, min(-(-hi // ROWS) * ROWS, LENGTH)  # the covering chunks
        assert store.bytes_read - before[0] == store.bytes_hashed - before[1] == (b - a) * row_bytes
        reads = sorted(e[1:] for ev in events.values() for e in ev if e[0] == "read")
        pieces = list(store._piece_bounds(a, b))
        assert reads == [(start + p * row_bytes, (q - p) * row_bytes) for p, q in pieces]  # one read a piece
        for ev in events.values():  # each read followed by one hash call per chunk of its piece, in order
            i = 0
            while i < len(ev):
                assert ev[i][0] == "read"
                n, i = ev[i][2], i + 1
                while n:
                    assert ev[i][0] == "hash"
                    size = ev[i][1]
                    assert size == chunk_bytes or size == (LENGTH % ROWS) * row_bytes == n  # the sample's last
                    n, i = n - size, i + 1
        hashes = sum(e[0] == "hash" for ev in events.values() for e in ev)
        assert hashes == -(-(b - a) // ROWS)
        monkeypatch.undo()  # os.preadv and the digest as they were, patched again for the next range


@pytest.mark.parametrize("chunk, at", [(3, ROWS * WIDTH * 2 - 1), (9, (LENGTH % ROWS) * WIDTH * 2 - 1)])
def test_a_flipped_last_byte_of_a_chunk_stops_the_read(tmp_path, monkeypatch, chunk, at):
    # the flipped byte is the last of its chunk (chunk 9 is the sample's last, shorter one), in the second
    # chunk of a two-chunk piece
    root, samples = _write(str(tmp_path / "store"))
    monkeypatch.setattr(store_mod, "PIECE_BYTES", 2 * ROWS * WIDTH * 2)
    victim = os.path.join(root, "samples", "00000000.safetensors")
    _flip(victim, _hidden_start(victim) + chunk * ROWS * WIDTH * 2 + at)
    lo, hi = chunk * ROWS, min(chunk * ROWS + ROWS, LENGTH) - 1
    message = (f"corrupted store file {victim}: hidden_states rows {lo}-{hi} (chunk {chunk}) differ from the "
               f"manifest's {chunk_hash_name()} checksum")  # fmt: skip
    got = []
    with pytest.raises(ValueError) as err:
        for offset, rows in FeatureStore(root, verify="lazy", read_threads=3).read_pieces("s0", 0, LENGTH):
            got.append((offset, rows.clone()))
    assert str(err.value) == message
    first = chunk // 2 * 2 * ROWS  # the rows of the pieces before the chunk's piece, and none of it
    assert sum(len(r) for _, r in got) == first
    assert torch.equal(torch.cat([r for _, r in got]), samples[0][1][:first])
    with pytest.raises(ValueError) as err:
        FeatureStore(root, verify="lazy").read_intervals("s0", [(hi, hi + 1)])
    assert str(err.value) == message


@pytest.mark.parametrize("name", ["crc32", "xxh3_64"])
def test_a_digest_does_not_depend_on_the_buffer_it_is_taken_from(name):
    # a reader hashes a chunk where its piece landed (a view into a larger buffer); the writer hashed it in
    # a buffer of its own: the digests agree, and an unknown or missing hash is one line
    if name == "xxh3_64":
        pytest.importorskip("xxhash")
    g = torch.Generator().manual_seed(2)
    buf = torch.randint(0, 256, ((3 << 20) + 17,), dtype=torch.uint8, generator=g)
    view = memoryview(buf.numpy())
    digest = hasher(name)
    for a, b in [(0, len(view)), (1, (1 << 20) + 1), (7, 8), (4096, 4096)]:
        assert digest(view[a:b]) == digest(memoryview(bytes(view[a:b]))), (name, a, b)


def test_hasher_errors_are_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ValueError, match="install the `xxhash` package") as err:
        hasher("xxh3_64")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="chunk_hash must be one of xxh3_64, crc32; got 'md5'"):
        hasher("md5")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_read_threads_run_at_a_lower_priority_than_the_caller(tmp_path, monkeypatch):
    # A read overlaps a training step with a whole step of slack; the step's own threads keep their cores.
    root, samples = _write(str(tmp_path / "store"))
    monkeypatch.setattr(store_mod, "PIECE_BYTES", 2 * ROWS * WIDTH * 2)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    store = FeatureStore(root, verify="lazy", read_threads=2)
    assert torch.equal(store.read_intervals("s0", [(0, LENGTH)]), samples[0][1])  # 5 pieces on the pool
    both = threading.Barrier(2, timeout=10)  # two jobs that wait for each other run on the pool's two threads

    def nice_of_this_thread():
        both.wait()
        tid = threading.get_native_id()
        return tid, os.getpriority(os.PRIO_PROCESS, tid)

    got = [f.result() for f in [store._executor().submit(nice_of_this_thread) for _ in range(2)]]
    assert len({tid for tid, _ in got}) == 2
    assert [nice for _, nice in got] == [min(19, mine + store_mod.READ_THREAD_NICE)] * 2
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's is unchanged
