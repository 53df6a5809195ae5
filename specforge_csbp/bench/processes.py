"""Run a benchmark command in a process group of its own, and stop the whole group at a time limit.

A benchmark launches torchrun, which launches ranks, which may start compile workers: killing only the
leader would leave the rest holding GPUs. So the command starts a new session (its own process group) and
the limit signals the group:

    limit reached -> SIGTERM to the group (when `grace_s` > 0), up to `grace_s` s to exit
                  -> SIGKILL to whatever of the group is left (a rank, a sleeping child)

Standard library only: the named GPU scenarios (scenarios.py) run it on machines without pydantic.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping
from typing import IO

__all__ = ["run_group"]


def run_group(
    argv: list[str], limit_s: float | None, *, grace_s: float = 0.0, stdout: IO | None = None,
    env: Mapping[str, str] | None = None, cwd: str | None = None,
) -> tuple[int, bool]:  # fmt: skip
    """(exit code, whether the limit stopped it); stdout (and stderr, merged) go to `stdout` when given."""
    proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT if stdout is not None else None,
                            env=None if env is None else dict(env), cwd=cwd, start_new_session=True)  # fmt: skip
    try:
        return proc.wait(timeout=limit_s), False
    except subprocess.TimeoutExpired:
        if grace_s > 0:
            os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):  # the group may be gone already
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return proc.returncode, True
