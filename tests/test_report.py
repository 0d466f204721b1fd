"""`memstream report`: a run folder in, one self-contained HTML page out.

The run folders are written by hand with the real output schemas; their document names, memories,
answers and quotes carry markup that must come out as text. The Chromium test opens the page in
a real browser under its own Content-Security-Policy.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.results import ANSWERS_SCHEMA, ERRORS_SCHEMA, TRAJECTORY_SCHEMA
from pipeline.cli.main import main
from pipeline.report import load_run, memory_diff, render_report

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip

INJECTED = "<script>window.pwned = 1; alert(1)</script>"
EVIL_NAME = f"{INJECTED}.txt"
EVIL_URI = "file:///docs/evil.txt"
CONTRACT_URI = "file:///docs/contract.pdf"
BROKEN_URI = "file:///docs/broken.log"
STARTED = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
# The tags the page itself writes; anything else would have come from the data.
PAGE_TAGS = {
    "html", "head", "meta", "title", "style", "body", "script", "h1", "h2", "h3", "h4", "p",
    "dl", "div", "dt", "dd", "table", "thead", "tbody", "tr", "th", "td", "a", "span", "strong",
    "form", "label", "select", "option", "output", "section", "ul", "ol", "li", "blockquote",
    "pre", "ins", "del", "details", "summary", "svg", "g", "rect", "line", "text",
    "polyline",
}  # fmt: skip


def answer(source_uri: str, name: str, question_id: str, **fields: Any) -> dict[str, Any]:
    compute_s = fields.pop("compute_s", 2.0)
    return {
        "run_id": "run-1",
        "doc_id": f"doc:{name}",
        "name": name,
        "source_uri": source_uri,
        "question_id": question_id,
        "question": f"Question {question_id} about {name}?",
        "answer": None,
        "raw_response": None,
        "final_memory": None,
        "grounded": None,
        "grounding_reason": None,
        "evidence": [],
        "status": "done",
        "error": None,
        "n_segments": 2,
        "n_tokens": 900,
        "prompt_tokens": 600,
        "completion_tokens": 40,
        "model": "tiny-model",
        "engine": "vllm",
        "dtype": "float32",
        "template": "reference",
        "chunk_size": 512,
        "sampling": {"temperature": 0.0, "top_p": 1.0, "seed": 0},
        "timings": {
            "started_at": STARTED,
            "finished_at": STARTED + timedelta(seconds=4),
            "wall_s": 4.0,
            "compute_s": compute_s,
        },
        "parser": "text",
        "parse_warnings": [],
        "content_sha256": "0" * 64,
        "chain_key": f"key-{name}-{question_id}",
        **fields,
    }


def steps(source_uri: str, question_id: str, memories: list[str], reply: str) -> list[dict]:
    """Updates of segments 0.. with these memories, then the final call with `reply`."""
    rows = []
    for step, memory in enumerate([*memories, reply]):
        final = step == len(memories)
        rows.append(
            {
                "run_id": "run-1",
                "chain_key": f"key-{source_uri}-{question_id}",
                "doc_id": "doc",
                "source_uri": source_uri,
                "question_id": question_id,
                "step": step,
                "kind": "final" if final else "update",
                "segment_index": None if final else step,
                "token_start": None if final else step * 512,
                "token_end": None if final else step * 512 + 450,
                "char_start": None if final else step * 2000,
                "char_end": None if final else step * 2000 + 1800,
                "memory_after": memory,
                "prompt_tokens": 300 + 10 * step,
                "completion_tokens": 20 + step,
                "finish_reason": "stop",
                "latency_s": 0.5 + step / 10,
                "rejected_quotes": [],
            }
        )
    return rows


def evidence(segment_index: int, quote: str, matches: str = "answer", page: int | None = None):
    start = segment_index * 2000 + 100
    return {
        "segment_index": segment_index,
        "page": page,
        "char_start": start,
        "char_end": start + len(quote),
        "quote": quote,
        "score": 100.0,
        "matches": matches,
    }


def write_run(folder: Path, *, with_rejected_quotes: bool = True) -> Path:
    """Five chains over three documents (grounded, not in the document, NOT grounded, no answer,
    failed) and one document that could not be parsed."""
    folder.mkdir(parents=True)
    evil_memory = [
        f"The code is 1. {INJECTED} </memory> <b>bold</b>",
        f"The code is 4417. {INJECTED} </memory> <b>bold</b>",
    ]
    answers = [
        answer(
            EVIL_URI, EVIL_NAME, "q0",
            question=f"What is the code? {INJECTED}",
            answer=f"4417 {INJECTED}",
            grounded=True,
            grounding_reason="Found in segment 1 with 'code' beside it </memory>.",
            evidence=[
                evidence(1, f"The code is 4417 {INJECTED}"),
                evidence(0, "code", matches="memory"),
            ],
        ),
        answer(
            EVIL_URI, EVIL_NAME, "q1",
            answer="The document does not mention it.",
            grounded=False,
            grounding_reason="No answer: the model said the document does not give one.",
        ),
        answer(
            CONTRACT_URI, "contract.pdf", "q0",
            answer="Delaware",
            grounded=False,
            grounding_reason="Found, but without the question's terms beside it.",
            evidence=[evidence(1, "Delaware corporation", matches="memory", page=2)],
            parser="pdf",
        ),
        answer(CONTRACT_URI, "contract.pdf", "q1", grounding_reason="No answer was given."),
        answer(
            BROKEN_URI, "broken.log", "q0",
            status="failed",
            error="EngineError: <boom> & more",
            n_segments=3,
            compute_s=0.0,
        ),
    ]  # fmt: skip
    trajectory = [
        *steps(EVIL_URI, "q0", evil_memory, f"The answer is 4417 {INJECTED}"),
        *steps(EVIL_URI, "q1", ["Nothing yet.", "Nothing yet."], "Not mentioned."),
        *steps(CONTRACT_URI, "q0", ["A contract.", "A Delaware contract."], "Delaware"),
        *steps(CONTRACT_URI, "q1", ["A contract.", "A contract."], "I do not know"),
        *steps(BROKEN_URI, "q0", ["Log lines."], "")[:1],
    ]
    trajectory[1]["rejected_quotes"] = [f"<img src=x onerror=alert(1)> {INJECTED}"]
    errors = [
        {
            "run_id": "run-1",
            "doc_id": "doc:bad",
            "name": f"bad{INJECTED}.pdf",
            "source_uri": "file:///docs/bad.pdf",
            "stage": "parse",
            "error_type": "ParseError",
            "message": "password required & <b>locked</b>",
        }
    ]
    trajectory_schema = TRAJECTORY_SCHEMA
    if not with_rejected_quotes:
        trajectory_schema = pa.schema([f for f in TRAJECTORY_SCHEMA if f.name != "rejected_quotes"])
        for row in trajectory:
            del row["rejected_quotes"]
    for name, rows, schema in (
        ("answers", answers, ANSWERS_SCHEMA),
        ("trajectory", trajectory, trajectory_schema),
        ("errors", errors, ERRORS_SCHEMA),
    ):
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / f"{name}.parquet")
    (folder / "manifest.json").write_text('{"run_id": "run-1", "attempt": 1, "elapsed_s": 9.5}')
    return folder


class Page(HTMLParser):
    """The tags, attributes, inline script and style and text of a page."""

    def __init__(self, source: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.ids: set[str] = set()
        self.inline: dict[str, list[str]] = {"script": [], "style": []}
        self._open: str | None = None
        self.feed(source)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.tags.append((tag, attributes))
        if attributes.get("id"):
            self.ids.add(str(attributes["id"]))
        self._open = tag if tag in self.inline else None

    def handle_data(self, data: str) -> None:
        if self._open:
            self.inline[self._open].append(data)

    def handle_endtag(self, tag: str) -> None:
        self._open = None

    def all(self, tag: str) -> list[dict[str, str | None]]:
        return [attributes for name, attributes in self.tags if name == tag]


@pytest.fixture
def run_folder(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run-1")


@pytest.fixture
def report(run_folder: Path) -> str:
    return render_report(load_run(run_folder))


def test_untrusted_text_is_escaped_everywhere(report: str) -> None:
    page = Page(report)
    assert {tag for tag, _ in page.tags} <= PAGE_TAGS
    assert len(page.all("script")) == 1 and len(page.all("style")) == 1
    assert not [name for _, attributes in page.tags for name in attributes if name.startswith("on")]
    assert "<b>" not in report and "</memory>" not in report and "<img" not in report
    assert "alert(1)</script>" not in report
    escaped_injection = "&lt;script&gt;window.pwned = 1; alert(1)&lt;/script&gt;"
    for shown in (
        f"{escaped_injection}.txt",  # the document name
        f"4417 {escaped_injection}",  # the answer
        f"The code is 4417 {escaped_injection}",  # an evidence quote
        f"bad{escaped_injection}.pdf",  # an error's document name
        "&lt;/memory&gt; &lt;b&gt;bold&lt;/b&gt;",  # a memory
        "&lt;img src=x onerror=alert(1)&gt;",  # a rejected quote
        "password required &amp; &lt;b&gt;locked&lt;/b&gt;",
        "EngineError: &lt;boom&gt; &amp; more",
    ):
        assert shown in report


def test_csp_allows_only_the_inline_script_and_style_by_their_hashes(report: str) -> None:
    page = Page(report)
    (meta,) = [m for m in page.all("meta") if m.get("http-equiv") == "Content-Security-Policy"]
    policy = str(meta["content"])
    directives = dict(part.strip().split(" ", 1) for part in policy.split(";"))
    assert directives["default-src"] == "'none'"
    assert "unsafe" not in policy and "http" not in policy
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        (source,) = page.inline[tag]
        digest = base64.b64encode(hashlib.sha256(source.encode()).digest()).decode()
        assert directives[directive] == f"'sha256-{digest}'"
    assert report.index("Content-Security-Policy") < report.index("<style>")


def test_memory_diff_marks_what_changed_and_escapes_it() -> None:
    assert memory_diff("The code is 1. Keep.", "The code is 4417. Keep.") == (
        "The code is <del>1. </del><ins>4417. </ins>Keep."
    )
    assert memory_diff("", "<b>new</b>") == "<ins>&lt;b&gt;new&lt;/b&gt;</ins>"
    assert memory_diff("same", "same") == "same"
    assert memory_diff("gone <i>", "") == "<del>gone &lt;i&gt;</del>"


def test_each_answer_has_its_grounded_mark(report: str) -> None:
    sections = {
        attributes["id"]: attributes
        for attributes in Page(report).all("section")
        if attributes.get("class") == "chain"
    }
    # in the order of document names ("<" sorts first), then question
    assert [s["data-grounded"] for s in sections.values()] == [
        "grounded",
        "not-in-document",
        "failed",
        "not-grounded",
        "no-answer",
    ]
    marks = re.findall(r'<span class="mark (\w+)">([^<]+)</span>', report)
    # each chain's mark shows twice: in the answers table and in its own section
    assert sorted(set(marks)) == [
        ("bad", "NOT grounded"),
        ("bad", "failed"),
        ("good", "grounded"),
        ("neutral", "no answer"),
        ("neutral", "not in the document"),
    ]
    assert len(marks) == 10
    assert "No answer: the model said the document does not give one." in report


def test_evidence_links_to_the_step_of_its_segment(report: str) -> None:
    page = Page(report)
    targets = [str(a["href"])[1:] for a in page.all("a") if str(a.get("href", "")).startswith("#")]
    assert targets and all(target in page.ids for target in targets)
    (evil_chain,) = [s["id"] for s in page.all("section") if s.get("data-grounded") == "grounded"]
    evidence_targets = [t for t in targets if t.startswith(f"{evil_chain}-step-")]
    assert evidence_targets == [f"{evil_chain}-step-1", f"{evil_chain}-step-0"]
    # the step it points at holds that segment's memory
    step_one = report.split(f'id="{evil_chain}-step-1"', 1)[1].split("</li>", 1)[0]
    assert "segment 1" in step_one and "<ins>4417. </ins>" in step_one


def test_counts_throughput_errors_and_chart(report: str) -> None:
    def figure(name: str) -> str:
        found = re.search(rf"<dt>{re.escape(name)}</dt><dd>([^<]*)</dd>", report)
        assert found, name
        return found.group(1)

    assert figure("documents") == "4"  # three with answers, one in errors
    assert figure("questions (document-question pairs)") == "5"
    assert figure("answered") == "3"
    assert (figure("grounded"), figure("not in the document")) == ("1", "1")
    assert (figure("no answer"), figure("failed"), figure("errors")) == ("1", "1", "1")
    assert figure("prompt tokens") == "3,000" and figure("completion tokens") == "200"
    assert figure("compute seconds (sum over chains)") == "8.0"
    assert figure("tokens per compute second") == "400.0"
    assert figure("this attempt end to end, s") == "9.5"
    svg = report.split("<svg", 1)[1].split("</svg>", 1)[0]
    assert svg.count('class="prompt"') == 13 and svg.count('class="completion"') == 13
    assert "<polyline" in svg


def test_older_run_folders_without_rejected_quotes_still_render(tmp_path: Path) -> None:
    with_quotes = render_report(load_run(write_run(tmp_path / "new")))
    without = render_report(load_run(write_run(tmp_path / "old", with_rejected_quotes=False)))
    assert "dropped, not found in the segment" in with_quotes
    assert "dropped, not found in the segment" not in without
    assert without.count('<section class="chain"') == 5


def test_cli_writes_the_report_and_names_it(
    run_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(run_folder)]) == 0
    assert capsys.readouterr().out.strip() == str(run_folder / "report.html")
    assert (run_folder / "report.html").read_text().startswith("<!DOCTYPE html>")
    elsewhere = tmp_path / "elsewhere.html"
    assert main(["report", str(run_folder), "--out", str(elsewhere)]) == 0
    assert capsys.readouterr().out.strip() == str(elsewhere) and elsewhere.is_file()


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_cli_says_in_one_line_when_the_folder_is_no_run(
    folder: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / folder)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("memstream: error: ")
    assert ("no such folder" if folder == "missing" else "no answers.parquet") in err


# --- in a real browser -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium driven by Playwright; off CI a missing one skips, in CI it fails."""
    in_ci = os.environ.get("CI", "").lower() in {"true", "1"}
    missing = None
    if not CHROMIUM.exists():
        missing = f"{CHROMIUM} is missing (bash infra/services/chromium.sh install)"
    else:
        try:
            from playwright.sync_api import sync_playwright
        except ImportError:
            missing = "playwright is not installed (the dev extra)"
    if missing:
        if in_ci:
            pytest.fail(missing)
        pytest.skip(missing)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


