"""`memstream eval`: long-context benchmarks on one engine, memory chains against direct reading.

`register(subparsers)` adds the command to the `memstream` parser. One engine is opened per run;
every method reads the same samples through it, and every sample of a configuration is sent at
once so the engine batches them. Results are rewritten after each configuration, so a stopped
run keeps what it finished, and `--resume` runs only the configurations the results lack; the
chains of one cut short continue from their last step (OUTPUT/checkpoints.sqlite).

This module is the command line: flags into an `EvalRequest`, the engine opened, progress and
the report on the terminal. The run itself is `pipeline.evaluation`: `request` (the request and
the metadata it records), `resuming` (when `--resume` may continue a run), `run` (the samples,
the configurations on an open engine, re-grading).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from connectors.engines.factory import EngineSpec, load_tokenizer, open_checked_engine
from connectors.engines.models import keep_hub_offline_unless_named
from operators.config import MethodConfig, parse_config
from operators.engine import Engine
from pipeline.cli import terminal
from pipeline.cli.flags import (
    EXIT_PARTIAL_FAILURE,
    add_engine_arguments,
    add_method_arguments,
    add_verbose_argument,
    engine_spec,
    positive_int,
    setting_flags,
    setting_overrides,
)
from pipeline.cli.progress import LineThrottle
from pipeline.corpora import check_root
from pipeline.evaluation import corpora
from pipeline.evaluation.checkpoints import EvalCheckpoints
from pipeline.evaluation.execution import EvalSettings, ProgressHook, parse_methods
from pipeline.evaluation.niah import DEFAULT_DEPTHS
from pipeline.evaluation.report import (
    ACCURACY_PLOT,
    RESULTS_JSON,
    render_markdown,
    write_accuracy_plot,
    write_outputs,
)
from pipeline.evaluation.request import EvalRequest, check_chunks_fit, run_metadata
from pipeline.evaluation.results import (
    Configuration,
    ConfigurationRun,
    Prediction,
    SkippedConfiguration,
)
from pipeline.evaluation.resuming import previous_results, resumed_metadata
from pipeline.evaluation.run import evaluate, regrade_results
from pipeline.evaluation.samples import parse_lengths
from pipeline.evaluation.suite import DEFAULT_TASKS, TASKS, SuiteOutcome, parse_tasks

DEFAULT_METHODS = "memstream:memagent-reference,memstream:segment-first,direct"


@dataclass(frozen=True)
class RunDefaults:
    """The size of a run: its own defaults, and the method settings (`MethodConfig` fields) it
    gives other defaults than the method's."""

    samples: int
    lengths: str
    time_budget_min: float | None
    method: Mapping[str, Any] = field(default_factory=dict)


FULL = RunDefaults(samples=10, lengths="8k,32k,128k", time_budget_min=None)
# Fits in minutes on a small CPU: the shortest length, two samples, short replies.
QUICK = RunDefaults(
    samples=2,
    lengths="8k",
    time_budget_min=20,
    method={"max_memory_tokens": 256, "max_answer_tokens": 64},
)
# The method settings every configuration of a run shares; `--methods` names the template set
# and the re-read budget of each, and eval reads at exact chunk boundaries.
EVAL_METHOD_FLAGS = setting_flags(
    MethodConfig,
    "method",
    only=(
        "chunk_size", "max_memory_tokens", "max_answer_tokens", "temperature", "top_p", "seed",
    ),
)  # fmt: skip


