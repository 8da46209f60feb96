"""Progress: a rich progress bar on stderr while a run is in flight (sent, finished,
failed), or nothing when disabled (library use, tests)."""
from __future__ import annotations

from types import TracebackType
from typing import Any


class Progress:
    """`with Progress(title, total, enabled) as p:` then `p.sent()` / `p.finished(ok)`."""

    def __init__(self, title: str, total: int, enabled: bool = True) -> None:
        self.title, self.total, self.enabled = title, total, enabled
        self.num_sent = self.num_finished = self.num_failed = 0
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, TextColumn,
                                       TimeElapsedColumn)
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TextColumn("{task.fields[detail]}"),
                                     TimeElapsedColumn(), console=Console(stderr=True),
                                     transient=False)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=self.total, detail="")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, tb)
            self._bar = None

    def sent(self) -> None:
        self.num_sent += 1
        self._update()

    def finished(self, is_completed: bool) -> None:
        self.num_finished += 1
        self.num_failed += not is_completed
        self._update(advance=1)

    def _update(self, advance: int = 0) -> None:
        if self._bar is not None:
            in_flight = self.num_sent - self.num_finished
            self._bar.update(self._task, advance=advance,
                             detail=f"in flight {in_flight}, failed {self.num_failed}")
