"""Everything outside the process: streaming document sources (local files, S3, SQL,
Parquet/JSONL) and output locations here; the state store in `state`; model engines in `engines`.

A job reads its sources as one Ray Data read (connectors.reading: shards planned on the driver,
items listed and fetched in read tasks). S3Source needs boto3 (extra "s3") for its listing and
reads objects through pyarrow's S3 filesystem, as the outputs are written; SqlSource needs
SQLAlchemy (extra "sql"). They are imported only when used, so local sources work without
those extras.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from connectors.base import Source, SourceError
from connectors.dataset import DatasetSource
from connectors.local import LocalSource
from connectors.output import OutputError, check_output, open_output

if TYPE_CHECKING:
    from connectors.s3 import S3Source
    from connectors.sql import SqlSource

__all__ = [
    "DatasetSource",
    "LocalSource",
    "OutputError",
    "S3Source",
    "Source",
    "SourceError",
    "SqlSource",
    "check_output",
    "open_output",
    "open_source",
]


def __getattr__(name: str) -> Any:
    if name == "S3Source":
        from connectors.s3 import S3Source

        return S3Source
    if name == "SqlSource":
        from connectors.sql import SqlSource

        return SqlSource
    raise AttributeError(f"module 'connectors' has no attribute {name!r}")


def open_source(spec: str | dict[str, Any]) -> Source:
    """A source from a spec: an s3:// URI, a local path or glob, or a dict with a "type"
    ("local", "s3", "sql" or "dataset") and that source's arguments, e.g.
    {"type": "sql", "url": "postgresql://...", "query": "SELECT id, text FROM docs"}."""
    if isinstance(spec, str):
        if spec.startswith("s3://"):
            return _source_class("s3")(spec)
        if "://" in spec and not spec.startswith("file://"):
            raise SourceError(
                f"cannot read {spec.split('://')[0]}:// URIs as a path: "
                'for a database give {"type": "sql", "url": ..., "query": ...}'
            )
        return LocalSource([spec])
    arguments = dict(spec)
    kind = arguments.pop("type", None)
    source_class = _source_class(kind)
    if kind == "local" and "path" in arguments:
        arguments["paths"] = [arguments.pop("path")]
    accepted = [name for name in inspect.signature(source_class).parameters if name != "self"]
    unknown = sorted(set(arguments) - set(accepted))
    if unknown:
        raise SourceError(
            f"unknown {kind} source option {', '.join(unknown)}: it takes {', '.join(accepted)}"
        )
    try:
        return source_class(**arguments)
    except TypeError as e:
        raise SourceError(f"{kind} source: {e}") from None


def _source_class(kind: Any) -> Callable[..., Source]:
    if kind == "local":
        return LocalSource
    if kind == "dataset":
        return DatasetSource
    if kind == "s3":
        from connectors.s3 import S3Source

        return S3Source
    if kind == "sql":
        from connectors.sql import SqlSource

        return SqlSource
    raise SourceError(f"unknown source type {kind!r}: use 'local', 's3', 'sql' or 'dataset'")
