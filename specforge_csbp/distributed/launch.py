"""Start P ranks on this machine (gloo on CPU) or join a torchrun launch (NCCL on GPU), and fail fast.

A rank that crashes, is killed or hangs must never leave the others waiting or running:

    parent (`spawn`)                           rank r (its own process group, dies with the parent)
    ────────────────                           ─────────────────────────────────────────────────────
    watchdog board (TCPStore) ◄──────────────  watchdog thread, every tick: publish {progress, heartbeat
    poll exits every 50 ms                       label, seconds blocked in one collective, frame}; read
    first failure (exception, signal,            the others'. A rank blocked >= timeout_s in a collective
      exit code, hang report)                    while some rank is not in one -> that rank hung: one
    -> SIGKILL every rank's process group        line naming it, exit 124 (every rank that sees it)
    -> RankFailure("rank 1 ...")               exception -> error record for the parent, exit 1 (a
                                                 user's error or a RunFault: no traceback, the parent
                                                 prints its one line)

Under torchrun the agent kills the other workers when one exits; the same watchdog (`init_from_env`) turns a
hang into such an exit, with a message naming the hung rank. "In a collective" means the main thread's
innermost Python frame is inside `torch.distributed` or waits on a collective handle (`.wait(`); a rank
blocked in a CUDA synchronisation is not seen as waiting (NCCL's own timeout covers that case).
Trainers mark progress with `heartbeat("step 3: forward")`, which labels the message.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import linecache
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import RunFault, is_user_error, one_line
from ..outputs import write_json_atomic

__all__ = [
    "HANG_EXIT_CODE",
    "RankFailure",
    "RankValueError",
    "free_port",
    "hang_report",
    "heartbeat",
    "init_from_env",
    "spawn",
]

HANG_EXIT_CODE = 124  # as timeout(1)
_BOARD_ENV = "SPECFORGE_CSBP_WATCHDOG"  # host:port of the watchdog board (set by spawn for its ranks)
_KEY = "specforge_csbp/watchdog/{}"
_GRACE_S = 0.3  # after the first exit, how long to collect the others' (to name the root cause)
# Messages of errors that are a consequence of another rank's death, not a cause.
_PEER_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out",
    "timed out",
)


class RankFailure(RuntimeError):
    """A rank of a `spawn` failed; `rank` names it, `kind` is exception | signal | exit | hang; `peer`: the
    exception is a peer's disconnection (no rank reported more; the rank did not print its traceback)."""

    def __init__(self, message: str, *, rank: int, kind: str, traceback: str = "", peer: bool = False):
        super().__init__(message)
        self.rank, self.kind, self.traceback, self.peer = rank, kind, traceback, peer


class RankValueError(RankFailure, ValueError):
    """A rank raised ValueError (a validation error): the one-line message, prefixed with the rank."""


def _backstop(timeout_s: float) -> timedelta:
    """The process group's own timeout: after the watchdog's (timeout_s + at most two ticks), a backstop."""
    return timedelta(seconds=timeout_s + max(10.0, 0.1 * timeout_s))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- heartbeats -------------------------------------------------------------------------------------------
_progress = [0, ""]  # (count, label) of this process; read by the watchdog thread


def heartbeat(label: str) -> None:
    """Mark progress (cheap: no I/O); `label` says where this rank is, e.g. 'step 3: gradient all-reduce'."""
    _progress[0] += 1
    _progress[1] = label


# -- the watchdog -------------------------------------------------------------------------------------------
def _frame_info(frame) -> tuple[bool, str]:
    """(blocked in a collective?, 'file:line in function') for a thread's innermost frame."""
    if frame is None:
        return False, "?"
    code = frame.f_code
    path = code.co_filename.replace(os.sep, "/")
    line = linecache.getline(code.co_filename, frame.f_lineno)
    waiting = "/torch/distributed/" in path or ".wait(" in line
    return waiting, f"{os.path.basename(path)}:{frame.f_lineno} in {code.co_name}"


