"""`memstream report`: one run's results as a single self-contained HTML page.

`load_run` reads a run folder (answers, trajectory and errors as Parquet, and manifest.json);
`render_report` turns it into HTML without any I/O. The page loads nothing: its style, script and
charts are inline. Everything that comes from the data (document names, answers, memories,
quotes, errors) is untrusted and escaped, and the page's Content-Security-Policy allows only its
own style and script, by their sha256, so nothing a document or the model wrote can run.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import html
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from operators.core.chain import ChainStatus
from operators.core.evidence import says_not_in_document

Row = dict[str, Any]

REPORT_FILE = "report.html"
# Above this many model calls, the chart shows the mean of consecutive calls per bar.
MAX_CHART_BARS = 400
# A word with the whitespace after it: memory diffs are word by word.
_DIFF_TOKEN = re.compile(r"\S+\s*|\s+")

STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; color: #1d1d1f; background: #fff;
  max-width: 76rem; margin: 0 auto; padding: 1rem 1.5rem; }
h1 { font-size: 1.4rem; }
h2 { font-size: 1.15rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05rem; margin: .25rem 0; } h4 { font-size: .95rem; margin: .75rem 0 .25rem; }
table { border-collapse: collapse; width: 100%; margin: .5rem 0; }
th, td { text-align: left; vertical-align: top; padding: .25rem .5rem;
  border-bottom: 1px solid #eee; }
.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.counts { display: flex; flex-wrap: wrap; gap: .25rem 2rem; margin: 0; }
.counts div { display: flex; flex-direction: column-reverse; }
.counts dt { color: #666; font-size: .85rem; } .counts dd { margin: 0; font-size: 1.3rem; }
.mark { font-weight: 600; padding: 0 .35rem; border-radius: .25rem; white-space: nowrap; }
.good { background: #d9f2dd; color: #0b5d1e; } .bad { background: #fbe0e0; color: #8a1111; }
.neutral { background: #eee; color: #333; }
.muted { color: #666; } .error { color: #8a1111; }
section.chain { border: 1px solid #ddd; border-radius: .4rem; padding: .5rem 1rem; margin: 1rem 0; }
pre, blockquote { white-space: pre-wrap; overflow-wrap: anywhere; }
pre { background: #f7f7f7; padding: .5rem; margin: .25rem 0; font-size: .85rem; }
blockquote { margin: .25rem 0 .5rem 1rem; border-left: 3px solid #ccc; padding-left: .5rem; }
ins { background: #c8f0cf; text-decoration: none; } del { background: #f7d0d0; }
ol.steps { list-style: none; padding-left: 0; } ol.steps > li { margin-bottom: .75rem; }
.rejected li { color: #8a1111; } select { max-width: 24rem; }
:target { outline: 2px solid #f0a45d; outline-offset: 2px; }
.filters { position: sticky; top: 0; background: #fff; padding: .5rem 0; display: flex;
  flex-wrap: wrap; gap: 1rem; align-items: center; border-bottom: 1px solid #ddd; }
svg { max-width: 100%; height: auto; } svg text { font-size: 11px; fill: #444; }
svg .prompt { fill: #7aa6d8; } svg .completion { fill: #f0a45d; } svg .axis { stroke: #999; }
svg .latency { fill: none; stroke: #222; stroke-width: 1.5; }
[hidden] { display: none !important; }
"""

# Shows the filters (hidden without JS), hides the answers and chains they rule out, and opens
# the folded steps an evidence link points into.
SCRIPT = """
"use strict";
const filters = document.getElementById("filters");
const filtered = document.querySelectorAll("[data-document]");
const chains = document.querySelectorAll("section.chain");
function applyFilters() {
  const selects = Array.from(filters.querySelectorAll("select"));
  for (const item of filtered) {
    item.hidden = !selects.every((s) => s.value === "" || item.dataset[s.name] === s.value);
  }
  const shown = Array.from(chains).filter((chain) => !chain.hidden).length;
  document.getElementById("shown").textContent = shown + " of " + chains.length + " shown";
}
function openTarget() {
  const target = document.getElementById(decodeURIComponent(location.hash.slice(1)));
  for (let node = target; node; node = node.parentElement) {
    if (node.tagName === "DETAILS") node.open = true;
  }
}
filters.hidden = false;
filters.addEventListener("change", applyFilters);
filters.addEventListener("submit", (event) => event.preventDefault());
window.addEventListener("hashchange", openTarget);
applyFilters();
openTarget();
"""


