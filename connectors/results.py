"""The run's results as Parquet tables and a manifest, exported from the state store.

Under `<output>/<run_id>/`: `answers.parquet` (one row per document and question, carried
forward or not: `answered_in_run` names the run that computed it), `trajectory.parquet` (one row
per model call), `errors.parquet` (one row per document that could not be read, parsed or
segmented), `superseded.parquet` (one row per answers row of the previous run over the archive
that this run replaced) and `manifest.json`. The state store is the truth; an export rewrites
the files whole, so a rerun replaces them instead of adding to them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import islice
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from connectors.state.export import trajectory_row
from connectors.state.store import StateStore
from operators.config import MethodConfig

ROWS_PER_BATCH = 1000
TIMESTAMP = pa.timestamp("ms", tz="UTC")

EVIDENCE_TYPE = pa.struct(
    [
        ("segment_index", pa.int32()),
        ("page", pa.int32()),
        ("char_start", pa.int64()),
        ("char_end", pa.int64()),
        ("quote", pa.string()),
        ("score", pa.float64()),
        ("matches", pa.string()),  # "answer" or "memory"
    ]
)

ANSWERS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        # the run that computed the answer: this one, or an earlier one whose answer was carried
        # forward (same content, question, model and method); NULL while unanswered
        ("answered_in_run", pa.string()),
        ("doc_id", pa.string()),
        ("name", pa.string()),
        ("source_uri", pa.string()),
        ("question_id", pa.string()),
        ("question", pa.string()),
        ("answer", pa.string()),
        ("raw_response", pa.string()),
        ("final_memory", pa.string()),
        # True when the answer is found in the source with the question's terms or the memory's
        # supporting fact beside it (operators.core.evidence); NULL for a chain with no answer row
        ("grounded", pa.bool_()),
        ("grounding_reason", pa.string()),
        ("evidence", pa.list_(EVIDENCE_TYPE)),
        ("status", pa.string()),
        ("error", pa.string()),
        ("n_segments", pa.int64()),
        ("n_tokens", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("model", pa.string()),
        ("engine", pa.string()),
        ("dtype", pa.string()),
        ("template", pa.string()),
        ("chunk_size", pa.int64()),
        (
            "sampling",
            pa.struct(
                [("temperature", pa.float64()), ("top_p", pa.float64()), ("seed", pa.int64())]
            ),
        ),
        (
            "timings",
            pa.struct(
                [
                    ("started_at", TIMESTAMP),
                    ("finished_at", TIMESTAMP),
                    ("wall_s", pa.float64()),
                    ("compute_s", pa.float64()),
                ]
            ),
        ),
        ("parser", pa.string()),
        ("parse_warnings", pa.list_(pa.string())),
        ("content_sha256", pa.string()),
        ("chain_key", pa.string()),
    ]
)

TRAJECTORY_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("chain_key", pa.string()),
        ("doc_id", pa.string()),
        ("source_uri", pa.string()),
        ("question_id", pa.string()),
        ("step", pa.int64()),
        ("kind", pa.string()),  # "update" or "final"
        ("segment_index", pa.int64()),
        ("token_start", pa.int64()),
        ("token_end", pa.int64()),
        ("char_start", pa.int64()),
        ("char_end", pa.int64()),
        ("memory_after", pa.string()),  # the raw response on the final step
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("finish_reason", pa.string()),
        ("latency_s", pa.float64()),
        # reply lines the memory policy did not find in the section (verified-quotes); else empty
        ("rejected_quotes", pa.list_(pa.string())),
        # the final step's re-read passages as [char_start, char_end] of the text; else empty
        ("reread_spans", pa.list_(pa.list_(pa.int64()))),
    ]
)

ERRORS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("doc_id", pa.string()),
        ("name", pa.string()),
        ("source_uri", pa.string()),
        ("stage", pa.string()),
        ("error_type", pa.string()),
        ("message", pa.string()),
    ]
)


SUPERSEDED_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),  # the earlier run whose answers row this is
        ("answered_in_run", pa.string()),
        ("superseded_by", pa.string()),  # this run
        ("change", pa.string()),  # "changed", "removed" or "answered anew"
        ("doc_id", pa.string()),
        ("name", pa.string()),
        ("source_uri", pa.string()),
        ("question_id", pa.string()),
        ("question", pa.string()),
        ("status", pa.string()),
        ("answer", pa.string()),
        ("content_sha256", pa.string()),
        ("chain_key", pa.string()),
    ]
)


@dataclass(frozen=True)
class RunIdentity:
    """What every answers row says about how it was made."""

    run_id: str
    attempt: int
    model: str
    engine: str
    dtype: str
    method: MethodConfig


@dataclass(frozen=True)
class ExportedTable:
    name: str
    uri: str
    rows: int


class ResultWriter:
    """Writes a run's tables and manifest under `<base>/<run_id>/` on a pyarrow filesystem."""

    def __init__(self, filesystem: pafs.FileSystem, base: str, run_id: str) -> None:
        self.filesystem = filesystem
        self.folder = f"{base}/{run_id}"
        self._is_local = isinstance(filesystem, pafs.LocalFileSystem)

    def uri(self, file_name: str) -> str:
        path = f"{self.folder}/{file_name}"
        return path if self._is_local else f"s3://{path}"

    def export_tables(self, store: StateStore, run: RunIdentity) -> dict[str, ExportedTable]:
        if self._is_local:
            self.filesystem.create_dir(self.folder, recursive=True)
        tables = {
            "answers": (
                ANSWERS_SCHEMA,
                (answer_row(row, run) for row in store.answers(run.run_id, run.attempt)),
            ),
            "trajectory": (
                TRAJECTORY_SCHEMA,
                (trajectory_row(row) for row in store.trajectory(run.run_id, run.attempt)),
            ),
            "errors": (ERRORS_SCHEMA, store.errors(run.run_id, run.attempt)),
            "superseded": (SUPERSEDED_SCHEMA, store.superseded(run.run_id, run.attempt)),
        }
        return {
            name: ExportedTable(name, self.uri(f"{name}.parquet"), self._write(name, *table))
            for name, table in tables.items()
        }

    def write_manifest(self, manifest: Mapping[str, Any]) -> str:
        text = json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n"
        self._replace("manifest.json", lambda path: self._write_bytes(path, text.encode()))
        return self.uri("manifest.json")

    def _write(self, name: str, schema: pa.Schema, rows: Iterable[dict[str, Any]]) -> int:
        written = 0

        def write(path: str) -> None:
            nonlocal written
            with pq.ParquetWriter(path, schema, filesystem=self.filesystem) as writer:
                for batch in _batches(rows):
                    writer.write_batch(pa.RecordBatch.from_pylist(batch, schema=schema))
                    written += len(batch)

        self._replace(f"{name}.parquet", write)
        return written

    def _replace(self, file_name: str, write: Callable[[str], None]) -> None:
        """Local files are written beside and moved into place; one that cannot be finished
        (a full disk) is removed, not left to hold the space the rerun needs. An S3 object
        appears whole when its upload completes."""
        target = f"{self.folder}/{file_name}"
        if not self._is_local:
            write(target)
            return
        partial = f"{target}.partial"
        try:
            write(partial)
            self.filesystem.move(partial, target)
        except BaseException:
            with contextlib.suppress(OSError):
                self.filesystem.delete_file(partial)
            raise

    def _write_bytes(self, path: str, data: bytes) -> None:
        with self.filesystem.open_output_stream(path) as stream:
            stream.write(data)


