"""What a run reports: its `RunSummary`, the memory stage's tally, and progress while it runs."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from connectors.state.database import StateStoreError
from connectors.state.records import DocumentChanges, RunProgress
from connectors.state.store import StateStore

logger = logging.getLogger(__name__)
ProgressCallback = Callable[[RunProgress], None]


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    attempt: int
    documents: int  # inputs listed
    documents_answered: int  # with a row per question in answers
    documents_failed: int  # in errors: could not be read, parsed or segmented
    chains: int
    chains_done: int  # answered, in this attempt or before
    chains_failed: int
    chains_resumed: int  # answered by this attempt, starting from a checkpoint
    chains_skipped: int  # answered before this attempt
    errors: int
    prompt_tokens: int  # processed by this attempt
    completion_tokens: int
    elapsed_s: float  # end to end: checks, listing, engine start-up, the stream, the export
    busy_s: float  # from this attempt's first model call to its last
    outputs: dict[str, str]  # table name (and "manifest") -> URI
    state_store: str
    engine: str = ""  # e.g. "vllm qwen2.5-coder-0.5b-instruct, float32, eager"
    # the documents against the previous finished run over the same sources and output
    changes: DocumentChanges = field(default_factory=DocumentChanges)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def chains_worked(self) -> int:
        """Chains this attempt answered."""
        return self.chains_done - self.chains_skipped

    @property
    def tokens_per_s(self) -> float:
        """End to end, start-up included."""
        return self.tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def chains_per_s(self) -> float:
        return self.chains_worked / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def busy_tokens_per_s(self) -> float:
        """While the engines were answering: start-up excluded."""
        return self.tokens / self.busy_s if self.busy_s else 0.0

    @property
    def busy_chains_per_s(self) -> float:
        return self.chains_worked / self.busy_s if self.busy_s else 0.0

    @property
    def ok(self) -> bool:
        return not self.errors and not self.chains_failed and self.chains_done == self.chains


@dataclass
class Tally:
    """What the memory stage reports of the chains that reached it in this attempt."""

    answered: int = 0
    resumed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.answered += row["status"] == "done"
            self.resumed += row["status"] == "done" and row["start_step"] > 0
            self.prompt_tokens += row["prompt_tokens"]
            self.completion_tokens += row["completion_tokens"]


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
    members = (
        f", documents read {progress.members_done}/{progress.members_planned}"
        if progress.members_planned
        else ""
    )
    logger.info(
        "model calls %d/%d, chains answered %d/%d%s",
        progress.steps_done,
        progress.steps_planned,
        progress.chains_done,
        progress.chains_planned,
        members,
    )