def _names(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def hang_report(status: dict[int, dict], world: int, timeout_s: float) -> tuple[list[int], str] | None:
    """(hung ranks, one-line message) when some rank has waited >= timeout_s in a collective, else None.

    The hung ranks are those not in a collective (or finished, or silent); if every rank waits, those with
    the least progress; if they are all level, every rank (mismatched collectives)."""
    if len(status) < world or not all(s["ready"] for s in status.values()):
        return None  # still starting: the process group's own timeout covers rendezvous
    waiters = sorted(r for r, s in status.items() if s["wait"] >= timeout_s)
    if not waiters:
        return None
    blocked = {r for r, s in status.items() if s["in_collective"] and not s["done"] and not s["stale"]}
    hung = sorted(set(range(world)) - blocked)
    w = status[waiters[0]]
    head = f"{_names(waiters)} waited {w['wait']:.1f} s in a collective (at {w['label'] or w['where']})"
    if hung:

        def state(r: int) -> str:
            s = status[r]
            what = "had finished" if s["done"] else "stopped responding" if s["stale"] else "was not in one"
            return f"{what} (at {s['label'] or '-'}, {s['where']})"

        detail = "; ".join(f"rank {r} {state(r)}" for r in hung)
        return hung, f"{_names(hung)} hung: {head} while {detail}"
    least = min(s["progress"] for s in status.values())
    hung = sorted(r for r, s in status.items() if s["progress"] == least)
    if len(hung) < world:
        return hung, f"{_names(hung)} hung: {head}; {_names(hung)} made the least progress"
    where = "; ".join(f"rank {r} at {status[r]['label'] or status[r]['where']}" for r in range(world))
    return hung, f"every rank waited >= {timeout_s:.1f} s in a collective no rank completes ({where})"


class _Watchdog(threading.Thread):
    """Publishes this rank's state to the board and exits the process when the job hangs."""

    def __init__(
        self, addr: str, rank: int, world: int, timeout_s: float, on_hang: Callable[[list, str], None]
    ):
        super().__init__(name="specforge-csbp-watchdog", daemon=True)
        host, port = addr.rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        self.rank, self.world, self.timeout_s, self.on_hang = rank, world, timeout_s, on_hang
        self.tick = max(0.05, min(1.0, timeout_s / 10))
        self.main = threading.main_thread().ident
        self.ready = self.done = False
        self._halt = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its tick, when it changed, local clock)
        self._n = 0
        self._blocked: tuple[Any, float] | None = None  # (frame key, since)
        self.publish()

    def publish(self) -> None:
        frame = sys._current_frames().get(self.main)
        waiting, where = _frame_info(frame)
        now = time.monotonic()
        key = (id(frame), frame.f_lineno if frame else 0, _progress[0])
        if waiting and not self.done:
            if self._blocked is None or self._blocked[0] != key:
                self._blocked = (key, now)
            wait = now - self._blocked[1]
        else:
            self._blocked, wait = None, 0.0
        self._n += 1
        state = {
            "n": self._n, "progress": _progress[0], "label": _progress[1], "wait": wait, "where": where,
            "in_collective": waiting and not self.done, "ready": self.ready, "done": self.done,
        }  # fmt: skip
        self.store.set(_KEY.format(self.rank), json.dumps(state))

    def read(self) -> dict[int, dict]:
        now, out = time.monotonic(), {}
        for r in range(self.world):
            key = _KEY.format(r)
            if not self.store.check([key]):
                continue
            s = json.loads(self.store.get(key))
            tick, since = self._seen.get(r, (-1, now))
            if s["n"] != tick:
                self._seen[r] = (s["n"], now)
                since = now
            s["stale"] = r != self.rank and now - since > max(10 * self.tick, 5.0)
            out[r] = s
        return out

    def run(self) -> None:
        while not self._halt.wait(self.tick):
            try:
                self.publish()
                found = hang_report(self.read(), self.world, self.timeout_s)
            except Exception:  # noqa: BLE001, S112 - the board is gone (parent exiting): nothing to watch
                continue
            if found is not None:
                self.on_hang(*found)

    def stop(self) -> None:
        self._halt.set()