def answer_row(row: Mapping[str, Any], run: RunIdentity) -> dict[str, Any]:
    method = run.method
    started, finished = row["started_at"], row["finished_at"]
    return {
        "run_id": row["run_id"],
        "answered_in_run": row["answered_in_run"],
        "doc_id": row["doc_id"],
        "name": row["name"],
        "source_uri": row["source_uri"],
        "question_id": row["question_id"],
        "question": row["question"],
        "answer": row["answer"],
        "raw_response": row["raw_response"],
        "final_memory": row["final_memory"],
        "grounded": None if row["grounded"] is None else bool(row["grounded"]),
        "grounding_reason": row["grounding_reason"],
        "evidence": json.loads(row["evidence"] or "[]"),
        "status": row["status"],
        "error": row["error"],
        "n_segments": row["n_segments"],
        "n_tokens": row["n_tokens"],
        "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["completion_tokens"],
        "model": run.model,
        "engine": run.engine,
        "dtype": run.dtype,
        "template": method.template,
        "chunk_size": method.chunk_size,
        "sampling": {"temperature": method.temperature, "top_p": method.top_p, "seed": method.seed},
        "timings": {
            "started_at": utc_timestamp(started),
            "finished_at": utc_timestamp(finished),
            "wall_s": finished - started if started is not None and finished is not None else None,
            "compute_s": row["compute_s"],
        },
        "parser": row["parser"],
        "parse_warnings": json.loads(row["warnings"] or "[]"),
        "content_sha256": row["content_sha256"],
        "chain_key": row["chain_key"],
    }


def utc_timestamp(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=timezone.utc)


def _batches(rows: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    iterator = iter(rows)
    while batch := list(islice(iterator, ROWS_PER_BATCH)):
        yield batch
