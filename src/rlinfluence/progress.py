"""One progress display for every long loop (rounds of a run, pairs of a comparison), on stderr.

On a terminal it is a rich progress bar. Otherwise (a batch job, stderr piped to a log file) a
bar would be one line redrawn in place, invisible until the loop ends, so each finished step
prints one plain line instead, as SB3 and CleanRL log: ``label [3/10] info | 12.3 s``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def progress_bar(enabled: bool, label: str, total: int, completed: int = 0) -> Iterator[Callable[[str], None]]:
    """Yields ``advance(info)``: one step done, ``info`` shown after the bar (on a terminal) or
    printed with the step's line (elsewhere). No-op if disabled."""
    if not enabled:
        yield lambda info="": None
        return
    if not sys.stderr.isatty():
        yield _line_printer(label, total, completed)
        return
    from rich.console import Console

    bar = rich_progress(Console(stderr=True))
    task = bar.add_task(label, total=total, completed=completed, info="")
    with bar:
        yield lambda info="": bar.update(task, advance=1, info=info)


def rich_progress(console: Any) -> Any:
    """The terminal display: label, bar, done/total, elapsed, remaining, then the step's info.
    The info column takes the width that is left and is cut with an ellipsis, so that on a narrow
    terminal (80 columns) the bar, the count and the times stay whole."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Column

    return Progress(TextColumn("{task.description}", table_column=Column(no_wrap=True)),
                    BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                    TextColumn("{task.fields[info]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
                    console=console, expand=True)


def _line_printer(label: str, total: int, completed: int) -> Callable[[str], None]:
    """``advance(info)`` printing ``label [done/total] info | elapsed s`` on stderr, flushed."""
    start, done = time.perf_counter(), completed

    def advance(info: str = "") -> None:
        nonlocal done
        done += 1
        parts = [f"{label} [{done}/{total}]", *([info] if info else []),
                 f"{time.perf_counter() - start:.1f} s"]
        print(" | ".join(parts), file=sys.stderr, flush=True)

    return advance