_watchdog: _Watchdog | None = None


def _start_watchdog(addr: str, rank: int, world: int, timeout_s: float, on_hang) -> None:
    global _watchdog
    _watchdog = _Watchdog(addr, rank, world, timeout_s, on_hang)
    _watchdog.start()


def _set_watchdog(**flags: bool) -> None:
    """Set `ready` / `done`; the watchdog thread publishes them on its next tick (it alone uses the board)."""
    if _watchdog is not None:
        for k, v in flags.items():
            setattr(_watchdog, k, v)


def _exit_hung(err_file: str | None, rank: int):
    def on_hang(hung: list[int], message: str) -> None:
        if err_file is not None:
            _write(err_file, kind="hang", rank=hung[0], message=message, traceback="")
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        print(f"specforge-csbp: rank {rank}: {message}\n{stack}", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)

    return on_hang


# -- spawn ---------------------------------------------------------------------------------------------------
def _write(path: str, **record: Any) -> None:
    write_json_atomic(path, record, indent=None)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the parent dies (so a killed test or CLI leaves no rank behind)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, timeout_s: float, args: tuple,
           err_dir: str, board: str) -> None:  # fmt: skip
    os.setpgid(0, 0)  # own process group: the parent kills the rank and anything it started
    _die_with_parent()
    err_file = os.path.join(err_dir, f"rank{rank}.json")
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), **{_BOARD_ENV: board})  # fmt: skip
        torch.set_num_threads(1)  # P ranks share the machine's cores
        _start_watchdog(board, rank, world_size, timeout_s, _exit_hung(err_file, rank))
        # The watchdog fires at timeout_s; gloo's own timeout is a backstop after it.
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=_backstop(timeout_s))
        _set_watchdog(ready=True)
        fn(rank, world_size, *args)
        _set_watchdog(done=True)
        dist.destroy_process_group()
        if _watchdog is not None:
            _watchdog.stop()
            _watchdog.join(timeout=5)
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: destroying gloo / TCPStore threads at exit can abort the process
        # ("terminate called without an active exception", SIGABRT) after all the work succeeded.
        os._exit(0)
    except SystemExit as err:
        if err.code in (None, 0):
            os._exit(0)
        _write(err_file, kind="exception", rank=rank, type="SystemExit", message=f"exit({err.code!r})",
               value_error=False, peer=False, traceback=traceback.format_exc())  # fmt: skip
        os._exit(1)
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the parent
        peer = isinstance(err, getattr(dist, "DistBackendError", ())) or any(
            s in str(err) for s in _PEER_ERRORS
        )

        user = not peer and is_user_error(err)  # bad input, a file, disk full, OOM: comes back as one line
        _write(err_file, kind="exception", rank=rank, type=type(err).__name__,
               message=one_line(err) if user else str(err), value_error=user, peer=peer,
               names_ranks=isinstance(err, RunFault), traceback=traceback.format_exc())  # fmt: skip
        if not (user or peer):  # a bug: its traceback; a user's error is the parent's line, a peer's noise
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # no teardown: a blocked peer must not keep this rank alive


def _describe(rank: int, code: int, err_dir: str) -> tuple[int, RankFailure]:
    """(priority, failure) of a rank that exited with `code`; lower priority = closer to the root cause."""
    path = os.path.join(err_dir, f"rank{rank}.json")
    record = None
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        record = json.load(f)
    if record is not None and record["kind"] == "hang":
        return 0, RankFailure(record["message"], rank=record["rank"], kind="hang")
    if record is not None:
        one_line = (record["message"].splitlines() or [""])[0]
        if record["value_error"]:  # a RunFault's line names its ranks already
            line = one_line if record.get("names_ranks") else f"rank {rank}: {one_line}"
            err = RankValueError(line, rank=rank, kind="exception", traceback=record["traceback"])
        else:
            err = RankFailure(
                f"rank {rank} failed: {record['type']}: {one_line}\n--- rank {rank} ---\n{record['traceback']}",
                rank=rank, kind="exception", traceback=record["traceback"], peer=record["peer"],
            )  # fmt: skip
        return (2 if record["peer"] else 0), err
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return 0, RankFailure(f"rank {rank} was killed by signal {name}", rank=rank, kind="signal")
    return 1, RankFailure(f"rank {rank} exited with code {code}", rank=rank, kind="exit")


