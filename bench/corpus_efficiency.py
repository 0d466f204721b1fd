"""Corpus efficiency: how well a mixed-length corpus keeps one engine busy, driven four ways.

A corpus of real text with log-normal document lengths (a few long documents, many short ones,
as a real archive has), one to three questions per document, drawn with a pinned seed. The same
corpus is answered, one run after the other in one process, never two engines at once:

1. the ChainRunner in process, longest-first: every chain submitted at once in source order;
   each request carries its chain's document tokens still to read as its vLLM priority;
2. the ceiling: every request of run 1 replayed at once on the same engine, as if no step
   waited for the one before (greedy decoding makes it the same work);
3. the runner again, in source order (`longest_first=False`), and in that order reversed: a
   drawn order can put the longest document anywhere (the pinned one puts it second), and an
   archive whose big files sort last is the case longest-first is for;
4. the Ray Data job (`pipeline.job.run_job`) on a fresh local Ray session, as a user's runs:
   one memory actor (at nice 0, its read and parse tasks at Ray's 15), longest-first, every
   document in flight at once, checkpoints in SQLite, Parquet export;
5. the longest chain alone: a schedule's makespan can be no shorter, and the runner's, set
   beside it and the ceiling, says how much the other chains slow it down.

At most `--max-active-chains` chains read at once (256: the whole corpus); fewer make the
order in which chains are admitted matter, as it does in an archive larger than the window.

Runs 1 and 4 count every process's CPU seconds by what it is (the engine, Ray's daemons, the
memory actor, task workers, the driver): where the job's time beside the runner's goes.

Runs 1-3 and 5 share one engine, started and warmed up before them (start-up excluded) and with its
prefix cache reset before each run. The job's end-to-end figure includes Ray and engine
start-up; its steady state counts from its first model call to its last (`RunSummary.busy_s`).

Each finished run's figures are kept as it ends, in `bench/results/corpus_efficiency-sittings-
<full|quick>-<dtype>-step<budget>.json` (other sizes spelt out; `-active<N>` for
`--max-active-chains N`; committed with the results, so sittings on later days
carry over), each with the machine it ran on; the report says so when they differ. Run 1's
requests, which the ceiling replays, and the generated corpus stay in a work folder under the cache
(`--work`); a sitting that finds no requests for a ceiling still owed runs run 1 again. `--resume`
skips the finished runs, so the full size, longer than a session, is measured over several
sittings; a run that was stopped starts again from its beginning, since half a run has no figures.

    .venv/bin/python bench/corpus_efficiency.py --resume   # full size: 87 min, 2-core Xeon (AMX)
    .venv/bin/python bench/corpus_efficiency.py --quick    # small documents: 12 minutes, 2 cores
    .venv/bin/python bench/corpus_efficiency.py --documents 32 --max-tokens 100000
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import common
import pipeline_overhead  # marks this run's Ray processes
import pyarrow.parquet as pq
from engine_efficiency import BusyMeter
from platformdirs import user_cache_dir

from connectors.engines.hardware import detect
from connectors.engines.vllm_local import VLLMEngine, VLLMEngineConfig
from operators.config import MethodConfig
from operators.core.chain import ChainStatus, MemoryChain
from operators.engine import GenerationRequest, SamplingConfig
from operators.runner import ChainRunner
from pipeline.ask import prepare
from pipeline.cli.ask import read_documents
from pipeline.cli.env import collect
from pipeline.job import JobSpec, RunSummary, run_job

SEED = 20240611  # the corpus: document lengths and questions
TEMPLATE = "segment-first"
MAX_ACTIVE_CHAINS = 256  # runner and job alike: more than the corpus has chains
# CPU seconds of every process on the machine during the run, by what the process is
CPU_BY_ROLE = "cpu_s_by_role"
CPU_BY_TITLE = "cpu_s_by_title"  # the same seconds by process title (which Ray task or actor)


@dataclass(frozen=True)
class RunnerVariant:
    """A run of the runner after run 1 and the ceiling: which chains, in which order."""

    name: str
    label: str
    pick: Callable[[list[MemoryChain]], list[MemoryChain]]
    longest_first: bool
    alone: bool = False  # one chain at a time


RUNNER_VARIANTS = (
    RunnerVariant("runner_source_order", "3. runner, source order", list, longest_first=False),
    RunnerVariant(
        "runner_reversed_order",
        "3. runner, reversed order",
        lambda cs: cs[::-1],
        longest_first=False,
    ),
    RunnerVariant(
        "longest_chain_alone",
        "5. the longest chain alone",
        lambda cs: [max(cs, key=lambda chain: len(chain.segments))],
        longest_first=True,
        alone=True,
    ),
)
# In this order: the ceiling replays run 1's requests, kept only in the cache, so it follows
# run 1 in the same sitting where it can.
IN_PROCESS_RUNS = (
    "runner_longest_first", "ceiling", *(variant.name for variant in RUNNER_VARIANTS),
)  # fmt: skip
KV_CACHE_GIB = 4
QUESTIONS = (
    "What is this document about, in one sentence?",
    "Which person, organization or system does this document mention most?",
    "What is the main problem or conflict described in this document?",
    "Which dates, numbers or quantities does this document give?",
    "What happens at the end of this document?",
)
# The targets: tokens/s of one path over another's.
RUNNER_OF_CEILING_TARGET = 0.90
JOB_STEADY_TARGET = 0.95
JOB_END_TO_END_TARGET = 0.90


@dataclass(frozen=True)
class Sizes:
    documents: int
    min_tokens: int
    max_tokens: int
    chunk_size: int
    max_memory_tokens: int


FULL = Sizes(documents=24, min_tokens=2000, max_tokens=200_000, chunk_size=2000,
             max_memory_tokens=128)  # fmt: skip
QUICK = Sizes(documents=24, min_tokens=400, max_tokens=1600, chunk_size=400,
              max_memory_tokens=64)  # fmt: skip


@dataclass(frozen=True)
class CorpusDocument:
    path: Path
    n_tokens: int
    questions: tuple[str, ...]


# --- the corpus -------------------------------------------------------------------------------


def draw_corpus(sizes: Sizes) -> list[tuple[int, tuple[str, ...]]]:
    """(token length, questions) per document. Lengths are log-normal with the range's
    geometric mean as median and 95% of draws inside it, clipped to it."""
    rng = random.Random(SEED)
    low, high = math.log(sizes.min_tokens), math.log(sizes.max_tokens)
    mu, sigma = (low + high) / 2, (high - low) / 4
    drawn = []
    for _ in range(sizes.documents):
        length = round(rng.lognormvariate(mu, sigma))
        length = min(max(length, sizes.min_tokens), sizes.max_tokens)
        questions = tuple(rng.sample(QUESTIONS, rng.randint(1, 3)))
        drawn.append((length, questions))
    return drawn


def write_corpus(folder: Path, sizes: Sizes, tokenizer: Any) -> list[CorpusDocument]:
    """The drawn documents as .txt files of real text, each with its questions beside it
    (`<name>.questions.txt`, which the job reads). Names keep the source order when sorted.
    The same sizes draw the same corpus, so a resumed measurement rewrites identical files."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    drawn = draw_corpus(sizes)
    texts = common.documents_of_lengths(tokenizer, [length for length, _ in drawn])
    corpus = []
    for index, ((length, questions), (_, text)) in enumerate(zip(drawn, texts, strict=True)):
        path = folder / f"doc{index:03d}-{length}.txt"
        path.write_text(text, encoding="utf-8")
        path.with_name(path.name + ".questions.txt").write_text("\n".join(questions) + "\n")
        corpus.append(CorpusDocument(path, length, questions))
    return corpus


