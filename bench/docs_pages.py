"""Writes the generated pages of the documentation site; `make docs` runs it before `mkdocs build`.

    .venv/bin/python bench/docs_pages.py           # writes docs/reference/ and docs/benchmarks/

- `docs/reference/`: every `memstream` command's flags, read from the real argparse parsers
  (`pipeline.cli.main.build_parser`, which also loads the commands registered by entry point);
  the job and server files (`examples/job.yaml`, `serving/example-config.yaml`) and the
  endpoint's API (`serving/README.md`) as they are; the import layers of `pyproject.toml`.
- `docs/benchmarks/`: one page for each results file of `bench/results/` (its Markdown, and the
  command, machine and date its run recorded), and an index of them.

Both folders are written whole on every run (and ignored by git): nothing in them is typed by
hand, so they cannot drift from the code and the results. `generate()` returns the pages
without writing them (tests/test_docs.py checks their links).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"
GENERATED = ("reference", "benchmarks")  # folders of docs/ that this script owns
DEFAULT_IN_HELP = re.compile(r" \(default: (.+)\)$")  # as a flag's help ends
WIDTH = "100"  # argparse's usage lines wrap at $COLUMNS

# A page's content: Markdown text, or a file (an image) copied as it is.
Page = str | Path

# bench script -> what its results page is called (the variant of the results file follows)
TITLES = {
    "accuracy_matrix": "Accuracy by model and memory strategy",
    "answer_replay": "Answer steps replayed on a saved evaluation",
    "bench_serving": "Serving overhead",
    "corpus_efficiency": "Corpus-scale scheduling",
    "demo_strategies": "Demo facts by memory strategy",
    "engine_efficiency": "Engine efficiency",
    "incremental": "Incremental runs",
    "learner_dtype": "Learner precision: float32 against bfloat16",
    "multi_question": "Several questions per document",
    "needle_update_probe": "Needle update probe",
    "pdf_parsers": "PDF parsers",
    "pdf_tables": "PDF table rows",
    "pipeline_overhead": "Ray Data job against the runner",
    "prefill_decode": "Prefill and decode speed",
    "prompt_lookup": "Prompt lookup",
    "reread_recall": "Re-read: is the figure shown to the model?",
    "reread_rendering": "Re-read: how the answer step shows its passages",
    "run": "make bench summary",
    "scaling": "Scaling with length",
    "soak": "Soak test of the endpoint",
    "step_budget": "Engine step budget",
    "streaming_reads": "Streaming reads",
    "train_demo": "Training on the CPU",
}
# results files whose name is not their script's
SCRIPT_OF = {"SUMMARY": "run", "serving": "bench_serving"}
# what a results file says of its machine and command, on a line of its own
MACHINE_LINES = (  # in order of preference
    re.compile(r"^Measured on (.+?)(?:, \d{4}-\d\d-\d\d[ T][\d:]+)?\.?$"),
    re.compile(r"^Machine: ([^;]+)"),
    re.compile(r"^CPU: ([^;]+)"),
)
COMMAND_LINE = re.compile(r"^Command:\s*`(.+)`\s*$")
PLACEHOLDER_MACHINE = "x86_64, cpu"  # what older results wrote when they did not look


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=DOCS, help="the site's docs_dir")
    args = parser.parse_args()
    pages = generate()
    write(pages, args.docs)
    counts = {folder: sum(p.startswith(folder + "/") for p in pages) for folder in GENERATED}
    print(
        f"docs_pages: wrote {counts['reference']} reference and "
        f"{counts['benchmarks']} benchmark files under {args.docs}"
    )
    return 0


def generate() -> dict[str, Page]:
    """Relative path under docs/ -> the page's text (or the file to copy there)."""
    pages: dict[str, Page] = {
        "reference/cli.md": cli_page(),
        "reference/files.md": files_page(),
        "reference/endpoint-api.md": endpoint_page(),
        "reference/layers.md": layers_page(),
    }
    pages.update(benchmark_pages())
    return pages


def write(pages: dict[str, Page], docs: Path) -> None:
    for folder in GENERATED:
        shutil.rmtree(docs / folder, ignore_errors=True)
    for relative, content in sorted(pages.items()):
        path = docs / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copyfile(content, path)
        else:
            path.write_text(content, encoding="utf-8")


# --- the command line -------------------------------------------------------------------------


