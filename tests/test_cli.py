"""`memstream` end to end, as a user runs it: a subprocess, its exit code, stdout and stderr."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from pipeline.cli import terminal
from tests.conftest import TEST_MODEL, assert_clean_terminal

TINY_RUN = [
    "--model", TEST_MODEL, "--enforce-eager", "--kv-cache-gib", "1", "--max-model-len", "2048",
    "--chunk-size", "300", "--max-memory-tokens", "32", "--max-answer-tokens", "32",
]  # fmt: skip


def memstream(
    *args: str, timeout: float = 600, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"} if env is None else env,
        stdin=subprocess.DEVNULL,
    )


def assert_one_clear_line(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and expected in errors[0], result.stderr


def test_empty_file_gives_one_clear_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = memstream("ask", str(empty), "-q", "What?", "--model", TEST_MODEL)
    assert result.returncode == 2
    assert "empty.txt: empty document" in result.stderr
    assert_one_clear_line(result, "no readable document")


def test_binary_and_missing_files_are_reported(tmp_path: Path) -> None:
    binary = tmp_path / "blob.txt"
    binary.write_bytes(bytes(range(256)) * 20)
    result = memstream("ask", str(binary), str(tmp_path / "missing.log"), "-q", "What?")
    assert result.returncode == 2
    assert "blob.txt: not a text file (binary content)" in result.stderr
    assert "missing.log: No such file or directory" in result.stderr


def test_unknown_model_gives_one_clear_line(tmp_path: Path) -> None:
    document = tmp_path / "a.txt"
    document.write_text("Some text.")
    result = memstream("ask", str(document), "-q", "What?", "--model", "no-such-model")
    assert result.returncode == 2
    assert_one_clear_line(result, "unknown model 'no-such-model'")


def test_unreachable_server_gives_one_clear_line(tmp_path: Path) -> None:
    document = tmp_path / "a.txt"
    document.write_text("Some text.")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = memstream(
        "ask", str(document), "-q", "What?", "--model", TEST_MODEL,
        "--engine", "openai", "--base-url", f"http://127.0.0.1:{port}/v1",
    )  # fmt: skip
    assert result.returncode == 2
    assert_one_clear_line(result, "is the server running?")


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--chunk-size", "0"], "must be a positive integer"),
        (["--engine", "tgi"], "invalid choice"),
        (["--snap-window", "9999"], "snap_window must be in [0, chunk_size)"),
        (["--engine", "openai"], "needs a base URL"),
    ],
)
def test_invalid_options_give_one_clear_line(
    tmp_path: Path, option: list[str], message: str
) -> None:
    document = tmp_path / "a.txt"
    document.write_text("Some text.")
    result = memstream("ask", str(document), "-q", "What?", *option)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert message in result.stderr


def test_an_s3_output_without_credentials_names_the_variables_at_once(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("Some text.")
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    env |= {
        "HF_HUB_OFFLINE": "1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }
    result = memstream(
        "run", "--input", str(tmp_path / "docs"), "-q", "What?", "--model", TEST_MODEL,
        "--output", "s3://memstream-no-such-bucket/out", timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    assert_one_clear_line(
        result,
        "no AWS credentials found for s3://memstream-no-such-bucket: set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
    )


def test_a_check_across_train_settings_prints_its_own_message(tmp_path: Path) -> None:
    result = memstream(
        "train", "--output", str(tmp_path / "run"), "--answers", str(tmp_path / "a.jsonl"),
        "--task", "cuad", timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert_one_clear_line(result, "--answers and --task cuad both name the samples: pass one")


def test_a_hub_id_that_cannot_load_says_whether_the_environment_keeps_the_hub_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from connectors.engines import models
    from pipeline.cli import main

    document = tmp_path / "a.txt"
    document.write_text("Some text.")
    offline = memstream("ask", str(document), "-q", "What?", "--model", "no-such-org/no-model")
    assert offline.returncode == 2
    assert_one_clear_line(offline, "HF_HUB_OFFLINE=1 is set in the environment")

    # A hub id leaves the hub to the environment; a packaged model or a folder needs none.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    models.keep_hub_offline_unless_named(["ask", "a.txt", "--model", "org/model"])
    assert "HF_HUB_OFFLINE" not in os.environ
    models.keep_hub_offline_unless_named(["ask", "a.txt", f"--model={tmp_path}"])
    assert os.environ.pop("HF_HUB_OFFLINE") == "1"
    os.environ.pop(models.OFFLINE_BY_MEMSTREAM_ENV)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert main.main(["report", str(tmp_path / "no-run")]) == 2
    assert os.environ["HF_HUB_OFFLINE"] == "0"  # the environment's choice stands
    capsys.readouterr()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    online = models.hub_error(
        "org/model", OSError("We couldn't connect to 'https://huggingface.co'")
    )
    assert "(HF_HUB_OFFLINE is not set): We couldn't connect" in str(online)


def test_memstream_keeps_the_hub_offline_only_where_no_hub_id_is_named_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from connectors.engines import models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv(models.OFFLINE_BY_MEMSTREAM_ENV, raising=False)
    job = tmp_path / "job.yaml"
    job.write_text("engine:\n  model: SomeOrg/SomeModel\n")
    packaged_job = tmp_path / "packaged.yaml"
    packaged_job.write_text(f"engine:\n  model: {TEST_MODEL}\n")
    for named in (["run", str(job)], ["ask", "a.txt", "--tokenizer", "SomeOrg/SomeTokenizer"]):
        models.keep_hub_offline_unless_named(named)
        assert "HF_HUB_OFFLINE" not in os.environ, named  # a hub id: the environment's choice
    for unnamed in (["run", str(packaged_job)], ["run", str(tmp_path / "missing.yaml")]):
        models.keep_hub_offline_unless_named(unnamed)
        assert os.environ.pop("HF_HUB_OFFLINE") == "1", unnamed
        assert os.environ.pop(models.OFFLINE_BY_MEMSTREAM_ENV) == "1", unnamed
    # Offline by memstream's choice, a hub id it did not see says so; not "the environment".
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(models.OFFLINE_BY_MEMSTREAM_ENV, "1")
    message = str(models.hub_error("SomeOrg/SomeModel", OSError("not cached")))
    assert "memstream kept the hub offline" in message and "environment" not in message


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        ("ConfigError", "memstream: error: for the user"),
        ("TemplateChanged", "memstream: error: for the user"),
        ("JobError", "memstream: error: for the user"),
        ("NotARunFolder", "memstream: error: for the user"),
        ("ParseError", "memstream: error: for the user"),
        (
            "ValueError",
            "memstream: error: ValueError: for the user (set MEMSTREAM_DEBUG=1 to see the "
            "traceback)",
        ),
    ],
)
def test_a_bare_value_error_is_a_bug_and_errors_meant_for_users_are_one_plain_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: str, shown: str
) -> None:
    from operators.config import ConfigError, TemplateChanged
    from operators.parsing import ParseError
    from pipeline.cli import main, report
    from pipeline.job import JobError
    from pipeline.report import NotARunFolder

    kinds = {kind.__name__: kind for kind in (ConfigError, TemplateChanged, JobError,
             NotARunFolder, ParseError, ValueError)}  # fmt: skip

    def fail(args: object) -> int:
        raise kinds[error]("for the user")

    monkeypatch.setattr(report, "run_report_command", fail)
    monkeypatch.delenv("MEMSTREAM_DEBUG", raising=False)
    assert main.main(["report", "somewhere"]) == 2
    assert capsys.readouterr().err.strip() == shown


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MEMSTREAM_GPU_MEMORY_UTILIZATION", "7", "MEMSTREAM_GPU_MEMORY_UTILIZATION='7': must be"),
        ("MEMSTREAM_DTYPE", "float64", "MEMSTREAM_DTYPE='float64': must be one of auto"),
    ],
)
def test_a_bad_environment_setting_fails_in_one_plain_line(
    tmp_path: Path, name: str, value: str, message: str
) -> None:
    """The GPU share is read for a flag's default, before the command runs."""
    (tmp_path / "a.txt").write_text("Some text.")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", name: value}
    result = memstream("ask", str(tmp_path / "a.txt"), "-q", "What?", env=env, timeout=60)
    assert result.returncode == 2
    assert_one_clear_line(result, f"memstream: error: {message}")
    assert "MEMSTREAM_DEBUG" not in result.stderr


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["eval", "--corpora", "{tmp}/missing"], "shared corpora not found at {tmp}/missing"),
        (["train", "--answers", "{tmp}/missing.jsonl", "--output", "{tmp}/run"], "no such file"),
        (["train", "--output", "{tmp}/a-file"], "--output {tmp}/a-file is a file"),
        (["train", "--answers", "{tmp}/a-file", "--output", "{tmp}/run"], "{tmp}/a-file:1: not"),
        (["train", "--answers", "{tmp}/rows.jsonl", "--output", "{tmp}/run"], "1: missing answers"),
        (
            ["ask", "{tmp}/a-file", "-q", "Q?", "--engine", "openai", "--base-url", "ftp://h"],
            "command line: base_url must start with http:// or https://, got 'ftp://h'",
        ),
        (["demo", "--scale", "0"], "--scale: must be a positive number, got 0"),
        (["demo", "--scale", "-0.5"], "--scale: must be a positive number, got -0.5"),
        (["demo", "--output", "{tmp}/a-file"], "the output {tmp}/a-file is a file"),
        (["eval", "--output", "{tmp}/a-file"], "the output {tmp}/a-file is a file"),
        (["run", "--input", "{tmp}", "-q", "Q?", "--output", "{tmp}/a-file"], "{tmp}/a-file is a"),
    ],
)
def test_arguments_are_checked_before_a_model_loads(
    tmp_path: Path, command: list[str], message: str
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "rows.jsonl").write_text('{"document": "d", "question": "q"}\n')
    with socket.socket() as s:  # an engine that cannot start: a run that gets to it fails there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    no_engine = ["--engine", "openai", "--base-url", f"http://127.0.0.1:{port}/v1"]
    engine = no_engine if command[0] in ("eval", "run", "demo") else []
    arguments = [part.format(tmp=tmp_path) for part in command]
    result = memstream(*arguments, *engine, timeout=60)
    assert result.returncode == 2
    assert_one_clear_line(result, message.format(tmp=tmp_path))
    assert "logs" not in result.stderr
    assert "Loading weights" not in result.stderr  # no model was loaded first


