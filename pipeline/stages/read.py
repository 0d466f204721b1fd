"""Read + parse: documents with their bytes in, documents with their text out. A document that
cannot be read or parsed becomes an `errors` row in the state store and leaves the stream; it
never raises."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace

import pyarrow as pa

from connectors.base import Source, SourceError
from connectors.state.database import StateStoreError
from operators.core.document import Document, documents_of, documents_table
from operators.core.injection import instruction_warning
from operators.parsing import ParseError, parse_document
from operators.parsing.base import check_char_limit
from pipeline.stages.run import RunContext

logger = logging.getLogger(__name__)


class ReadParseStage:
    """Documents with their bytes (or inline text) in, documents with their text out. Parses
    each document's bytes, as its read task fetched them (reads them here for a document that
    comes without: from a source's documents() in tests and tools), or takes its inline text.
    A document whose listing or read failed (its `error`) becomes an errors row. Runs as plain
    Ray tasks. With `keep_failed` (a job with collections), a document that failed stays in the
    stream, its `error` saying why, so a collection can note which member it read without."""

    def __init__(
        self, sources: Sequence[Source], run: RunContext, keep_failed: bool = False
    ) -> None:
        self.sources = list(sources)
        self.run = run
        self.keep_failed = keep_failed

    def __call__(self, batch: pa.Table) -> pa.Table:
        parsed = (self._parsed(document) for document in documents_of(batch))
        return documents_table(document for document in parsed if document is not None)

    def _parsed(self, document: Document) -> Document | None:
        stage = "read"
        try:
            if document.error:
                raise SourceError(document.error)
            if document.text is not None:
                stage = "parse"
                if not document.text.strip():
                    raise ParseError("empty document")
                check_char_limit(len(document.text), self.run.limits.max_chars)
                parsed = replace(document, parser="inline")
            else:
                data = document.data
                if data is None:
                    data = self.sources[document.source_index].read_bytes(document)
                stage = "parse"
                text = parse_document(data, document.name, limits=self.run.limits)
                parsed = replace(
                    document,
                    data=None,
                    text=text.text,
                    parser=text.parser,
                    pages=text.pages,
                    warnings=text.warnings,
                    page_starts=text.page_starts,
                )
        except ParseError as error:
            return self._failed(document, stage, "ParseError", error.reason)
        except SourceError as error:
            return self._failed(document, stage, "SourceError", str(error))
        except StateStoreError:  # not the document's fault: the job stops
            raise
        except Exception as error:  # a bug or a library failure: one error row, not a crash
            logger.exception("cannot %s %s", stage, document.uri)
            message = str(error) or type(error).__name__
            return self._failed(document, stage, type(error).__name__, message)
        warning = instruction_warning(parsed.text or "")
        if warning is not None:
            parsed = replace(parsed, warnings=(*parsed.warnings, warning))
        text_bytes = (parsed.text or "").encode()
        return replace(parsed, content_sha256=hashlib.sha256(text_bytes).hexdigest())

    def _failed(
        self, document: Document, stage: str, error_type: str, message: str
    ) -> Document | None:
        self.run.record_error(document, stage, error_type, message)
        if not self.keep_failed:
            return None
        return replace(document, data=None, text=None, error=f"{error_type}: {message}")