def cli_page() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pipeline.cli.main import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # usage lines as wide as the page, wherever it is built
    try:
        return cli_markdown(build_parser())
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def cli_markdown(parser: argparse.ArgumentParser) -> str:
    lines = [
        "# Command line",
        "",
        "Every `memstream` command and its flags, generated from the command's own parsers "
        "when the site is built; `memstream COMMAND --help` prints the same.",
        "",
    ]
    commands = subcommands(parser)
    lines += ["| command | what it does |", "|---|---|"]
    for name, (summary, _) in commands.items():
        lines.append(f"| [`memstream {name}`](#memstream-{name}) | {cell(summary)} |")
    lines.append("")
    for name, (summary, sub) in commands.items():
        lines += command_section(f"memstream {name}", summary, sub, level=2)
    return "\n".join(lines)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, Any]]:
    """name -> (one-line help, parser), in the order the parser lists them."""
    out: dict[str, tuple[str, Any]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                out[name] = (helps.get(name, "") or (sub.description or "").split("\n")[0], sub)
    return out


def command_section(title: str, summary: str, parser: Any, level: int) -> list[str]:
    formatter = parser._get_formatter()
    usage = parser.format_usage().strip()
    lines = ["#" * level + f" {title}", ""]
    description = " ".join((parser.description or summary or "").split())
    if description:
        lines += [escape(description), ""]
    lines += ["```", usage, "```", ""]
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        ]
        if not actions:
            continue
        heading = {"options": "Options", "positional arguments": "Arguments"}.get(
            group.title or "", (group.title or "").capitalize()
        )
        lines += [f"**{heading}**", "", "| flag | default | meaning |", "|---|---|---|"]
        for action in actions:
            invocation = formatter._format_action_invocation(action)
            meaning = " ".join(formatter._expand_help(action).split()) if action.help else ""
            default = default_of(action)
            stated = DEFAULT_IN_HELP.search(meaning)
            if stated is not None:  # the help's own words go to the default column
                meaning = meaning[: stated.start()]
                if stated.group(1) != str(action.default):
                    default = cell(stated.group(1))
            lines.append(f"| `{invocation}` | {default} | {cell(meaning)} |")
        lines.append("")
    for name, (sub_summary, sub) in subcommands(parser).items():
        lines += command_section(f"{title} {name}", sub_summary, sub, level + 1)
    return lines


def default_of(action: argparse.Action) -> str:
    default = action.default
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "on" if default is True else "off"
    if default is None or default == argparse.SUPPRESS or default == []:
        return ""
    if isinstance(default, list | tuple):
        default = ",".join(map(str, default))
    return f"`{default}`"


def escape(text: str) -> str:
    """Plain text as Markdown: no HTML, emphasis or links made of it."""
    text = text.replace("\\", "\\\\").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([*_\[\]])", r"\\\1", text)


def cell(text: str) -> str:
    return escape(text).replace("|", "\\|")


# --- job and server files, the endpoint, the layers --------------------------------------------


def files_page() -> str:
    job = (ROOT / "examples" / "job.yaml").read_text(encoding="utf-8")
    serving = (ROOT / "serving" / "example-config.yaml").read_text(encoding="utf-8")
    return "\n".join(
        [
            "# Job and server files",
            "",
            "Copied from the repository when the site is built.",
            "",
            "## Job file",
            "",
            "`examples/job.yaml`, for `memstream run JOB.yaml` and `pipeline.job.run_job`: every "
            "section and key. Unknown keys are errors, named by their dotted path.",
            "",
            "```yaml",
            job.rstrip(),
            "```",
            "",
            *job_keys(),
            "## Server settings",
            "",
            "`serving/example-config.yaml`, for `memstream serve --config FILE`: every setting "
            "with its default (`memstream serve --print-config` prints the settings in effect).",
            "",
            "```yaml",
            serving.rstrip(),
            "```",
            "",
            *serve_keys(),
        ]
    )


def job_keys() -> list[str]:
    from connectors.engines.factory import EngineSpec
    from operators.config import DocumentLimits, MethodConfig
    from pipeline.cli.run import FLAGS
    from pipeline.job import ConcurrencySpec, JobSpec, OutputSpec

    sections = {
        None: JobSpec, "output": OutputSpec, "engine": EngineSpec, "method": MethodConfig,
        "limits": DocumentLimits, "concurrency": ConcurrencySpec,
    }  # fmt: skip
    intro = (
        "Every key of a job file, from the records that declare them (`pipeline.job.JobSpec` "
        "and its sections), with the `memstream run` flag that overrides it."
    )
    return keys_section("### Job file keys", intro, sections, FLAGS)


