"""The `memstream` command line.

Each command is a module of this package with a `register(subcommands)`; commands that live
higher up (`serve`, in `serving`) register through the `memstream.commands` entry point, so
nothing here imports them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from connectors.engines.models import ModelError, keep_hub_offline_unless_named
from operators.config import ConfigError, TemplateChanged
from operators.engine import EngineError
from operators.parsing import ParseError
from pipeline.cli import ask, demo, env, evaluate, models, report, run, terminal, train
from pipeline.cli.flags import EXIT_INTERRUPTED, EXIT_USAGE, UserError
from pipeline.job import JobError
from pipeline.report import NotARunFolder

COMMANDS = (ask, demo, report, run, evaluate, env, models, train)
PLUGIN_GROUP = "memstream.commands"
# What a user can fix, raised on purpose with a message for them: one line, no hint at a
# traceback. Any other error, a bare ValueError included, is a bug, named by its type.
USER_ERRORS = (
    UserError, ConfigError, TemplateChanged, JobError, NotARunFolder, ParseError, ModelError,
    EngineError, OSError,
)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    keep_hub_offline_unless_named(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # stdout carries results (e.g. `ask --json`); vLLM logs to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:  # building the parser reads settings from the environment (their defaults)
        args = build_parser().parse_args(argv)
        return int(args.handler(args) or 0)
    except USER_ERRORS as error:
        if os.environ.get("MEMSTREAM_DEBUG"):
            raise
        return _fail(f"memstream: error: {error}", EXIT_USAGE)
    except KeyboardInterrupt:
        return _fail("memstream: interrupted; rerun the same command to resume", EXIT_INTERRUPTED)
    except Exception as error:  # an unexpected failure: still one line, the traceback on demand
        if os.environ.get("MEMSTREAM_DEBUG"):
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        return _fail(
            f"memstream: error: {type(error).__name__}: {first_line} "
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
    subcommands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(subcommands)
    for plugin in entry_points(group=PLUGIN_GROUP):
        plugin.load()(subcommands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
