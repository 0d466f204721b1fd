"""The Ray Data stages of the job: read + parse, segment + plan, and the memory stage.

Rows flow as Arrow tables with fixed schemas. A document that cannot be read, parsed or
segmented becomes an `errors` row in the state store and leaves the stream; it never raises.
The memory stage runs on an actor pool: each actor owns one engine and drives every chain of
every batch it holds concurrently, so the engine batches steps across documents.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import hashlib
import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa

from connectors.base import Source, SourceError, SourceItem
from connectors.state_store import (
    DONE,
    Checkpoint,
    DocumentRecord,
    ErrorRecord,
    PlannedChain,
    StateStore,
    StepCheckpoint,
)
from operators.parsing import ParseError, parse_document

from .config import MethodConfig
from .core.chain import MemoryChain
from .core.evidence import find_evidence
from .core.segmentation import Segment, segment, tokenize
from .engines.factory import EngineSpec, load_tokenizer, open_engine
from .runner import ChainRunner, StepRecord

logger = logging.getLogger(__name__)
T = TypeVar("T")

ITEM_SCHEMA = pa.schema(
    [
        ("source_index", pa.int32()),
        ("uri", pa.string()),
        ("name", pa.string()),
        ("size", pa.int64()),
        ("metadata", pa.string()),  # JSON
        ("text", pa.string()),
        ("data", pa.binary()),
        ("questions", pa.list_(pa.string())),
    ]
)

DOCUMENT_SCHEMA = pa.schema(
    [
        ("source_uri", pa.string()),
        ("doc_id", pa.string()),
        ("name", pa.string()),
        ("text", pa.string()),
        ("content_sha256", pa.string()),
        ("parser", pa.string()),
        ("pages", pa.int32()),
        ("page_starts", pa.list_(pa.int64())),  # PDFs: where each page starts in `text`
        ("warnings", pa.list_(pa.string())),
        ("metadata", pa.string()),
        ("questions", pa.list_(pa.string())),
    ]
)

SEGMENT_TYPE = pa.struct(
    [
        ("index", pa.int32()),
        ("token_start", pa.int64()),
        ("token_end", pa.int64()),
        ("char_start", pa.int64()),
        ("char_end", pa.int64()),
        ("text", pa.string()),
    ]
)
PLANNED_CHAIN_TYPE = pa.struct(
    [
        ("chain_key", pa.string()),
        ("question_id", pa.string()),
        ("question", pa.string()),
        ("status", pa.string()),
    ]
)
PLAN_SCHEMA = pa.schema(
    [
        ("source_uri", pa.string()),
        ("doc_id", pa.string()),
        ("name", pa.string()),
        ("n_tokens", pa.int64()),
        # NULL when every chain of the document was already answered: nothing to read
        ("segments", pa.list_(SEGMENT_TYPE)),
        ("page_starts", pa.list_(pa.int64())),
        ("chains", pa.list_(PLANNED_CHAIN_TYPE)),
    ]
)

# Ray kills an exiting actor's child processes before any Python teardown runs, so the engine
# would lose its processes while alive (and log EngineDeadError). With this off in the memory
# actors, MemoryStage.close shuts the engine down in order at exit; vLLM's own processes still
# exit when their parent dies.
ENGINE_ACTOR_ENV = {"RAY_kill_child_processes_on_worker_exit": "false"}

RESULT_SCHEMA = pa.schema(
    [
        ("source_uri", pa.string()),
        ("doc_id", pa.string()),
        ("question_id", pa.string()),
        ("chain_key", pa.string()),
        ("status", pa.string()),  # done, failed, or skipped (answered by an earlier attempt)
        ("start_step", pa.int64()),
        ("steps_run", pa.int64()),
        ("n_steps", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("elapsed_s", pa.float64()),
        ("error", pa.string()),
    ]
)


@dataclass(frozen=True)
class Question:
    question_id: str
    text: str


@dataclass(frozen=True)
class RunContext:
    """What every stage needs to know about the run; small and picklable."""

    run_id: str
    attempt: int
    store_url: str
    engine: EngineSpec  # resolved: its dtype is concrete, and part of every chain's key
    method: MethodConfig
    questions: tuple[Question, ...]  # asked of every document

    def chain_key(self, content_sha256: str, question: str) -> str:
        identity = {
            "content_sha256": content_sha256,
            "question": question,
            "model": self.engine.model,
            "tokenizer": self.engine.tokenizer or self.engine.model,
            "dtype": self.engine.dtype,
            "method": self.method.as_dict(),
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def questions_for(self, own_questions: Sequence[str]) -> list[Question]:
        """The run's questions, then the document's own ones it does not already ask."""
        asked = list(self.questions)
        known = {question.text for question in asked}
        for index, text in enumerate(own_questions):
            if text not in known:
                known.add(text)
                asked.append(Question(f"d{index}", text))
        return asked


def doc_id_of(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()[:16]


def item_row(source_index: int, item: SourceItem) -> dict[str, Any]:
    return {
        "source_index": source_index,
        "uri": item.uri,
        "name": item.name,
        "size": item.size,
        "metadata": json.dumps(item.metadata, sort_keys=True, default=str),
        "text": item.text,
        "data": item.data,
        "questions": list(item.questions),
    }


@functools.cache
def open_store(url: str) -> StateStore:
    """One store (and connection pool) per worker process."""
    return StateStore(url)


@functools.cache
def cached_tokenizer(spec: EngineSpec) -> Any:
    return load_tokenizer(spec)


class ReadParseStage:
    """Items in, documents out: reads each item's bytes (unless it carries its text) and
    parses them. Runs as plain Ray tasks."""

    def __init__(self, sources: Sequence[Source], run: RunContext) -> None:
        self.sources = list(sources)
        self.run = run

    def __call__(self, batch: pa.Table) -> pa.Table:
        documents = []
        for row in batch.to_pylist():
            document = self._document(row)
            if document is not None:
                documents.append(document)
        return pa.Table.from_pylist(documents, schema=DOCUMENT_SCHEMA)

    def _document(self, row: dict[str, Any]) -> dict[str, Any] | None:
        uri, name = row["uri"], row["name"]
        stage = "read"
        try:
            if row["text"] is not None:
                stage = "parse"
                text, parser, pages, warnings, page_starts = row["text"], "inline", None, (), ()
                if not text.strip():
                    raise ParseError("empty document")
            else:
                data = row["data"]
                if data is None:
                    source = self.sources[row["source_index"]]
                    data = source.read_bytes(_item_of(row))
                stage = "parse"
                parsed = parse_document(data, name)
                text, parser, pages, warnings, page_starts = (
                    parsed.text,
                    parsed.parser,
                    parsed.pages,
                    parsed.warnings,
                    parsed.page_starts,
                )
        except ParseError as error:
            self._fail(row, stage, "ParseError", error.reason)
            return None
        except SourceError as error:
            self._fail(row, stage, "SourceError", str(error))
            return None
        except Exception as error:  # a bug or a library failure: one error row, not a crash
            logger.exception("cannot %s %s", stage, uri)
            self._fail(row, stage, type(error).__name__, str(error) or type(error).__name__)
            return None
        return {
            "source_uri": uri,
            "doc_id": doc_id_of(uri),
            "name": name,
            "text": text,
            "content_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "parser": parser,
            "pages": pages,
            "page_starts": list(page_starts),
            "warnings": list(warnings),
            "metadata": row["metadata"],
            "questions": row["questions"] or [],
        }

    def _fail(self, row: dict[str, Any], stage: str, error_type: str, message: str) -> None:
        open_store(self.run.store_url).record_error(
            ErrorRecord(
                run_id=self.run.run_id,
                attempt=self.run.attempt,
                source_uri=row["uri"],
                stage=stage,
                error_type=error_type,
                message=message,
                doc_id=doc_id_of(row["uri"]),
                name=row["name"],
            )
        )


def _item_of(row: dict[str, Any]) -> SourceItem:
    return SourceItem(
        uri=row["uri"],
        name=row["name"],
        size=row["size"],
        metadata=json.loads(row["metadata"] or "{}"),
    )


class SegmentStage:
    """Documents in, plans out: tokenizes each document once, cuts it into segments and
    records its chains (one per question) in the state store. A document whose chains are all
    answered already is passed on without its segments. Runs as plain Ray tasks; the tokenizer
    is loaded once per worker process."""

    def __init__(self, run: RunContext) -> None:
        self.run = run

    def __call__(self, batch: pa.Table) -> pa.Table:
        plans = []
        for row in batch.to_pylist():
            try:
                plan = self._plan(row)
            except Exception as error:  # one bad document never stops the job
                logger.exception("cannot segment %s", row["source_uri"])
                self._fail(row, type(error).__name__, str(error) or type(error).__name__)
                continue
            if plan is not None:
                plans.append(plan)
        return pa.Table.from_pylist(plans, schema=PLAN_SCHEMA)

    def _plan(self, row: dict[str, Any]) -> dict[str, Any] | None:
        questions = self.run.questions_for(row["questions"])
        if not questions:
            self._fail(
                row,
                "NoQuestion",
                "no question for this document: give questions in the job, or beside the file",
            )
            return None
        store = open_store(self.run.store_url)
        planned = [
            PlannedChain(
                self.run.chain_key(row["content_sha256"], question.text),
                question.question_id,
                question.text,
            )
            for question in questions
        ]
        statuses = store.chain_statuses([chain.chain_key for chain in planned])
        segments_out = None
        n_tokens = n_segments = None
        if any(statuses.get(chain.chain_key) != DONE for chain in planned):
            tokenizer = cached_tokenizer(self.run.engine)
            tokenized = tokenize(row["doc_id"], row["text"], tokenizer)
            segments = segment(tokenized, tokenizer, self.run.method.segmentation())
            n_tokens, n_segments = tokenized.n_tokens, len(segments)
            segments_out = [_segment_row(piece) for piece in segments]
        document = self._record(row, n_tokens=n_tokens, n_segments=n_segments)
        statuses = store.plan_document(document, planned)
        return {
            "source_uri": row["source_uri"],
            "doc_id": row["doc_id"],
            "name": row["name"],
            "n_tokens": n_tokens,
            "segments": segments_out,
            "page_starts": row["page_starts"] or [],
            "chains": [
                {
                    "chain_key": chain.chain_key,
                    "question_id": chain.question_id,
                    "question": chain.question,
                    "status": statuses.get(chain.chain_key),
                }
                for chain in planned
            ],
        }

    def _record(
        self, row: dict[str, Any], *, n_tokens: int | None, n_segments: int | None
    ) -> DocumentRecord:
        return DocumentRecord(
            run_id=self.run.run_id,
            attempt=self.run.attempt,
            source_uri=row["source_uri"],
            doc_id=row["doc_id"],
            name=row["name"],
            content_sha256=row["content_sha256"],
            parser=row["parser"],
            pages=row["pages"],
            warnings=row["warnings"] or [],
            metadata=json.loads(row["metadata"] or "{}"),
            n_tokens=n_tokens,
            n_segments=n_segments,
        )

    def _fail(self, row: dict[str, Any], error_type: str, message: str) -> None:
        open_store(self.run.store_url).record_error(
            ErrorRecord(
                run_id=self.run.run_id,
                attempt=self.run.attempt,
                source_uri=row["source_uri"],
                stage="segment",
                error_type=error_type,
                message=message,
                doc_id=row["doc_id"],
                name=row["name"],
            )
        )


def _segment_row(piece: Segment) -> dict[str, Any]:
    return {
        "index": piece.index,
        "token_start": piece.token_start,
        "token_end": piece.token_end,
        "char_start": piece.char_start,
        "char_end": piece.char_end,
        "text": piece.text,
    }


class MemoryStage:
    """Plans in, one result row per chain out. Each actor owns one engine; `__call__` is async,
    so the batches an actor holds run side by side on one event loop and their chains' steps
    meet in the engine's continuous batch. Every step is checkpointed before the chain moves
    on; a chain resumes from its last checkpoint, and an answered one is skipped. The engine
    is built when the first chain needs it, so a rerun whose chains are all answered costs no
    engine start-up."""

    def __init__(self, run: RunContext, max_active_chains: int, longest_first: bool = True) -> None:
        self.run = run
        self.store = StateStore(run.store_url)
        self.chain_config = run.method.chain()
        self.max_active_chains = max_active_chains
        self.longest_first = longest_first
        self.engine: Any = None
        self._runner: ChainRunner | None = None
        self._runner_lock = asyncio.Lock()
        # Store calls block; one thread per actor keeps them off the event loop, in order.
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="memstream-store")
        self._closed = threading.Event()

    async def __call__(self, batch: pa.Table) -> pa.Table:
        documents = batch.to_pylist()
        results = await asyncio.gather(*(self._run_document(d) for d in documents))
        return pa.Table.from_pylist([r for rows in results for r in rows], schema=RESULT_SCHEMA)

    async def _run_document(self, document: dict[str, Any]) -> list[dict[str, Any]]:
        segments = None
        if document["segments"] is not None:
            segments = [Segment(document["doc_id"], **s) for s in document["segments"]]
        return list(
            await asyncio.gather(
                *(self._run_chain(document, segments, planned) for planned in document["chains"])
            )
        )

    async def _run_chain(
        self,
        document: dict[str, Any],
        segments: list[Segment] | None,
        planned: dict[str, Any],
    ) -> dict[str, Any]:
        key = planned["chain_key"]
        row = {
            "source_uri": document["source_uri"],
            "doc_id": document["doc_id"],
            "question_id": planned["question_id"],
            "chain_key": key,
            "status": "failed",
            "start_step": 0,
            "steps_run": 0,
            "n_steps": 0 if segments is None else len(segments) + 1,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "elapsed_s": 0.0,
            "error": None,
        }
        try:
            checkpoint: Checkpoint | None = await self._in_store(self.store.load_checkpoint, key)
            if checkpoint is not None and checkpoint.status == DONE:
                if segments is not None and (
                    answered := await self._in_store(self.store.ungrounded_answer, key)
                ):
                    answer, memory = answered
                    await self._ground(key, planned["question"], answer, memory, segments,
                                       document["page_starts"])  # fmt: skip
                return row | {"status": "skipped", "start_step": checkpoint.step}
            if segments is None:
                raise RuntimeError("the document was planned as answered; run the job again")
            start_step = min(checkpoint.step if checkpoint else 0, len(segments))
            memory = checkpoint.memory if checkpoint and start_step > 0 else None
            chain = MemoryChain(
                key,
                planned["question"],
                segments,
                self.chain_config,
                memory=memory,
                start_step=start_step,
            )
            runner = await self._chain_runner()
            await self._in_store(self.store.mark_running, key, self.run.run_id)
            result = await runner.run_chain(chain, self._checkpoint)
        except Exception as error:  # e.g. the store is unreachable: recorded, resumable later
            logger.exception("chain %s failed", key)
            message = f"{type(error).__name__}: {error}"
            await self._mark_failed(key, message)
            return row | {"error": message}
        if result.status != "ok":
            await self._mark_failed(key, result.error or "unknown error")
        else:
            await self._ground(key, planned["question"], result.answer, result.final_memory,
                               segments, document["page_starts"])  # fmt: skip
        return row | {
            "status": "done" if result.status == "ok" else "failed",
            "start_step": start_step,
            "steps_run": len(result.trajectory),
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "elapsed_s": result.elapsed_s,
            "error": result.error,
        }

    async def _chain_runner(self) -> ChainRunner:
        async with self._runner_lock:
            if self._runner is None:
                # Blocks the actor's event loop while the engine starts; no chain of this
                # actor could move without it anyway.
                self.engine = open_engine(self.run.engine)
                # Ray Data's async actors keep the UDF referenced until the process exits, so
                # __del__ would come too late: multiprocessing's exit hook would wait forever
                # on the engine's processes. Exit hooks run last-registered first; registered
                # here, after the engine imported multiprocessing, this one runs before it.
                atexit.register(self.close)
                self._runner = ChainRunner(
                    self.engine,
                    self.run.method.sampling(),
                    self.max_active_chains,
                    longest_first=self.longest_first,
                )
            return self._runner

    async def _checkpoint(self, chain: MemoryChain, record: StepRecord) -> None:
        await self._in_store(self.store.record_step, StepCheckpoint.after(chain, record))

    async def _ground(
        self,
        key: str,
        question: str,
        answer: str | None,
        memory: str,
        segments: Sequence[Segment],
        page_starts: Sequence[int] | None,
    ) -> None:
        """Finds the answer's evidence in the source and records it; a failure here costs the
        answer its evidence, never the answer."""
        try:
            grounding = await asyncio.get_running_loop().run_in_executor(
                None,
                functools.partial(
                    find_evidence, question, answer, memory, segments, page_starts or None,
                ),
            )  # fmt: skip
            evidence = [item.as_dict() for item in grounding.evidence]
            await self._in_store(
                self.store.record_grounding, key, grounding.grounded, grounding.reason, evidence
            )
        except Exception:
            logger.exception("cannot find the evidence of chain %s", key)

    async def _mark_failed(self, key: str, message: str) -> None:
        try:
            await self._in_store(self.store.mark_failed, key, message)
        except Exception:
            logger.exception("cannot record the failure of chain %s", key)

    async def _in_store(self, call: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._store_thread, functools.partial(call, *args))

    def close(self) -> None:
        """Shuts the engine down. Called from the actor's main thread at teardown; vLLM's
        shutdown is synchronous inside, so it needs no event loop of the actor's."""
        if self._closed.is_set():
            return
        self._closed.set()
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                asyncio.run(engine.shutdown())
            except Exception:
                logger.warning("engine shutdown failed", exc_info=True)
        self._store_thread.shutdown(wait=True)
        self.store.close()

    def __del__(self) -> None:
        if hasattr(self, "_closed"):
            self.close()
