"""What a job is: `JobSpec` and its sections, from YAML (`load_job_spec`) or built in Python."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import yaml
from pydantic import AfterValidator, Field

from connectors.engines.factory import EngineSpec
from connectors.output import S3_MAX_ATTEMPTS
from operators.config import (
    STRICT_KEYS,
    ConfigError,
    DocumentLimits,
    MethodConfig,
    parse_config,
    with_measured_defaults,
)
from operators.core.collection import check_order_by
from operators.core.settings import Flag


class JobError(ValueError):
    """A job that cannot run as specified; the message says what to fix."""


@dataclass(frozen=True)
class OutputSpec:
    """Where a run's tables go: OUTPUT/RUN_ID/answers.parquet, trajectory, errors."""

    uri: Annotated[
        str,
        Field(description="a local folder or s3://bucket/prefix"),
        Flag(name="--output", metavar="URI"),
    ]
    s3_endpoint_url: Annotated[
        str | None,
        Field(description="an S3-compatible store's endpoint for an s3:// output; unset: AWS"),
        Flag(metavar="URL"),
    ] = None
    s3_max_attempts: Annotated[
        int, Field(gt=0, description="attempts of each S3 call, with backoff between them")
    ] = S3_MAX_ATTEMPTS

    def __post_init__(self) -> None:
        if not self.uri.strip():
            raise ValueError("output.uri is empty: give a local folder or s3://bucket/prefix")
        if self.s3_max_attempts < 1:
            raise ValueError(f"s3_max_attempts must be at least 1, got {self.s3_max_attempts}")

    @property
    def is_local(self) -> bool:
        return urlparse(self.uri).scheme in ("", "file")


@dataclass(frozen=True)
class ConcurrencySpec:
    """How much of the job runs at once, and where."""

    actors: Annotated[
        int, Field(ge=1, description="memory-stage actors (engines), one engine each")
    ] = 1
    max_active_chains: Annotated[int, Field(ge=1, description="chains one actor runs at once")] = 64
    batches_in_flight: Annotated[
        int,
        Field(
            ge=1,
            description="batches one actor holds at once: their chains run together, and the "
            "window in which longest-first scheduling chooses",
        ),
    ] = 32
    batch_size: Annotated[int, Field(ge=1, description="documents per memory-stage batch")] = 1
    num_gpus: Annotated[float, Field(ge=0, description="GPUs per memory-stage actor")] = 0.0
    num_cpus: Annotated[float, Field(ge=0, description="CPUs per memory-stage actor")] = 1.0
    read_tasks: Annotated[int, Field(ge=1, description="read, parse and segment tasks at once")] = 2
    schedule: Annotated[
        Literal["longest-first", "source-order"],
        Field(
            description="which chains the engine serves first; longest-first: those with most "
            "document tokens left, so the longest document is not the tail of the run; "
            "source-order: as they come"
        ),
    ] = "longest-first"

    def __post_init__(self) -> None:
        for name in ("actors", "max_active_chains", "batches_in_flight", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.read_tasks < 1:
            raise ValueError(f"read_tasks must be at least 1, got {self.read_tasks}")
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise ValueError("num_gpus and num_cpus cannot be negative")


def _checked_order_by(order_by: str) -> str:
    check_order_by(order_by)
    return order_by


@dataclass(frozen=True)
class CollectionSpec:
    """Documents read together, in order, by one memory chain per question: a question that
    spans them is asked of the collection, not of each document (docs/guide/collections.md)."""

    name: Annotated[
        str,
        Field(
            min_length=1,
            description="the collection's name: its answers rows' `name`, and "
            "`collection:<name>` their `source_uri`",
        ),
    ]
    questions: Annotated[
        tuple[str, ...],
        Field(min_length=1, description="asked of the collection as a whole (ids q0, q1, ...)"),
    ]
    documents: Annotated[
        tuple[str, ...],
        Field(
            min_length=1,
            description="which documents it holds: globs over the documents' names (a file's "
            "name, as the answers' `name` column shows it); default: every document",
        ),
    ] = ("*",)
    source: Annotated[
        int | None,
        Field(
            ge=0, description="only documents of the job's source with this index (0: the first)"
        ),
    ] = None
    order_by: Annotated[
        str,
        AfterValidator(_checked_order_by),
        Field(
            description="the reading order; listed: by the `documents` globs as written, then by "
            "name within a glob; name: by name; mtime: oldest first (local files); "
            "metadata.<key>: by the source's field <key> (an SQL or dataset column in "
            "`metadata_columns`, an S3 object's `last_modified` or user metadata), lowest first"
        ),
    ] = "listed"

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("a collection's name is empty")
        if not any(question.strip() for question in self.questions):
            raise ValueError(f"collection {self.name!r} asks no question")
        check_order_by(self.order_by)  # built in Python, not from YAML: checked here


@dataclass(frozen=True)
class JobSpec:
    __pydantic_config__ = STRICT_KEYS

    sources: Annotated[
        tuple[str | dict[str, Any], ...],
        Field(
            description="the documents: a path, glob, folder or s3://bucket/prefix, or a mapping "
            "as connectors.open_source takes it"
        ),
        Flag(name="--input", metavar="URI", repeat=True),
    ]
    output: OutputSpec
    questions: Annotated[
        tuple[str, ...],
        Field(description="a question asked of every document (ids q0, q1, ...)"),
        Flag(name="--question", short="-q", metavar="Q", repeat=True),
    ] = ()
    questions_file: Annotated[
        str | None,
        Field(description="more questions: one a line, or a JSON list"),
        Flag(name="--questions", metavar="FILE"),
    ] = None
    schema: Annotated[
        dict[str, str],
        Field(description="field name -> question, the field name being the question's id"),
    ] = field(default_factory=dict)
    collections: Annotated[
        tuple[CollectionSpec, ...],
        Field(
            description="named collections of the documents, each read in order by one chain "
            "per question of its own; a document may be in several"
        ),
    ] = ()
    engine: EngineSpec = field(default_factory=EngineSpec)
    method: MethodConfig = field(default_factory=MethodConfig)
    limits: DocumentLimits = field(default_factory=DocumentLimits)  # of one document
    # Kept out of repr: it may hold a password.
    state_store: Annotated[
        str | None,
        Field(
            description="SQLAlchemy URL of the checkpoints; unset: SQLite beside the output "
            "(an s3:// output's in the user cache folder)"
        ),
        Flag(metavar="URL"),
    ] = field(default=None, repr=False)
    run_id: Annotated[
        str | None,
        Field(
            description="the run to start or resume; unset: <job key>-<n>, a new one per run, "
            "the unfinished one resumed"
        ),
    ] = None
    concurrency: ConcurrencySpec = field(default_factory=ConcurrencySpec)
    ray_address: Annotated[
        str | None,
        Field(
            description="Ray cluster to run on; unset: the running Ray session, else a local one"
        ),
        Flag(metavar="ADDRESS"),
    ] = None

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("sources is empty: name at least one input (a path, s3:// or SQL)")
        names = [collection.name for collection in self.collections]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"collection names must differ: {', '.join(twice)} named twice")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "job") -> JobSpec:
        """Validates a plain mapping (as YAML gives it); errors name the key and what is wrong."""
        if not isinstance(data, Mapping):
            raise JobError(f"{where}: a job must be a mapping of keys, got {type(data).__name__}")
        raw = with_measured_defaults(data)
        if isinstance(raw.get("output"), str):
            raw["output"] = {"uri": raw["output"]}
        for key in ("sources", "questions"):
            if isinstance(raw.get(key), (str, dict)):
                raw[key] = [raw[key]]
        if isinstance(raw.get("collections"), list):
            raw["collections"] = [_listing(collection) for collection in raw["collections"]]
        try:
            return parse_config(cls, raw, where)
        except ConfigError as error:
            raise JobError(str(error)) from None


