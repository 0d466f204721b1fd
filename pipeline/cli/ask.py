"""`memstream ask`: local files in, answers out, with a progress bar over all chain steps."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console

from connectors.engines import models
from connectors.engines.factory import EngineSpec, load_tokenizer, open_checked_engine
from connectors.state.records import RunProgress
from operators.config import MethodConfig, check_context_fit
from operators.core.chain import ChainStatus, MemoryChain, StepRecord
from operators.core.collection import (
    ORDERS,
    Member,
    member_segments,
    members_read,
    order_members,
    with_longest_header,
)
from operators.core.document import Document
from operators.core.evidence import Evidence
from operators.parsing import ParseError, parse_document
from operators.runner import ChainResult, ChainRunner
from pipeline.ask import PreparedDocument, answer, prepare, prepare_collection
from pipeline.cli import terminal
from pipeline.cli.flags import (
    EXIT_PARTIAL_FAILURE,
    EXIT_USAGE,
    add_engine_arguments,
    add_method_arguments,
    add_verbose_argument,
    engine_spec,
    method_config,
)
from pipeline.cli.progress import progress_bar

EXIT_NOTHING_READABLE = EXIT_USAGE


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("ask", help="answer questions about local documents")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="text, Markdown, log or PDF files")
    parser.add_argument(
        "-q",
        "--question",
        action="append",
        required=True,
        dest="questions",
        metavar="Q",
        help="a question asked of every document; repeat for more",
    )
    parser.add_argument(
        "--across",
        action="store_true",
        help="ask each question once of all the files together, read in order by one memory "
        "(a collection), instead of once per file",
    )
    parser.add_argument(
        "--order-by",
        choices=ORDERS,
        default="listed",
        help="with --across, the reading order: as listed, by file name, or by modification "
        "time (default: listed)",
    )
    add_engine_arguments(parser)
    add_method_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    add_verbose_argument(parser)
    parser.set_defaults(handler=run_ask)


def run_ask(args: argparse.Namespace) -> int:
    terminal.capture(None, "ask", verbose=args.verbose)
    return ask_files(
        [Path(p) for p in args.paths],
        args.questions,
        engine_spec(args),
        method_config(args),
        as_json=args.json,
        across=args.across,
        order_by=args.order_by,
    )


def ask_files(
    paths: Sequence[Path],
    questions: Sequence[str],
    spec: EngineSpec,
    method: MethodConfig,
    *,
    as_json: bool,
    across: bool = False,
    order_by: str = "listed",
) -> int:
    term = terminal.current()
    console = term.console()
    documents, failures = read_documents(paths)
    for path, reason in failures.items():
        console.print(f"[red]skipped[/red] {path}: {reason}")
    if not documents:
        console.print("memstream: error: no readable document; nothing to answer")
        return EXIT_NOTHING_READABLE
    models.ensure_pulled(spec.model, console.print)
    tokenizer = load_tokenizer(spec)
    members = collection_members(documents) if across else []
    ordered = order_members(members, order_by) if across else []
    fitted = with_longest_header(questions, ordered) if across else questions
    check_context_fit(method, fitted, tokenizer, spec.resolved_max_model_len)
    if across:
        prepared = [
            prepare_collection(
                f"collection of {len(members)}", members, questions, tokenizer, method, order_by
            )
        ]
    else:
        prepared = [prepare(document, questions, tokenizer, method) for document in documents]
    chains = [chain for document in prepared for chain in document.chains]
    spec = spec.resolved(
        planned_tokens=sum(chain.tokens_left for chain in chains), planned_chains=len(chains)
    )
    results, timings = asyncio.run(run_with_progress(prepared, spec, method, console))
    if as_json:
        print(json.dumps(as_records(prepared, results, spec, timings), indent=2), file=term.out)
    else:
        print_answers(prepared, results, term.out)
    print(f"engine: {spec.describe()}", file=term.err)
    term.print_log_path()
    failed_chains = sum(r.status != ChainStatus.DONE for rs in results.values() for r in rs)
    if failures or failed_chains:
        console.print(f"{len(failures)} file(s) skipped, {failed_chains} question(s) failed")
        return EXIT_PARTIAL_FAILURE
    return 0


def read_documents(paths: Sequence[Path]) -> tuple[list[Document], dict[str, str]]:
    """The files that parse, as documents with their text (uri: the path as given), and why
    each of the others cannot be read, by path."""
    documents: list[Document] = []
    failures: dict[str, str] = {}
    for path in paths:
        try:
            data = path.read_bytes()
            parsed = parse_document(data, path.name)
        except ParseError as error:
            failures[str(path)] = error.reason
        except OSError as error:
            failures[str(path)] = error.strerror or str(error)
        else:
            documents.append(
                Document(
                    uri=str(path),
                    name=path.name,
                    size=len(data),
                    text=parsed.text,
                    parser=parsed.parser,
                    pages=parsed.pages,
                    page_starts=parsed.page_starts,
                    warnings=parsed.warnings,
                )
            )
    return documents, failures


def collection_members(documents: Sequence[Document]) -> list[Member]:
    """The files read as one collection: each named by its file name (its path where two
    share a name), with its modification time for `--order-by mtime`."""
    paths = [Path(document.uri) for document in documents]
    names = [path.name for path in paths]
    return [
        Member(
            document.uri,
            path.name if names.count(path.name) == 1 else str(path),
            document.text or "",
            document.page_starts,
            path.stat().st_mtime,
        )
        for document, path in zip(documents, paths, strict=True)
    ]


async def run_with_progress(
    prepared: Sequence[PreparedDocument],
    spec: EngineSpec,
    method: MethodConfig,
    console: Console,
) -> tuple[dict[str, list[ChainResult]], dict[str, float]]:
    started = time.perf_counter()
    chains = [chain for document in prepared for chain in document.chains]
    # a collection's chains: the segments of each member, and the members read so far
    cut = {
        chain.chain_id: member_segments(document.segments, len(document.documents))
        for document in prepared
        if document.documents
        for chain in document.chains
    }
    read = dict.fromkeys(cut, 0)
    planned = RunProgress(
        0,
        sum(chain.n_steps for chain in chains),
        0,
        len(chains),
        members_planned=sum(len(counts) for counts in cut.values()),
    )
    with progress_bar(console, starting=f"starting the engine for {spec.model}") as show:
        show(replace(planned, steps_planned=0))
        async with terminal.interrupted_by_ctrl_c():
            engine = await open_checked_engine(spec)
            try:
                startup = time.perf_counter() - started
                done = planned
                show(done)

                def step_done(chain: MemoryChain, _: StepRecord) -> None:
                    nonlocal done
                    members = done.members_done
                    if chain.chain_id in cut:
                        now = members_read(cut[chain.chain_id], chain.step)
                        members += now - read[chain.chain_id]
                        read[chain.chain_id] = now
                    done = replace(
                        done,
                        steps_done=done.steps_done + 1,
                        chains_done=done.chains_done + chain.done,
                        members_done=members,
                    )
                    show(done)

                runner = ChainRunner(engine, method.sampling())
                results = await answer(runner, prepared, step_done)
            finally:
                await engine.shutdown()
    return results, {"engine_startup_s": startup, "total_s": time.perf_counter() - started}


def print_answers(
    prepared: Sequence[PreparedDocument], results: dict[str, list[ChainResult]], out: TextIO
) -> None:
    def say(line: str) -> None:
        print(line, file=out)

    for document in prepared:
        say(f"{document.uri}  ({len(document.segments)} segments, {document.n_tokens:,} tokens)")
        for ref in document.documents:  # a collection's documents, in reading order
            say(f"  {ref.label}")
        for result in results[document.uri]:
            say(f"  Q: {result.question}")
            if result.status != ChainStatus.DONE:
                say(f"  failed: {result.error}")
            elif result.answer is None:
                say("  A: (no answer: the model did not say 'the answer is')")
                say(f"     raw: {one_line(result.raw_response or '')}")
            else:
                grounding = document.grounding(result)
                mark = "grounded" if grounding.grounded else "NOT GROUNDED"
                say(f"  A: {result.answer}  [{mark}: {grounding.reason}]")
                for item in grounding.evidence:
                    say(f"     {describe_evidence(item)}")


def describe_evidence(item: Evidence) -> str:
    """One line: what matched, where in the source, and the quote."""
    where = f"page {item.page}, " if item.page else ""
    where = f"{item.document}, {where}" if item.document else where
    span = f"segment {item.segment_index}, chars {item.char_start}-{item.char_end}"
    return f"{item.matches} evidence ({where}{span}): {one_line(item.quote, 120)}"


def one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def as_records(
    prepared: Sequence[PreparedDocument],
    results: dict[str, list[ChainResult]],
    spec: EngineSpec,
    timings: dict[str, float],
) -> list[dict[str, Any]]:
    records = []
    for document in prepared:
        for result in results[document.uri]:
            records.append(
                {
                    "document": document.uri,
                    "question": result.question,
                    "answer": result.answer,
                    "status": result.status.answer_status,
                    "error": result.error,
                    "raw_response": result.raw_response,
                    "final_memory": result.final_memory,
                    **document.grounding(result).as_dict(),
                    **(
                        {"documents": [ref.label for ref in document.documents]}
                        if document.documents
                        else {}
                    ),
                    "n_segments": len(document.segments),
                    "n_tokens": document.n_tokens,
                    "prompt_tokens": result.prompt_tokens,
                    "completion_tokens": result.completion_tokens,
                    "model": spec.model,
                    "engine": spec.kind,
                    "dtype": spec.dtype,
                    "timings": {"chain_s": round(result.elapsed_s, 3), **timings},
                }
            )
    return records
