"""Live progress of a corpus job, read from the state store while the job runs.

Every model call is checkpointed in the state store, so the store knows how far the run is,
wherever its actors run. A watcher thread on the driver polls it and hands each reading to a
callback: a progress bar for the command line, a log line for a DAG task.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from connectors.state_store import RunProgress, StateStore, StateStoreError

logger = logging.getLogger(__name__)
ProgressCallback = Callable[[RunProgress], None]


@contextmanager
def watching(
    store: StateStore, run_id: str, attempt: int, report: ProgressCallback, interval_s: float
) -> Iterator[None]:
    """Calls `report` every `interval_s` seconds while the block runs, and once at its end."""
    stop = threading.Event()

    def poll() -> None:
        while True:
            stopping = stop.wait(interval_s)
            try:
                report(store.progress(run_id, attempt))
            except StateStoreError as error:  # progress is a courtesy; the job goes on
                logger.debug("progress unavailable: %s", error)
            if stopping:
                return

    thread = threading.Thread(target=poll, name="memstream-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def log_progress(progress: RunProgress) -> None:
    logger.info(
        "model calls %d/%d, chains answered %d/%d",
        progress.steps_done,
        progress.steps_planned,
        progress.chains_done,
        progress.chains_planned,
    )


@contextmanager
def progress_bar(console: Console) -> Iterator[ProgressCallback]:
    """A bar over model calls on `console`; the total grows as documents are planned. Where
    `console` is not a terminal (a log file, a DAG task), a line now and then instead."""
    if not console.is_terminal:
        yield progress_lines(console)
        return
    columns = (
        TextColumn("model calls"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("chains answered {task.fields[chains]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("calls", total=None, chains="0/0")

        def update(progress: RunProgress) -> None:
            bar.update(
                task,
                completed=progress.steps_done,
                total=progress.steps_planned or None,
                chains=f"{progress.chains_done}/{progress.chains_planned}",
            )

        yield update


def progress_lines(console: Console, every_s: float = 30.0) -> ProgressCallback:
    """Prints the reading when it changed, at most every `every_s` seconds, except the one
    that answers the last chain planned so far."""
    started = time.monotonic()
    last: tuple[float, RunProgress | None] = (-every_s, None)

    def report(progress: RunProgress) -> None:
        nonlocal last
        now = time.monotonic()
        finished = progress.chains_done == progress.chains_planned
        if progress != last[1] and (finished or now - last[0] >= every_s):
            last = (now, progress)
            console.print(
                f"model calls {progress.steps_done}/{progress.steps_planned}, chains answered "
                f"{progress.chains_done}/{progress.chains_planned}, {now - started:.0f} s"
            )

    return report
