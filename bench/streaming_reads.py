"""Streaming reads: the driver's memory while the corpus job reads, parses and segments.

Two corpora, each through the job's own stages (pipeline.job.graph.read_sources, ReadParseStage,
SegmentStage: the real tokenizer, a real SQLite state store) but without the memory stage, so
no model runs; the driver takes each plan as a row of counts, as the job takes the memory
stage's small rows:

(a) `sql`: an SQLite table of --sql-rows documents of --sql-chars characters of real text
    (default 20,000 x 50,000: 1 GB), read in --read-tasks hash shards;
(b) `s3`: an S3 prefix on SeaweedFS (connectors/seaweedfs.py) of --s3-objects small
    objects (default 100,000 of about 1.5 KB of real text; every 100th with a sidecar question
    file), listed page by page in a read task and fetched through pyarrow.

The driver's RSS (psutil, this process alone) is sampled every 0.5 s; reported are its peak,
its rise over the RSS at the start of the stream, and the curve's flatness: the spread of the
samples after the first tenth of the run and their least-squares slope.

`before` variants run main's way of reading (every item listed on the driver, `list_items`,
then `ray.data.from_items`) on --before-fraction of each corpus; `s3-binary` runs
`ray.data.read_binary_files` with a pyarrow S3FileSystem over the same 100,000 objects (read
and parse only), the other candidate for S3.

    .venv/bin/python bench/streaming_reads.py [--quick] [--only sql,s3,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import common  # noqa: E402

from connectors import S3Source, SqlSource  # noqa: E402
from connectors.engines.factory import EngineSpec  # noqa: E402
from connectors.engines.fake import word_tokenizer  # noqa: E402
from connectors.state.store import StateStore  # noqa: E402
from operators.config import MethodConfig  # noqa: E402
from pipeline.job.graph import read_sources  # noqa: E402
from pipeline.stages.read import ReadParseStage  # noqa: E402
from pipeline.stages.run import Question, RunContext  # noqa: E402
from pipeline.stages.segment import SegmentStage  # noqa: E402

NOTES = [
    "How to read it:",
    "",
    "- `s3`, `sql` (read, parse): the job's read (`connectors/reading.py`) at full scale. "
    "The S3 prefix is one shard, listed page by page inside its read task, objects fetched "
    "there with 8 threads through pyarrow's S3FileSystem; SQLite is read in 2 hash shards "
    "through server-side cursors. The driver holds neither the listing nor any text.",
    "- `s3 before (main), listing + from_items`: what main's driver holds before any document "
    "is read (`list_items` then `from_items`, drained by a map that only counts): the rise "
    "is the listing of 100,000 references; main's SQL and dataset items carry their text "
    "inline in that list, so for the 1 GB table the list alone is the corpus (see the "
    "`sql ... before` pair: same rows, main's way against this branch's).",
    "- `s3 read_binary_files`: the other candidate for S3. Ray lists every path on the "
    "driver when the dataset is made (its rise, over a heap the previous run had already "
    "grown, so a lower bound), then streams flat; it would also read sidecar question files "
    "as documents and give no ETags, so the job uses its own datasource.",
    "- `before` and `after` pairs through segment use connectors/engines/fake.py's WordTokenizer "
    "(`--tokenizer word`) so that they finish on a shared two-core machine: the driver's "
    "memory does not depend on the tokenizer, which runs in the tasks.",
    "- Ray keeps task results under 100 KiB in the driver's memory store (Ray's "
    "max_direct_call_object_size); the read cuts blocks at about 1 MiB of content, so "
    "document text goes to the object store, and only a shard's last block can be small.",
]
MODEL = "smollm2-135m-instruct"
QUESTION = "What is this document about?"
MiB = 1 << 20


# --- the driver's RSS ---------------------------------------------------------------------


class RssCurve(common.Sampler):
    """The driver's RSS every `interval_s`."""

    def __init__(self, interval_s: float = 0.5) -> None:
        super().__init__(interval_s)
        self.samples: list[tuple[float, int]] = []
        self._process = psutil.Process()

    def sample(self) -> None:
        rss = self._process.memory_info().rss
        self.samples.append((time.perf_counter() - self.started_at, rss))

    def summary(self, baseline: int) -> dict[str, Any]:
        times = [t for t, _ in self.samples]
        values = [v for _, v in self.samples]
        settled = [(t, v) for t, v in self.samples if t >= times[-1] / 10] or self.samples
        slope = _slope(settled)
        return {
            "samples": len(values),
            "baseline_mib": round(baseline / MiB, 1),
            "peak_mib": round(max(values) / MiB, 1),
            "rise_mib": round((max(values) - baseline) / MiB, 1),
            "settled_spread_mib": round(
                (max(v for _, v in settled) - min(v for _, v in settled)) / MiB, 1
            ),
            "settled_slope_mib_per_min": round(slope * 60 / MiB, 2),
            "median_mib": round(statistics.median(values) / MiB, 1),
            "curve_mib": _thin([(round(t, 1), round(v / MiB, 1)) for t, v in self.samples]),
        }