def _kill_group(proc) -> None:
    if proc.pid is None:  # never started
        return
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError, AttributeError):
            kill()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> None:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; fn must be importable (picklable).

    Fails fast: when a rank raises, is killed, exits non-zero or hangs (waits >= `timeout_s` in a
    collective that another rank does not join), every rank is killed (with anything it started) and
    `RankFailure` names the failed rank; a ValueError in a rank is re-raised as `RankValueError` (also a
    ValueError) with its one line."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    ctx = mp.get_context("spawn")
    board = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="specforge-csbp-spawn-") as err_dir:
        procs = [
            ctx.Process(target=_entry, name=f"rank{r}", daemon=False,
                        args=(r, fn, world_size, port, timeout_s, args, err_dir, f"127.0.0.1:{board.port}"))
            for r in range(world_size)
        ]  # fmt: skip
        failures: list[tuple[int, float, int, RankFailure]] = []
        try:
            for p in procs:
                p.start()
            alive = set(range(world_size))
            first_failure_at = None
            while alive:
                ready = multiprocessing.connection.wait([procs[r].sentinel for r in alive], timeout=0.05)
                for r in [r for r in alive if procs[r].sentinel in ready]:
                    procs[r].join()
                    alive.discard(r)
                    if procs[r].exitcode != 0:
                        prio, err = _describe(r, procs[r].exitcode, err_dir)
                        failures.append((prio, time.monotonic(), r, err))
                        first_failure_at = first_failure_at or time.monotonic()
                if first_failure_at is not None and time.monotonic() - first_failure_at >= _GRACE_S:
                    break
        finally:
            for p in procs:  # failed job: kill the survivors; finished job: anything a rank left behind
                _kill_group(p)
            for p in procs:
                if p.pid is not None:
                    p.join(timeout=10)
        del board
    if failures:
        raise min(failures, key=lambda f: (f[0], f[1], f[2]))[3]


def _launch_store_address() -> str | None:
    """host:port of the TCPStore the process group rendezvoused on (torchrun's agent store, or rank 0's)."""
    store = (
        dist.distributed_c10d._get_default_store()
        if hasattr(dist.distributed_c10d, "_get_default_store")
        else None
    )
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return f"{store.host}:{store.port}"
    port = os.environ.get("MASTER_PORT")
    return f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}" if port else None


def init_from_env(
    backend: str | None = None, timeout_s: float = 600.0, *, watchdog: bool = True
) -> tuple[int, int]:
    """Join a torchrun launch (RANK/WORLD_SIZE/MASTER_* set); NCCL when CUDA is available.

    With `watchdog`, a rank blocked `timeout_s` in a collective that another rank does not join makes
    every rank that sees it exit with code 124 and a line naming the hung rank (torchrun then stops the
    rest); the board is the launch's own TCPStore (a separate client connection). The process group's
    timeout (NCCL's too) is then a backstop a little after `timeout_s`."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend, timeout=_backstop(timeout_s) if watchdog else timedelta(seconds=timeout_s)
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if watchdog and world > 1 and _watchdog is None:
        board = os.environ.get(_BOARD_ENV) or _launch_store_address()
        try:
            _start_watchdog(board, rank, world, timeout_s, _exit_hung(None, rank))
            _set_watchdog(ready=True)
        except Exception as err:  # noqa: BLE001 - no board: run without hang detection rather than not at all
            print(f"specforge-csbp: rank {rank}: hang watchdog disabled ({err})", file=sys.stderr, flush=True)
    return rank, world
