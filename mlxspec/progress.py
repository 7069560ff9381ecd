"""One progress bar for every slow loop (rich, on stderr, gone when done)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(description: str, total: int | None, show: bool = True) -> Iterator[Callable]:
    """Yield ``advance()``, which moves a rich bar on stderr by one step.

    The bar writes to the stderr of the moment it starts, so code inside may silence the
    output of the libraries it calls (``contextlib.redirect_stderr``) without hiding the bar.
    ``total`` None draws a bar without an end (a generator of unknown length); ``show`` False
    yields a no-op, so callers do not branch on it.
    """
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
        TimeRemainingColumn(), transient=True,
        console=Console(file=sys.stderr),  # this stderr: a redirect inside does not hide the bar
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)