def build_chains(
    corpus: Sequence[CorpusDocument], tokenizer: Any, method: MethodConfig
) -> list[MemoryChain]:
    """Fresh chains of every document, in source order, from the files the job reads too."""
    readable, unreadable = read_documents([document.path for document in corpus])
    if unreadable:
        raise RuntimeError(f"cannot read the generated corpus: {unreadable}")
    questions = {str(document.path): document.questions for document in corpus}
    prepared = [prepare(d, questions[d.uri], tokenizer, method) for d in readable]
    return [chain for document in prepared for chain in document.chains]


# --- runs 1-3: one engine in this process -----------------------------------------------------


def figures(seconds: float, tokens: int, meter: BusyMeter | None, failed: int) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "busy_fraction": meter.busy_s / seconds if meter else None,
        "mean_requests_in_flight": meter.request_seconds / seconds if meter else None,
        "failed_chains": failed,
        "load_1min_after": os.getloadavg()[0],  # other work on the machine skews every run
        "machine": detect().describe(),  # sittings may run on different machines
    }


async def run_runner(
    engine: VLLMEngine,
    chains: list[MemoryChain],
    method: MethodConfig,
    longest_first: bool,
    max_active_chains: int,
) -> tuple[dict[str, Any], list[GenerationRequest]]:
    """The chains submitted in the order given, cold prefix cache; the figures and every
    request the run sent."""
    await engine.reset_prefix_cache()
    meter = BusyMeter(engine)
    runner = ChainRunner(meter, method.sampling(), max_active_chains, longest_first=longest_first)
    with common.CpuByProcess() as cpu:
        started = time.perf_counter()
        results = await runner.run(chains)
        seconds = time.perf_counter() - started
    failed = sum(result.status != ChainStatus.DONE for result in results)
    longest = max(results, key=lambda result: result.n_segments)
    return {
        **figures(seconds, common.processed_tokens(results), meter, failed),
        CPU_BY_ROLE: cpu.seconds_by_role(),
        CPU_BY_TITLE: cpu.seconds_by_title(),
        "longest_chain_steps": len(longest.trajectory),
        "longest_chain_s": sum(record.latency_s for record in longest.trajectory),
    }, meter.requests


