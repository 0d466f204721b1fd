"""The HTTP API (FastAPI): routes, authentication, body limits, errors and request metrics.

`build_api(services)` is called in each API replica, once its services exist. Routes, errors and
the OpenAPI document (at /docs and /openapi.json) are described here; the work is done by the
services it is given.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from connectors.state.database import StateStoreError
from connectors.state.jobs import JobConflict
from connectors.state.records import JobState, NewJob
from connectors.state.schema import SUCCEEDED
from connectors.state.store import StateStore
from operators.engine import Engine, EngineError
from pipeline.report import content_security_policy
from serving.answering import SyncAnswerer
from serving.config import LimitsConfig
from serving.documents import DocumentLoader, InputError, RequestReader
from serving.jobs import JobWorker
from serving.metrics import CONTENT_TYPE, ServingMetrics
from serving.reporting import job_report
from serving.schemas import (
    ERROR_RESPONSES,
    Answer,
    AnswerRequest,
    AnswerResponse,
    DocumentInfo,
    JobCreated,
    JobResult,
    JobStatus,
    QuestionProgress,
    usage_of,
)
from serving.security import ApiKeys

logger = logging.getLogger("ray.serve")
JOB_ID = re.compile(r"^[0-9a-f]{32}$")
KEEP_ALIVE_S = 15.0
ENGINE_HEALTH_TIMEOUT_S = 2.0


@dataclass
class ApiServices:
    keys: ApiKeys
    limits: LimitsConfig
    reader: RequestReader
    loader: DocumentLoader
    answerer: SyncAnswerer
    engine: Engine
    store: StateStore
    worker: JobWorker
    metrics: ServingMetrics
    model: str
    method: dict[str, Any]
    poll_interval_s: float


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuses request bodies over `max_bytes` with 413: by Content-Length before reading, and
    by counting while reading when the length is not declared (chunked uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge
            return message

        await self.app(scope, counted, send)


class RequestMetrics:
    """Counts requests by route template (not by path, which holds job ids) and status."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                route = getattr(scope.get("route"), "path", "unmatched")
                self.metrics.observe_http(
                    scope["method"], route, status, time.perf_counter() - started
                )
            await send(message)

        await self.app(scope, receive, observed)


BEARER = HTTPBearer(auto_error=False, description="an API key of this server")