def test_every_flag_of_the_commands_a_user_meets_has_help_and_shows_its_default() -> None:
    import argparse

    from connectors.engines.factory import DEFAULT_MODEL
    from pipeline.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("run", "ask", "eval", "serve", "demo"):
        command = commands.choices[name]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = (name, action.option_strings or action.dest)
            assert action.help, flag
            if not isinstance(action, argparse._StoreConstAction) and action.default not in (
                None,
                False,
                argparse.SUPPRESS,
            ):
                assert "default" in action.help, flag
    run_help = " ".join(commands.choices["run"].format_help().split())
    for shown in (f"(default: {DEFAULT_MODEL})", "(default: vllm)", "(default: 5000)"):
        assert shown in run_help


@pytest.mark.engine
def test_ask_answers_good_files_and_reports_the_bad_one(corpora: Path, tmp_path: Path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text(
        "# Meeting notes\n\nThe budget owner is Priya Raman.\n\n" + "The team met again. " * 150
    )
    log = corpora / "logs" / "Apache" / "Apache_2k.log"
    excerpt = tmp_path / "apache.log"
    excerpt.write_text("\n".join(log.read_text().splitlines()[:60]) + "\n")
    bad = tmp_path / "scan.pdf"
    bad.write_bytes((corpora / "pdfs" / "bad" / "scanned-image-only-grumman-1974.pdf").read_bytes())

    result = memstream(
        "ask", str(notes), str(excerpt), str(bad),
        "-q", "Who is the budget owner?", "-q", "Is there an error?", "--json", *TINY_RUN,
    )  # fmt: skip

    assert result.returncode == 1, result.stderr[-3000:]
    assert "scan.pdf: no text layer (needs OCR)" in result.stderr
    assert_clean_terminal(result.stdout, result.stderr)
    assert "model calls " in result.stderr  # progress lines, though stderr is not a terminal
    records = json.loads(result.stdout)
    assert [(Path(r["document"]).name, r["question"]) for r in records] == [
        ("notes.md", "Who is the budget owner?"),
        ("notes.md", "Is there an error?"),
        ("apache.log", "Who is the budget owner?"),
        ("apache.log", "Is there an error?"),
    ]
    for record in records:
        assert record["status"] == "ok", record["error"]
        assert record["n_segments"] >= 2
        assert record["final_memory"]
        assert record["raw_response"]
        assert record["prompt_tokens"] > record["n_tokens"]
        assert record["timings"]["engine_startup_s"] > 0
        assert record["model"] == TEST_MODEL and record["dtype"] in ("float32", "bfloat16")
        assert isinstance(record["grounded"], bool) and record["grounding_reason"]
        source = (notes if record["document"].endswith("notes.md") else excerpt).read_text()
        for item in record["evidence"]:
            assert source[item["char_start"] : item["char_end"]] == item["quote"]


@pytest.mark.engine
def test_ctrl_c_during_the_chains_ends_ask_with_one_line(tmp_path: Path) -> None:
    document = tmp_path / "long.md"
    # Progress lines come at most every 30 s: the chain must still be running at the first one,
    # even on a fast CPU (about 500 model calls here; 52 were done within 30 s on one).
    document.write_text("The budget owner is Priya Raman.\n" + "The team met again. " * 30000)
    command = [
        sys.executable,
        "-m",
        "pipeline.cli.main",
        "ask",
        str(document),
        "-q",
        "Who?",
        *TINY_RUN,
    ]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdin=subprocess.DEVNULL,
    ) as process:  # fmt: skip
        assert process.stderr is not None
        seen = []
        for line in process.stderr:  # progress lines, until the first model call is done
            seen.append(line)
            if line.startswith("model calls ") and not line.startswith("model calls 0/"):
                assert "chains answered 0/" in line, "the chain ended before the interrupt"
                break
        else:
            pytest.fail("no progress line: " + "".join(seen)[-2000:])
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C sends: the whole process group
        stdout, rest = process.communicate(timeout=120)
    stderr = "".join(seen) + rest
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "RuntimeError" not in stderr, stderr[-3000:]
    (last,) = [line for line in stderr.splitlines() if "interrupted" in line]
    assert last.startswith("memstream: interrupted") and stdout == ""