def serve_keys() -> list[str]:
    from connectors.engines.factory import EngineSpec
    from operators.config import MethodConfig
    from serving.cli import FLAGS
    from serving.config import ServerConfig

    sections = {"server": ServerConfig, "engine": EngineSpec, "method": MethodConfig}
    intro = (
        "The server settings a `memstream serve` flag overrides, from the records that declare "
        "them; the file above shows the other sections."
    )
    return keys_section("### Server setting keys", intro, sections, FLAGS)


def keys_section(
    heading: str, intro: str, sections: dict[str | None, type], flags: list[Any]
) -> list[str]:
    """A table of each leaf key of `sections`: its default, its meaning and its flag."""
    from pipeline.cli.flags import is_section, setting_flags, settings_fields

    flag_of = {
        (flag.section, flag.key): " ".join(
            f"`{name}`" for name in (flag.marker.short, flag.flag, flag.marker.negative) if name
        )
        for flag in flags
    }
    lines = [heading, "", intro, "", "| key | default | meaning | flag |", "|---|---|---|---|"]
    for section, record in sections.items():
        generated = {flag.key: flag for flag in setting_flags(record, section)}
        for key, info in settings_fields(record).items():
            if is_section(info):
                continue  # its own rows follow
            setting = generated.get(key)
            default = setting.shown_default() if setting else None
            if setting is None and not info.is_required() and info.default_factory is None:
                default = None if info.default is None else str(info.default)
            if not info.is_required() and info.default == ():
                default = None
            dotted = f"{section}.{key}" if section else key
            flag = flag_of.get((section, key))
            lines.append(
                f"| `{dotted}` | {cell(default or '')} | {cell(info.description or '')} | "
                f"{flag or ''} |"
            )
    return [*lines, ""]


