"""The commands' stderr console and the stage log of a long command."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

console = Console(stderr=True, soft_wrap=True)  # messages carry paths: never hard-wrap them


class StageLog:
    """A long command's stages on stderr, each as it starts: ``progress(stage, item)``.

    In a terminal, one rich status line (spinner, stage, item, elapsed) that disappears when the
    work ends; otherwise (piped, a file, CI) one plain line per stage: ``YYYY-mm-dd HH:MM:SS
    TITLE STAGE: ITEM``, flushed at once, so a log shows where a long export or load is.
    """

    def __init__(self, title: str, terminal: bool | None = None):
        self.title = title
        self.terminal = console.is_terminal if terminal is None else terminal
        self._bar: Progress | None = None
        self._task = None

    def __enter__(self) -> "StageLog":
        if self.terminal:
            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                 TextColumn("{task.fields[item]}", markup=False), TimeElapsedColumn(),
                                 console=console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.title, total=None, item="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def __call__(self, stage: str, item: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.title} {stage}", item=item)
        else:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            print(f"{stamp} {self.title} {stage}: {item}" if item else f"{stamp} {self.title} {stage}",
                  file=sys.stderr, flush=True)