class KeyCheck:
    """The dependency that refuses requests without a valid `Authorization: Bearer` key."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def __call__(
        self, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]
    ) -> None:
        if not self.keys.accepts(credentials.credentials if credentials else None):
            raise HTTPException(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )


def too_large(max_bytes: int) -> JSONResponse:
    return JSONResponse(
        {"detail": f"the request body is larger than the limit of {max_bytes:,} bytes"}, 413
    )


def build_api(services: ApiServices) -> FastAPI:
    app = FastAPI(
        title="memstream",
        version="0.1.0",
        description=(
            "Answers questions about documents far longer than a context window (MemAgent "
            "memory chains). Send a document as JSON text, as an uploaded file (PDF, DOCX, "
            "HTML, Markdown, text, logs) or as an allowed URI, with one or more questions."
        ),
    )
    register_errors(app, services.limits)
    app.add_middleware(BodyLimit, max_bytes=services.limits.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=services.metrics)
    authorized = [Depends(KeyCheck(services.keys))]
    document_body = openapi_document_body()
    store = services.store

    @app.get(
        "/healthz", tags=["service"], responses={503: {"description": "the engine is unhealthy"}}
    )
    async def healthz() -> JSONResponse:
        """Readiness (no key needed): 200 when the engine answers its health check in time; 503
        with the reason when it fails it, or when no engine replica answers (starting,
        restarting, or busy with all the calls it takes at once)."""
        body: dict[str, Any] = {
            "status": "ok",
            "model": services.model,
            "jobs_running": services.worker.running,
        }
        try:
            await asyncio.wait_for(services.engine.check_health(), ENGINE_HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            reason = f"the engine did not answer within {ENGINE_HEALTH_TIMEOUT_S:g} s"
        except EngineError as error:
            reason = str(error)
        else:
            return JSONResponse(body, 200)
        return JSONResponse({**body, "status": "unhealthy", "reason": reason}, 503)

    @app.get(
        "/metrics",
        tags=["service"],
        dependencies=authorized,
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE: {}}}},
    )
    async def metrics() -> Response:
        """Prometheus metrics of this replica, and job counts of the store."""
        body = await asyncio.to_thread(services.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.post(
        "/v1/answer",
        tags=["answers"],
        dependencies=authorized,
        response_model=AnswerResponse,
        responses={**ERROR_RESPONSES, 502: {"description": "every question failed in the engine"}},
        openapi_extra=document_body,
    )
    async def answer(request: Request) -> AnswerResponse | JSONResponse:
        """Reads the document and answers every question before responding."""
        started = time.perf_counter()
        document = await services.reader.read(request)
        loaded = await services.loader.load(document)
        services.metrics.input_bytes.labels(services.metrics.replica).inc(loaded.size)
        response = await services.answerer.answer(
            loaded,
            document.questions,
            time.perf_counter() - started,
            on_step=lambda _chain, record: services.metrics.observe_step(record),
        )
        for item in response.answers:
            services.metrics.observe_answer("sync", item.status)
        if all(item.status == "error" for item in response.answers):
            first = response.answers[0].error or "engine error"
            return JSONResponse({"detail": f"no question could be answered: {first}"}, 502)
        return response

    @app.post(
        "/v1/jobs",
        tags=["jobs"],
        dependencies=authorized,
        status_code=202,
        response_model=JobCreated,
        responses=ERROR_RESPONSES,
        openapi_extra=document_body,
    )
    async def create_job(request: Request) -> JobCreated:
        """Queues the document and its questions; the job survives restarts of the server."""
        document = await services.reader.read(request)
        job = NewJob(
            name=document.name,
            source=document.source,
            questions=document.questions,
            method=services.method,
            uri=document.uri,
            data=document.data,
            mime_type=document.mime_type,
        )
        job_id = await asyncio.to_thread(store.create_job, job)
        services.worker.wake()
        return JobCreated(job_id=job_id, status="queued", links=job_links(job_id))

    @app.get(
        "/v1/jobs/{job_id}",
        tags=["jobs"],
        dependencies=authorized,
        response_model=JobStatus,
        responses={404: {"description": "no such job"}},
    )
    async def job_status(job_id: str) -> JobStatus:
        """Status and progress: segments read so far, per question."""
        return status_of(await find_job(store, job_id))

    @app.get(
        "/v1/jobs/{job_id}/result",
        tags=["jobs"],
        dependencies=authorized,
        response_model=JobResult,
        responses={404: {"description": "no such job"}, 409: {"description": "not succeeded"}},
    )
    async def job_result(job_id: str) -> JobResult:
        """The answers of a succeeded job; 409 while it runs or when it failed or was cancelled."""
        job = await find_job(store, job_id)
        if job.status != SUCCEEDED:
            reason = f": {job.error}" if job.error else ""
            raise HTTPException(409, f"the job is {job.status}{reason}")
        answers = [state.answer_record() for state in job.chains]
        document = job.document or {}
        return JobResult(
            job_id=job.job_id,
            status=job.status,
            model=services.model,
            document=DocumentInfo(**document),
            answers=[Answer(**item) for item in answers],
            usage=usage_of(answers),
            timings={
                "read_s": document.get("read_s", 0.0),
                "queued_s": round((job.started_at or job.created_at) - job.created_at, 3),
                "total_s": round((job.finished_at or job.updated_at) - job.created_at, 3),
            },
        )

    @app.get(
        "/v1/jobs/{job_id}/report",
        tags=["jobs"],
        dependencies=authorized,
        response_class=HTMLResponse,
        responses={200: {"content": {"text/html": {}}}, 404: {"description": "no such job"}},
    )
    async def job_report_page(job_id: str) -> HTMLResponse:
        """The job's audit report: answers with their evidence and grounded marks, and the
        memory after every segment (the page of `memstream report`); works while it runs."""
        job = await find_job(store, job_id)
        trajectory = await asyncio.to_thread(store.job_trajectory, job)
        page = await asyncio.to_thread(job_report, job, trajectory, services.model)
        return HTMLResponse(page, headers={"Content-Security-Policy": content_security_policy()})

    @app.get(
        "/v1/jobs/{job_id}/events",
        tags=["jobs"],
        dependencies=authorized,
        response_class=StreamingResponse,
        responses={
            200: {"content": {"text/event-stream": {}}},
            404: {"description": "no such job"},
        },
    )
    async def job_events(job_id: str, request: Request) -> StreamingResponse:
        """Server-sent events: `memory` after every memory update (question_index, step,
        segments_done, segments_total, memory) and one `end` (status, error, answers). Events
        are replayed from the start, or after the id in a Last-Event-ID header."""
        await find_job(store, job_id)
        last = request.headers.get("last-event-id", "")
        after = int(last) if last.isdigit() else 0
        return StreamingResponse(
            event_stream(store, job_id, after, services.poll_interval_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.delete(
        "/v1/jobs/{job_id}",
        tags=["jobs"],
        dependencies=authorized,
        response_model=JobStatus,
        responses={404: {"description": "no such job"}, 409: {"description": "already finished"}},
    )
    async def cancel_job(job_id: str) -> JobStatus:
        """Cancels a queued or running job: its chains stop at once."""
        check_job_id(job_id)
        try:
            found = await asyncio.to_thread(store.cancel_job, job_id)
        except JobConflict as conflict:
            raise HTTPException(409, str(conflict)) from None
        if not found:
            raise HTTPException(404, f"no job {job_id}")
        services.worker.cancel_local(job_id)
        return status_of(await find_job(store, job_id))

    return app


def register_errors(app: FastAPI, limits: LimitsConfig) -> None:
    @app.exception_handler(InputError)
    async def input_error(_: Request, error: InputError) -> JSONResponse:
        return JSONResponse({"detail": error.message}, error.status)

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(_: Request, __: BodyTooLarge) -> JSONResponse:
        return too_large(limits.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        parts = [
            f"{'.'.join(str(part) for part in item['loc'])}: {item['msg']}"
            for item in error.errors()
        ]
        return JSONResponse({"detail": "; ".join(parts) or "invalid request"}, 422)

    @app.exception_handler(StateStoreError)
    async def store_error(_: Request, error: StateStoreError) -> JSONResponse:
        logger.error("%s", error)
        return JSONResponse({"detail": "the job store is unavailable; try again shortly"}, 503)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return JSONResponse({"detail": f"internal error ({type(error).__name__})"}, 500)


def check_job_id(job_id: str) -> None:
    if not JOB_ID.match(job_id):
        raise HTTPException(404, f"no job {job_id[:64]}")


async def find_job(store: StateStore, job_id: str) -> JobState:
    check_job_id(job_id)
    job = await asyncio.to_thread(store.get_job, job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id}")
    return job


def job_links(job_id: str) -> dict[str, str]:
    base = f"/v1/jobs/{job_id}"
    return {
        "self": base,
        "result": f"{base}/result",
        "events": f"{base}/events",
        "report": f"{base}/report",
    }


def status_of(job: JobState) -> JobStatus:
    document = job.document
    return JobStatus(
        job_id=job.job_id,
        status=job.status,  # type: ignore[arg-type]
        source=job.source,
        error=job.error,
        document=DocumentInfo(**document) if document else None,
        progress=[
            QuestionProgress(
                question=state.question,
                segments_done=state.segments_done,
                segments_total=state.n_segments,
                done=state.done,
            )
            for state in job.chains
        ],
        created_at=job.created_at,
        started_at=job.started_at,
        updated_at=job.updated_at,
        finished_at=job.finished_at,
        links=job_links(job.job_id),
    )


async def event_stream(
    store: StateStore, job_id: str, after: int, poll_interval_s: float
) -> AsyncIterator[str]:
    idle = 0.0
    while True:
        batch = await asyncio.to_thread(store.events_after, job_id, after)
        for event in batch:
            after = event.event_id
            yield f"id: {event.event_id}\nevent: {event.kind}\ndata: {json.dumps(event.data)}\n\n"
            if event.kind == "end":
                return
        idle = 0.0 if batch else idle + poll_interval_s
        if idle >= KEEP_ALIVE_S:
            idle = 0.0
            yield ": keep-alive\n\n"
        await asyncio.sleep(poll_interval_s)


def openapi_document_body() -> dict[str, Any]:
    """Both accepted bodies, for the OpenAPI document (the route reads the body itself)."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": AnswerRequest.model_json_schema()},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["file", "questions"],
                        "properties": {
                            "file": {"type": "string", "format": "binary"},
                            "questions": {
                                "type": "array",
                                "items": {"type": "string"},
                                "description": "repeat the field, or send one JSON list",
                            },
                            "name": {"type": "string", "description": "file name override"},
                        },
                    }
                },
            },
        }
    }
