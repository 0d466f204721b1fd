"""Documents in the rows of Parquet or JSON Lines files, read batch by batch or line by line."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from connectors.base import SourceError, SourceItem, coerce_questions, plain_value
from connectors.local import expand_paths

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}


class DatasetSource:
    """One document per row, its content inline in `text_column`.

    `path` is a file, a folder or a glob; its files are read in path order. `format` is
    "parquet" or "jsonl", by default from each file's extension.
    """

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

    def items(self) -> Iterator[SourceItem]:
        for path in self._files():
            rows = (
                self._parquet_rows(path) if self._format(path) == "parquet" else _jsonl_rows(path)
            )
            for row in rows:
                yield self._item(path, row)

    def read_bytes(self, item: SourceItem) -> bytes:
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

    def _parquet_rows(self, path: Path) -> Iterator[dict[str, Any]]:
        try:
            batches = pq.ParquetFile(path).iter_batches(self.batch_size, columns=self.columns)
            for batch in batches:
                yield from batch.to_pylist()
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"{path}: cannot read Parquet rows ({e})") from None

    def _item(self, path: Path, row: Mapping[str, Any]) -> SourceItem:
        try:
            row_id = str(row[self.id_column])
            content = row[self.text_column]
            name = str(row[self.name_column]) if self.name_column else f"{row_id}.txt"
        except KeyError as e:
            raise SourceError(f"{path}: a row has no column {e}") from None
        questions: tuple[str, ...] = ()
        if self.questions_column:
            questions = coerce_questions(row.get(self.questions_column), f"{path} row {row_id}")
        metadata = {column: plain_value(row.get(column)) for column in self.metadata_columns}
        return SourceItem(
            uri=f"{path.as_uri()}#{row_id}",
            name=name,
            metadata=metadata,
            text=None if content is None else str(content),
            questions=questions,
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