async def replay_at_once(engine: VLLMEngine, requests: list[GenerationRequest]) -> dict[str, Any]:
    await engine.reset_prefix_cache()
    meter = BusyMeter(engine)
    replayed = [replace(request, request_id=f"replay-{request.request_id}") for request in requests]
    started = time.perf_counter()
    completions = await asyncio.gather(*(meter.generate(request) for request in replayed))
    seconds = time.perf_counter() - started
    tokens = sum(c.prompt_tokens + c.completion_tokens for c in completions)
    return figures(seconds, tokens, meter, failed=0)


SITTING = "sitting"  # when the run's sitting began (UTC), in each run's figures
APART = "- (runs of different sittings)"


class Sittings:
    """The figures of the runs finished so far, kept in `record` as each one ends, and run 1's
    requests in `<work>/requests.jsonl`, which the ceiling replays."""

    def __init__(
        self, record: Path, work: Path, sizes: Sizes, config: VLLMEngineConfig, model: str, *,
        max_active_chains: int, resume: bool,
    ) -> None:  # fmt: skip
        self._runs_path = record
        self._requests_path = work / "requests.jsonl"
        # Runs of one sitting share the machine's state of the moment; ratios need that.
        self.sitting = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
        identity = {"sizes": asdict(sizes), "model": model, "dtype": config.dtype, "seed": SEED,
                    "template": TEMPLATE, "step_budget": step_budget(config)}  # fmt: skip
        if max_active_chains != MAX_ACTIVE_CHAINS:  # sittings from before the option stay valid
            identity["max_active_chains"] = max_active_chains
        kept = json.loads(record.read_text()) if record.exists() else None
        if resume and kept and kept["identity"] == identity:
            self.runs: dict[str, Any] = kept["runs"]
        else:
            shutil.rmtree(work, ignore_errors=True)
            self.runs = {}
        self._identity = identity
        if not self.done("ceiling") and not self._requests_path.exists():
            self.runs.pop("runner_longest_first", None)  # its requests are not at hand here
        work.mkdir(parents=True, exist_ok=True)

    def done(self, name: str) -> bool:
        return name in self.runs

    def keep(self, name: str, figures: Any) -> None:
        self.runs[name] = (
            {**figures, SITTING: self.sitting} if isinstance(figures, dict) else figures
        )
        temporary = self._runs_path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"identity": self._identity, "runs": self.runs}, indent=2))
        temporary.replace(self._runs_path)

    def keep_requests(self, requests: Sequence[GenerationRequest]) -> None:
        lines = [json.dumps({"request_id": r.request_id, "prompt": r.prompt,
                             "max_tokens": r.max_tokens, "priority": r.priority})
                 for r in requests]  # fmt: skip
        self._requests_path.write_text("\n".join(lines) + "\n")

    def requests(self, sampling: SamplingConfig) -> list[GenerationRequest]:
        return [GenerationRequest(sampling=sampling, **json.loads(line))
                for line in self._requests_path.read_text().splitlines()]  # fmt: skip