def test_ctrl_c_is_an_interruption_even_when_the_work_it_cut_short_ends_on_its_own() -> None:
    """As when the engine's processes, hit by the same SIGINT, fail the requests in flight and
    the chains end as errors before the task is cancelled."""

    async def work_that_swallows_the_cancellation() -> str:
        async with terminal.interrupted_by_ctrl_c():
            os.kill(os.getpid(), signal.SIGINT)
            # What a request failing first looks like from here: the cancellation is not seen.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(5)
            return "finished as if nothing happened"

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(work_that_swallows_the_cancellation())

    async def quiet_work() -> str:
        async with terminal.interrupted_by_ctrl_c():
            await asyncio.sleep(0)
            return "done"

    assert asyncio.run(quiet_work()) == "done"


def test_env_json_reports_the_machine_and_the_dtype_auto_picks() -> None:
    from connectors.engines.hardware import detect, resolve_dtype

    result = memstream("env", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"dtype", "cpu_flags", "gpus", "versions", "models"} <= set(report)
    assert report["dtype"] == resolve_dtype("auto")
    assert report["cpu_flags"]["avx2"] == ("avx2" in detect().cpu_flags)
    assert report["versions"]["vllm"] and report["versions"]["torch"]
    assert {model["name"] for model in report["models"]} >= {TEST_MODEL}
    with_env = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", "env", "--json"],
        capture_output=True, text=True,
        env={**os.environ, "MEMSTREAM_DTYPE": "float16"}, check=True,
    )  # fmt: skip
    assert json.loads(with_env.stdout)["dtype"] == "float16"


