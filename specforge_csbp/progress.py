"""The one progress bar every command draws (eval, capture, import, train-bdlm's trainer, the sweep, ...).

    bar = progress_bar(items, total=n, desc="capture", unit="sample", disable=not progress)

On a terminal it is tqdm's own bar. Anywhere else - a log file, a pipe, CI - a redrawn bar would leave runs of
carriage returns in the log, so the same object prints one plain line (tqdm's numbers: count, rate, postfix)
at most every `interval_s` seconds, and a last one when it closes. `interactive(stream)` is the one test of
"a terminal" (the plugin's SpecForge progress bar uses it too). The libraries' own bars (transformers'
"Loading weights", huggingface_hub's downloads) are not ours to redraw: off a terminal `quiet_library_bars`
turns them off, in this process and, through the environment, in every worker it starts.
"""

from __future__ import annotations

import io
import os
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["PlainProgress", "interactive", "progress_bar", "quiet_library_bars"]

PLAIN_INTERVAL_S = 30.0


def interactive(stream: Any) -> bool:
    """Is `stream` a terminal (where a redrawn bar belongs)?"""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class PlainProgress(tqdm):
    """tqdm's counting and formatting, printed as whole lines: every `interval_s` seconds and at close."""

    def __init__(self, *args: Any, interval_s: float = PLAIN_INTERVAL_S, **kwargs: Any) -> None:
        self._interval_s = interval_s
        self._printed_at: float | None = None  # none yet: the first update prints (a run's start shows)
        self._printed: tuple | None = None  # (count, postfix) of the last line
        kwargs.setdefault("bar_format", "{desc}: {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]")
        super().__init__(*args, **kwargs)

    def _emit(self) -> None:
        self.fp.write(self.__str__() + "\n")
        self.fp.flush()
        self._printed_at, self._printed = time.monotonic(), (self.n, self.postfix)

    # tqdm's drawing calls: a line when one is due, never a carriage return or a cursor move
    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        due = self._printed_at is None or time.monotonic() - self._printed_at >= self._interval_s
        if msg is None and self._printed != (self.n, self.postfix) and due:
            self._emit()
        return True

    def clear(self, nolock: bool = False) -> None:
        pass

    def moveto(self, n: int) -> None:
        pass

    def close(self) -> None:
        if self.disable:
            return
        if self._printed != (self.n, self.postfix):  # the last count or postfix not printed yet
            self._emit()
        self.fp = io.StringIO()  # tqdm's own close ends its line with '\n' / '\r': nothing left to end
        super().close()


def progress_bar(
    iterable: Any = None, *, file: TextIO | None = None, interval_s: float = PLAIN_INTERVAL_S, **kwargs: Any
) -> tqdm:
    """tqdm's bar on a terminal, else PlainProgress (same arguments; `file` defaults to stderr, as tqdm's)."""
    stream = sys.stderr if file is None else file
    if interactive(stream):
        return tqdm(iterable, file=stream, **kwargs)
    return PlainProgress(iterable, file=stream, interval_s=interval_s, **kwargs)


def quiet_library_bars(stream: Any = None) -> None:
    """Off a terminal, switch off transformers' and huggingface_hub's own bars (they honour
    HF_HUB_DISABLE_PROGRESS_BARS when imported; transformers' switch covers one already imported). A user's own
    setting of the variable wins."""
    if interactive(sys.stderr if stream is None else stream):
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] != "1":
        return
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging  # lazy: only when the caller already loaded it

        hf_logging.disable_progress_bar()
