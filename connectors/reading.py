"""Sources as one Ray Data read: the driver plans shards, read tasks stream the documents.

    driver: source.shards() -> one ReadTask per shard (a few small tuples, no document)
    read task: source.shard_documents(shard) -> their content -> blocks of DOCUMENT_SCHEMA rows

No list of the corpus and no document text passes through the driver: a shard lists its documents
lazily (a folder walk, S3 pages of 1,000 keys, an SQL server-side cursor, a Parquet row group
or a JSON Lines file) inside its read task, which also fetches the content of those that
carry none inline (files, objects), with the source's `read_threads` threads. Blocks are cut at
about `block_bytes` of content, so that a block of long documents holds one or a few, and one
of tiny ones many; Ray keeps blocks over 100 KiB in its object store, out of the driver.

A document that cannot be read becomes a row with its `error`, which the read stage records in
the errors table. A shard that fails as a whole (a database or a bucket gone mid-listing, a
line of JSON that does not parse, a service unreachable past its retries: `SourceUnavailable`)
fails the read task, and with it the job, with its message.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from connectors.base import Source, SourceError, SourceUnavailable, bounded_map
from operators.core.document import DOCUMENT_SCHEMA, Document

logger = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 20
MAX_ROWS_PER_BLOCK = 1024


class SourceDatasource(Datasource):
    """Every item of `sources`, each row tagged with its source's index. Reads up to
    `parallelism` shards of each source that can be split (SQL on PostgreSQL and SQLite,
    Parquet row groups); a folder or an S3 prefix is one shard, listed lazily."""

    def __init__(
        self,
        sources: Sequence[Source],
        parallelism: int = 2,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        super().__init__()
        self.sources = list(sources)
        self.parallelism = max(1, parallelism)
        self.block_bytes = block_bytes
        self._shards: list[tuple[int, Any]] | None = None

    @property
    def shards(self) -> list[tuple[int, Any]]:
        """(source index, shard) of every source, planned once."""
        if self._shards is None:
            self._shards = [
                (index, shard)
                for index, source in enumerate(self.sources)
                for shard in source.shards(self.parallelism)
            ]
        return self._shards

    def get_name(self) -> str:
        return "Sources"

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(
        self,
        parallelism: int,
        per_task_row_limit: int | None = None,
        data_context: Any = None,
    ) -> list[ReadTask]:
        tasks = []
        for index, shard in self.shards:
            read = partial(read_shard, self.sources[index], index, shard, self.block_bytes)
            metadata = BlockMetadata(
                num_rows=None, size_bytes=None, input_files=None, exec_stats=None
            )
            tasks.append(
                ReadTask(
                    read, metadata, schema=DOCUMENT_SCHEMA, per_task_row_limit=per_task_row_limit
                )
            )
        return tasks


def read_shard(
    source: Source, index: int, shard: Any, block_bytes: int = BLOCK_BYTES
) -> Iterator[pa.Table]:
    """The blocks of one shard: its documents with their content, about block_bytes a block."""
    documents = with_content(source, source.shard_documents(shard))
    rows = (replace(document, source_index=index).to_row() for document in documents)
    yield from blocks_of(rows, block_bytes)


def with_content(source: Source, items: Iterable[Document]) -> Iterator[Document]:
    """The documents, in order, each with its bytes read unless it carries text or bytes (or
    an error) already; a read that fails gives the document an error instead."""
    threads = max(1, getattr(source, "read_threads", 1))
    if threads == 1:
        yield from (_fetched(source, item) for item in items)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="memstream-read") as pool:
        yield from bounded_map(pool, partial(_fetched, source), items, window=2 * threads)


def _fetched(source: Source, item: Document) -> Document:
    if item.text is not None or item.data is not None or item.error is not None:
        return item
    try:
        return replace(item, data=source.read_bytes(item))
    except SourceUnavailable:
        raise  # the shard, and with it the job, stops: a rerun reads the document again
    except SourceError as error:
        return replace(item, error=str(error))
    except OSError as error:
        return replace(item, error=f"cannot read {item.uri}: {error}")


def blocks_of(rows: Iterable[dict[str, Any]], block_bytes: int = BLOCK_BYTES) -> Iterator[pa.Table]:
    """Item rows as Arrow tables of about block_bytes of content (at most MAX_ROWS_PER_BLOCK
    rows): a long document alone, short ones together."""
    batch: list[dict[str, Any]] = []
    size = 0
    for row in rows:
        batch.append(row)
        size += len(row["text"] or "") + len(row["data"] or b"") + 256
        if size >= block_bytes or len(batch) >= MAX_ROWS_PER_BLOCK:
            yield pa.Table.from_pylist(batch, schema=DOCUMENT_SCHEMA)
            batch, size = [], 0
    if batch:
        yield pa.Table.from_pylist(batch, schema=DOCUMENT_SCHEMA)


def estimated_bytes(sources: Sequence[Source], enough: int) -> int:
    """The documents' bytes from the sources' metadata, read only until `enough` is reached
    (so a large corpus costs a few pages of listing, not a pass over it)."""
    total = 0
    for source in sources:
        for size in source.sizes():
            total += size
            if total >= enough:
                return total
    return total
