"""One progress bar for every long loop (rounds of a run, pairs of a comparison)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(enabled: bool, label: str, total: int, completed: int = 0) -> Iterator[Callable[[str], None]]:
    """Yields ``advance(info)``: one step done, ``info`` shown after the bar. No-op if disabled."""
    if not enabled:
        yield lambda info="": None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
    task = bar.add_task(label, total=total, completed=completed, info="")
    with bar:
        yield lambda info="": bar.update(task, advance=1, info=info)