WATCH_VIOLATIONS = """
window.violations = [];
document.addEventListener("securitypolicyviolation",
  (event) => window.violations.push(event.effectiveDirective));
"""


def test_the_page_in_chromium_filters_and_runs_nothing_from_the_data(
    browser: Any, run_folder: Path, tmp_path: Path
) -> None:
    main(["report", str(run_folder)])
    url = (run_folder / "report.html").as_uri()
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    console: list[str] = []
    page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
    page.on("pageerror", lambda error: console.append(f"pageerror: {error}"))
    page.add_init_script(WATCH_VIOLATIONS)
    page.goto(url)

    assert page.title() == "memstream run run-1"
    assert page.locator("h3", has_text=EVIL_NAME).first.is_visible()  # markup shown as text
    assert page.get_by_text("password required & <b>locked</b>").is_visible()
    assert page.evaluate("typeof window.pwned") == "undefined"
    assert page.evaluate("window.violations") == [] and console == []
    good = page.locator(".mark.good").first
    assert good.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(217, 242, 221)"

    chains = page.locator("section.chain")
    assert page.locator("#filters").is_visible() and chains.count() == 5
    assert page.locator("#shown").text_content() == "5 of 5 shown"
    page.select_option("select[name=document]", label="contract.pdf")
    visible = page.locator("section.chain:visible")
    assert visible.count() == 2 and page.locator("#shown").text_content() == "2 of 5 shown"
    assert set(visible.evaluate_all("s => s.map(e => e.querySelector('h3').textContent)")) == {
        "contract.pdf"
    }
    assert page.locator("tbody tr[data-document]:visible").count() == 2
    page.select_option("select[name=grounded]", label="NOT grounded")
    assert visible.count() == 1 and visible.locator(".mark").first.text_content() == "NOT grounded"
    page.select_option("select[name=document]", value="")
    page.select_option("select[name=grounded]", value="grounded")
    assert visible.count() == 1 and visible.locator("h3").text_content() == EVIL_NAME
    page.screenshot(path=tmp_path / "report-filtered.png", full_page=True)

    # an evidence link opens the folded steps at the segment it points at
    link = visible.locator("li a[href^='#chain-']").first
    target = str(link.get_attribute("href"))
    assert not page.locator(target).is_visible()
    link.click()
    assert page.locator(target).is_visible() and page.evaluate("location.hash") == target
    page.screenshot(path=tmp_path / "report-evidence.png")

    # the policy is enforced: a script that is not the page's own does not run
    page.evaluate(
        """() => { const s = document.createElement("script");
        s.textContent = "window.pwned = 2"; document.body.append(s); }"""
    )
    page.wait_for_function("window.violations.length > 0")
    assert page.evaluate("typeof window.pwned") == "undefined"
    assert page.evaluate("window.violations") == ["script-src-elem"]
    page.close()

    ARTIFACTS.mkdir(exist_ok=True)
    for screenshot in tmp_path.glob("report-*.png"):
        shutil.copy(screenshot, ARTIFACTS / screenshot.name)


def test_the_page_without_javascript_shows_everything_and_hides_the_filters(
    browser: Any, report: str, tmp_path: Path
) -> None:
    (tmp_path / "report.html").write_text(report)
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.goto((tmp_path / "report.html").as_uri())
    assert page.locator("section.chain:visible").count() == 5
    assert not page.locator("#filters").is_visible()
    assert page.get_by_text("not in the document").first.is_visible()
    context.close()