def _slope(points: list[tuple[float, int]]) -> float:
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    num = sum((t - mean_t) * (v - mean_v) for t, v in points)
    den = sum((t - mean_t) ** 2 for t, _ in points)
    return num / den if den else 0.0


def _thin(points: list[Any], keep: int = 60) -> list[Any]:
    step = max(1, len(points) // keep)
    return points[::step] + ([points[-1]] if (len(points) - 1) % step else [])


# --- the corpora --------------------------------------------------------------------------


def make_sql(path: Path, rows: int, chars: int) -> None:
    text = common.real_text(chars * 4)
    span = len(text) - chars
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, title TEXT, body TEXT)")
    batch = []
    for number in range(rows):
        offset = (number * 7919) % span
        batch.append((number, f"doc-{number}.txt", f"Document {number}.\n" + text[offset:][:chars]))
        if len(batch) == 500:
            connection.executemany("INSERT INTO docs VALUES (?, ?, ?)", batch)
            batch = []
    connection.executemany("INSERT INTO docs VALUES (?, ?, ?)", batch)
    connection.commit()
    connection.close()


def fill_bucket(server: Any, bucket: str, objects: int, chars: int = 1500) -> None:
    text = common.real_text(chars * 50)
    client = server.client()
    client.create_bucket(Bucket=bucket)

    def put(number: int) -> None:
        offset = (number * 104729) % (len(text) - chars)
        key = f"docs/{number // 1000:03d}/doc-{number:06d}.txt"
        client.put_object(Bucket=bucket, Key=key, Body=text[offset : offset + chars].encode())
        if number % 100 == 0:
            client.put_object(
                Bucket=bucket, Key=f"{key}.questions.txt", Body=f"What is in {number}?".encode()
            )

    with ThreadPoolExecutor(16) as pool:
        for _ in pool.map(put, range(objects)):
            pass


@contextmanager
def s3_server(folder: Path) -> Iterator[Any]:
    from connectors.seaweedfs import SeaweedFS

    weed = SeaweedFS(folder)
    weed.start()
    server = weed.server
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(
        AWS_ACCESS_KEY_ID=server.access_key,
        AWS_SECRET_ACCESS_KEY=server.secret_key,
        AWS_DEFAULT_REGION=server.region,
        AWS_EC2_METADATA_DISABLED="true",
    )
    try:
        yield server
    finally:
        weed.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --- the stages ---------------------------------------------------------------------------


def run_context(store_url: str, run_id: str) -> RunContext:
    store = StateStore(store_url)
    store.migrate()
    attempt = store.begin_run(run_id, {"bench": "streaming_reads"}).attempt
    spec = EngineSpec(model=MODEL, dtype="float32")
    return RunContext(run_id, attempt, store_url, spec, MethodConfig(), (Question("q0", QUESTION),))


class WordSegmentStage(SegmentStage):
    """The segment stage with connectors/engines/fake.py's WordTokenizer (one token a word) in place
    of the model's: the same segmentation, plans and state store writes, without the cost of
    tokenizing a gigabyte on a shared two-core machine (--tokenizer word)."""

    def __init__(self, run: RunContext) -> None:
        super().__init__(run, tokenizer_factory=word_tokenizer)


TOKENIZER: dict[str, Any] = {"stage": SegmentStage}
STAGES_SHOWN = {False: "read, parse, segment", True: "read, parse"}


def counts(plans: pa.Table) -> pa.Table:
    """What the driver takes of a plan: counts, as the job takes the memory stage's rows."""
    return pa.table(
        {
            "n_tokens": plans.column("n_tokens"),
            "segments": pa.array([len(s or ()) for s in plans.column("segments").to_pylist()]),
        }
    )


def parsed_counts(documents: pa.Table) -> pa.Table:
    """What the driver takes of a parsed document (--stages parse)."""
    chars = [len(text) for text in documents.column("text").to_pylist()]
    return pa.table({"n_tokens": pa.array([None] * len(chars), pa.int64()), "chars": chars})