class NotARunFolder(ValueError):
    """The folder is missing or holds no run's tables."""


@dataclass(frozen=True)
class RunData:
    folder_name: str
    answers: list[Row]
    trajectory: list[Row]
    errors: list[Row]
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    key: str  # the value the grounded filter selects on
    label: str
    tone: str  # CSS class: good, bad or neutral


OUTCOMES = {
    outcome.key: outcome
    for outcome in (
        Outcome("grounded", "grounded", "good"),
        Outcome("not-grounded", "NOT grounded", "bad"),
        Outcome("not-in-document", "not in the document", "neutral"),
        Outcome("no-answer", "no answer", "neutral"),
        Outcome("failed", "failed", "bad"),
        Outcome("unfinished", "unfinished", "neutral"),
    )
}


@dataclass(frozen=True)
class Chain:
    """One (document, question) pair: its answers row and its model calls in order."""

    anchor: str
    document_key: str
    answer: Row
    steps: list[Row]
    outcome: Outcome


# --- loading ---------------------------------------------------------------------------------


def load_run(folder: Path) -> RunData:
    if not folder.is_dir():
        raise NotARunFolder(f"{folder}: no such folder")
    answers = folder / "answers.parquet"
    if not answers.is_file():
        raise NotARunFolder(f"{folder} is not a run folder: it has no answers.parquet")
    manifest = folder / "manifest.json"
    return RunData(
        folder_name=folder.resolve().name,
        answers=_rows(answers),
        trajectory=_rows(folder / "trajectory.parquet"),
        errors=_rows(folder / "errors.parquet"),
        manifest=json.loads(manifest.read_text(encoding="utf-8")) if manifest.is_file() else {},
    )


def write_report(folder: Path, out: Path | None = None) -> Path:
    """Writes the report of the run in `folder` (by default to `folder/report.html`)."""
    run = load_run(folder)
    target = out if out is not None else folder / REPORT_FILE
    target.write_text(render_report(run), encoding="utf-8")
    return target


def _rows(path: Path) -> list[Row]:
    return pq.read_table(path).to_pylist() if path.is_file() else []


# --- the page --------------------------------------------------------------------------------