def endpoint_page() -> str:
    text = (ROOT / "serving" / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join(
        [
            "# Endpoint API",
            "",
            "The reference of `memstream serve`, copied from `serving/README.md` when the site "
            "is built. The [endpoint guide](../guide/endpoint.md) shows how to run it.",
            *lines,
            "",
        ]
    )


def layers_page() -> str:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    linter = config["tool"]["importlinter"]
    lines = [
        "# Import layers",
        "",
        "Read from `[tool.importlinter]` in `pyproject.toml` when the site is built; "
        "`make lint` checks the contracts with import-linter. Root packages: "
        + ", ".join(f"`{name}`" for name in linter["root_packages"])
        + ".",
        "",
    ]
    for contract in linter.get("contracts", []):
        lines += [f"## {contract['name']}", "", f"Contract type: `{contract['type']}`.", ""]
        if contract.get("layers"):
            lines += ["From the top (may import everything below it) to the bottom:", ""]
            lines += ["| layer | packages |", "|---:|---|"]
            layers = contract["layers"]
            containers = contract.get("containers", [])
            prefix = f"{containers[0]}." if len(containers) == 1 else ""
            for number, layer in enumerate(layers):
                parts = re.split(r"[|:]", layer)
                names = ", ".join(f"`{prefix}{part.strip()}`" for part in parts)
                lines.append(f"| {len(layers) - number} | {names} |")
            lines.append("")
        for key in ("source_modules", "forbidden_modules", "ignore_imports"):
            if contract.get(key):
                values = ", ".join(f"`{value}`" for value in contract[key])
                lines += [f"{key.replace('_', ' ').capitalize()}: {values}.", ""]
    return "\n".join(lines)


# --- benchmarks --------------------------------------------------------------------------------


@dataclass
class Result:
    page: str  # path under docs/benchmarks/, without .md
    title: str
    markdown: Path
    data: Path | None
    command: str
    machine: str
    date: str
    images: list[Path]
    kind: str  # "benchmark" or "evaluation"


def benchmark_pages() -> dict[str, Page]:
    results = sorted(find_results(), key=lambda r: (r.kind, r.title.lower(), r.page))
    pages: dict[str, Page] = {}
    for result in results:
        pages[f"benchmarks/{result.page}.md"] = result_page(result)
        for image in result.images:
            pages[f"benchmarks/{result.page}/{image.name}"] = image
    pages["benchmarks/index.md"] = index_page(results)
    return pages


def find_results() -> Iterator[Result]:
    for markdown in sorted(RESULTS.glob("*.md")):
        data = markdown.with_suffix(".json")
        yield bench_result(markdown, data if data.exists() else None)
    for markdown in sorted(RESULTS.glob("**/results.md")):
        yield folder_result(markdown)


def script_of(stem: str) -> tuple[str, str]:
    """(bench script, variant) of a results file's name."""
    if stem in SCRIPT_OF:
        return SCRIPT_OF[stem], ""
    scripts = sorted((p.stem for p in (ROOT / "bench").glob("*.py")), key=len, reverse=True)
    for script in scripts:
        if stem == script or stem.startswith(script + "-"):
            return script, stem[len(script) + 1 :]
    return stem, ""


def bench_result(markdown: Path, data_path: Path | None) -> Result:
    script, variant = script_of(markdown.stem)
    text = markdown.read_text(encoding="utf-8")
    data = load_json(data_path)
    title = TITLES.get(script, script.replace("_", " ").capitalize())
    if variant:
        title += f" ({variant})"
    command = recorded_command(text, data, script)
    return Result(
        page=markdown.stem,
        title=title,
        markdown=markdown,
        data=data_path,
        command=command,
        machine=recorded_machine(text, data),
        date=recorded_date(data),
        images=[],
        kind="benchmark",
    )


def folder_result(markdown: Path) -> Result:
    folder = markdown.parent.relative_to(RESULTS)
    data_path = markdown.with_name("results.json")
    data = load_json(data_path if data_path.exists() else None)
    state = load_json(markdown.with_name("state.json"))
    text = markdown.read_text(encoding="utf-8")
    if data is not None:
        kind, title = "evaluation", f"memstream eval: {folder}"
        command = eval_command(data, folder)
        machines = sorted({c.get("machine", "") for c in data.get("configurations", [])} - {""})
        machine = "; ".join(machines) or recorded_machine(text, None)
        date = str(data.get("started_at", ""))
    else:
        kind, title = "benchmark", TITLES["train_demo"] + f" ({folder})"
        command = recorded_command(text, None, "train_demo")
        machine = recorded_machine(text, state)
        date = ""
    return Result(
        page=str(folder),
        title=title,
        markdown=markdown,
        data=data_path if data is not None else None,
        command=command,
        machine=machine,
        date=date,
        images=sorted(markdown.parent.glob("*.png")),
        kind=kind,
    )


def load_json(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.exists():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def recorded_command(text: str, data: dict[str, Any] | None, script: str) -> str:
    """The command as the run recorded it, or as rebuilt from its recorded arguments."""
    data = data or {}
    if isinstance(data.get("command"), str):
        return f"`{data['command']}`"
    for line in text.splitlines():
        match = COMMAND_LINE.match(line.strip())
        if match:
            return f"`{match.group(1)}`"
    base = f".venv/bin/python bench/{script}.py"
    if isinstance(data.get("arguments"), str):
        return f"`{base} {data['arguments']}`"
    first = text.lstrip().splitlines()[0] if text.strip() else ""
    if first.startswith("# bench/"):
        return f"`.venv/bin/python {first[2:].strip()}`"
    if isinstance(data.get("args"), dict):
        flags = []
        for key, value in data["args"].items():
            flag = "--" + key.replace("_", "-")
            if value is None or value is False:
                continue
            if value is True:
                flags.append(flag)
            elif isinstance(value, list):
                flags += [flag, *map(str, value)]
            else:
                flags += [flag, str(value)]
        return f"`{base} {shlex.join(flags)}` (rebuilt from the arguments the run recorded)"
    if (ROOT / "bench" / f"{script}.py").exists():
        return f"not recorded; the script is `bench/{script}.py`"
    return "not recorded"


def eval_command(data: dict[str, Any], folder: Path) -> str:
    settings = data.get("settings", {})
    labels: list[str] = []
    for configuration in data.get("configurations", []):
        label = configuration.get("configuration", {}).get("length_label")
        if label and label != "native" and label not in labels:
            labels.append(label)
    parts = ["memstream", "eval", "--tasks", ",".join(data.get("tasks", []))]
    if labels:
        parts += ["--lengths", ",".join(labels)]
    parts += ["--methods", ",".join(data.get("methods", []))]
    parts += ["--samples", str(data.get("samples_per_task_and_length", ""))]
    parts += ["--model", str(data.get("model", ""))]
    for key in ("chunk_size", "max_memory_tokens", "max_answer_tokens"):
        if key in settings:
            parts += ["--" + key.replace("_", "-"), str(settings[key])]
    for key, default in (("temperature", 0.0), ("top_p", 1.0), ("seed", 0)):
        if settings.get(key, default) != default:
            parts += ["--" + key.replace("_", "-"), str(settings[key])]
    if data.get("prompt_lookup_tokens"):
        parts += ["--prompt-lookup", str(data["prompt_lookup_tokens"])]
    parts += ["--output", f"bench/results/{folder}"]
    command = shlex.join(parts)
    return f"`{command}` (rebuilt from the settings in `results.json`; dtype {data.get('dtype')})"


def recorded_machine(text: str, data: dict[str, Any] | None) -> str:
    for pattern in MACHINE_LINES:
        for line in reversed(text.splitlines()):
            match = pattern.match(line.strip())
            if match:
                return match.group(1).strip()
    data = data or {}
    machine = data.get("machine")
    if isinstance(machine, dict):
        machine = machine.get("cpu")
    if isinstance(machine, str) and machine != PLACEHOLDER_MACHINE:
        return machine
    cpu = data.get("cpu")
    if isinstance(cpu, str):
        return cpu
    if isinstance(cpu, dict):
        name = cpu.get("model") or cpu.get("model_name") or "CPU not named"
        parts = [str(name)]
        if "cores" in cpu:
            parts.append(f"{cpu['cores']} cores")
        if "native_bf16" in cpu:
            parts.append("native bf16" if cpu["native_bf16"] else "no native bf16")
        elif "avx512f" in cpu:
            parts.append("AVX-512" if cpu["avx512f"] else "AVX2 only")
        return ", ".join(parts)
    return "not recorded"


def recorded_date(data: dict[str, Any] | None) -> str:
    data = data or {}
    date = data.get("date")
    if date is None and isinstance(data.get("machine"), dict):
        date = data["machine"].get("date")
    return str(date or "")


def result_page(result: Result) -> str:
    body = result.markdown.read_text(encoding="utf-8").strip().splitlines()
    subtitle = ""
    if body and body[0].startswith("# "):
        subtitle, body = body[0][2:].strip(), body[1:]
    sources = [result.markdown, *([result.data] if result.data else [])]
    lines = [f"# {result.title}", ""]
    if subtitle and subtitle != result.title:
        lines += [f"**{escape(subtitle)}**", ""]
    lines += [
        "| | |",
        "|---|---|",
        f"| command | {result.command.replace('|', chr(92) + '|')} |",
        f"| machine | {cell(result.machine)} |",
    ]
    if result.date:
        lines.append(f"| date | {cell(result.date)} |")
    files = ", ".join(f"`{path.relative_to(ROOT)}`" for path in sources)
    lines += [f"| results | {files} |", ""]
    lines += ["Generated from the results file; the text below is the run's own.", ""]
    lines += body
    for image in result.images:
        name = Path(result.page).name
        lines += ["", f"![{image.stem.replace('_', ' ')}]({name}/{image.name})"]
    return "\n".join(lines) + "\n"


def index_page(results: list[Result]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Every results file of `bench/results/`, each with the command, the machine and the "
        "date its run recorded. These pages are generated from the files when the site is "
        "built; [Performance](../performance.md) and [Accuracy](../accuracy.md) say what the "
        "figures mean.",
        "",
    ]
    for kind, heading in (("benchmark", "Benchmarks"), ("evaluation", "Evaluations")):
        chosen = [r for r in results if r.kind == kind]
        lines += [f"## {heading}", "", "| results | machine | date |", "|---|---|---|"]
        for result in chosen:
            date = result.date[:10]
            lines.append(
                f"| [{cell(result.title)}]({result.page}.md) | {cell(result.machine)} | {date} |"
            )
        lines.append("")
    paged = {r.markdown.with_suffix(".json") for r in results} | {r.data for r in results if r.data}
    data_only = [p for p in sorted(RESULTS.glob("*.json")) if p not in paged]
    if data_only:
        lines += [
            "## Data files without a page",
            "",
            "Intermediate data kept with the results (e.g. the finished runs of a benchmark "
            "measured over several sittings, which `--resume` reads):",
            "",
        ]
        lines += [f"- `{path.relative_to(ROOT)}`" for path in data_only]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