def stages(dataset: Any, sources: list[Any], run: RunContext, read_tasks: int) -> Any:
    from ray.data import TaskPoolStrategy

    compute = TaskPoolStrategy(size=read_tasks)
    dataset = dataset.map_batches(
        ReadParseStage(sources, run), batch_format="pyarrow", batch_size=1, compute=compute,
        num_cpus=0.5,
    )  # fmt: skip
    if TOKENIZER.get("parse_only"):
        return dataset.map_batches(
            parsed_counts, batch_format="pyarrow", batch_size=None, compute=compute
        )
    dataset = dataset.map_batches(
        TOKENIZER["stage"](run), batch_format="pyarrow", batch_size=1, compute=compute,
        num_cpus=0.5,
    )  # fmt: skip
    return dataset.map_batches(counts, batch_format="pyarrow", batch_size=None, compute=compute)


def streaming(sources: list[Any], run: RunContext, read_tasks: int) -> Any:
    return stages(read_sources(sources, read_tasks), sources, run, read_tasks)


def before(sources: list[Any], run: RunContext, read_tasks: int) -> Any:
    """main's read: every item listed on the driver (pipeline.job.list_items there), shipped
    with from_items, one block per item up to 2,000 (MAX_INPUT_BLOCKS there)."""
    import ray

    rows = listed_rows(sources)
    dataset = ray.data.from_items(rows, override_num_blocks=min(len(rows), 2000))
    return stages(dataset, sources, run, read_tasks)


def listed_rows(sources: list[Any]) -> list[dict[str, Any]]:
    """Every document of the sources, listed on the driver, as rows of the read stage."""
    return [
        replace(document, source_index=index).to_row()
        for index, source in enumerate(sources)
        for document in source.documents()
    ]


def listing_only(sources: list[Any], read_tasks: int) -> Any:
    """main's listing and from_items, drained with a map that only counts (no read, no
    parse): what main's driver holds for the corpus before any document is read."""
    import ray

    rows = listed_rows(sources)
    dataset = ray.data.from_items(rows, override_num_blocks=min(len(rows), 2000))
    return dataset.map_batches(
        lambda batch: pa.table({"n": [batch.num_rows]}), batch_format="pyarrow",
        batch_size=None,
    )  # fmt: skip


def binary_files(server: Any, uri: str, read_tasks: int, limit: int) -> Any:
    """ray.data.read_binary_files over the prefix with pyarrow's S3 filesystem, then parse."""
    import pyarrow.fs as pafs
    import ray

    from operators.parsing import parse_document

    filesystem = pafs.S3FileSystem(endpoint_override=server.endpoint_url)

    def parse(batch: pa.Table) -> pa.Table:
        chars = []
        for path, data in zip(batch["path"].to_pylist(), batch["bytes"].to_pylist(), strict=True):
            chars.append(len(parse_document(data, path.rsplit("/", 1)[-1]).text))
        return pa.table({"chars": pa.array(chars, pa.int64())})

    dataset = ray.data.read_binary_files(
        uri.removeprefix("s3://"), filesystem=filesystem, include_paths=True
    )
    from ray.data import TaskPoolStrategy

    return dataset.limit(limit).map_batches(
        parse, batch_format="pyarrow", batch_size=64, compute=TaskPoolStrategy(size=read_tasks)
    )


def measure(name: str, build: Callable[[], Any], documents: int) -> dict[str, Any]:
    """Builds the dataset (the listing counts for `before`) and drains it on the driver."""
    name = f"{name} [{STAGES_SHOWN[TOKENIZER.get('parse_only', False)]}]"
    baseline = psutil.Process().memory_info().rss
    started = time.perf_counter()
    rows = tokens = 0
    with RssCurve() as curve:
        dataset = build()
        for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
            rows += batch.num_rows
            if "n_tokens" in batch.column_names:
                tokens += sum(n or 0 for n in batch.column("n_tokens").to_pylist())
    seconds = time.perf_counter() - started
    result = {
        "name": name,
        "documents": documents,
        "rows_out": rows,
        "tokens": tokens,
        "seconds": round(seconds, 1),
        "documents_per_s": round(documents / seconds, 1),
        **curve.summary(baseline),
    }
    shown = {k: v for k, v in result.items() if k != "curve_mib"}
    print(json.dumps(shown), flush=True)
    return result


# --- the report ---------------------------------------------------------------------------


