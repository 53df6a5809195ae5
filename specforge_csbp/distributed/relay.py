"""Worker-error relay: a torchrun worker's one-line error reaches the user as the launcher's last line.

    launcher                                   worker (rank r, under torchrun)
    --------                                   -------------------------------
    error_dir(): mkdtemp, export               exception -> record(err): write ERROR_DIR/rank{r}.txt
      SPECFORGE_CSBP_ERROR_DIR                   (one line: errors.one_line), then exit non-zero;
    run torchrun ... -> rc != 0                  a RunFault (every rank raises it, e.g. out of device
    root_cause(dir, rc): the first failure's     memory): ERROR_DIR/job.txt, a line naming the ranks;
      line (a job-wide fault first, then a       an unexpected error: `Type: message (unexpected: the
      rank's own error over a survivor's         rank's traceback is above; exit code 1)`
      "connection closed by peer"), printed
      last; exit rc

Both launchers run torchrun's agent quietly (distributed/torchrun.py: no ChildFailedError report, whose
"Root Cause" names whichever exit it saw first): `specforge train --csbp` through its torchrun prefix,
`train-bdlm` in its own process; the relayed line is what the user reads last.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from ..errors import RunFault, is_user_error, one_line

__all__ = ["ENV", "error_dir", "record", "root_cause"]

ENV = "SPECFORGE_CSBP_ERROR_DIR"
# messages of ranks that failed only because another rank went away first
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
              "ProcessGroup", "recvBytes", "sendBytes", "Socket Timeout")  # fmt: skip


@contextlib.contextmanager
def error_dir() -> Iterator[str]:
    """A fresh directory named in the environment the workers inherit; removed afterwards."""
    path = tempfile.mkdtemp(prefix="specforge-csbp-errors-")
    previous = os.environ.get(ENV)
    os.environ[ENV] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
        shutil.rmtree(path, ignore_errors=True)


def record(err: BaseException) -> None:
    """In a worker: write this rank's one-line error where the launcher looks (no-op outside a relay)."""
    root = os.environ.get(ENV)
    if not root or not os.path.isdir(root):
        return
    if is_user_error(err):
        line = one_line(err)
    else:  # the worker re-raises it: Python prints the traceback and exits 1
        line = f"{type(err).__name__}: {one_line(err)} (unexpected: the rank's traceback is above; exit code 1)"
    rank = os.environ.get("RANK", "0")
    name = "job" if isinstance(err, RunFault) else f"rank{rank}"  # every rank raises a RunFault: one file
    tmp = os.path.join(root, f".{name}.{rank}.tmp")
    with contextlib.suppress(OSError):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(line.replace("\n", " ") + "\n")
        os.replace(tmp, os.path.join(root, f"{name}.txt"))


def root_cause(root: str, rc: int) -> str:
    """The line to print for a failed launch: the first rank whose error is not a peer's disconnection."""
    with contextlib.suppress(OSError), open(os.path.join(root, "job.txt"), encoding="utf-8") as f:
        return f.read().strip()  # a fault of the whole job (every rank agreed on it): its line names the ranks
    found: list[tuple[float, int, str]] = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith("rank") and name.endswith(".txt") and name[4:-4].isdigit():
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                with open(path, encoding="utf-8") as f:
                    found.append((os.path.getmtime(path), int(name[4:-4]), f.read().strip()))
    if not found:
        return (f"a worker failed (exit code {rc}) without reporting an error (killed by a signal, or out of "
                "memory); its output above names it")  # fmt: skip
    primary = [f for f in found if not any(m in f[2] for m in _SECONDARY)] or found
    _, rank, line = min(primary, key=lambda f: (f[0], f[1]))
    return f"rank {rank}: {line}"
