"""Answering in the API replica: documents become chains, chains run against the engine.

Both the synchronous answer and the jobs go through `DocumentPreparer` (the project's `prepare`:
tokenize once, one chain per question) and the project's `ChainRunner`. A document is the
project's record (`operators.core.document.Document`), as `DocumentLoader` returns it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from operators.config import ConfigError, DocumentLimits, MethodConfig, check_context_fit
from operators.core.chain import ChainStatus
from operators.core.document import Document
from operators.engine import Engine
from operators.runner import ChainResult, ChainRunner, StepCallback
from pipeline.ask import PreparedDocument, prepare
from serving.documents import InputError
from serving.schemas import Answer, AnswerResponse, DocumentInfo, usage_of


class DocumentPreparer:
    """Tokenizes and segments off the event loop, one document at a time: a Hugging Face fast
    tokenizer is not safe to call from several threads at once."""

    def __init__(
        self, tokenizer: Any, max_model_len: int, max_tokens: int = DocumentLimits().max_tokens
    ) -> None:
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._max_tokens = max_tokens
        self._lock = threading.Lock()

    async def prepare(
        self, document: Document, questions: Sequence[str], method: MethodConfig
    ) -> PreparedDocument:
        """The document's chains, named after its uri (`{uri}#q{index}`)."""
        return await asyncio.to_thread(self._prepare, document, questions, method)

    def _prepare(
        self, document: Document, questions: Sequence[str], method: MethodConfig
    ) -> PreparedDocument:
        with self._lock:
            try:
                check_context_fit(method, questions, self._tokenizer, self._max_model_len)
            except ConfigError as error:
                raise InputError(422, str(error)) from None
            prepared = prepare(document, questions, self._tokenizer, method)
        if prepared.n_tokens > self._max_tokens:
            raise InputError(
                413,
                f"too large: {prepared.n_tokens:,} tokens, over the limit of {self._max_tokens:,}",
            )
        return prepared


def document_info(loaded: Document, prepared: PreparedDocument) -> DocumentInfo:
    return DocumentInfo(
        name=loaded.name,
        parser=loaded.parser,
        pages=loaded.pages,
        warnings=list(loaded.warnings),
        n_tokens=prepared.n_tokens,
        n_segments=len(prepared.segments),
    )


def answer_of(result: ChainResult) -> dict[str, Any]:
    return {
        "question": result.question,
        "status": result.status.answer_status,
        "answer": result.answer,
        "raw_response": result.raw_response,
        "final_memory": result.final_memory,
        "n_segments": result.n_segments,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "compute_s": round(sum(step.latency_s for step in result.trajectory), 3),
        "error": result.error,
    }


class SyncAnswerer:
    """Answers the questions about one loaded document while the client waits."""

    def __init__(
        self, engine: Engine, preparer: DocumentPreparer, method: MethodConfig, model: str
    ) -> None:
        self.engine = engine
        self.preparer = preparer
        self.method = method
        self.model = model

    async def answer(
        self,
        loaded: Document,
        questions: Sequence[str],
        read_s: float,
        on_step: StepCallback | None = None,
    ) -> AnswerResponse:
        started = time.perf_counter()
        # Its chains are named after a fresh id per request, not after the document's source:
        # that keeps engine request ids unique across concurrent requests.
        prepared = await self.preparer.prepare(
            replace(loaded, uri=f"sync-{uuid.uuid4().hex}"), questions, self.method
        )
        prepared_at = time.perf_counter()
        runner = ChainRunner(self.engine, self.method.sampling())
        results = await runner.run(prepared.chains, on_step)
        finished_at = time.perf_counter()
        groundings = await asyncio.to_thread(lambda: [prepared.grounding(r) for r in results])
        answers = [
            answer_of(result) | grounding.as_dict()
            for result, grounding in zip(results, groundings, strict=True)
        ]
        return AnswerResponse(
            status="succeeded" if all(r.status == ChainStatus.DONE for r in results) else "failed",
            model=self.model,
            document=document_info(loaded, prepared),
            answers=[Answer(**answer) for answer in answers],
            usage=usage_of(answers),
            timings={
                "read_s": round(read_s, 3),
                "prepare_s": round(prepared_at - started, 3),
                "chains_s": round(finished_at - prepared_at, 3),
                "total_s": round(read_s + finished_at - started, 3),
            },
        )
