"""Live progress on the terminal: a bar for `ask`, `run` and `demo`, lines for a plain log.

The readings come from the job's watcher (`pipeline.job.summary.watching`), or from `ask`'s chains.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from connectors.state.records import RunProgress
from pipeline.job import ProgressCallback

logger = logging.getLogger(__name__)


@contextmanager
def progress_bar(console: Console, starting: str = "starting") -> Iterator[ProgressCallback]:
    """A bar over model calls on `console`, with the time left once a call has finished; the
    total grows as documents are planned. Until a first reading plans any call, it says
    `starting` (Ray, the engine, the first documents). Where `console` is not a terminal (a
    log file, a DAG task), a line now and then instead."""
    if not console.is_terminal:
        yield progress_lines(console, starting)
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("chains answered {task.fields[chains]}"),
        TextColumn("{task.fields[members]}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[left]}"),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(starting, total=None, chains="0/0", members="", left="")
        first_done_at: list[tuple[float, int]] = []

        def update(progress: RunProgress) -> None:
            if progress.steps_done and not first_done_at:
                first_done_at.append((time.monotonic(), progress.steps_done))
            bar.update(
                task,
                description="model calls" if progress.steps_planned else starting,
                completed=progress.steps_done,
                total=progress.steps_planned or None,
                chains=f"{progress.chains_done}/{progress.chains_planned}",
                members=members_read(progress),
                left=_time_left(progress, first_done_at),
            )

        yield update


def members_read(progress: RunProgress) -> str:
    """The collections' members read whole, of those planned: `documents read 3/7`; "" for a
    job without collections."""
    if not progress.members_planned:
        return ""
    return f"documents read {progress.members_done}/{progress.members_planned}"


def _time_left(progress: RunProgress, first_done_at: list[tuple[float, int]]) -> str:
    """From the pace since the first reading with a finished call (start-up and the first
    calls' own wait are not the pace of the rest)."""
    if not first_done_at or progress.steps_done >= progress.steps_planned:
        return ""
    since, done_then = first_done_at[0]
    if progress.steps_done <= done_then:
        return ""
    pace = (time.monotonic() - since) / (progress.steps_done - done_then)
    seconds = pace * (progress.steps_planned - progress.steps_done)
    return f"about {_duration(seconds)} left"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class LineThrottle:
    """The pace of progress lines in a log: one at most every `every_s` seconds, but a final
    one (the work done) always."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._last = -math.inf

    def due(self, final: bool = False) -> bool:
        now = time.monotonic()
        if final or now - self._last >= self.every_s:
            self._last = now
            return True
        return False


def progress_lines(
    console: Console, starting: str = "starting", every_s: float = 30.0
) -> ProgressCallback:
    """Prints the reading when it changed, at most every `every_s` seconds, except the one
    that answers the last chain planned so far; `starting` until a call is planned."""
    started = time.monotonic()
    throttle = LineThrottle(every_s)
    last: RunProgress | None = None
    first_done_at: list[tuple[float, int]] = []

    def report(progress: RunProgress) -> None:
        nonlocal last
        now = time.monotonic()
        if progress.steps_done and not first_done_at:
            first_done_at.append((now, progress.steps_done))
        finished = progress.chains_planned > 0 and progress.chains_done == progress.chains_planned
        if progress != last and throttle.due(final=finished):
            last = progress
            if not progress.steps_planned:
                console.print(f"{starting}, {now - started:.0f} s")
                return
            left = _time_left(progress, first_done_at)
            members = members_read(progress)
            console.print(
                f"model calls {progress.steps_done}/{progress.steps_planned}, chains answered "
                f"{progress.chains_done}/{progress.chains_planned}"
                + (f", {members}" if members else "")
                + f", {now - started:.0f} s"
                + (f", {left}" if left else "")
            )

    return report