async def run_in_process(
    config: VLLMEngineConfig,
    chains: Callable[[], list[MemoryChain]],
    method: MethodConfig,
    sittings: Sittings,
    max_active_chains: int,
) -> None:
    """Runs 1-3 and 5, those not finished in an earlier sitting, on one engine."""
    if all(sittings.done(name) for name in IN_PROCESS_RUNS):
        return
    started = time.perf_counter()
    async with common.warm_engine(config) as engine:
        startup_s = time.perf_counter() - started
        print(f"engine ready in {startup_s:.1f} s", flush=True)
        if not sittings.done("engine_startup_s"):
            sittings.keep("engine_startup_s", startup_s)
        if not sittings.done("runner_longest_first"):
            longest, requests = await run_runner(
                engine, chains(), method, longest_first=True, max_active_chains=max_active_chains
            )
            sittings.keep_requests(requests)
            sittings.keep("runner_longest_first", longest)
            print(f"1. runner, longest-first: {longest['seconds']:.1f} s", flush=True)
        if not sittings.done("ceiling"):
            ceiling = await replay_at_once(engine, sittings.requests(method.sampling()))
            sittings.keep("ceiling", ceiling)
            print(f"2. ceiling: {ceiling['seconds']:.1f} s", flush=True)
        for variant in RUNNER_VARIANTS:
            if not sittings.done(variant.name):
                measured, _ = await run_runner(
                    engine,
                    variant.pick(chains()),
                    method,
                    longest_first=variant.longest_first,
                    max_active_chains=1 if variant.alone else max_active_chains,
                )
                sittings.keep(variant.name, measured)
                print(f"{variant.label}: {measured['seconds']:.1f} s", flush=True)


# --- run 4: the Ray Data job ------------------------------------------------------------------


def run_ray_job(
    config: VLLMEngineConfig,
    corpus: Sequence[CorpusDocument],
    method: MethodConfig,
    folder: Path,
    model: str,
    max_active_chains: int,
) -> dict[str, Any]:
    for stale in (folder / "output", folder / "state.sqlite"):  # a stopped attempt's
        if stale.is_dir():
            shutil.rmtree(stale)
        stale.unlink(missing_ok=True)
    spec = JobSpec.from_dict({
        "sources": [str(folder / "corpus")],  # listed sorted by name: in source order
        "questions": [],  # each document's own, from its .questions.txt
        "output": str(folder / "output"),
        "state_store": f"sqlite:///{folder / 'state.sqlite'}",
        "engine": {"model": model, "max_model_len": config.max_model_len, "dtype": config.dtype,
                   "enforce_eager": True, "cpu_kvcache_space_gib": config.cpu_kvcache_space_gib,
                   "engine_kwargs": {"max_num_batched_tokens": step_budget(config)}},
        "method": method.as_dict(),
        "concurrency": {"actors": 1, "schedule": "longest-first",
                        "batches_in_flight": max(32, len(corpus)),
                        "max_active_chains": max_active_chains},
        "ray_address": "local",  # a fresh local session, started and stopped inside the timing
    })  # fmt: skip
    with common.CpuByProcess() as cpu:
        summary: RunSummary = run_job(spec)
    failed = summary.chains - summary.chains_done
    end_to_end = figures(summary.elapsed_s, summary.tokens, None, failed)
    end_to_end["busy_fraction"] = summary.busy_s / summary.elapsed_s
    return {
        "end_to_end": end_to_end,
        "steady": figures(summary.busy_s, summary.tokens, None, failed),
        CPU_BY_ROLE: cpu.seconds_by_role(),
        CPU_BY_TITLE: cpu.seconds_by_title(),
        "chains": summary.chains,
        "documents_failed": summary.documents_failed,
        "engine": summary.engine,
        "leftover_processes": pipeline_overhead.end_leftovers(),
        "longest_chain": longest_chain(folder / "output"),
    }


