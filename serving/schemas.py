"""The HTTP API's request and response bodies, as they appear in the OpenAPI document."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class AnswerRequest(BaseModel):
    """A document as inline text or as a URI, and the questions to answer about it."""

    model_config = ConfigDict(extra="forbid")

    questions: list[str] = Field(min_length=1, description="one or more questions")
    text: str | None = Field(None, description="the document itself (text, Markdown, HTML, log)")
    uri: str | None = Field(
        None,
        description="where to fetch the document: an http(s):// or s3:// URI under an "
        "allowed prefix of this server",
    )
    name: str | None = Field(
        None, description="a file name for the document, whose extension tells its format"
    )


class DocumentInfo(BaseModel):
    name: str
    parser: str
    pages: int | None = None
    warnings: list[str] = []
    n_tokens: int
    n_segments: int


class Evidence(BaseModel):
    segment_index: int
    page: int | None = None
    char_start: int = Field(description="offset in the parsed document text")
    char_end: int
    quote: str = Field(description="the document text at [char_start, char_end)")
    score: float = Field(description="0-100 match score")
    matches: Literal["answer", "memory"]


class Answer(BaseModel):
    question: str
    status: Literal["ok", "error", "pending"]
    answer: str | None = Field(None, description="what follows 'the answer is', if said")
    raw_response: str | None = None
    final_memory: str = Field("", description="the memory the answer was given from")
    n_segments: int
    prompt_tokens: int
    completion_tokens: int
    compute_s: float = Field(description="sum of this chain's model call latencies")
    error: str | None = None
    grounded: bool | None = Field(
        None,
        description="the answer is found in the document with the question's terms or the "
        "memory's supporting fact beside it; None where not checked (jobs)",
    )
    grounding_reason: str | None = Field(None, description="why grounded or not, in a sentence")
    evidence: list[Evidence] = Field(
        default_factory=list, description="where the answer and the memory are found in the text"
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class AnswerResponse(BaseModel):
    status: Literal["succeeded", "failed"]
    model: str
    document: DocumentInfo
    answers: list[Answer]
    usage: Usage
    timings: dict[str, float] = Field(description="seconds: read, prepare, chains, total")


class JobCreated(BaseModel):
    job_id: str
    status: str
    links: dict[str, str]


class QuestionProgress(BaseModel):
    question: str
    segments_done: int
    segments_total: int
    done: bool


class JobStatus(BaseModel):
    job_id: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    source: str
    error: str | None = None
    document: DocumentInfo | None = None
    progress: list[QuestionProgress] = Field(
        [], description="one entry per question, once the document is read"
    )
    created_at: float
    started_at: float | None = None
    updated_at: float
    finished_at: float | None = None
    links: dict[str, str]


class JobResult(BaseModel):
    job_id: str
    status: str
    model: str
    document: DocumentInfo
    answers: list[Answer]
    usage: Usage
    timings: dict[str, float]


class ErrorBody(BaseModel):
    detail: str


def usage_of(answers: list[dict[str, Any]]) -> Usage:
    return Usage(
        prompt_tokens=sum(a["prompt_tokens"] for a in answers),
        completion_tokens=sum(a["completion_tokens"] for a in answers),
    )


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or invalid API key"},
    413: {"model": ErrorBody, "description": "request body or document too large"},
    415: {"model": ErrorBody, "description": "neither JSON nor multipart/form-data"},
    422: {"model": ErrorBody, "description": "invalid input, refused URI or unreadable document"},
}