def register(subparsers: Any) -> argparse.ArgumentParser:

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "eval",
        help="benchmark memory chains against direct reading (HotpotQA, NIAH, CUAD)",
        description=(
            "Builds RULER-HotpotQA, needle-in-a-haystack and CUAD samples from the shared "
            "corpora at the given lengths, answers them with each method on one engine, and "
            "writes results.json, results.md and accuracy_vs_length.png."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK.samples} samples, {QUICK.lengths} only, "
        f"{QUICK.method['max_memory_tokens']} memory and {QUICK.method['max_answer_tokens']} "
        f"answer tokens, {QUICK.time_budget_min:g} min budget (explicit options win)",
    )
    parser.add_argument(
        "--tasks",
        default=",".join(DEFAULT_TASKS),
        help=f"comma-separated: {', '.join(TASKS)}; sec10q is the held-out part of the 10-Q "
        "figures, sec10q-tune the part to tune on, sec10q-across the questions over several "
        "filings of one company (default: %(default)s)",
    )
    parser.add_argument(
        "--lengths",
        help=f"target document tokens, e.g. 8k,32k,128k,512k,1m (default: {FULL.lengths}; "
        f"--quick {QUICK.lengths})",
    )
    parser.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma-separated: direct, rag-bm25, memstream:<template set>[+reread<N>] "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--samples",
        type=positive_int,
        help="samples per task and length; CUAD asks every label (default: "
        f"{FULL.samples}; --quick {QUICK.samples})",
    )
    parser.add_argument(
        "--time-budget-min",
        type=float,
        help="start no new configuration after this many minutes (default: none; --quick "
        f"{QUICK.time_budget_min:g})",
    )
    parser.add_argument(
        "--depths",
        default=",".join(str(d) for d in DEFAULT_DEPTHS),
        help="needle depths, shares of the document (default: %(default)s)",
    )
    method_defaults = MethodConfig()
    add_method_arguments(
        parser,
        EVAL_METHOD_FLAGS,
        shown_defaults={
            name: f"{getattr(method_defaults, name)}; --quick {value}"
            for name, value in QUICK.method.items()
        },
        title="method (of every configuration)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("eval-output"),
        help="folder of results.json, results.md, the plot and the checkpoints "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the configurations OUTPUT/results.json already has (same model and settings "
        "required) and run only the missing ones; chains of a configuration cut short continue "
        "from their last step, kept in OUTPUT/checkpoints.sqlite",
    )
    parser.add_argument(
        "--regrade",
        action="store_true",
        help="score the answers in OUTPUT/results.json again with this version's scoring and "
        "grounding rules and rewrite its tables; no model is called (the samples are rebuilt "
        "from the run's settings and the corpora)",
    )
    parser.add_argument(
        "--corpora",
        type=Path,
        default=corpora.DEFAULT_CORPORA,
        help="the shared corpora folder (default: shared/corpora beside the repository)",
    )
    add_engine_arguments(parser)
    add_verbose_argument(parser)
    parser.set_defaults(handler=run_eval_command)
    return parser


def resolve_request(args: argparse.Namespace, context_window: int) -> EvalRequest:
    defaults = QUICK if args.quick else FULL
    given = setting_overrides(args, EVAL_METHOD_FLAGS).get("method", {})
    settings = parse_config(
        EvalSettings,
        {"context_window": context_window, **defaults.method, **given},
        "command line",
    )
    methods = parse_methods(args.methods)
    budget = args.time_budget_min if args.time_budget_min is not None else defaults.time_budget_min
    if budget is not None and budget <= 0:
        raise ValueError(f"--time-budget-min must be positive, got {budget:g}")
    return EvalRequest(
        tasks=parse_tasks(args.tasks),
        lengths=parse_lengths(args.lengths or defaults.lengths),
        methods=methods,
        samples=args.samples or defaults.samples,
        depths=parse_depths(args.depths),
        settings=settings,
        time_budget_min=budget,
        output=args.output,
        corpora=args.corpora,
        quick=args.quick,
        resume=args.resume,
    )


def parse_depths(text: str) -> tuple[float, ...]:
    try:
        depths = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--depths takes numbers between 0 and 1, got {text!r}") from None
    if not depths or any(not 0 <= depth <= 1 for depth in depths):
        raise ValueError(f"--depths takes numbers between 0 and 1, got {text!r}")
    return depths


def run_eval_command(args: argparse.Namespace) -> int:
    check_root(args.corpora)
    if args.regrade:
        if not (args.output / RESULTS_JSON).is_file():
            raise ValueError(
                f"nothing to re-grade: {args.output / RESULTS_JSON} does not exist (--output "
                "names the folder of a finished `memstream eval` run)"
            )
        terminal.capture(args.output.resolve(), "eval", verbose=args.verbose)
        return regrade_run(args.output, args.corpora)

    spec = engine_spec(args)
    request = resolve_request(args, spec.resolved_max_model_len)
    planned = sum(length.tokens for length in request.lengths) * request.samples
    spec = spec.resolved(planned_tokens=planned * len(request.tasks) * len(request.methods))
    terminal.capture(request.output.resolve(), "eval", verbose=args.verbose)
    return run_eval(request, spec)


def run_eval(request: EvalRequest, spec: EngineSpec) -> int:
    console = terminal.current().console()
    tokenizer = load_tokenizer(spec)
    check_chunks_fit(request, tokenizer)
    metadata = run_metadata(request, spec)
    found = previous_results(request, metadata) if request.resume else None
    previous = None
    if found:
        earlier, previous = found
        metadata = resumed_metadata(earlier, metadata)
        console.print(f"resuming: {len(previous.runs)} configuration(s) done in {request.output}")
    outcome = asyncio.run(_open_and_evaluate(request, spec, tokenizer, metadata, console, previous))
    return report_run(request, metadata, outcome, console)


async def _open_and_evaluate(
    request: EvalRequest,
    spec: EngineSpec,
    tokenizer: Any,
    metadata: dict[str, Any],
    console: Console,
    previous: SuiteOutcome | None,
) -> SuiteOutcome:
    started = time.perf_counter()
    with console.status(f"starting the {spec.kind} engine for {spec.model}"):
        engine = await open_checked_engine(spec)
    metadata["engine_startup_s"] = round(time.perf_counter() - started, 1)
    checkpoints = EvalCheckpoints.in_folder(request.output, spec, resume=request.resume)
    try:
        async with terminal.interrupted_by_ctrl_c():
            return await evaluate_with_progress(
                request, engine, tokenizer, metadata, console, previous, checkpoints
            )
    finally:
        checkpoints.close()
        await engine.shutdown()


async def evaluate_with_progress(
    request: EvalRequest,
    engine: Engine,
    tokenizer: Any,
    metadata: dict[str, Any],
    console: Console,
    previous: SuiteOutcome | None = None,
    checkpoints: EvalCheckpoints | None = None,
) -> SuiteOutcome:
    """`evaluate` on an open engine, showing progress on `console`; results.json and results.md
    are rewritten after each configuration."""
    listener = ConsoleListener(console, request.output, metadata, previous)
    with listener.progress:
        return await evaluate(request, engine, tokenizer, metadata, listener, previous, checkpoints)


def report_run(
    request: EvalRequest, metadata: dict[str, Any], outcome: SuiteOutcome, console: Console
) -> int:
    """Writes the final outputs, prints the accuracy table; exit 1 when a prediction failed."""
    written = write_outputs(request.output, metadata, outcome, plot=False)
    try:
        write_accuracy_plot(outcome.predictions, request.output / ACCURACY_PLOT)
        written.append(request.output / ACCURACY_PLOT)
    except ImportError:
        console.print(f"no {ACCURACY_PLOT}: matplotlib is not installed (pip install matplotlib)")
    print(
        render_markdown(metadata, outcome).split("\n## All metrics")[0], file=terminal.current().out
    )
    console.print("wrote " + ", ".join(str(path) for path in written))
    terminal.current().print_log_path()
    failed = sum(prediction.status != "ok" for prediction in outcome.predictions)
    if failed:
        console.print(f"{failed} prediction(s) failed; see the errors in results.json")
        return EXIT_PARTIAL_FAILURE
    return 0


def regrade_run(output: Path, corpora_root: Path) -> int:
    """Re-grades the run in `output` in place (see pipeline.evaluation.regrade)."""
    request, metadata, outcome, regraded = regrade_results(output, corpora_root)
    console = terminal.current().console()
    console.print(
        f"re-graded {len(regraded.predictions)} answers in {output}: the grounded flag changed "
        f"for {regraded.grounded_changed}, accuracy for {regraded.accuracy_changed}"
    )
    return report_run(request, metadata, outcome, console)


class _ConfigurationProgress:
    def __init__(self, progress: Progress, task_id: Any) -> None:
        self._progress = progress
        self._task_id = task_id

    def planned(self, calls: int, earlier: int = 0) -> None:
        self._progress.update(self._task_id, total=earlier + calls, completed=earlier)

    def called(self) -> None:
        self._progress.advance(self._task_id)


class ConfigurationLines:
    """Progress of one configuration as a line now and then, where the console is not a
    terminal (a log file, a background run): a rich bar would print only when it ends."""

    def __init__(self, console: Console, label: str, every_s: float = 30.0) -> None:
        self._console = console
        self._label = label
        self._throttle = LineThrottle(every_s)
        self._started = time.monotonic()
        self._planned = 0
        self._done = 0

    def planned(self, calls: int, earlier: int = 0) -> None:
        self._planned = calls
        self._throttle.due(final=True)
        resumed = f" ({earlier} made in an earlier sitting)" if earlier else ""
        self._console.print(f"{self._label}: {calls} model calls planned{resumed}")

    def called(self) -> None:
        self._done += 1
        if self._throttle.due(final=self._done >= self._planned):
            elapsed = time.monotonic() - self._started
            self._console.print(
                f"{self._label}: model calls {self._done}/{self._planned}, {elapsed:.0f} s"
            )


class ConsoleListener:
    """Shows a progress bar of model calls per configuration, prints each configuration's
    accuracy, and rewrites results.json and results.md after each one."""

    def __init__(
        self,
        console: Console,
        output: Path,
        metadata: dict[str, Any],
        previous: SuiteOutcome | None = None,
    ) -> None:
        self.console = console
        self.output = output
        self.metadata = metadata
        self.outcome = SuiteOutcome.continuing(previous)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("model calls"),
            TimeElapsedColumn(),
            console=console,
        )

    def started(self, configuration: Configuration, n_samples: int) -> ProgressHook:
        label = f"{configuration.describe()} ({n_samples})"
        if not self.console.is_terminal:
            return ConfigurationLines(self.console, label)
        task_id = self.progress.add_task(label, total=None)
        return _ConfigurationProgress(self.progress, task_id)

    def finished(self, run: ConfigurationRun, predictions: Sequence[Prediction]) -> None:
        self.outcome.runs.append(run)
        self.outcome.predictions += predictions
        accuracy = sum(p.scores["accuracy"] for p in predictions) / max(len(predictions), 1)
        errors = sum(p.status != "ok" for p in predictions)
        self.console.print(
            f"{run.configuration.describe()}: accuracy {accuracy:.2f} over {run.n_samples} "
            f"samples in {run.seconds:.0f} s" + (f", {errors} failed" if errors else "")
        )
        write_outputs(self.output, self.metadata, self.outcome, plot=False)

    def skipped(self, skipped: SkippedConfiguration) -> None:
        self.outcome.skipped.append(skipped)
        self.console.print(f"skipped {skipped.configuration.describe()}: {skipped.reason}")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pipeline.cli.evaluate [options]`: the command without the `memstream` CLI."""
    keep_hub_offline_unless_named(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="memstream")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
