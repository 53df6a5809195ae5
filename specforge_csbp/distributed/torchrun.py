"""torchrun (torch.distributed.run) with its agent in this process, quiet when a rank fails.

    python -m specforge_csbp.distributed.torchrun [torchrun's arguments]   # as `python -m torch.distributed.run`

torchrun ends a failed launch with its ChildFailedError traceback and a "Failures:" report. The launchers
here already print the failed rank's own one-line error (relay.py) as their last line, so that report only
hides it: `run_agent` runs the same agent and returns the failed rank's exit status instead (128 + N for
signal N), and its per-rank "failed (exitcode ...)" / "closing signal" log records are silenced. What a rank
prints itself (a bug's traceback) still shows. `specforge train --csbp` launches its workers through this
module (plugin/launch.py TORCHRUN_PREFIX); `train-bdlm` calls `run_agent` in its own process.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["AgentResult", "main", "run_agent"]


@dataclass(frozen=True)
class AgentResult:
    status: int  # 0, the first failed rank's exit status, or 128 + N when this process got signal N
    failed_rank: int | None = None
    how: str = ""  # "exited with code 1" | "was killed by SIGKILL"
    stopped_by: str | None = None  # SIGINT / SIGTERM sent to this process (the agent stopped every rank)


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(previous)


def run_agent(args: list[str]) -> AgentResult:
    """torchrun's launch of `args` (its command line after `-m torch.distributed.run`), here."""
    # lazy: torch's elastic agent is only needed by a launch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    with _quiet(agent_log):
        try:
            torchrun(parse_args(args))
        except ChildFailedError as err:
            rank, failure = err.get_first_failure()
            code = failure.exitcode
            how = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with code {code}"
            return AgentResult(128 - code if code < 0 else code or 1, rank, how)
        except SignalException as err:
            return AgentResult(128 + int(err.sigval), stopped_by=err.sigval.name)
    return AgentResult(0)


def main(argv: list[str] | None = None) -> int:
    return run_agent(list(sys.argv[1:] if argv is None else argv)).status


if __name__ == "__main__":
    sys.exit(main())
