"""Where `memstream eval` keeps its chains' progress: a state store in the output folder.

Every step of every chain is checkpointed as a corpus run's are, through the same
`resume_chain`, so `--resume` continues a configuration cut short (a session's end, Ctrl-C)
from each chain's last step instead of from its start: a long cell can be measured over
several sittings. Without `--resume` the store starts empty.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import shutil
import tempfile
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from connectors.engines.factory import EngineSpec
from connectors.state.records import DocumentRecord
from connectors.state.store import StateStore
from operators.config import MethodConfig
from operators.core.document import PlannedChain
from pipeline.evaluation.samples import EvalSample
from pipeline.resume import chain_key, memory_keys

CHECKPOINTS_FILE = "checkpoints.sqlite"
RUN_ID = "eval"


class EvalCheckpoints:
    """The chains of one eval run, keyed by what they read and how: a resumed run continues
    only chains of the same sample, model, dtype and method."""

    def __init__(self, path: Path, engine: EngineSpec, *, temporary: bool = False) -> None:
        self.path = path
        self._temporary = temporary
        self.engine = engine
        self.store = StateStore(f"sqlite:///{path}")
        self.store.migrate()
        self.attempt = self.store.begin_run(RUN_ID, {"kind": "eval"}).attempt
        # SQLite writes one at a time: one thread keeps the calls off the event loop, in order.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="memstream-eval-store")

    @classmethod
    def in_folder(cls, output: Path, engine: EngineSpec, *, resume: bool) -> EvalCheckpoints:
        path = output / CHECKPOINTS_FILE
        if not resume:
            for stale in (
                path,
                path.with_name(path.name + "-wal"),
                path.with_name(path.name + "-shm"),
            ):
                stale.unlink(missing_ok=True)
        output.mkdir(parents=True, exist_ok=True)
        return cls(path, engine)

    @classmethod
    def temporary(cls) -> EvalCheckpoints:
        """For a run that keeps nothing (tests): the store lives in a temp folder until closed."""
        folder = Path(tempfile.mkdtemp(prefix="memstream-eval-"))
        return cls(folder / CHECKPOINTS_FILE, EngineSpec(model="unrecorded"), temporary=True)

    def key(self, sample: EvalSample, method: MethodConfig) -> str:
        content_sha256 = hashlib.sha256(sample.document.encode()).hexdigest()
        return chain_key(content_sha256, sample.question, self.engine, method)

    def memory_keys(self, sample: EvalSample, method: MethodConfig) -> tuple[str, ...]:
        content_sha256 = hashlib.sha256(sample.document.encode()).hexdigest()
        return memory_keys(content_sha256, sample.question, self.engine, method)

    def plan(self, samples: Iterable[tuple[EvalSample, int]], method: MethodConfig) -> list[str]:
        """Records each sample's chain, given the sample and its number of segments; returns
        their keys, in the order given."""
        keys = []
        for sample, n_segments in samples:
            content_sha256 = hashlib.sha256(sample.document.encode()).hexdigest()
            key = self.key(sample, method)
            document = DocumentRecord(
                run_id=RUN_ID,
                attempt=self.attempt,
                source_uri=key,  # a sample's text may be asked by several methods: one row each
                doc_id=content_sha256[:16],
                name=sample.sample_id,
                content_sha256=content_sha256,
                parser=None,
                pages=None,
                warnings=(),
                metadata={},
                n_tokens=sample.n_tokens,
                n_segments=n_segments,
            )
            self.store.plan_document(document, [PlannedChain(key, "q0", sample.question)])
            keys.append(key)
        return keys

    def chains(self, keys: Collection[str]) -> dict[str, dict[str, Any]]:
        """Each chain's row as the store holds it: its answer, memory and counts over every
        sitting."""
        return {row["chain_key"]: row for row in self.store.answers(RUN_ID, self.attempt, keys)}

    async def call(self, function: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(function, *args))

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.store.close()
        if self._temporary:
            shutil.rmtree(self.path.parent, ignore_errors=True)
