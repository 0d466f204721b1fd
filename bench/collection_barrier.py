"""Collection barrier: what the corpus job's wait for every parsed document costs a collection.

On Ray Data a collection needs its members together, in order. The job's graph
(pipeline/job/graph.py) holds the parsed documents once (`Dataset.materialize()`), then groups
them by collection (`groupby` on the collection's name, `map_groups(CollectionStage)`): a
barrier. The alternative, members parsed in parallel and held until the chain reaches them,
was not built; this measures how much there is to win, on one machine in one run.

N text documents (default 100, 2,000 to 5,000 words each, cut one after another from the
real text of ../shared/corpora/text, so the same every run) are written to a temporary folder
as doc000.txt, doc001.txt, ... and a corpus job (`pipeline.job.run_job`, a fresh local Ray
session and a fresh SQLite state store each) answers them three ways:

(a) `documents`: one question asked of every document, no collection (the graph streams);
(b) `both`: the same, plus one collection of all N documents, `order_by: name`, one question
    (the graph materializes the parsed documents, and groups the collection's members);
(c) `collection`: the collection alone.

The engine is the fake engine's reply (connectors/engines/fake.py `reply_to`) behind
bench/openai_stub.py, an OpenAI-compatible server in its own process with no delay: the
`openai` engine kind, the model's tokenizer for segmentation, and model time near nothing,
so what is left is the pipeline's own cost. Times are measured from the call of `run_job`
(Ray already started; its start-up is reported apart), first model calls from the state
store (`steps.created_at - steps.latency_s`), planning times from the `documents` rows the
segment and collection stages write, the barrier from the driver's call of
`Dataset.materialize()` (wrapped to time it, called as it is). A job over 3 documents runs
first, unmeasured (a process's first Ray session starts slower). The driver's RSS (this process
alone) and the Ray object store's bytes in use are sampled every --sample-s while a job runs.
Times are for 2 CPU cores under load: N=10 ~2 min, N=100 ~5-10 min (estimated), --repeats 3
about three times that.

    .venv/bin/python bench/collection_barrier.py                    # 100 documents
    .venv/bin/python bench/collection_barrier.py --documents 10     # a quick check
    .venv/bin/python bench/collection_barrier.py --repeats 3        # the median of three
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shlex
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
import pipeline_overhead  # marks this run's Ray processes
import psutil

from connectors.engines import models
from pipeline.job import JobSpec, run_job

MODEL = "smollm2-135m-instruct"  # its tokenizer cuts the segments; no model runs
QUESTION = "What is this document about, in one sentence?"
COLLECTION = "all"
COLLECTION_QUESTION = "Which documents of the collection mention a date, and in what order?"
WAYS = {
    "documents": "(a) every document one question, no collection",
    "both": "(b) the same plus one collection of all documents",
    "collection": "(c) the collection alone",
}
MIN_WORDS, MAX_WORDS = 2000, 5000
MiB = 1 << 20


# --- the corpus ---------------------------------------------------------------------------


def words_of(index: int) -> int:
    """The word count of document `index`: spread over MIN_WORDS..MAX_WORDS, fixed."""
    return MIN_WORDS + (index * 7919) % (MAX_WORDS - MIN_WORDS + 1)


def write_corpus(folder: Path, documents: int) -> list[dict[str, Any]]:
    """doc000.txt, doc001.txt, ...: consecutive slices of real text, whitespace kept."""
    counts = [words_of(index) for index in range(documents)]
    text = common.real_text(sum(counts) * 8)
    starts = [match.start() for match in re.finditer(r"\S+", text)]
    while len(starts) <= sum(counts):  # real_text repeats itself for long corpora
        text += "\n" + text
        starts = [match.start() for match in re.finditer(r"\S+", text)]
    folder.mkdir(parents=True)
    written, word = [], 0
    for index, count in enumerate(counts):
        body = text[starts[word] : starts[word + count]].rstrip() + "\n"
        name = f"doc{index:03d}.txt"
        (folder / name).write_text(body, encoding="utf-8")
        written.append({"name": name, "words": count, "bytes": len(body.encode("utf-8"))})
        word += count
    return written


# --- the engine: the fake engine's replies over HTTP ----------------------------------------


@contextlib.contextmanager
def stub_server() -> Iterator[str]:
    """bench/openai_stub.py in a process of its own, replying at once; yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stub = Path(__file__).with_name("openai_stub.py")
    command = [sys.executable, str(stub), "--port", str(port), "--model", MODEL, "--delay-ms", "0"]
    process = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the stub server did not start: {shlex.join(command)}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=20)