def _listing(collection: Any) -> Any:
    """A collection's `documents` and `questions` given as one string: a list of one."""
    if not isinstance(collection, Mapping):
        return collection
    return {
        key: [value] if key in ("documents", "questions") and isinstance(value, str) else value
        for key, value in collection.items()
    }


def load_job_spec(path: str | Path, overrides: Mapping[str, Any] | None = None) -> JobSpec:
    """A job from YAML. Relative local paths in it are relative to the YAML file's folder.
    `overrides` (e.g. from command-line flags) are merged over it, section by section."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise JobError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise JobError(f"{path}: a job must be a mapping of keys, got {type(data).__name__}")
    data = anchor_paths(data, path.parent)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return JobSpec.from_dict(data, str(path))


def anchor_paths(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The job with its relative local paths made relative to `folder`."""
    data = dict(data)
    sources = data.get("sources")
    if isinstance(sources, (str, dict)):
        sources = [sources]
    if isinstance(sources, list):
        data["sources"] = [_anchor_source(source, folder) for source in sources]
    if isinstance(data.get("questions_file"), str):
        data["questions_file"] = _anchor(data["questions_file"], folder)
    output = data.get("output")
    if isinstance(output, str):
        data["output"] = _anchor(output, folder)
    elif isinstance(output, dict) and isinstance(output.get("uri"), str):
        data["output"] = {**output, "uri": _anchor(output["uri"], folder)}
    return data


def _anchor_source(source: Any, folder: Path) -> Any:
    if isinstance(source, str):
        return _anchor(source, folder)
    if isinstance(source, dict) and source.get("type") in ("local", "dataset"):
        anchored = dict(source)
        for key in ("path", "paths"):
            value = anchored.get(key)
            if isinstance(value, str):
                anchored[key] = _anchor(value, folder)
            elif isinstance(value, list):
                anchored[key] = [_anchor(v, folder) if isinstance(v, str) else v for v in value]
        return anchored
    return source


def _anchor(value: str, folder: Path) -> str:
    if "://" in value or Path(value).expanduser().is_absolute():
        return value
    return str(folder / value)
