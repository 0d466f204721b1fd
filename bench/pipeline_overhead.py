"""Pipeline overhead: the Ray Data corpus job against the ChainRunner alone, on one corpus.

By default real PDFs of ../shared/corpora (the two contracts, the DMCA summary, a damaged PDF
and an encrypted one, which becomes an `errors` row) and two questions; with --quick, three
short documents of real text written to a temporary folder as .txt files and one question; with
--sources, the given files, folders or globs and the --question(s). They are answered
(a) in this process: read and parse the files, tokenize, start one engine, run every chain at
once with the ChainRunner; and (b) by `pipeline.job.run_job` on a fresh local Ray session:
listing, read and parse tasks, segment tasks, the memory actor with its own engine, checkpoints
in SQLite, Parquet export. Same model, method and engine settings; the runner goes first, then
the job, never both at once.

End to end counts everything each path needs (for the job: Ray start-up and shutdown too);
steady state counts from the first model call to the last (the job's `busy_s`).

    .venv/bin/python bench/pipeline_overhead.py [--quick]
    .venv/bin/python bench/pipeline_overhead.py --sources ../shared/corpora/pdfs \
        ../shared/corpora/text '../shared/corpora/logs/*/*.log' --question Q1 --question Q2 \
        --chunk-size 5000 --max-memory-tokens 256 --template segment-first
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import common
import psutil

from connectors.engines.vllm_local import VLLMEngine, VLLMEngineConfig
from connectors.local import expand_paths
from operators.config import MethodConfig
from operators.runner import ChainRunner
from pipeline.ask import prepare
from pipeline.cli.ask import read_documents
from pipeline.job import JobSpec, run_job

PDFS = common.CORPORA / "pdfs"
REAL_SOURCES = [
    str(PDFS / "contracts"),
    str(PDFS / "reports" / "copyright-office-dmca-summary-1998.pdf"),
    str(PDFS / "bad" / "corrupted-zen_of_python.pdf"),
    str(PDFS / "bad" / "encrypted-userpw-openpassword.pdf"),
]
REAL_QUESTIONS = [
    "What is this document about, in one sentence?",
    "Which organization, person or system does this document mention most?",
]
QUICK_QUESTION = "What is this document about?"
# Marks this run's Ray processes, which leave this process tree once the session is shut down.
MARKER = ("MEMSTREAM_BENCH_RUN", uuid.uuid4().hex)
os.environ[MARKER[0]] = MARKER[1]


async def run_in_process(
    config: VLLMEngineConfig, sources: list[str], questions: list[str], method: MethodConfig
) -> dict[str, Any]:
    started = time.perf_counter()
    tokenizer = common.load_tokenizer(config)
    readable, _unreadable = read_documents(list(expand_paths(sources)))
    documents = [prepare(document, questions, tokenizer, method) for document in readable]
    chains = [chain for document in documents for chain in document.chains]
    engine = VLLMEngine(config)
    try:
        runner = ChainRunner(engine, method.sampling(), max_active_chains=64)
        run = await common.timed_run(runner, chains)
        seconds = time.perf_counter() - started
    finally:
        await engine.shutdown()
    return throughput(run["processed_tokens"], len(chains) - run["failed"], seconds, run["seconds"])


def run_ray_job(
    args: Any, sources: list[str], questions: list[str], output: Path, method: MethodConfig
) -> dict[str, Any]:
    config = common.engine_config(args)
    spec = JobSpec.from_dict({
        "sources": sources,
        "questions": questions,
        "output": str(output),
        "engine": {"model": args.model, "max_model_len": config.max_model_len,
                   "enforce_eager": True, "cpu_kvcache_space_gib": config.cpu_kvcache_space_gib},
        "method": method.as_dict(),
        "ray_address": "local",  # a fresh local session, started and stopped inside the timing
    })  # fmt: skip
    summary = run_job(spec)
    measured = throughput(summary.tokens, summary.chains_worked, summary.elapsed_s, summary.busy_s)
    return {
        **measured,
        "chains_failed": summary.chains_failed,
        "documents_failed": summary.documents_failed,
        "leftover_processes": end_leftovers(),
    }


def generated_corpus(folder: Path, args: Any, config: VLLMEngineConfig) -> Path:
    folder.mkdir()
    lengths = [int(n) for n in args.lengths.split(",")]
    for doc_id, text in common.documents_of_lengths(common.load_tokenizer(config), lengths):
        (folder / f"{doc_id}.txt").write_text(text)
    return folder


def end_leftovers(grace_s: float = 30.0) -> int:
    """Ends this run's processes still alive `grace_s` after the job returned (a memory-stage
    actor whose engine did not shut down, say); returns how many there were."""
    deadline = time.monotonic() + grace_s
    while (left := marked_processes()) and time.monotonic() < deadline:
        time.sleep(1)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    for process in psutil.wait_procs(left, timeout=20)[1]:
        with contextlib.suppress(psutil.Error):
            process.kill()
    return len(left)


def marked_processes() -> list[psutil.Process]:
    mine = {psutil.Process().pid, *(p.pid for p in psutil.Process().children(recursive=True))}
    marked = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid not in mine and process.environ().get(MARKER[0]) == MARKER[1]:
                marked.append(process)
    return marked


def throughput(tokens: int, chains: int, seconds: float, busy_s: float) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "chains": chains,
        "seconds": seconds,
        "busy_s": busy_s,
        "tokens_per_s": tokens / seconds,
        "chains_per_s": chains / seconds,
        "busy_tokens_per_s": tokens / busy_s,
        "busy_chains_per_s": chains / busy_s,
        "load_1min_after": os.getloadavg()[0],  # other work on the machine skews both paths
    }


def main() -> None:
    parser = common.bench_parser(__doc__)
    corpus = parser.add_mutually_exclusive_group()
    corpus.add_argument("--lengths", help="documents of real text of these token lengths")
    corpus.add_argument("--sources", nargs="+", help="files, folders or globs")
    parser.add_argument("--question", action="append", dest="questions", metavar="Q")
    parser.add_argument("--template", default="memagent-reference")
    args = parser.parse_args()
    if args.quick and not (args.sources or args.lengths):
        args.lengths = "1000,1500,2000"
    if not args.lengths:
        args.sources = args.sources or REAL_SOURCES
    questions = args.questions or ([QUICK_QUESTION] if args.quick else REAL_QUESTIONS)
    method = common.bench_method(args, args.template)
    config = common.engine_config(args)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as temporary:
        sources = args.sources or [str(generated_corpus(Path(temporary) / "corpus", args, config))]
        runner = asyncio.run(run_in_process(config, sources, questions, method))
        print(f"runner: {runner['seconds']:.1f} s", flush=True)
        job = run_ray_job(args, sources, questions, Path(temporary) / "output", method)
        print(f"job: {job['seconds']:.1f} s", flush=True)
    ratios = {key: job[key] / runner[key] for key in ("tokens_per_s", "busy_tokens_per_s")}
    cells = [
        (name, r["chains"], r["tokens"], f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.0f}",
         f"{r['chains_per_s']:.3f}", f"{r['busy_s']:.1f}", f"{r['busy_tokens_per_s']:.0f}",
         f"{r['busy_chains_per_s']:.3f}", f"{r['load_1min_after']:.1f}")
        for name, r in (("ChainRunner in process", runner), ("Ray Data job", job))
    ]  # fmt: skip
    header = ["path", "chains", "tokens", "end-to-end s", "tokens/s", "chains/s",
              "steady s", "steady tokens/s", "steady chains/s", "1-min load after"]  # fmt: skip
    notes = []
    if job["documents_failed"]:
        notes.append(
            f"{job['documents_failed']} input(s) could not be read or parsed: rows of the job's "
            "`errors` table; the runner skips them too."
        )
    if job["chains_failed"]:
        notes.append(f"**{job['chains_failed']} chain(s) of the job failed.**")
    if job["leftover_processes"]:
        notes.append(
            f"**{job['leftover_processes']} process(es) of the job's Ray session (its memory-stage "
            "actor and engine) were still running 30 s after `run_job` returned; the benchmark "
            "ended them.**"
        )
    corpus = (
        f"the documents of {' '.join(os.path.relpath(s, common.REPO) for s in args.sources)}"
        if args.sources
        else f"documents of {args.lengths} tokens of real text"
    )  # fmt: skip
    markdown = "\n".join([
        f"Pipeline overhead, {args.model}, {corpus}, {len(questions)} question(s), "
        f"{args.template}, chunk {args.chunk_size}, memory {args.max_memory_tokens} tokens, "
        f"{config.dtype}, eager, one engine each, one after the other",
        "",
        *common.table(header, cells),
        "",
        f"job / runner tokens/s: **{ratios['tokens_per_s']:.2f}x** end to end, "
        f"**{ratios['busy_tokens_per_s']:.2f}x** steady state.",
        "",
        "End to end: the runner from reading the files to the last answer (engine start-up "
        "included, shutdown not); the job from `run_job` to its return (Ray start-up, engine "
        "start-up, Parquet export and Ray shutdown included). Steady: first model call to last.",
        *[line for note in notes for line in ("", note)],
    ])  # fmt: skip
    common.write_results(
        "pipeline_overhead",
        {"args": vars(args), "runner": runner, "job": job, "ratios": ratios},
        markdown,
    )


if __name__ == "__main__":
    main()