def render_report(run: RunData) -> str:
    chains = _chains(run)
    run_id = run.manifest.get("run_id") or _first(run.answers, "run_id") or run.folder_name
    title = f"memstream run {run_id}"
    body = "\n".join(
        [
            f"<h1>{escaped(title)}</h1>",
            _run_description(run),
            "<h2>Counts</h2>",
            _counts(run, chains),
            "<h2>Throughput</h2>",
            _throughput(run),
            _steps_chart(run.trajectory),
            f"<h2>Errors ({len(run.errors)})</h2>",
            _errors_table(run.errors),
            f"<h2>Answers ({len(chains)})</h2>",
            _filters(chains, _document_names(chains)),
            _answers_table(chains),
            *(_chain_section(chain) for chain in chains),
        ]
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{content_security_policy()}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escaped(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        f"{body}\n<script>{SCRIPT}</script>\n</body>\n</html>\n"
    )


def content_security_policy() -> str:
    """Nothing may load; only this module's inline style and script may apply and run."""
    return (
        f"default-src 'none'; script-src '{inline_hash(SCRIPT)}'; "
        f"style-src '{inline_hash(STYLE)}'; base-uri 'none'; form-action 'none'"
    )


def inline_hash(source: str) -> str:
    digest = hashlib.sha256(source.encode("utf-8")).digest()
    return "sha256-" + base64.b64encode(digest).decode("ascii")


def escaped(value: object) -> str:
    return "" if value is None else html.escape(str(value), quote=True)


def outcome_of(answer: Row) -> Outcome:
    if answer["status"] == ChainStatus.FAILED:
        return OUTCOMES["failed"]
    if answer["status"] != ChainStatus.DONE:
        return OUTCOMES["unfinished"]
    text = answer["answer"]
    if text is None or not text.strip():
        return OUTCOMES["no-answer"]
    if answer["grounded"]:
        return OUTCOMES["grounded"]
    if says_not_in_document(text):
        return OUTCOMES["not-in-document"]
    return OUTCOMES["not-grounded"]


def memory_diff(before: str, after: str) -> str:
    """`after` as HTML, with the words `before` did not have in <ins> and those it lost in
    <del>."""
    old, new = _DIFF_TOKEN.findall(before), _DIFF_TOKEN.findall(after)
    parts = []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for operation, old_start, old_end, new_start, new_end in matcher.get_opcodes():
        if operation == "equal":
            parts.append(escaped("".join(new[new_start:new_end])))
            continue
        if old_end > old_start:
            parts.append(f"<del>{escaped(''.join(old[old_start:old_end]))}</del>")
        if new_end > new_start:
            parts.append(f"<ins>{escaped(''.join(new[new_start:new_end]))}</ins>")
    return "".join(parts)


def _chains(run: RunData) -> list[Chain]:
    steps: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for step in run.trajectory:
        steps[step["source_uri"], step["question_id"]].append(step)
    answers = sorted(
        run.answers,
        key=lambda row: (row["name"] or "", row["source_uri"] or "", row["question_id"] or ""),
    )
    document_keys: dict[str, str] = {}
    chains = []
    for number, answer in enumerate(answers, start=1):
        document_key = document_keys.setdefault(
            answer["source_uri"], f"doc-{len(document_keys) + 1}"
        )
        chain_steps = sorted(
            steps.get((answer["source_uri"], answer["question_id"]), []),
            key=lambda row: row["step"],
        )
        chains.append(
            Chain(f"chain-{number}", document_key, answer, chain_steps, outcome_of(answer))
        )
    return chains


def _document_names(chains: Sequence[Chain]) -> dict[str, str]:
    return {
        chain.document_key: chain.answer["name"] or chain.answer["source_uri"] for chain in chains
    }


def _run_description(run: RunData) -> str:
    first = run.answers[0] if run.answers else {}
    sampling = first.get("sampling") or {}
    facts = {
        "folder": run.folder_name,
        "attempt": run.manifest.get("attempt"),
        "finished": run.manifest.get("finished_at"),
        "model": first.get("model"),
        "engine": " ".join(str(first[key]) for key in ("engine", "dtype") if first.get(key)),
        "template": first.get("template"),
        "chunk size": first.get("chunk_size"),
        "temperature": sampling.get("temperature"),
    }
    shown = [f"{escaped(name)}: {escaped(value)}" for name, value in facts.items() if value]
    return f'<p class="muted">{" · ".join(shown)}</p>'


def _counts(run: RunData, chains: Sequence[Chain]) -> str:
    outcomes = [chain.outcome.key for chain in chains]
    documents = {row["source_uri"] for row in run.answers} | {
        row["source_uri"] for row in run.errors
    }
    answered = {"grounded", "not-grounded", "not-in-document"}
    counts = {
        "documents": len(documents),
        "questions (document-question pairs)": len(chains),
        "answered": sum(key in answered for key in outcomes),
        "grounded": outcomes.count("grounded"),
        "not in the document": outcomes.count("not-in-document"),
        "no answer": outcomes.count("no-answer"),
        "failed": outcomes.count("failed"),
        "unfinished": outcomes.count("unfinished"),
        "errors": len(run.errors),
    }
    return _figures(counts.items())


def _figures(items: Iterable[tuple[str, object]]) -> str:
    cells = "".join(
        f"<div><dt>{escaped(name)}</dt><dd>{escaped(value)}</dd></div>" for name, value in items
    )
    return f'<dl class="counts">{cells}</dl>'


def _throughput(run: RunData) -> str:
    prompt = sum(row["prompt_tokens"] or 0 for row in run.answers)
    completion = sum(row["completion_tokens"] or 0 for row in run.answers)
    timings = [row["timings"] or {} for row in run.answers]
    compute_s = sum(timing.get("compute_s") or 0.0 for timing in timings)
    starts = [t["started_at"] for t in timings if isinstance(t.get("started_at"), datetime)]
    ends = [t["finished_at"] for t in timings if isinstance(t.get("finished_at"), datetime)]
    span_s = (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0
    tokens = prompt + completion
    figures: list[tuple[str, object]] = [
        ("prompt tokens", f"{prompt:,}"),
        ("completion tokens", f"{completion:,}"),
        ("compute seconds (sum over chains)", f"{compute_s:,.1f}"),
        ("tokens per compute second", f"{tokens / compute_s:,.1f}" if compute_s else "n/a"),
        ("first start to last finish, s", f"{span_s:,.1f}" if span_s else "n/a"),
        ("tokens per second over that span", f"{tokens / span_s:,.1f}" if span_s else "n/a"),
    ]
    if isinstance(run.manifest.get("elapsed_s"), (int, float)):
        figures.append(("this attempt end to end, s", f"{run.manifest['elapsed_s']:,.1f}"))
    return _figures(figures)


def _errors_table(errors: Sequence[Row]) -> str:
    if not errors:
        return "<p>No input failed.</p>"
    columns = ("name", "stage", "error_type", "message")
    head = "".join(f"<th>{name.replace('_', ' ')}</th>" for name in columns)
    rows = "".join(
        "<tr>" + "".join(f"<td>{escaped(error.get(name))}</td>" for name in columns) + "</tr>"
        for error in errors
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _filters(chains: Sequence[Chain], document_names: dict[str, str]) -> str:
    statuses = sorted({str(chain.answer["status"]) for chain in chains})
    outcomes = [o for o in OUTCOMES.values() if any(c.outcome is o for c in chains)]
    selects = {
        "document": document_names.items(),
        "status": [(status, status) for status in statuses],
        "grounded": [(outcome.key, outcome.label) for outcome in outcomes],
    }
    fields = "".join(
        f'<label>{name} <select name="{name}"><option value="">all</option>'
        + "".join(
            f'<option value="{escaped(value)}">{escaped(label)}</option>'
            for value, label in options
        )
        + "</select></label>"
        for name, options in selects.items()
    )
    return f'<form id="filters" class="filters" hidden>{fields}<output id="shown"></output></form>'


def _filter_attributes(chain: Chain) -> str:
    return (
        f'data-document="{chain.document_key}" data-status="{escaped(chain.answer["status"])}" '
        f'data-grounded="{chain.outcome.key}"'
    )


def _mark(outcome: Outcome) -> str:
    return f'<span class="mark {outcome.tone}">{escaped(outcome.label)}</span>'


def _answers_table(chains: Sequence[Chain]) -> str:
    rows = "".join(
        f"<tr {_filter_attributes(chain)}>"
        f'<td><a href="#{chain.anchor}">{escaped(chain.answer["name"])}</a></td>'
        f"<td>{escaped(chain.answer['question'])}</td>"
        f"<td>{escaped(chain.answer['answer'])}</td><td>{_mark(chain.outcome)}</td></tr>"
        for chain in chains
    )
    return (
        "<table><thead><tr><th>document</th><th>question</th><th>answer</th><th>grounded</th>"
        f"</tr></thead><tbody>{rows}</tbody></table>"
    )


def _chain_section(chain: Chain) -> str:
    answer = chain.answer
    step_ids = {
        step["segment_index"]: _step_id(chain, step)
        for step in chain.steps
        if step["kind"] == "update"
    }
    shown_answer = (
        escaped(answer["answer"])
        if answer["answer"] is not None
        else '<span class="muted">(none)</span>'
    )
    facts = [
        f"{answer['n_segments']} segments" if answer["n_segments"] is not None else "",
        f"{answer['n_tokens']:,} document tokens" if answer["n_tokens"] is not None else "",
        f"{(answer['prompt_tokens'] or 0) + (answer['completion_tokens'] or 0):,} tokens used",
        f"compute {(answer['timings'] or {}).get('compute_s') or 0:.1f} s",
        f"parser {answer['parser']}" if answer["parser"] else "",
        f"status {answer['status']}",
    ]
    parts = [
        f'<section class="chain" id="{chain.anchor}" {_filter_attributes(chain)}>',
        f"<h3>{escaped(answer['name'])}</h3>",
        f'<p class="muted">{escaped(answer["source_uri"])}</p>',
        f"<p><strong>Q:</strong> {escaped(answer['question'])}</p>",
        f"<p><strong>A:</strong> {shown_answer} {_mark(chain.outcome)}</p>",
    ]
    if answer["grounding_reason"]:
        parts.append(f"<p>{escaped(answer['grounding_reason'])}</p>")
    if answer["error"]:
        parts.append(f'<p class="error">{escaped(answer["error"])}</p>')
    if answer.get("parse_warnings"):
        warnings = "; ".join(answer["parse_warnings"])
        parts.append(f'<p class="muted">parse warnings: {escaped(warnings)}</p>')
    parts.append(f'<p class="muted">{escaped(" · ".join(fact for fact in facts if fact))}</p>')
    parts.append(_evidence_list(answer["evidence"] or [], step_ids))
    parts.append(_steps(chain))
    parts.append("</section>")
    return "\n".join(parts)


def _step_id(chain: Chain, step: Row) -> str:
    return f"{chain.anchor}-step-{int(step['step'])}"


def _evidence_list(evidence: Sequence[Row], step_ids: dict[int, str]) -> str:
    if not evidence:
        return "<h4>Evidence</h4><p>None found in the source.</p>"
    items = []
    for item in evidence:
        segment = f"segment {int(item['segment_index'])}"
        target = step_ids.get(item["segment_index"])
        where = [f'<a href="#{target}">{segment}</a>' if target else segment]
        if item["page"] is not None:
            where.append(f"page {int(item['page'])}")
        where.append(f"chars {int(item['char_start']):,}-{int(item['char_end']):,}")
        where.append(f"{escaped(item['matches'])} match, score {float(item['score'] or 0):.0f}")
        items.append(
            f'<li><span class="muted">{", ".join(where)}</span>'
            f"<blockquote>{escaped(item['quote'])}</blockquote></li>"
        )
    return f"<h4>Evidence</h4><ul>{''.join(items)}</ul>"


def _steps(chain: Chain) -> str:
    if not chain.steps:
        return "<p>No model calls recorded.</p>"
    items = []
    previous = ""
    for step in chain.steps:
        memory = step["memory_after"] or ""
        latency = step["latency_s"]
        head = [f"step {step['step']}"]
        if step["kind"] == "update":
            head.append(f"segment {step['segment_index']}")
            head.append(f"chars {step['char_start'] or 0:,}-{step['char_end'] or 0:,}")
            label, body = "memory after it (changes marked)", memory_diff(previous, memory)
            previous = memory
        else:
            label, body = "reply to the question", escaped(memory)
        head.append(f"{step['prompt_tokens'] or 0:,} + {step['completion_tokens'] or 0:,} tokens")
        head.append(f"{latency:.2f} s" if latency is not None else "")
        head.append(f"finish: {step['finish_reason']}" if step["finish_reason"] else "")
        rejected = step.get("rejected_quotes") or []
        rejected_list = (
            f"<p>{len(rejected)} reply line(s) dropped, not found in the segment:</p>"
            f'<ul class="rejected">{"".join(f"<li>{escaped(q)}</li>" for q in rejected)}</ul>'
            if rejected
            else ""
        )
        items.append(
            f'<li id="{_step_id(chain, step)}">'
            f'<span class="muted">{escaped(" · ".join(part for part in head if part))}, '
            f"{label}:</span>"
            f"<pre>{body}</pre>{rejected_list}</li>"
        )
    return (
        f"<details><summary>Memory after each segment ({len(chain.steps)} model calls)</summary>"
        f'<ol class="steps" start="0">{"".join(items)}</ol></details>'
    )


def _steps_chart(trajectory: Sequence[Row]) -> str:
    """Stacked bars of each model call's prompt and completion tokens, and a line of its
    latency, as inline SVG."""
    if not trajectory:
        return "<p>No model calls recorded.</p>"
    calls = [
        (row["prompt_tokens"] or 0, row["completion_tokens"] or 0, row["latency_s"] or 0.0)
        for row in trajectory
    ]
    per_bar = -(-len(calls) // MAX_CHART_BARS)
    bars = [
        tuple(
            sum(values) / len(values)
            for values in zip(*calls[start : start + per_bar], strict=True)
        )
        for start in range(0, len(calls), per_bar)
    ]
    width, height, left, right, top, bottom = 760, 220, 60, 60, 20, 30
    plot_width, plot_height = width - left - right, height - top - bottom
    base = top + plot_height
    max_tokens = max(prompt + completion for prompt, completion, _ in bars) or 1
    max_latency = max(latency for _, _, latency in bars) or 1
    bar_width = plot_width / len(bars)
    shapes, line = [], []
    for number, (prompt, completion, latency) in enumerate(bars):
        x = left + number * bar_width
        prompt_height = prompt / max_tokens * plot_height
        completion_height = completion / max_tokens * plot_height
        first = number * per_bar + 1
        calls_shown = f"call {first}" if per_bar == 1 else f"calls {first}+ (mean)"
        shapes.append(
            f"<g><title>{calls_shown}: {prompt:,.0f} prompt + {completion:,.0f} completion "
            f"tokens, {latency:.2f} s</title>"
            f'<rect class="prompt" x="{x:.1f}" y="{base - prompt_height:.1f}" '
            f'width="{bar_width * 0.85:.2f}" height="{prompt_height:.1f}"/>'
            f'<rect class="completion" x="{x:.1f}" '
            f'y="{base - prompt_height - completion_height:.1f}" width="{bar_width * 0.85:.2f}" '
            f'height="{completion_height:.1f}"/></g>'
        )
        line.append(f"{x + bar_width / 2:.1f},{base - latency / max_latency * plot_height:.1f}")
    axes = (
        f'<line class="axis" x1="{left}" y1="{base}" x2="{left + plot_width}" y2="{base}"/>'
        f'<text x="{left - 6}" y="{top + 4}" text-anchor="end">{max_tokens:,.0f}</text>'
        f'<text x="{left - 6}" y="{base}" text-anchor="end">0</text>'
        f'<text x="{left + plot_width + 6}" y="{top + 4}">{max_latency:.2f} s</text>'
        f'<text x="{left + plot_width + 6}" y="{base}">0 s</text>'
        f'<text x="{left}" y="{height - 8}">model calls 1-{len(calls):,}, chain by chain; '
        "bars: prompt (blue) and completion (orange) tokens; line: latency</text>"
    )
    return (
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        'aria-label="tokens and latency of each model call">'
        f'{axes}{"".join(shapes)}<polyline class="latency" points="{" ".join(line)}"/></svg>'
    )


def _first(rows: Sequence[Row], key: str) -> Any:
    return rows[0].get(key) if rows else None