def longest_chain(output: Path) -> dict[str, Any]:
    """How the job's longest chain spent its time: a chain's steps are sequential, so no
    schedule ends before it does, and its steps slow down while many chains share the engine."""
    (run,) = output.glob("run-*")
    answers = pq.read_table(run / "answers.parquet", columns=["chain_key", "timings"]).to_pylist()
    timings = {row["chain_key"]: row["timings"] for row in answers}
    first_start = min(t["started_at"] for t in timings.values())
    last_end = max(t["finished_at"] for t in timings.values())
    columns = ["chain_key", "step", "latency_s"]
    trajectory = pq.read_table(run / "trajectory.parquet", columns=columns)
    steps: dict[str, list[tuple[int, float]]] = {}
    for row in trajectory.to_pylist():
        steps.setdefault(row["chain_key"], []).append((row["step"], row["latency_s"]))
    key = max(steps, key=lambda k: len(steps[k]))
    latencies = [latency for _, latency in sorted(steps[key])]
    quarter = max(1, len(latencies) // 4)
    return {
        "steps": len(latencies),
        "started_s": (timings[key]["started_at"] - first_start).total_seconds(),
        "finished_s": (timings[key]["finished_at"] - first_start).total_seconds(),
        "all_chains_s": (last_end - first_start).total_seconds(),
        "mean_step_s_first_quarter": statistics.mean(latencies[:quarter]),
        "mean_step_s_last_quarter": statistics.mean(latencies[-quarter:]),
    }


def step_budget(config: VLLMEngineConfig) -> int:
    """The most prompt tokens one engine step takes, as the engine will be started."""
    from vllm.config.scheduler import SchedulerConfig

    told = config.engine_args().get("max_num_batched_tokens")
    return told or SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS


def sizes_label(sizes: Sizes, model: str, dtype: str, budget: int, max_active_chains: int) -> str:
    """The sittings' name: full-<dtype>-step<budget>[-active<N>] or quick-..., for the pinned
    sizes, else the sizes spelt out; the model's name when it is not the default."""
    active = "" if max_active_chains == MAX_ACTIVE_CHAINS else f"-active{max_active_chains}"
    label = {FULL: "full", QUICK: "quick"}.get(sizes) or (
        f"{sizes.documents}docs-{sizes.min_tokens}-{sizes.max_tokens}-chunk{sizes.chunk_size}"
        f"-memory{sizes.max_memory_tokens}"
    )
    named = "" if model == common.DEFAULT_MODEL else f"-{Path(model).name}"
    return f"{label}{named}-{dtype}-step{budget}{active}"


def results_name(label: str, dtype: str) -> str:
    """The report's name: `corpus_efficiency` for the pinned full size at vLLM's step budget with
    every chain at once (the README's table), `corpus_efficiency-<label>` for any other."""
    return (
        "corpus_efficiency" if label == f"full-{dtype}-step2048" else f"corpus_efficiency-{label}"
    )


def default_work_folder(label: str) -> Path:
    return Path(user_cache_dir("memstream")) / "bench" / f"corpus_efficiency-{label}"


# --- report -----------------------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return "met" if value >= target else "**missed**"


def report(
    args: argparse.Namespace,
    corpus: Sequence[CorpusDocument],
    n_chains: int,
    machine: dict[str, Any],
    runs: dict[str, Any],
    job: dict[str, Any],
) -> tuple[str, dict[str, float]]:
    longest, source = runs["runner_longest_first"], runs["runner_source_order"]
    reversed_order, alone = runs["runner_reversed_order"], runs["longest_chain_alone"]
    ceiling, steady, end_to_end = runs["ceiling"], job["steady"], job["end_to_end"]
    ratios = {
        "runner_longest_first_of_ceiling": longest["tokens_per_s"] / ceiling["tokens_per_s"],
        "runner_source_order_of_ceiling": source["tokens_per_s"] / ceiling["tokens_per_s"],
        "job_steady_of_runner": steady["tokens_per_s"] / longest["tokens_per_s"],
        "job_end_to_end_of_runner": end_to_end["tokens_per_s"] / longest["tokens_per_s"],
        "source_order_over_longest_first_makespan": source["seconds"] / longest["seconds"],
        "reversed_order_over_longest_first_makespan": (
            reversed_order["seconds"] / longest["seconds"]
        ),
        "runner_over_alone_plus_ceiling": (
            longest["seconds"] / (alone["seconds"] + ceiling["seconds"])
        ),
    }

    def row(name: str, r: dict[str, Any]) -> tuple[object, ...]:
        busy, in_flight = r["busy_fraction"], r["mean_requests_in_flight"]
        return (name, f"{r['seconds']:.1f}", r["tokens"], f"{r['tokens_per_s']:.0f}",
                "-" if busy is None else f"{busy:.0%}",
                "-" if in_flight is None else f"{in_flight:.1f}",
                r["failed_chains"], f"{r['load_1min_after']:.1f}")  # fmt: skip

    runs_table = common.table(
        ["run", "wall s", "tokens", "tokens/s", "engine busy", "mean requests in flight",
         "failed chains", "1-min load after"],
        [row("1. runner in process, longest-first", longest),
         row("2. ceiling: run 1's requests replayed at once", ceiling),
         row("3. runner in process, source order", source),
         row("3. runner in process, source order reversed", reversed_order),
         row("4. Ray job, end to end", end_to_end),
         row("4. Ray job, steady state", steady),
         row("5. the longest chain alone", alone)],
    )  # fmt: skip

    def apart(*compared: dict[str, Any]) -> bool:
        sittings = {r.get(SITTING) for r in compared}
        return len(sittings) > 1 or None in sittings

    def judged(value: float, target: float, *compared: dict[str, Any]) -> str:
        return APART if apart(*compared) else verdict(value, target)

    def order_row(name: str, key: str, other: dict[str, Any]) -> tuple[object, ...]:
        makespan = ratios[key]
        sooner = "longest-first sooner" if makespan > 1 else "**longest-first not sooner**"
        sooner = APART if apart(other, longest) else sooner
        return (f"{name} / longest-first makespan", f"{makespan:.2f}",
                "- (above 1: longest-first finished sooner)", sooner)  # fmt: skip

    ratios_table = common.table(
        ["ratio", "value", "target", "verdict"],
        [("runner longest-first / ceiling tokens/s",
          f"{ratios['runner_longest_first_of_ceiling']:.2f}", f">= {RUNNER_OF_CEILING_TARGET:.2f}",
          judged(ratios["runner_longest_first_of_ceiling"], RUNNER_OF_CEILING_TARGET, longest,
                 ceiling)),
         ("runner source order / ceiling tokens/s",
          f"{ratios['runner_source_order_of_ceiling']:.2f}", "- (reference)", "-"),
         ("job steady / runner longest-first tokens/s", f"{ratios['job_steady_of_runner']:.2f}",
          f">= {JOB_STEADY_TARGET:.2f}",
          judged(ratios["job_steady_of_runner"], JOB_STEADY_TARGET, job, longest)),
         ("job end to end / runner longest-first tokens/s",
          f"{ratios['job_end_to_end_of_runner']:.2f}", f">= {JOB_END_TO_END_TARGET:.2f}",
          judged(ratios["job_end_to_end_of_runner"], JOB_END_TO_END_TARGET, job, longest)),
         order_row("source order", "source_order_over_longest_first_makespan", source),
         order_row("source order reversed", "reversed_order_over_longest_first_makespan",
                   reversed_order),
         ("runner longest-first makespan / (longest chain alone + ceiling)",
          f"{ratios['runner_over_alone_plus_ceiling']:.2f}",
          "- (near 1: the longest chain gained nothing from sharing the engine)",
          APART if apart(longest, alone, ceiling) else "-")],
    )  # fmt: skip
    cpu_table = _cpu_table(longest, job, machine["cpu"]["cores"])
    lengths = sorted(document.n_tokens for document in corpus)
    cpu = machine["cpu"]
    flags = " ".join(f"{name}{'+' if on else '-'}" for name, on in machine["cpu_flags"].items())
    notes = [
        f"Engine start-up (excluded from runs 1-3, included in the job's end to end): "
        f"{runs['engine_startup_s']:.1f} s in process. Tokens are prompt + completion tokens "
        "processed; wall s of runs 1-3 is the makespan from submitting every chain to the last "
        "answer. Engine busy: share of the wall time with at least one request in flight "
        "(for the job: steady s / end-to-end s).",
    ]
    if chain := job.get("longest_chain"):
        notes.append(
            f"The job's longest chain ({chain['steps']} steps) ran from second "
            f"{chain['started_s']:.0f} to {chain['finished_s']:.0f} of the "
            f"{chain['all_chains_s']:.0f} s from the first chain's start to the last one's end. "
            f"Its steps took {chain['mean_step_s_first_quarter']:.1f} s each in its first "
            f"quarter, with the other chains, and {chain['mean_step_s_last_quarter']:.1f} s in "
            "its last, nearly alone."
        )
    in_process = (longest, source, reversed_order, alone)
    if any(r["failed_chains"] for r in (*in_process, end_to_end)) or job["documents_failed"]:
        notes.append("**Some chains or documents failed: the figures are not comparable.**")
    if abs(end_to_end["tokens"] - longest["tokens"]) > 0.01 * longest["tokens"]:
        notes.append("**The job and the runner processed token counts more than 1% apart.**")
    by_sitting: dict[str, list[str]] = {}
    for label, r in [("1", longest), ("2", ceiling), ("3", source), ("3 reversed", reversed_order),
                     ("4", job), ("5", alone)]:  # fmt: skip
        by_sitting.setdefault(r.get(SITTING) or "a sitting before they were dated", []).append(
            label
        )
    if len(by_sitting) > 1:
        notes.append(
            "Sittings (a ratio of runs of different sittings is not judged: this machine's "
            "speed drifts between them): "
            + "; ".join(f"runs {', '.join(labels)}: {when}" for when, labels in by_sitting.items())
            + "."
        )
    machines = {r["machine"] for r in (*in_process, ceiling, end_to_end)}
    if len(machines) > 1:
        notes.append(
            f"**The runs were made on different machines: {'; '.join(sorted(machines))}.**"
        )
    if job["leftover_processes"]:
        notes.append(
            f"**{job['leftover_processes']} process(es) of the job's Ray session were still "
            "running 30 s after `run_job` returned; the benchmark ended them.**"
        )
    markdown = "\n".join([
        f"Corpus efficiency, {args.model}, {len(corpus)} documents of real text "
        f"(log-normal lengths clipped to {args.min_tokens:,}-{args.max_tokens:,} tokens, seed "
        f"{SEED}: min {lengths[0]:,}, median {statistics.median(lengths):,.0f}, max "
        f"{lengths[-1]:,}, total {sum(lengths):,}), {n_chains} chains (1-3 questions each), "
        f"{TEMPLATE}, chunk {args.chunk_size}, memory {args.max_memory_tokens}, answers 32 "
        f"tokens, greedy, eager, up to {args.max_active_chains} chains at once, one engine at a "
        "time",
        "",
        f"CPU: {cpu['model']} ({cpu['architecture']}, {cpu['cores']} cores usable); "
        f"{flags}; "
        f"dtype {machine['dtype']}",
        "",
        *runs_table,
        "",
        *ratios_table,
        *cpu_table,
        *[line for note in notes for line in ("", note)],
    ])  # fmt: skip
    return markdown, ratios


def _cpu_table(runner: dict[str, Any], job: dict[str, Any], cores: int) -> list[str]:
    """Where the CPU went in run 1 and the job: each role's CPU seconds and its share of what
    the machine's cores could give over the run's wall time (runs of older versions: none)."""
    if CPU_BY_ROLE not in runner or CPU_BY_ROLE not in job:
        return []
    runner_wall, job_wall = runner["seconds"], job["end_to_end"]["seconds"]
    roles = list(dict.fromkeys([*runner[CPU_BY_ROLE], *job[CPU_BY_ROLE]]))

    def cell(seconds: float | None, wall: float) -> str:
        return "-" if not seconds else f"{seconds:,.0f} ({seconds / (cores * wall):.0%})"

    rows = [(role, cell(runner[CPU_BY_ROLE].get(role), runner_wall),
             cell(job[CPU_BY_ROLE].get(role), job_wall)) for role in roles]  # fmt: skip
    rows.append(("all", cell(sum(runner[CPU_BY_ROLE].values()), runner_wall),
                 cell(sum(job[CPU_BY_ROLE].values()), job_wall)))  # fmt: skip
    lines = [
        "",
        f"CPU seconds by process, with their share of {cores} cores over the run's wall time "
        "(every process on the machine, sampled every 2 s):",
        "",
        *common.table(["process", "1. runner, longest-first", "4. Ray job, end to end"], rows),
    ]
    titles = job.get(CPU_BY_TITLE, {})
    if titles:
        lines += [
            "",
            "The job's CPU seconds by process title, a second or more (a Ray worker's title "
            "is the task or actor it runs at the time):",
            "",
            *common.table(
                ["process title", "CPU s"],
                [(f"`{title}`", f"{seconds:,.1f}") for title, seconds in titles.items()
                 if seconds >= 1],
            ),
        ]  # fmt: skip
    return lines


def main() -> None:
    parser = common.bench_parser(__doc__)
    parser.set_defaults(chunk_size=None, max_memory_tokens=None, dtype="auto")
    parser.add_argument("--documents", type=int, help="how many documents to draw")
    parser.add_argument("--min-tokens", type=int, help="the shortest document length")
    parser.add_argument("--max-tokens", type=int, help="the longest document length")
    parser.add_argument(
        "--work", type=Path, help="where the corpus and run 1's requests are kept (see --resume)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="skip the runs an earlier sitting finished"
    )
    parser.add_argument(
        "--max-active-chains", type=int, default=MAX_ACTIVE_CHAINS,
        help=f"the most chains reading at once, runner and job alike (default {MAX_ACTIVE_CHAINS})",
    )  # fmt: skip
    parser.add_argument(
        "--step-budget", type=int, help="the most prompt tokens an engine step takes (default: "
        "vLLM's, 2048)",
    )  # fmt: skip
    args = parser.parse_args()
    base = QUICK if args.quick else FULL
    sizes = Sizes(
        documents=args.documents or base.documents,
        min_tokens=args.min_tokens or base.min_tokens,
        max_tokens=args.max_tokens or base.max_tokens,
        chunk_size=args.chunk_size or base.chunk_size,
        max_memory_tokens=args.max_memory_tokens or base.max_memory_tokens,
    )
    if not 0 < sizes.min_tokens <= sizes.max_tokens:
        parser.error("need 0 < --min-tokens <= --max-tokens")
    for name in ("documents", "min_tokens", "max_tokens", "chunk_size", "max_memory_tokens"):
        setattr(args, name, getattr(sizes, name))
    machine = collect()
    method = common.bench_method(args, TEMPLATE)
    config = common.engine_config(args, KV_CACHE_GIB)
    config = replace(config, max_num_batched_tokens=args.step_budget)
    tokenizer = common.load_tokenizer(config)
    active = args.max_active_chains
    label = sizes_label(sizes, args.model, config.dtype, step_budget(config), active)
    work = args.work or default_work_folder(label)
    record = common.RESULTS / f"corpus_efficiency-sittings-{label}.json"
    sittings = Sittings(
        record, work, sizes, config, args.model, max_active_chains=active, resume=args.resume
    )
    if sittings.runs:
        print(f"resuming from {record}: done {', '.join(sittings.runs)}", flush=True)
    corpus = write_corpus(work / "corpus", sizes, tokenizer)
    n_chains = sum(len(document.questions) for document in corpus)
    print(f"{len(corpus)} documents, {n_chains} chains, dtype {config.dtype}", flush=True)
    asyncio.run(
        run_in_process(
            config, lambda: build_chains(corpus, tokenizer, method), method, sittings, active
        )
    )
    if not sittings.done("job"):
        sittings.keep("job", run_ray_job(config, corpus, method, work, args.model, active))
        print(f"4. job: {sittings.runs['job']['end_to_end']['seconds']:.1f} s", flush=True)
    job = sittings.runs["job"]
    if "longest_chain" not in job and (work / "output").is_dir():  # a job of an older version
        sittings.keep("job", {**job, "longest_chain": longest_chain(work / "output")})
        job = sittings.runs["job"]
    runs = {name: sittings.runs[name] for name in ("engine_startup_s", *IN_PROCESS_RUNS)}
    markdown, ratios = report(args, corpus, n_chains, machine, runs, job)
    common.write_results(
        results_name(label, config.dtype),
        {"args": {**vars(args), "work": str(work)}, "seed": SEED, "template": TEMPLATE,
         "max_active_chains": active, "kv_cache_gib": KV_CACHE_GIB,
         "cpu": machine["cpu"], "cpu_flags": machine["cpu_flags"], "dtype": machine["dtype"],
         "versions": machine["versions"],
         "documents": [{"name": d.path.name, "tokens": d.n_tokens, "questions": list(d.questions)}
                       for d in corpus],
         **runs, "job": job, "ratios": ratios,
         "targets": {"runner_of_ceiling": RUNNER_OF_CEILING_TARGET,
                     "job_steady_of_runner": JOB_STEADY_TARGET,
                     "job_end_to_end_of_runner": JOB_END_TO_END_TARGET}},
        markdown,
    )  # fmt: skip


if __name__ == "__main__":
    main()
