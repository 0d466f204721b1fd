"""Documents in the rows of Parquet or JSON Lines files, read batch by batch or line by line."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from connectors.base import SourceError, coerce_questions, plain_value
from connectors.local import expand_paths
from operators.core.document import Document

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}


class DatasetSource:
    """One document per row, its content inline in `text_column`.

    `path` is a file, a folder or a glob; its files are read in path order. `format` is
    "parquet" or "jsonl", by default from each file's extension. A job reads each Parquet row
    group, and each JSON Lines file, in a Ray read task (a shard) of its own.
    """

    read_threads = 1  # the content is in the rows

    def __init__(
        self,
        path: str,
        format: str | None = None,
        id_column: str = "id",
        text_column: str = "text",
        name_column: str | None = None,
        metadata_columns: Sequence[str] = (),
        questions_column: str | None = None,
        batch_size: int = 1024,
    ) -> None:
        if format not in (None, "parquet", "jsonl"):
            raise SourceError(f"unknown dataset format {format!r}: use 'parquet' or 'jsonl'")
        self.path = path
        self.format = format
        self.id_column = id_column
        self.text_column = text_column
        self.name_column = name_column
        self.metadata_columns = list(metadata_columns)
        self.questions_column = questions_column
        self.batch_size = batch_size

    def __repr__(self) -> str:
        return f"DatasetSource({self.path!r})"

    @property
    def columns(self) -> list[str]:
        """The columns that items() reads."""
        named = [self.id_column, self.text_column, self.name_column]
        named += [*self.metadata_columns, self.questions_column]
        return [column for column in named if column]

    def check(self) -> None:
        files = list(self._files())
        if not files:
            raise SourceError(f"no dataset files at {self.path!r}: check the path")
        for path in files:
            found = self._columns_of(path)
            missing = [column for column in self.columns if column not in found]
            if missing:
                raise SourceError(
                    f"{path} has no column {', '.join(missing)} (it has {', '.join(found)}): "
                    "fix the column names"
                )

    def documents(self) -> Iterator[Document]:
        for path in self._files():
            yield from self.shard_documents((str(path), None))

    def shards(self, parallelism: int) -> list[Any]:
        """(path, row group) for each Parquet row group, (path, None) for a JSON Lines file:
        the files' footers are read here, never their rows."""
        shards: list[Any] = []
        for path in self._files():
            if self._format(path) == "parquet":
                groups = self._parquet_file(path).metadata.num_row_groups
                shards.extend((str(path), group) for group in range(groups))
            else:
                shards.append((str(path), None))
        return shards

    def shard_documents(self, shard: Any) -> Iterator[Document]:
        name, group = shard
        path = Path(name)
        if self._format(path) == "parquet":
            rows = self._parquet_rows(path, None if group is None else [group])
        else:
            rows = _jsonl_rows(path)
        for row in rows:
            yield self._item(path, row)

    def sizes(self) -> Iterator[int]:
        """The text column's uncompressed bytes in each Parquet row group, or a JSON Lines
        file's size: from the footers and the file system, without reading a row."""
        for path in self._files():
            if self._format(path) != "parquet":
                yield path.stat().st_size
                continue
            metadata = self._parquet_file(path).metadata
            for group in range(metadata.num_row_groups):
                row_group = metadata.row_group(group)
                for index in range(row_group.num_columns):
                    column = row_group.column(index)
                    if column.path_in_schema == self.text_column:
                        yield column.total_uncompressed_size

    def read_bytes(self, item: Document) -> bytes:
        raise SourceError(f"{item.uri} has no content: its text column is empty")

    def _files(self) -> Iterator[Path]:
        return expand_paths([self.path])

    def _format(self, path: Path) -> str:
        found = self.format or FORMATS.get(path.suffix.lower())
        if found is None:
            raise SourceError(f"{path}: unknown dataset format: give format='parquet' or 'jsonl'")
        return found

    def _columns_of(self, path: Path) -> list[str]:
        if self._format(path) == "parquet":
            try:
                return list(pq.read_schema(path).names)
            except (OSError, pa.ArrowException) as e:
                raise SourceError(f"{path}: not a readable Parquet file ({e})") from None
        first = next(_jsonl_rows(path), {})
        return list(first)

    def _parquet_file(self, path: Path) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"{path}: not a readable Parquet file ({e})") from None

    def _parquet_rows(
        self, path: Path, row_groups: list[int] | None = None
    ) -> Iterator[dict[str, Any]]:
        try:
            batches = self._parquet_file(path).iter_batches(
                self.batch_size, row_groups=row_groups, columns=self.columns
            )
            for batch in batches:
                yield from batch.to_pylist()
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"{path}: cannot read Parquet rows ({e})") from None

    def _item(self, path: Path, row: Mapping[str, Any]) -> Document:
        try:
            row_id = str(row[self.id_column])
            content = row[self.text_column]
            name = str(row[self.name_column]) if self.name_column else f"{row_id}.txt"
        except KeyError as e:
            raise SourceError(f"{path}: a row has no column {e}") from None
        questions: tuple[str, ...] = ()
        error = None
        if self.questions_column:
            try:
                questions = coerce_questions(row.get(self.questions_column), f"{path} row {row_id}")
            except SourceError as e:
                error = str(e)
        metadata = {column: plain_value(row.get(column)) for column in self.metadata_columns}
        return Document(
            uri=f"{path.as_uri()}#{row_id}",
            name=name,
            metadata=metadata,
            text=None if content is None else str(content),
            questions=questions,
            error=error,
        )


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8-sig") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise SourceError(f"{path}:{number}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise SourceError(f"{path}:{number}: a line must be a JSON object")
            yield row