# --- one job ------------------------------------------------------------------------------


def job_spec(
    way: str, corpus: Path, work: Path, base_url: str, args: argparse.Namespace
) -> JobSpec:
    collections = [{"name": COLLECTION, "order_by": "name", "questions": [COLLECTION_QUESTION]}]
    return JobSpec.from_dict({
        "sources": [str(corpus)],
        "questions": [] if way == "collection" else [QUESTION],
        **({} if way == "documents" else {"collections": collections}),
        "output": str(work / "output"),
        "state_store": f"sqlite:///{work / 'state.sqlite'}",
        "engine": {"kind": "openai", "base_url": base_url, "model": MODEL,
                   "tokenizer": str(models.resolve(MODEL)), "max_model_len": 4096},
        "method": {"template": "memagent-reference", "chunk_size": args.chunk_size,
                   "max_memory_tokens": args.max_memory_tokens, "max_answer_tokens": 32},
    })  # fmt: skip


class Usage(common.Sampler):
    """The driver's RSS and the Ray object store's bytes in use, peaks since entering."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(interval_s)
        self._process = psutil.Process()
        self.rss_start = self.rss_peak = self._process.memory_info().rss
        self.store_peak: int | None = None
        self._state: Any = None

    def begin(self) -> None:
        import ray
        from ray._private.internal_api import get_state_from_address

        with contextlib.suppress(Exception):  # Ray's private API: skip it if it changed
            self._state = get_state_from_address(ray.get_runtime_context().gcs_address)

    def sample(self) -> None:
        self.rss_peak = max(self.rss_peak, self._process.memory_info().rss)
        if self._state is None:
            return
        from ray._private.internal_api import get_memory_info_reply

        try:
            used = get_memory_info_reply(self._state, timeout_seconds=5).store_stats
        except Exception:  # a reply missed while Ray is busy: the next sample comes
            return
        self.store_peak = max(self.store_peak or 0, used.object_store_bytes_used)


@contextlib.contextmanager
def timing_materialize() -> Iterator[list[tuple[float, float]]]:
    """(start, end) wall times of each `Dataset.materialize()` the driver calls meanwhile: the
    graph's barrier (pipeline/job/graph.py calls it in this process, and it runs to its end
    before the graph goes on). Timing only: the call is the same."""
    from ray.data import Dataset

    calls: list[tuple[float, float]] = []
    original = Dataset.materialize

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        try:
            return original(self, *args, **kwargs)
        finally:
            calls.append((started, time.time()))

    Dataset.materialize = timed  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        Dataset.materialize = original  # type: ignore[method-assign]


def timed_job(way: str, corpus: Path, base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    with tempfile.TemporaryDirectory(prefix=f"bench-barrier-{way}-") as temporary:
        work = Path(temporary)
        spec = job_spec(way, corpus, work, base_url, args)
        ray_started = time.perf_counter()
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
        ray_init_s = time.perf_counter() - ray_started
        try:
            with Usage(args.sample_s) as usage, timing_materialize() as barriers:
                started_at = time.time()
                started = time.perf_counter()
                summary = run_job(spec)  # joins the session started above
                run_job_s = time.perf_counter() - started
        finally:
            ray.shutdown()
        times = store_times(work / "state.sqlite", summary.run_id, started_at)
    barrier = (barriers[0][0] - started_at, barriers[0][1] - started_at) if barriers else None
    return {
        "way": way,
        "ray_init_s": ray_init_s,
        "run_job_s": run_job_s,
        "end_to_end_s": ray_init_s + run_job_s,
        "busy_s": summary.busy_s,
        **times,
        "materialize_start_s": None if barrier is None else barrier[0],
        "materialize_end_s": None if barrier is None else barrier[1],
        "chains": summary.chains,
        "chains_done": summary.chains_done,
        "chains_failed": summary.chains_failed,
        "errors": summary.errors,
        "prompt_tokens": summary.prompt_tokens,
        "completion_tokens": summary.completion_tokens,
        "driver_rss_start_mib": usage.rss_start / MiB,
        "driver_rss_peak_mib": usage.rss_peak / MiB,
        "object_store_peak_mib": None if usage.store_peak is None else usage.store_peak / MiB,
        "load_1min_after": os.getloadavg()[0],  # other work on the machine skews every way
        "leftover_processes": pipeline_overhead.end_leftovers(),
    }


def store_times(path: Path, run_id: str, started_at: float) -> dict[str, Any]:
    """Seconds from `started_at` (the call of run_job) to the first model call of a document's
    chain and of the collection's, to the last call, and to the first and last document planned
    (segmented) and the collection planned; with model calls and tokens planned."""
    is_collection = "source_uri LIKE 'collection:%'"
    with contextlib.closing(sqlite3.connect(path)) as connection:

        def one(query: str) -> tuple[Any, ...]:
            return connection.execute(query, (run_id,)).fetchone()

        def calls(where: str) -> tuple[Any, ...]:
            return one(
                "SELECT min(s.created_at - s.latency_s), max(s.created_at), count(*) "
                "FROM run_chains c JOIN steps s ON s.chain_key = c.chain_key "
                f"WHERE c.run_id = ? AND {where}"
            )

        def planned(where: str) -> tuple[Any, ...]:
            return one(
                "SELECT min(updated_at), max(updated_at), sum(n_tokens), count(*) "
                f"FROM documents WHERE run_id = ? AND {where}"
            )

        documents, collection = calls(f"NOT {is_collection}"), calls(is_collection)
        documents_planned, collection_planned = (
            planned(f"NOT {is_collection}"),
            planned(is_collection),
        )

    def since(at: float | None) -> float | None:
        return None if at is None else at - started_at

    last = max((at for at in (documents[1], collection[1]) if at is not None), default=None)
    return {
        "first_document_call_s": since(documents[0]),
        "first_collection_call_s": since(collection[0]),
        "last_call_s": since(last),
        "last_document_call_s": since(documents[1]),
        "last_collection_call_s": since(collection[1]),
        "document_calls": documents[2],
        "collection_calls": collection[2],
        "first_document_planned_s": since(documents_planned[0]),
        "last_document_planned_s": since(documents_planned[1]),
        "documents_planned": documents_planned[3],
        "document_tokens": documents_planned[2],
        "collection_planned_s": since(collection_planned[0]),
        "collection_tokens": collection_planned[2],
    }


# --- the report ---------------------------------------------------------------------------


def median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric field's median over the repeats; the rest from the first."""
    merged = dict(runs[0])
    for key, value in runs[0].items():
        values = [run[key] for run in runs]
        if isinstance(value, int | float) and not isinstance(value, bool) and None not in values:
            merged[key] = statistics.median(values)
    return merged


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def span(first: float | None, last: float | None) -> str:
    return "-" if first is None else f"{seconds(first)}-{seconds(last)}"


