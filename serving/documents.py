"""From an HTTP request to a document and its questions, and from there to parsed text.

`RequestReader` accepts JSON (`text` or `uri`) or multipart/form-data (`file`), checks the
questions and the sizes, and refuses a URI the policy does not allow before anything is queued.
`DocumentLoader` turns a `DocumentRequest` into the project's document record
(`operators.core.document.Document`) with its text: the bytes the request carries or the ones its
URI holds, through the project's parsers.
"""

from __future__ import annotations

import asyncio
import json
import posixpath
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request

from operators.config import DocumentLimits
from operators.core.document import Document
from operators.core.injection import instruction_warning
from operators.parsing import ParseError, parse_document
from serving.config import LimitsConfig
from serving.schemas import AnswerRequest
from serving.uris import DocumentFetcher, FetchError, UriPolicy, UriRefused, redact_uri

MAX_NAME_CHARS = 255
INLINE_NAME = "document.txt"


class InputError(Exception):
    """Input the server will not take; `status` is the HTTP status, `message` is for people."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class DocumentRequest:
    name: str
    questions: tuple[str, ...]
    data: bytes | None = None
    uri: str | None = None
    mime_type: str | None = None
    inline: bool = False  # text in a JSON body rather than an uploaded file

    @property
    def source(self) -> str:
        """What the client gave, safe to show back."""
        if self.uri is not None:
            return redact_uri(self.uri)
        return f"{'inline' if self.inline else 'upload'}:{self.name}"


class RequestReader:
    def __init__(self, limits: LimitsConfig, policy: UriPolicy) -> None:
        self.limits = limits
        self.policy = policy

    async def read(self, request: Request) -> DocumentRequest:
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type == "application/json":
            document = await self._read_json(request)
        elif media_type == "multipart/form-data":
            document = await self._read_form(request)
        else:
            raise InputError(
                415,
                "send application/json (with 'text' or 'uri') or multipart/form-data "
                "(with 'file'), and one or more questions",
            )
        if document.uri is not None:
            try:
                await self.policy.check(document.uri)
            except UriRefused as refusal:
                raise InputError(422, f"URI refused: {refusal}") from None
        return document

    async def _read_json(self, request: Request) -> DocumentRequest:
        try:
            payload = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as error:
            raise InputError(422, f"the body is not valid JSON: {error}") from None
        try:
            body = AnswerRequest.model_validate(payload)
        except ValidationError as error:
            raise InputError(422, describe_validation_error(error)) from None
        if (body.text is None) == (body.uri is None):
            raise InputError(422, "give the document as exactly one of 'text' or 'uri'")
        questions = self._questions(body.questions)
        if body.uri is not None:
            return DocumentRequest(_clean_name(body.name), questions, uri=body.uri)
        data = body.text.encode("utf-8") if body.text is not None else b""
        self._check_size(len(data))
        name = _clean_name(body.name) or INLINE_NAME
        return DocumentRequest(name, questions, data=data, inline=True)

    async def _read_form(self, request: Request) -> DocumentRequest:
        try:
            form = await request.form(
                max_files=1,
                max_fields=self.limits.max_questions + 4,
                max_part_size=self.limits.max_question_chars * 4 + 1024,
            )
        except HTTPException as error:
            raise InputError(422, f"invalid multipart body: {error.detail}") from None
        try:
            return await self._document_of(form)
        finally:
            await form.close()  # uploads are spooled to temporary files

    async def _document_of(self, form: FormData) -> DocumentRequest:
        unknown = sorted(set(form.keys()) - {"file", "questions", "question", "name"})
        if unknown:
            raise InputError(
                422, f"unknown form field {', '.join(unknown)}; use file, questions and name"
            )
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InputError(422, "the multipart body needs the document as a 'file' part")
        values = [*form.getlist("questions"), *form.getlist("question")]
        texts = [value for value in values if isinstance(value, str)]
        questions = self._questions([q for value in texts for q in _split_questions(value)])
        data = await upload.read(self.limits.max_input_bytes + 1)
        self._check_size(len(data))
        given_name = form.get("name")
        name = _clean_name(given_name if isinstance(given_name, str) else upload.filename)
        return DocumentRequest(
            name or INLINE_NAME, questions, data=data, mime_type=upload.content_type
        )

    def _questions(self, questions: list[str]) -> tuple[str, ...]:
        cleaned = tuple(question.strip() for question in questions if question.strip())
        if not cleaned:
            raise InputError(422, "ask at least one question (a non-empty 'questions' entry)")
        if len(cleaned) > self.limits.max_questions:
            raise InputError(
                422, f"{len(cleaned)} questions; at most {self.limits.max_questions} per document"
            )
        longest = max(len(question) for question in cleaned)
        if longest > self.limits.max_question_chars:
            raise InputError(
                422,
                f"a question has {longest:,} characters; at most "
                f"{self.limits.max_question_chars:,}",
            )
        return cleaned

    def _check_size(self, size: int) -> None:
        if size > self.limits.max_input_bytes:
            raise InputError(
                413,
                f"the document is larger than the input limit of "
                f"{self.limits.max_input_bytes:,} bytes",
            )


class DocumentLoader:
    def __init__(self, fetcher: DocumentFetcher, limits: DocumentLimits | None = None) -> None:
        self.fetcher = fetcher
        self.limits = limits or DocumentLimits()

    async def load(self, document: DocumentRequest) -> Document:
        """The request's document, parsed: its uri is the request's `source` (safe to show),
        its size the bytes read, and its warnings the parser's and any instruction warning."""
        name, data, mime_type = document.name, document.data, document.mime_type
        if document.uri is not None:
            try:
                fetched = await self.fetcher.fetch(document.uri)
            except UriRefused as refusal:
                raise InputError(422, f"URI refused: {refusal}") from None
            except FetchError as error:
                raise InputError(error.status, error.message) from None
            name = document.name or fetched.name
            data, mime_type = fetched.data, fetched.mime_type
        try:
            parsed = await asyncio.to_thread(
                parse_document, data or b"", name, mime_type, self.limits
            )
        except ParseError as error:
            # Over a limit: 413, as for too many bytes; anything else cannot be read: 422.
            status = 413 if error.reason.startswith("too large") else 422
            raise InputError(status, f"cannot read {name}: {error.reason}") from None
        warning = instruction_warning(parsed.text)
        return Document(
            uri=document.source,
            name=name,
            size=len(data or b""),
            text=parsed.text,
            parser=parsed.parser,
            pages=parsed.pages,
            page_starts=parsed.page_starts,
            warnings=parsed.warnings if warning is None else (*parsed.warnings, warning),
        )


def describe_validation_error(error: ValidationError) -> str:
    """Pydantic's errors as one line: 'questions: ...; text: ...'."""
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "body"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown field; use questions, text, uri and name"
        parts.append(f"{where}: {message}")
    return "; ".join(parts)


def _split_questions(value: str) -> list[str]:
    """A form field holds one question, or a JSON list of them."""
    stripped = value.strip()
    if stripped.startswith("["):
        try:
            parsed = json.loads(stripped)
        except ValueError:
            return [value]
        if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
            return parsed
    return [value]


def _clean_name(name: str | None) -> str:
    """The last path component of a client's file name, for format detection and display."""
    if not name:
        return ""
    base = posixpath.basename(name.replace("\\", "/")).strip()
    return "".join(char for char in base if char.isprintable())[:MAX_NAME_CHARS]
