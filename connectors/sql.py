"""Documents in the rows of an SQL query, streamed from the server in batches.

A job reads the query in shards, each in a Ray read task of its own: shard i of n is the query's
rows whose id hashes to i modulo n, computed by the database (PostgreSQL's hashtextextended;
on SQLite, a function this module registers on each connection). Other databases are read in
one shard. Each shard streams through a server-side cursor, `batch_size` rows at a time.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from connectors.base import SourceError, coerce_questions, plain_value
from operators.core.document import Document

# The project installs psycopg 3, while SQLAlchemy's plain "postgresql://" means psycopg2.
DEFAULT_DRIVERS = {"postgresql": "postgresql+psycopg", "postgres": "postgresql+psycopg"}
SQLITE_SHARD_FUNCTION = "memstream_shard_hash"


class SqlSource:
    """One document per row of `query`: its id, and its content in a text or a blob column.

    The password of `url` never shows in repr, errors or item URIs. The engine is made on first
    use, so the source pickles to Ray workers.
    """

    read_threads = 1  # the content is in the rows

    def __init__(
        self,
        url: str,
        query: str,
        id_column: str = "id",
        text_column: str | None = "text",
        blob_column: str | None = None,
        name_column: str | None = None,
        metadata_columns: Sequence[str] = (),
        questions_column: str | None = None,
        batch_size: int = 500,
    ) -> None:
        if not text_column and not blob_column:
            raise SourceError("an SQL source needs a text_column or a blob_column")
        self.url = _parse_url(url)
        self.query = query.strip().rstrip(";")
        self.id_column = id_column
        self.text_column = text_column
        self.blob_column = blob_column
        self.name_column = name_column
        self.metadata_columns = list(metadata_columns)
        self.questions_column = questions_column
        self.batch_size = batch_size
        self._engine: Engine | None = None

    def __repr__(self) -> str:
        return f"SqlSource({self.safe_url!r}, {self.query!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_engine": None}

    @property
    def safe_url(self) -> str:
        return redacted(self.url)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            try:
                self._engine = create_engine(self.url, poolclass=NullPool)
                if self.url.get_backend_name() == "sqlite":
                    event.listen(self._engine, "connect", _register_shard_hash)
            except ImportError as e:
                raise SourceError(
                    f"the database driver for {self.url.drivername} is not installed ({e.name}): "
                    "pip install it, or name an installed driver in the URL"
                ) from None
        return self._engine

    @property
    def columns(self) -> list[str]:
        """The columns that items() reads."""
        named = [self.id_column, self.text_column, self.blob_column, self.name_column]
        named += [*self.metadata_columns, self.questions_column]
        return [column for column in named if column]

    def check(self) -> None:
        """Connects and runs the query for no rows, to see that it runs and has our columns."""
        probe = text(f"SELECT * FROM ({self.query}) AS memstream_probe LIMIT 0")
        try:
            with self.engine.connect() as connection:
                found = list(connection.execute(probe).keys())
        except SQLAlchemyError as e:
            raise self._error(e) from None
        missing = [column for column in self.columns if column not in found]
        if missing:
            raise SourceError(
                f"the SQL query has no column {', '.join(missing)} (it has {', '.join(found)}): "
                "fix the query or the column names"
            )

    def documents(self) -> Iterator[Document]:
        for shard in self.shards(1):
            yield from self.shard_documents(shard)

    def shards(self, parallelism: int) -> list[Any]:
        """(i, n) for i < n: n is `parallelism` where the database can hash ids, else 1."""
        count = parallelism if self._shard_expression(2) is not None else 1
        return [(index, max(1, count)) for index in range(max(1, count))]

    def shard_documents(self, shard: Any) -> Iterator[Document]:
        index, count = shard
        query, parameters = self.query, {}
        if count > 1:
            query = (
                f"SELECT * FROM ({self.query}) AS memstream_rows "
                f"WHERE {self._shard_expression(count)} = :memstream_shard"
            )
            parameters = {"memstream_shard": index}
        base_uri = URL.create(
            self.url.drivername, host=self.url.host, port=self.url.port, database=self.url.database
        ).render_as_string()
        try:
            with self.engine.connect() as connection:
                streaming = connection.execution_options(
                    stream_results=True, yield_per=self.batch_size
                )
                for row in streaming.execute(text(query), parameters):
                    yield self._item(base_uri, row._mapping)
        except SQLAlchemyError as e:
            raise self._error(e) from None

    def sizes(self) -> Iterator[int]:
        """Each row's content length, computed by the database: no text leaves it."""
        lengths = [
            f"length(memstream_rows.{self._quoted(column)})"
            for column in (self.text_column, self.blob_column)
            if column
        ]
        query = f"SELECT coalesce({', '.join(lengths)}, 0) FROM ({self.query}) AS memstream_rows"
        try:
            with self.engine.connect() as connection:
                streaming = connection.execution_options(stream_results=True, yield_per=10_000)
                for (length,) in streaming.execute(text(query)):
                    yield int(length or 0)
        except SQLAlchemyError as e:
            raise self._error(e) from None

    def _quoted(self, column: str) -> str:
        return self.engine.dialect.identifier_preparer.quote(column)

    def _shard_expression(self, count: int) -> str | None:
        """SQL for the shard (0 to count-1) of a row's id, or None on other databases."""
        column = f"memstream_rows.{self._quoted(self.id_column)}"
        backend = self.url.get_backend_name()
        if backend == "postgresql":
            # a 64-bit hash of the id's text, its sign bit cleared
            return (
                f"((hashtextextended(CAST({column} AS text), 0) & 9223372036854775807) % {count})"
            )
        if backend == "sqlite":
            return f"({SQLITE_SHARD_FUNCTION}({column}) % {count})"
        return None

    def read_bytes(self, item: Document) -> bytes:
        raise SourceError(f"{item.uri} has no content: its text and blob columns are NULL")

    def _item(self, base_uri: str, row: Mapping[str, Any]) -> Document:
        row_id = str(row[self.id_column])
        blob = row[self.blob_column] if self.blob_column else None
        content = row[self.text_column] if self.text_column else None
        default_name = f"{row_id}.txt" if self.text_column else f"{row_id}.bin"
        questions: tuple[str, ...] = ()
        error = None
        if self.questions_column:
            try:
                questions = coerce_questions(row[self.questions_column], f"row {row_id}")
            except SourceError as e:
                error = str(e)
        return Document(
            uri=f"{base_uri}#{row_id}",
            name=str(row[self.name_column]) if self.name_column else default_name,
            size=len(blob) if blob is not None else None,
            metadata={column: plain_value(row[column]) for column in self.metadata_columns},
            text=None if content is None else str(content),
            data=None if blob is None else bytes(blob),
            questions=questions,
            error=error,
        )

    def _error(self, error: SQLAlchemyError) -> SourceError:
        """The driver's first line, with the password scrubbed in case a driver echoes it."""
        reason = str(error.orig) if isinstance(error, DBAPIError) else str(error)
        lines = [line.strip() for line in reason.splitlines() if line.strip()]
        first_line = lines[0] if lines else type(error).__name__
        if self.url.password:
            first_line = first_line.replace(str(self.url.password), "***")
        return SourceError(f"SQL source {self.safe_url}: {first_line}")


def _register_shard_hash(dbapi_connection: Any, _record: Any) -> None:
    """SQLite has no hash function: a CRC-32 of the value's text, the same in every process."""
    dbapi_connection.create_function(
        SQLITE_SHARD_FUNCTION,
        1,
        lambda value: zlib.crc32(str(value).encode()),
        deterministic=True,
    )


def _parse_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        raise SourceError(
            "cannot parse the SQL URL: write it as dialect+driver://user:password@host:port/db"
        ) from None
    return with_default_driver(parsed)


def with_default_driver(url: URL) -> URL:
    """`url` with psycopg 3 as the driver of a plain postgresql:// or postgres:// URL."""
    return url.set(drivername=DEFAULT_DRIVERS.get(url.drivername, url.drivername))


def redacted(url: str | URL) -> str:
    """The URL as it may be shown and logged: its password as ***."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return "(invalid URL)"