# The settings of each command that takes them: config section -> the record declaring them.
def commands_and_their_settings() -> dict[str, dict[str | None, type]]:
    from connectors.engines.factory import EngineSpec
    from operators.config import DocumentLimits, MethodConfig
    from pipeline.job import ConcurrencySpec, JobSpec, OutputSpec
    from pipeline.training.config import TrainConfig
    from serving.config import ServerConfig

    chains = {"engine": EngineSpec, "method": MethodConfig}
    return {
        "run": {
            None: JobSpec, "output": OutputSpec, **chains, "limits": DocumentLimits,
            "concurrency": ConcurrencySpec,
        },
        "ask": chains,
        "demo": chains,
        "eval": chains,
        "serve": {"server": ServerConfig, **chains},
        "train": {None: TrainConfig, **chains},
    }  # fmt: skip


TRAINER_CHOOSES = "the trainer's rollout engine is vLLM in process, eager, float32, no lookup"
# (command, "section.key") -> why that setting has no flag there ("*": on every command).
WITHOUT_A_FLAG = {
    ("*", "engine.engine_kwargs"): "a mapping of vLLM's own arguments: a file's key only",
    ("run", "schema"): "a mapping of field names to questions: the job file's key only",
    ("eval", "method.template"): "--methods names each configuration's template set",
    ("eval", "method.reread_tokens"): "--methods names each configuration's re-read budget",
    ("eval", "method.snap_window"): "eval reads at exact boundaries, as its results record",
    ("train", "method.snap_window"): "training chains read at exact boundaries",
    ("train", "method.reread_tokens"): "training chains answer from the memory alone",
    **{
        ("train", f"engine.{key}"): TRAINER_CHOOSES
        for key in (
            "kind", "dtype", "tensor_parallel_size", "gpu_memory_utilization", "enforce_eager",
            "prompt_lookup_tokens", "base_url", "served_model", "api_key_env", "timeout_s",
            "max_retries", "max_concurrency", "tokenizer",
        )
    },
}  # fmt: skip


