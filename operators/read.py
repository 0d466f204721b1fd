"""Read + parse: source items in, documents out. A document that cannot be read or parsed
becomes an `errors` row in the state store and leaves the stream; it never raises."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

# The items' schema and rows live with the sources that read them (connectors.reading).
from connectors.base import ITEM_SCHEMA, Source, SourceError, SourceItem, item_row
from connectors.state.store import ErrorRecord
from operators.parsing import ParseError, parse_document
from operators.run import RunContext, doc_id_of, open_store

logger = logging.getLogger(__name__)

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


__all__ = ["DOCUMENT_SCHEMA", "ITEM_SCHEMA", "ReadParseStage", "item_row"]


class ReadParseStage:
    """Items in, documents out: parses each item's bytes, as its read task fetched them
    (reads them here for an item that comes without: from a source's items() in tests and
    tools), or takes its inline text. An item whose listing or read failed (its `error`)
    becomes an errors row. Runs as plain Ray tasks."""

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
            if row.get("error"):
                raise SourceError(row["error"])
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
