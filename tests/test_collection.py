"""Questions over a collection: one chain reads several documents in order (fake engine, word
tokenizer; no model). Segments stay inside their document, each document is headed, quotes and
evidence name their document, and one document alone reads exactly as before."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from connectors.engines.fake import FactEngine, WordTokenizer
from operators.config import MethodConfig
from operators.core.chain import MemoryChain, StepKind
from operators.core.collection import (
    Member,
    collection_sha256,
    combined_text,
    order_members,
    segment_collection,
    strip_labels,
)
from operators.core.document import Document
from operators.core.evidence import find_evidence
from operators.core.retrieval import render_passages, split_passages
from operators.core.segmentation import SegmentationConfig
from operators.core.templates import get_template_set
from operators.engine import GenerationRequest
from operators.runner import ChainRunner
from pipeline.ask import PreparedDocument, answer, prepare, prepare_collection

QUESTION = "Which facts are there?"
ALPHA = (
    "Alpha opens the first filing.\nThe amber line says fact-amber is kept.\n"
    + "Filler words of the first filing. " * 12
    + "\nThe coral line says fact-coral is kept."
)
BETA = (
    "Beta opens the second filing.\nThe blue line says fact-blue is kept.\n"
    + "Filler words of the second filing. " * 12
    + "\nThe end."
)


def members() -> list[Member]:
    return [
        Member("docs/alpha.txt", "alpha.txt", ALPHA, mtime=2_000_000_000.0),
        Member("docs/beta.txt", "beta.txt", BETA, mtime=1_000_000_000.0),
    ]


def run(document: PreparedDocument, engine: FactEngine | None = None) -> FactEngine:
    engine = engine or FactEngine()
    runner = ChainRunner(engine, MethodConfig().sampling())
    document.results = asyncio.run(answer(runner, [document]))[document.uri]  # type: ignore[attr-defined]
    return engine


def method(template: str = "memagent-reference", chunk_size: int = 16) -> MethodConfig:
    return MethodConfig(chunk_size=chunk_size, template=template)


@pytest.mark.parametrize("snap_window", [0, 5])
def test_segments_never_cross_a_document_boundary(snap_window: int) -> None:
    ordered = order_members(members(), "listed")
    config = SegmentationConfig(chunk_size=16, snap_window=snap_window)
    read = segment_collection(ordered, WordTokenizer(), config)

    assert [piece.index for piece in read.segments] == list(range(len(read.segments)))
    by_document: dict[str, list[str]] = {}
    for piece in read.segments:
        text = {m.doc_id: m.text for m in members()}[piece.doc_id]
        assert piece.text == text[piece.char_start : piece.char_end]  # inside its own document
        assert piece.document is not None and piece.document.name == Path(piece.doc_id).name
        by_document.setdefault(piece.doc_id, []).append(piece.text)
    assert list(by_document) == ["docs/alpha.txt", "docs/beta.txt"]  # in order, not interleaved
    assert "".join(by_document["docs/alpha.txt"]) == ALPHA
    assert "".join(by_document["docs/beta.txt"]) == BETA
    assert read.n_tokens == sum(len(WordTokenizer()(m.text)["input_ids"]) for m in members())
    assert [ref.label for ref in read.documents] == ["doc 1: alpha.txt", "doc 2: beta.txt"]


def test_orders_as_listed_by_name_or_by_modification_time() -> None:
    listed = [m.name for m, _ in order_members(members(), "listed")]
    by_name = [m.name for m, _ in order_members(list(reversed(members())), "name")]
    by_mtime = order_members(members(), "mtime")
    assert listed == by_name == ["alpha.txt", "beta.txt"]
    assert [(m.name, key) for m, key in by_mtime] == [
        ("beta.txt", "modified 2001-09-09"),
        ("alpha.txt", "modified 2033-05-18"),
    ]
    with pytest.raises(ValueError, match="order_by must be one of"):
        order_members(members(), "date")
    with pytest.raises(ValueError, match="no modification time for a"):
        order_members([Member("a", "a", "text")], "mtime")


def test_orders_by_a_metadata_field_ties_keeping_the_listed_order() -> None:
    def filed(*values: object) -> list[Member]:
        return [
            Member(f"docs/{i}.txt", f"{i}.txt", "text", metadata={} if v is None else {"filed": v})
            for i, v in enumerate(values)
        ]

    dates = order_members(
        filed("2023-05-02", "2022-08-01", "2023-05-02", "2023-01-31"), "metadata.filed"
    )
    assert [(m.name, key) for m, key in dates] == [
        ("1.txt", "filed 2022-08-01"),
        ("3.txt", "filed 2023-01-31"),
        ("0.txt", "filed 2023-05-02"),  # a tie: as listed
        ("2.txt", "filed 2023-05-02"),
    ]
    assert combined_text(dates).startswith("## Document 1 of 4: 1.txt (filed 2022-08-01)\n")
    numbers = order_members(filed(10, 9, 2.5), "metadata.filed")  # as numbers, not as text
    assert [m.name for m, _ in numbers] == ["2.txt", "1.txt", "0.txt"]
    mixed = order_members(filed(10, "9"), "metadata.filed")  # not all numbers: as text
    assert [m.name for m, _ in mixed] == ["0.txt", "1.txt"]
    (long,) = order_members(filed("a  long\nvalue " * 10), "metadata.filed")
    assert long[1].startswith("filed a long value a long") and len(long[1]) == len("filed ") + 40

    with pytest.raises(ValueError, match=r"^no metadata\.filed for 1\.txt, 3\.txt$"):
        order_members(filed("2023", None, "2022", None), "metadata.filed")
    with pytest.raises(ValueError, match=r"no metadata\.filed for 0\.txt"):
        order_members([Member("a", "0.txt", "text", metadata={"filed": None})], "metadata.filed")
    for refused in ("metadata.", "metadata. ", "date", "meta.filed"):
        with pytest.raises(ValueError, match=r"order_by must be one of .* or metadata\.<key>"):
            order_members(filed("2023"), refused)


def test_each_document_is_headed_and_the_memory_carries_across() -> None:
    document = prepare_collection(
        "c", members(), [QUESTION], WordTokenizer(), method(), order_by="mtime"
    )
    engine = run(document)

    updates = [r.prompt for r in engine.requests if "<section>" in r.prompt]
    assert len(updates) == len(document.segments)
    for prompt, piece in zip(updates, document.segments, strict=True):
        assert piece.document is not None
        header = piece.document.header(continued=piece.token_start > 0)
        assert f"<section>\n{header}\n\n" in prompt
    assert "## Document 1 of 2: beta.txt (modified 2001-09-09)" in updates[0]
    assert "## Document 1 of 2, continued: beta.txt (modified 2001-09-09)" in updates[1]
    firsts = [p for p in updates if "## Document 2 of 2: alpha.txt (modified 2033-05-18)" in p]
    assert len(firsts) == 1
    # the memory read beta first and still holds its fact when alpha's facts come in
    (result,) = document.results  # type: ignore[attr-defined]
    assert result.answer == "fact-blue, fact-amber, fact-coral"


def test_verified_quotes_are_kept_with_their_documents_label() -> None:
    document = prepare_collection(
        "c", members(), [QUESTION], WordTokenizer(), method("verified-quotes")
    )
    run(document)
    (result,) = document.results  # type: ignore[attr-defined]
    lines = result.final_memory.splitlines()
    assert lines == [
        "[doc 1: alpha.txt] The amber line says fact-amber is kept.",
        "[doc 1: alpha.txt] The coral line says fact-coral is kept.",
        "[doc 2: beta.txt] The blue line says fact-blue is kept.",
    ]
    assert strip_labels(result.final_memory).splitlines()[0].startswith("The amber line")


def test_the_same_quote_in_two_documents_is_kept_once_for_each() -> None:
    templates = get_template_set("verified-quotes")
    memory = templates.initial_memory
    for label in ("doc 1: a", "doc 1: a", "doc 2: b"):
        section = "Revenue was 10 in the quarter.\nOther text."
        memory = templates.next_memory(
            memory, "Revenue was 10 in the quarter.", section, 4000, label=label
        ).memory
    assert memory.splitlines() == [
        "[doc 1: a] Revenue was 10 in the quarter.",
        "[doc 2: b] Revenue was 10 in the quarter.",
    ]


def test_an_appending_memory_labels_its_lines_but_not_a_none_reply() -> None:
    templates = get_template_set("append-evidence")
    start = templates.initial_memory
    kept = templates.next_memory(start, "line one\nline two", "section", 4000, label="doc 2: b")
    assert kept.memory == "[doc 2: b] line one\n[doc 2: b] line two"
    assert templates.next_memory(start, "NONE", "section", 4000, label="doc 2: b").memory == start
    overwrite = get_template_set("memagent-reference")
    assert overwrite.next_memory(start, "mine", "section", 4000, label="doc 2: b").memory == "mine"


def test_evidence_names_its_document_and_that_documents_page() -> None:
    first = "Cover page of the first filing.\n" + "Words. " * 30 + "\niPhone: $ 40,665; $ 39,570"
    second = "Cover page.\n" + "More words. " * 20 + "\niPhone: $ 51,334; $ 50,570"
    collection = [
        Member("q3.pdf", "2022 Q3.pdf", first, page_starts=(0, 100)),
        Member("q2.pdf", "2023 Q2.pdf", second, page_starts=(0, 50, 120)),
    ]
    read = segment_collection(
        order_members(collection, "listed"), WordTokenizer(), SegmentationConfig(chunk_size=20)
    )
    memory = "[doc 2: 2023 Q2.pdf] iPhone: $ 51,334; $ 50,570"
    grounding = find_evidence("What were iPhone net sales?", "$51,334", memory, read.segments)

    assert grounding.grounded, grounding.reason
    best = grounding.evidence[0]
    assert best.document == "doc 2: 2023 Q2.pdf"
    assert second[best.char_start : best.char_end] == best.quote == "51,334"
    assert best.page == 3
    assert "of doc 2: 2023 Q2.pdf, page 3" in grounding.reason
    assert best.as_dict()["document"] == "doc 2: 2023 Q2.pdf"
    # the memory's labelled quote is found in its source without its label
    memory_items = [item for item in grounding.evidence if item.matches == "memory"]
    assert memory_items and memory_items[0].document == "doc 2: 2023 Q2.pdf"

    older = find_evidence("What were iPhone net sales?", "$40,665", "", read.segments)
    assert older.grounded and older.evidence[0].document == "doc 1: 2022 Q3.pdf"
    assert older.evidence[0].page == 2


def test_re_read_passages_name_their_document() -> None:
    document = prepare_collection("c", members(), [QUESTION], WordTokenizer(), method())
    rendered = render_passages(split_passages(document.segments, words=8)[:2])
    assert rendered.startswith("[1] (doc 1: alpha.txt) Alpha opens")


def test_one_document_alone_reads_exactly_as_before() -> None:
    tokenizer = WordTokenizer()
    for template in ("memagent-reference", "verified-quotes"):
        config = method(template)
        document = prepare(
            Document(uri="a.txt", name="a.txt", text=ALPHA), [QUESTION], tokenizer, config
        )
        assert all(piece.document is None for piece in document.segments)
        assert all(piece.shown_text == piece.text for piece in document.segments)
        engine = run(document)
        templates = get_template_set(template)
        chain = MemoryChain("replay", QUESTION, document.segments, config.chain())
        for request in engine.requests:  # every prompt is the template around the bare text
            step = chain.next_request()
            assert step is not None and step.prompt == request.prompt
            if step.kind is StepKind.UPDATE:
                assert step.prompt == templates.render_update(
                    QUESTION, chain.memory, document.segments[step.step].text
                )
            chain.submit(asyncio.run(FactEngine().generate(_request(step.prompt))).text)
        (result,) = document.results  # type: ignore[attr-defined]
        assert "[doc" not in result.final_memory
        grounding = document.grounding(result)
        assert all("document" not in item.as_dict() for item in grounding.evidence)
        assert " of doc " not in grounding.reason
    assert render_passages(split_passages(document.segments, words=8)[:1]).startswith("[1] Alpha")


def _request(prompt: str) -> GenerationRequest:
    return GenerationRequest("x", prompt, 10, MethodConfig().sampling())


def test_a_collections_content_hash_names_its_order_and_names() -> None:
    listed = order_members(members(), "listed")
    reversed_order = order_members(members(), "mtime")
    assert collection_sha256(listed) != collection_sha256(reversed_order)
    assert combined_text(listed).startswith("## Document 1 of 2: alpha.txt\n\nAlpha opens")


def test_ask_parses_across_and_order_by() -> None:
    from pipeline.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["ask", "a.pdf", "b.pdf", "--across", "-q", "Q?"])
    assert args.across and args.order_by == "listed" and args.paths == ["a.pdf", "b.pdf"]
    args = parser.parse_args(["ask", "a.pdf", "--order-by", "mtime", "-q", "Q?"])
    assert not args.across and args.order_by == "mtime"
    with pytest.raises(SystemExit):
        parser.parse_args(["ask", "a.pdf", "--across", "--order-by", "date", "-q", "Q?"])


def test_ask_across_answers_once_for_the_collection_with_evidence_naming_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from connectors.engines.factory import EngineSpec
    from pipeline.cli import ask as ask_command

    alpha, beta = tmp_path / "alpha.txt", tmp_path / "beta.txt"
    alpha.write_text(ALPHA)
    beta.write_text(BETA)
    os.utime(alpha, (2_000_000_000, 2_000_000_000))
    os.utime(beta, (1_000_000_000, 1_000_000_000))
    engine = FactEngine()

    async def fake_engine(spec: EngineSpec) -> FactEngine:
        return engine

    monkeypatch.setattr(ask_command, "open_checked_engine", fake_engine)
    monkeypatch.setattr(ask_command, "load_tokenizer", lambda spec: WordTokenizer())
    monkeypatch.setattr(ask_command.models, "ensure_pulled", lambda *args: None)
    spec = EngineSpec(model="fake-model", max_model_len=4096)

    code = ask_command.ask_files(
        [alpha, beta],
        [QUESTION],
        spec,
        MethodConfig(chunk_size=16, max_memory_tokens=64, template="verified-quotes"),
        as_json=True,
        across=True,
        order_by="mtime",
    )
    assert code == 0, capsys.readouterr().err
    (record,) = json.loads(capsys.readouterr().out)
    assert record["documents"] == [
        "doc 1: beta.txt, modified 2001-09-09",
        "doc 2: alpha.txt, modified 2033-05-18",
    ]
    assert record["status"] == "ok" and record["grounded"]
    assert {item["document"] for item in record["evidence"]} >= {
        "doc 1: beta.txt, modified 2001-09-09",
        "doc 2: alpha.txt, modified 2033-05-18",
    }
    texts = {"beta.txt": BETA, "alpha.txt": ALPHA}
    for item in record["evidence"]:
        source = texts[item["document"].split(": ")[1].split(",")[0]]
        assert source[item["char_start"] : item["char_end"]] == item["quote"]
    assert record["final_memory"].startswith("[doc 1: beta.txt, modified 2001-09-09] ")
    assert engine.shut_down

    code = ask_command.ask_files(
        [alpha, beta], [QUESTION], spec, MethodConfig(chunk_size=16), as_json=False, across=True
    )
    shown = capsys.readouterr().out
    assert code == 0
    assert shown.splitlines()[:3] == [
        "collection of 2  (12 segments, 177 tokens)",
        "  doc 1: alpha.txt",
        "  doc 2: beta.txt",
    ]
    assert "doc 2: beta.txt, " in shown  # an evidence line names its file


def test_ask_across_progress_counts_the_documents_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from collections.abc import Iterator
    from contextlib import contextmanager

    from connectors.engines.factory import EngineSpec
    from connectors.state.records import RunProgress
    from pipeline.cli import ask as ask_command

    alpha, beta = tmp_path / "alpha.txt", tmp_path / "beta.txt"
    alpha.write_text(ALPHA)
    beta.write_text(BETA)
    readings: list[RunProgress] = []

    @contextmanager
    def recorded(console: object, starting: str = "") -> Iterator[object]:
        yield readings.append

    async def fake_engine(spec: EngineSpec) -> FactEngine:
        return FactEngine()

    monkeypatch.setattr(ask_command, "progress_bar", recorded)
    monkeypatch.setattr(ask_command, "open_checked_engine", fake_engine)
    monkeypatch.setattr(ask_command, "load_tokenizer", lambda spec: WordTokenizer())
    monkeypatch.setattr(ask_command.models, "ensure_pulled", lambda *args: None)
    spec = EngineSpec(model="fake-model", max_model_len=4096)
    code = ask_command.ask_files(
        [alpha, beta], [QUESTION, "Which filing is first?"], spec, method(), as_json=True,
        across=True,
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    # two chains over two documents: 4 planned; a document counts once a chain has read all of
    # its segments, so the count grows, document by document, to 4 when both are answered
    assert {reading.members_planned for reading in readings} == {4}
    done = [reading.members_done for reading in readings]
    assert done == sorted(done) and done[0] == 0 and {1, 2} <= set(done)
    last = readings[-1]
    assert (last.steps_done, last.chains_done, last.members_done) == (last.steps_planned, 2, 4)
    # no document is read whole before a chain has read more than one segment (each has several)
    assert all(r.members_done == 0 for r in readings if r.steps_done <= 2)