def test_every_setting_has_a_flag_on_each_command_that_takes_it() -> None:
    """Flags, YAML keys and Python fields cannot drift apart: every leaf field of the records a
    command takes has its flag there, generated from the field (help: its description), but
    for the listed ones, and none of the listed ones has one."""
    import argparse
    import dataclasses

    from pydantic import BaseModel

    from pipeline.cli.flags import setting_flags, settings_fields
    from pipeline.cli.main import build_parser

    def is_record(annotation: object) -> bool:
        kinds = [annotation, *getattr(annotation, "__args__", ())]
        return any(
            dataclasses.is_dataclass(kind)
            or (isinstance(kind, type) and issubclass(kind, BaseModel))
            for kind in kinds
        )

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing, listed_but_flagged = [], []
    for command, sections in commands_and_their_settings().items():
        options = {
            option: action
            for action in commands.choices[command]._actions
            for option in action.option_strings
        }
        for section, record in sections.items():
            generated = {flag.key: flag for flag in setting_flags(record, section)}
            for key, info in settings_fields(record).items():
                if is_record(info.annotation):
                    continue  # a section: its own record is checked
                dotted = f"{section}.{key}" if section else key
                excused = {(command, dotted), ("*", dotted)} & set(WITHOUT_A_FLAG)
                flag = generated.get(key)
                has_flag = flag is not None and flag.flag in options
                if has_flag and excused:
                    listed_but_flagged.append((command, dotted))
                elif not has_flag and not excused:
                    missing.append((command, dotted))
                elif has_flag and flag is not None and info.description:
                    assert info.description in options[flag.flag].help.replace("%%", "%"), (
                        command, dotted,
                    )  # fmt: skip
    assert not missing, f"settings without a flag: {missing}"
    assert not listed_but_flagged, f"listed as flagless but flagged: {listed_but_flagged}"


def test_train_and_eval_take_the_method_and_engine_settings_as_declared() -> None:
    """A command may give a setting another default (the trainer's short chunks) but takes its
    declaration: the same description, so the same meaning."""
    from connectors.engines.factory import EngineSpec
    from operators.config import MethodConfig
    from pipeline.cli.flags import settings_fields
    from pipeline.evaluation.execution import EvalSettings
    from pipeline.training.config import TrainConfig

    method, engine = settings_fields(MethodConfig), settings_fields(EngineSpec)
    declared = {**method, **engine, "kv_cache_gib": engine["cpu_kvcache_space_gib"]}
    for record in (TrainConfig, EvalSettings):
        shared = {key: info for key, info in settings_fields(record).items() if key in declared}
        assert len(shared) >= 6, record
        for key, info in shared.items():
            assert info.description == declared[key].description, (record, key)
    train = TrainConfig(output="x")  # type: ignore[arg-type]
    assert (train.chunk_size, train.temperature) == (200, 1.0)  # its own defaults
    assert EvalSettings(context_window=8192).chunk_size == MethodConfig().chunk_size