def cpu() -> dict[str, Any]:
    model = platform.processor() or "cpu"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "cpu", platform.machine()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "model": model,
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "cores": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def markdown(payload: dict[str, Any]) -> str:
    machine = payload["cpu"]
    lines = [
        "# Streaming reads: the driver's RSS through read, parse and segment",
        "",
        f"{payload['date']}, {machine['model']} (avx2: {machine['avx2']}, avx512f: "
        f"{machine['avx512f']}), {machine['cores']} cores, {machine['memory_gib']} GiB; load "
        f"average at the start {machine['load_average_at_start']} (a vLLM evaluation shared "
        f"the machine). ray {payload['ray']}, pyarrow {pa.__version__}; each run names the "
        "commit and the arguments it ran with (`python bench/streaming_reads.py ...`).",
        "",
        "The job's stages without the memory stage (no model): read -> parse -> segment + plan "
        "(the tokenizer of the column: `model`, the model's; `word`, connectors/engines/fake.py's; "
        "a real SQLite state store), or read -> parse only where the run says so, the driver "
        "taking one row of counts per document. RSS is the driver process alone (psutil, every "
        "0.5 s); the rise is over its RSS when the run starts (Ray already up, the corpora "
        "written by child processes); spread and slope are over the samples after the first "
        "tenth of the run. The runs of one invocation share a driver process, in the order "
        "shown: a run's baseline is what the runs before it left, so compare the rises.",
        "",
    ]
    lines += common.table(
        ["run", "tokenizer", "commit", "documents", "time (s)", "docs/s", "peak RSS (MiB)",
         "rise (MiB)", "spread after 10% (MiB)", "slope (MiB/min)"],
        [
            (r["name"], "-" if r.get("stages") == "parse" else r.get("tokenizer", ""),
             r.get("commit", ""), f"{r['documents']:,}",
             r["seconds"],
             r["documents_per_s"], r["peak_mib"], r["rise_mib"], r["settled_spread_mib"],
             r["settled_slope_mib_per_min"])
            for r in payload["runs"]
        ],
    )  # fmt: skip
    lines += ["", *payload.get("notes", [])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sql-rows", type=int, default=20_000)
    parser.add_argument("--sql-chars", type=int, default=50_000)
    parser.add_argument("--s3-objects", type=int, default=100_000)
    parser.add_argument("--before-fraction", type=float, default=0.1)
    parser.add_argument("--s3-before-objects", type=int, default=2_000)
    parser.add_argument("--sql-segment-rows", type=int, default=0, help="rows of the sql run")
    parser.add_argument("--binary-limit", type=int, default=20_000)
    parser.add_argument("--tokenizer", choices=["model", "word"], default="model")
    parser.add_argument(
        "--stages", choices=["segment", "parse"], default="segment",
        help="parse: read -> parse only (the segment stage left out too)",
    )  # fmt: skip
    parser.add_argument("--append", action="store_true", help="add to the results written")
    parser.add_argument("--read-tasks", type=int, default=2)
    parser.add_argument("--only", default="sql,s3,sql-before,s3-before,s3-before-listing,s3-binary")
    parser.add_argument("--quick", action="store_true", help="1/100 of the sizes")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the .md from the .json, run nothing"
    )
    args = parser.parse_args()
    if args.report_only:
        payload = json.loads((common.RESULTS / "streaming_reads.json").read_text())
        payload["notes"] = NOTES
        (common.RESULTS / "streaming_reads.json").write_text(json.dumps(payload, indent=2) + "\n")
        (common.RESULTS / "streaming_reads.md").write_text(markdown(payload) + "\n")
        return
    if args.quick:
        args.sql_rows, args.s3_objects = args.sql_rows // 100, args.s3_objects // 100
    wanted = args.only.split(",")
    if args.tokenizer == "word":
        TOKENIZER["stage"] = WordSegmentStage
    TOKENIZER["parse_only"] = args.stages == "parse"

    import ray

    machine = cpu()
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    earlier: list[dict[str, Any]] = []
    if args.append and (common.RESULTS / "streaming_reads.json").exists():
        earlier = json.loads((common.RESULTS / "streaming_reads.json").read_text())["runs"]
    runs: list[dict[str, Any]] = []

    def save() -> None:
        """The results so far (a run that is stopped keeps the runs it finished)."""
        for run in runs:
            run.setdefault("tokenizer", args.tokenizer)
            run.setdefault("stages", args.stages)
            run.setdefault("commit", commit)
            run.setdefault("arguments", " ".join(sys.argv[1:]))
        payload = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "cpu": machine,
            "ray": ray.__version__,
            "commit": commit,
            "arguments": " ".join(sys.argv[1:]),
            "runs": earlier + runs,
            "notes": NOTES,
        }
        if args.no_write:
            print(markdown(payload))
        else:
            common.write_results("streaming_reads", payload, markdown(payload))

    stack = contextlib.ExitStack()
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="memstream-bench-")))
    server = None
    fills = []
    # The corpora are written by child processes, before Ray starts: the driver's heap is not
    # grown by writing them (which would hide what the runs add).
    fork = multiprocessing.get_context("fork")
    if any(name.startswith("s3") for name in wanted):  # first: Ray's workers get its credentials
        (folder / "s3").mkdir()
        server = stack.enter_context(s3_server(folder / "s3"))
        fills.append(fork.Process(target=fill_bucket, args=(server, "bench", args.s3_objects)))
    if any(name.startswith("sql") for name in wanted):
        fills.append(
            fork.Process(
                target=make_sql, args=(folder / "docs.sqlite", args.sql_rows, args.sql_chars)
            )
        )
    started = time.perf_counter()
    for fill in fills:
        fill.start()
    for fill in fills:
        fill.join()
        if fill.exitcode:
            raise SystemExit(f"a corpus could not be written (exit {fill.exitcode})")
    print(f"corpora: {time.perf_counter() - started:.0f} s", flush=True)
    ray.init(
        num_cpus=2,
        object_store_memory=2 << 30,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    with stack:
        store = f"sqlite:///{folder / 'state.sqlite'}"
        if server is not None:
            source = S3Source("s3://bench/docs/", endpoint_url=server.endpoint_url)
            if "s3" in wanted:
                run = run_context(store, "bench-s3")
                runs.append(measure(
                    f"s3: {args.s3_objects:,} objects",
                    lambda: streaming([source], run, args.read_tasks), args.s3_objects,
                ))  # fmt: skip
                save()
            if "s3-before-listing" in wanted:
                runs.append(measure(
                    f"s3 before (main), listing + from_items, counted only: {args.s3_objects:,}",
                    lambda: listing_only([source], args.read_tasks), args.s3_objects,
                ))  # fmt: skip
                save()
            if "s3-binary" in wanted:
                limit = min(args.binary_limit, args.s3_objects)
                runs.append(measure(
                    f"s3 read_binary_files over {args.s3_objects:,} objects, first {limit:,} "
                    "read + parsed",
                    lambda: binary_files(server, "s3://bench/docs/", args.read_tasks, limit),
                    limit,
                ))  # fmt: skip
                save()
            if "s3-before" in wanted:
                part = min(args.s3_before_objects, args.s3_objects)
                prefixes = sorted({f"docs/{n // 1000:03d}/" for n in range(part)})
                small = [
                    S3Source(f"s3://bench/{prefix}", endpoint_url=server.endpoint_url)
                    for prefix in prefixes
                ]
                for name, build in (("after", streaming), ("before (main)", before)):
                    run = run_context(store, f"bench-s3-{name[:5]}-small")
                    runs.append(measure(
                        f"s3 {name}: {part:,} objects",
                        lambda build=build, run=run: build(small, run, args.read_tasks), part,
                    ))  # fmt: skip
                    save()
        if any(name.startswith("sql") for name in wanted):
            url = f"sqlite:///{folder / 'docs.sqlite'}"
            if "sql" in wanted:
                rows = min(args.sql_segment_rows or args.sql_rows, args.sql_rows)
                query = f"SELECT id, title, body FROM docs WHERE id < {rows}"
                full = [SqlSource(url, query, text_column="body", name_column="title")]
                run = run_context(store, "bench-sql")
                runs.append(measure(
                    f"sql: {rows:,} x {args.sql_chars // 1000} KB",
                    lambda: streaming(full, run, args.read_tasks), rows,
                ))  # fmt: skip
                save()
            if "sql-before" in wanted:
                part = int(args.sql_rows * args.before_fraction)
                query = f"SELECT id, title, body FROM docs WHERE id < {part}"
                small = [SqlSource(url, query, text_column="body", name_column="title")]
                for name, build in (("after", streaming), ("before (main)", before)):
                    run = run_context(store, f"bench-sql-{name[:5]}-small")
                    runs.append(measure(
                        f"sql {name}: {part:,} x {args.sql_chars // 1000} KB",
                        lambda build=build, run=run: build(small, run, args.read_tasks), part,
                    ))  # fmt: skip
                    save()
    ray.shutdown()


if __name__ == "__main__":
    main()