def difference(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def derived(ways: dict[str, dict[str, Any]]) -> dict[str, Any]:
    a, b, c = ways["documents"], ways["both"], ways["collection"]
    # The alternative's earliest collection call: its first member parsed and segmented, as a
    # document's first call comes in (a), where nothing waits for the other documents.
    earliest = a["first_document_call_s"]
    wait = b["first_collection_call_s"]
    return {
        "b_over_a_run_job": ratio(b["run_job_s"], a["run_job_s"]),
        "b_over_a_end_to_end": ratio(b["end_to_end_s"], a["end_to_end_s"]),
        "b_over_a_first_document_call": ratio(
            b["first_document_call_s"], a["first_document_call_s"]
        ),
        "b_over_a_driver_rss_peak": ratio(b["driver_rss_peak_mib"], a["driver_rss_peak_mib"]),
        "b_over_a_object_store_peak": ratio(b["object_store_peak_mib"], a["object_store_peak_mib"]),
        "collection_wait_s": wait,
        "collection_wait_share_of_b": ratio(wait, b["run_job_s"]),
        "alternative_earliest_collection_call_s": earliest,
        "alternative_bound_s": None if wait is None or earliest is None else wait - earliest,
        "alternative_bound_share_of_b": ratio(
            None if wait is None or earliest is None else wait - earliest, b["run_job_s"]
        ),
        "c_first_collection_call_s": c["first_collection_call_s"],
        # materialize() returns once every document is parsed: the barrier
        "b_all_parsed_s": b["materialize_end_s"],
        "b_after_barrier_to_first_document_call_s": difference(
            b["first_document_call_s"], b["materialize_end_s"]
        ),
        "b_after_barrier_to_collection_planned_s": difference(
            b["collection_planned_s"], b["materialize_end_s"]
        ),
        "b_collection_planned_to_first_call_s": difference(
            b["first_collection_call_s"], b["collection_planned_s"]
        ),
    }


ALTERNATIVE = (
    "What the alternative would change (from pipeline/job/graph.py): today a job with "
    "collections materializes every parsed document before either branch goes on, so the "
    "documents' own chains start only once the last document is parsed (not only the "
    "collection's), and the collection is cut by one `map_groups` task that holds all its "
    "members' text at once. Members parsed in parallel and held until the chain reaches them "
    "would let the collection's first call come once its first member is parsed and cut, as a "
    "document's first call does in (a), and would let (b)'s documents stream as in (a). It "
    "cannot make the collection's chain itself shorter: its calls are one after another, one "
    "per segment of every member. So the most it saves a collection is its wait above less "
    "(a)'s time to a first call (the bound); it saves (b) end to end only where the "
    "collection's chain is the run's tail, and then at most that bound."
)


def report(
    args: argparse.Namespace,
    corpus: list[dict[str, Any]],
    ways: dict[str, dict[str, Any]],
    found: dict[str, Any],
    command: str,
) -> str:
    header = ["way", "chains", "model calls (doc / coll)", "run_job s", "Ray start s",
              "materialize s (start-end)", "1st doc call s", "1st coll call s",
              "docs planned s (first-last)",
              "coll planned s", "last call s", "driver RSS peak MiB (start)",
              "object store peak MiB", "1-min load after"]  # fmt: skip
    rows = []
    for way, label in WAYS.items():
        run = ways[way]
        store = run["object_store_peak_mib"]
        rows.append((
            label, f"{run['chains_done']}/{run['chains']}",
            f"{run['document_calls']} / {run['collection_calls']}",
            seconds(run["run_job_s"]), seconds(run["ray_init_s"]),
            span(run["materialize_start_s"], run["materialize_end_s"]),
            seconds(run["first_document_call_s"]), seconds(run["first_collection_call_s"]),
            span(run["first_document_planned_s"], run["last_document_planned_s"]),
            seconds(run["collection_planned_s"]), seconds(run["last_call_s"]),
            f"{run['driver_rss_peak_mib']:.0f} ({run['driver_rss_start_mib']:.0f})",
            "-" if store is None else f"{store:.2f}", f"{run['load_1min_after']:.1f}",
        ))  # fmt: skip
    text_bytes = sum(document["bytes"] for document in corpus)
    words = sum(document["words"] for document in corpus)

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    def share(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    notes = []
    if any(run["chains_failed"] or run["errors"] or run["chains_done"] != run["chains"]
           for run in ways.values()):  # fmt: skip
        notes.append("**Some chains failed or some documents are errors rows: not comparable.**")
    if leftovers := sum(run["leftover_processes"] for run in ways.values()):
        notes.append(
            f"**{leftovers} process(es) of a job's Ray session were still running 30 s after "
            "it returned; the benchmark ended them.**"
        )
    b_tokens = ways["both"]["collection_tokens"]
    return "\n".join([
        f"Collection barrier: {len(corpus)} text documents of {MIN_WORDS:,}-{MAX_WORDS:,} words "
        f"({words:,} words, {text_bytes / MiB:.2f} MiB of parsed text; the collection "
        f"{b_tokens or 0:,} tokens), `run_job` on a fresh local Ray session and SQLite store per "
        f"way, the fake engine's replies over HTTP (bench/openai_stub.py, no delay), "
        f"{MODEL}'s tokenizer, memagent-reference, chunk {args.chunk_size}, memory "
        f"{args.max_memory_tokens}; median of {args.repeats} run(s) of each way"
        f"{', after an unmeasured warm-up job' if args.warmup else ''}",
        "",
        f"Command: `{command}`",
        "",
        *common.table(header, rows),
        "",
        f"- (b) / (a): run_job {times(found['b_over_a_run_job'])}, end to end with Ray's "
        f"start {times(found['b_over_a_end_to_end'])}, time to the first document call "
        f"{times(found['b_over_a_first_document_call'])}, driver RSS peak "
        f"{times(found['b_over_a_driver_rss_peak'])}, object store peak "
        f"{times(found['b_over_a_object_store_peak'])}.",
        f"- The collection's wait for the barrier in (b), from `run_job`'s call to its first "
        f"model call: {seconds(found['collection_wait_s'])} s, "
        f"{share(found['collection_wait_share_of_b'])} of (b)'s run_job time "
        f"({seconds(found['c_first_collection_call_s'])} s in (c)).",
        f"- (b)'s barrier: `materialize()` returned, every document parsed, at "
        f"{seconds(found['b_all_parsed_s'])} s; then "
        f"{seconds(found['b_after_barrier_to_first_document_call_s'])} s to a document's "
        "first call (the memory actor and the segment stage start only "
        f"then), {seconds(found['b_after_barrier_to_collection_planned_s'])} s to the "
        "collection planned (`groupby`: its shuffle and the one task that cuts the whole "
        f"collection) and {seconds(found['b_collection_planned_to_first_call_s'])} s more to "
        "its first call.",
        f"- The bound on what the alternative could save: that wait less (a)'s time to a "
        f"document's first call ({seconds(found['alternative_earliest_collection_call_s'])} s): "
        f"{seconds(found['alternative_bound_s'])} s, "
        f"{share(found['alternative_bound_share_of_b'])} of (b)'s run_job time.",
        f"- Parsed text held: {text_bytes:,} bytes (UTF-8) of the documents, all in Ray's "
        "object store at once in (b) and (c) (`materialize()`), and all in the memory of the "
        "one task that cuts the collection.",
        "",
        "Times are seconds from the call of `run_job` (Ray already started; its start is "
        "`Ray start s`): a chain's first model call is `steps.created_at - latency_s`, a "
        "document planned is its `documents` row written by the segment stage (in (b) and (c) "
        "only once every document is parsed), the collection planned is its row written by "
        "the collection stage after the `groupby`; materialize is the driver's call of "
        "`Dataset.materialize()` (timed by wrapping it). Driver RSS: this process alone, sampled "
        f"every {args.sample_s} s; object store: Ray's bytes in use, sampled alike.",
        "",
        ALTERNATIVE,
        *[line for note in notes for line in ("", note)],
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100, help="N, the collection's size")
    parser.add_argument("--chunk-size", type=int, default=2000)
    parser.add_argument("--max-memory-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each way, in turn")
    parser.add_argument("--sample-s", type=float, default=0.25, help="RSS and store sampling")
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first a job over 3 documents, not measured (a process's first Ray session is "
        "slower to start)",
    )
    parser.add_argument("--quick", action="store_true", help="10 documents (bench/run.py --quick)")
    args = parser.parse_args()
    if args.quick:
        args.documents = 10
    if args.documents < 1 or args.repeats < 1:
        parser.error("--documents and --repeats must be at least 1")
    command = shlex.join(
        [os.path.relpath(sys.executable), os.path.relpath(sys.argv[0]), *sys.argv[1:]]
    )
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="bench-barrier-") as temporary, stub_server() as url:
        corpus_folder = Path(temporary) / "corpus"
        corpus = write_corpus(corpus_folder, args.documents)
        if args.warmup:  # the first Ray session of a process starts slower: not measured
            warm = write_corpus(Path(temporary) / "warmup", min(3, args.documents))
            run = timed_job("both", Path(temporary) / "warmup", url, args)
            print(f"warm-up ({len(warm)} documents, both): {run['run_job_s']:.1f} s", flush=True)
        for repeat in range(args.repeats):
            order = list(WAYS)[repeat % 3 :] + list(WAYS)[: repeat % 3]  # each way first in turn
            for way in order:
                run = timed_job(way, corpus_folder, url, args)
                runs[way].append(run)
                print(
                    f"{way}: run_job {run['run_job_s']:.1f} s, first document call "
                    f"{seconds(run['first_document_call_s'])} s, first collection call "
                    f"{seconds(run['first_collection_call_s'])} s",
                    flush=True,
                )
    ways = {way: median_runs(done) for way, done in runs.items()}
    found = derived(ways)
    common.write_results(
        "collection_barrier",
        {"args": vars(args), "command": command, "model_tokenizer": MODEL,
         "questions": {"document": QUESTION, "collection": COLLECTION_QUESTION},
         "corpus": corpus, "parsed_text_bytes": sum(d["bytes"] for d in corpus),
         "ways": ways, "runs": runs, "derived": found, "alternative": ALTERNATIVE},
        report(args, corpus, ways, found, command),
    )  # fmt: skip


if __name__ == "__main__":
    main()