def test_run_prompt_lookup_reaches_the_engine_spec(tmp_path: Path) -> None:
    from pipeline.cli.flags import engine_spec, method_config
    from pipeline.cli.main import build_parser
    from pipeline.cli.run import spec_from_arguments

    parser = build_parser()
    args = parser.parse_args(
        ["run", "--input", "docs", "-q", "Q?", "--output", str(tmp_path), "--prompt-lookup", "4"]
    )
    spec = spec_from_arguments(args)
    assert spec.engine.prompt_lookup_tokens == 4
    assert spec.engine.resolved(planned_chains=1000).prompt_lookup_tokens == 4  # as given
    assert spec.sources == ("docs",) and spec.questions == ("Q?",)
    unset = spec_from_arguments(parser.parse_args(["run", "--input", "d", "--output", "o"]))
    assert unset.engine.prompt_lookup_tokens is None  # by the work planned
    job = tmp_path / "job.yaml"
    job.write_text("sources: [d]\noutput: o\nengine: {prompt_lookup_tokens: 2}\n")
    from_file = spec_from_arguments(parser.parse_args(["run", str(job)]))
    assert from_file.engine.prompt_lookup_tokens == 2
    flag_wins = spec_from_arguments(parser.parse_args(["run", str(job), "--prompt-lookup", "0"]))
    assert flag_wins.engine.prompt_lookup_tokens == 0

    asked = parser.parse_args(
        ["ask", "a.txt", "-q", "Q?", "--model", "m", "--chunk-size", "700", "--kv-cache-gib", "2"]
    )
    assert engine_spec(asked).cpu_kvcache_space_gib == 2 and engine_spec(asked).model == "m"
    assert method_config(asked).chunk_size == 700
    assert engine_spec(parser.parse_args(["ask", "a", "-q", "Q"])).cpu_kvcache_space_gib == 4


def test_an_unexpected_failure_ends_with_its_first_line_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.cli import env, main

    def fails() -> None:
        raise RuntimeError("the node timed out during startup.\nThis could happen because ...")

    monkeypatch.delenv("MEMSTREAM_DEBUG", raising=False)
    monkeypatch.setattr(env, "collect", fails)
    assert main.main(["env"]) != 0
    printed = capsys.readouterr()
    assert printed.err.strip().splitlines() == [
        "memstream: error: RuntimeError: the node timed out during startup. "
        "(set MEMSTREAM_DEBUG=1 to see the traceback)"
    ]


def test_progress_lines_in_a_log_come_at_most_every_interval_but_the_last_always() -> None:
    import io

    from rich.console import Console

    from connectors.state.records import RunProgress
    from pipeline.cli.progress import LineThrottle, progress_lines

    throttle = LineThrottle(every_s=3600)
    assert [throttle.due(), throttle.due(), throttle.due(final=True), throttle.due()] == [
        True,
        False,
        True,
        False,
    ]

    out = io.StringIO()
    report = progress_lines(Console(file=out, width=200), every_s=3600)
    for done in (0, 1, 2, 3, 4):
        report(RunProgress(done, 4, chains_done=done // 4, chains_planned=1))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("model calls 0/4, chains answered 0/1, ")
    assert lines[1].startswith("model calls 4/4, chains answered 1/1, ")
    assert "documents read" not in out.getvalue()  # no collection: as before
    # a job with collections: the members read whole of those planned, beside the chains
    out = io.StringIO()
    report = progress_lines(Console(file=out, width=200), every_s=3600)
    report(RunProgress(3, 8, 0, 1, members_done=1, members_planned=3))
    assert out.getvalue().startswith("model calls 3/8, chains answered 0/1, documents read 1/3, ")


def test_the_default_model_runs_its_measured_method_unless_a_template_is_named(
    tmp_path: Path,
) -> None:
    """The default model re-reads 6,000 tokens at answer time (docs/accuracy.md: why), in `ask`,
    a job and the server alike; a named template is the method as named, a given budget wins,
    and other models answer from the memory alone."""
    from pipeline.cli.flags import method_config
    from pipeline.cli.main import build_parser
    from pipeline.cli.run import spec_from_arguments
    from serving.config import config_from_mapping

    parser = build_parser()

    def asked(*flags: str) -> tuple[str, int]:
        method = method_config(parser.parse_args(["ask", "a.txt", "-q", "Q?", *flags]))
        return method.template, method.reread_tokens

    assert asked() == ("verified-quotes", 6000)
    assert asked("--reread-tokens", "0") == ("verified-quotes", 0)
    assert asked("--reread-tokens", "3000") == ("verified-quotes", 3000)
    assert asked("--template", "memagent-reference") == ("memagent-reference", 0)
    assert asked("--template", "verified-quotes") == ("verified-quotes", 0)
    assert asked("--model", "smollm2-135m-instruct") == ("segment-first", 0)
    assert asked("--model", "org/any-other-model") == ("memagent-reference", 0)

    job = spec_from_arguments(parser.parse_args(["run", "--input", "d", "--output", "o"]))
    assert (job.method.template, job.method.reread_tokens) == ("verified-quotes", 6000)
    served = config_from_mapping({}).method
    assert (served.template, served.reread_tokens) == ("verified-quotes", 6000)
    named = config_from_mapping({"method": {"template": "segment-first"}}).method
    assert (named.template, named.reread_tokens) == ("segment-first", 0)
