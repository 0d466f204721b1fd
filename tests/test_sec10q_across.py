"""`sec10q-across`: the committed questions over several filings (their figures are printed in
their filings' parsed text, on the pages named, and make the answer), the sample builder, and
the memstream and rag-bm25 methods over a collection with the fake engine."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

import pytest

from connectors.engines.fake import FactEngine, WordTokenizer
from operators.core.collection import Member, combined_text, order_members
from operators.core.evidence import page_of
from operators.core.figures import find_figures, parse_gold, same_figure, states_figure
from pipeline.corpora.sec10q_across import (
    OPERATIONS,
    AcrossQuestion,
    load_across_questions,
    load_parsed_filings,
)
from pipeline.evaluation.execution import EvalMethod, EvalSettings, run_configuration
from pipeline.evaluation.samples import EvalSample
from pipeline.evaluation.sec10q_across import TASK, build_sec10q_across_samples
from pipeline.evaluation.suite import NATIVE_LENGTH_TASKS, TASKS, parse_tasks


class BatchWordTokenizer(WordTokenizer):
    """The word tokenizer, taking a batch of texts as Hugging Face tokenizers do."""

    def __call__(self, text: str | Sequence[str], **options: object) -> dict[str, list]:  # type: ignore[override]
        one = super().__call__
        if isinstance(text, str):
            return one(text, **options)
        return {"input_ids": [one(piece, **options)["input_ids"] for piece in text]}


@pytest.fixture(scope="module")
def questions() -> list[AcrossQuestion]:
    return load_across_questions()


def test_the_questions_are_ten_to_fifteen_over_two_or_three_filings_of_one_company(
    questions: list[AcrossQuestion],
) -> None:
    assert 10 <= len(questions) <= 15
    assert len({q.id for q in questions}) == len(questions)
    for q in questions:
        assert 2 <= len(q.filings) <= 3 and len(set(q.filings)) == len(q.filings), q.id
        assert list(q.filings) == sorted(q.filings), q.id  # oldest filing first
        assert all(name.endswith(f" {q.company}.pdf") for name in q.filings), q.id
        assert q.operation in OPERATIONS, q.id
        # every filing of the collection gives at least one figure: the answer needs them all
        assert {f.filing for f in q.figures} == set(q.filings), q.id


def test_each_answer_is_made_from_its_figures_and_every_spelling_states_it(
    questions: list[AcrossQuestion],
) -> None:
    for q in questions:
        assert q.computed() == Decimal(q.answer.replace(",", "")), q.id
        gold = parse_gold(q.accepted[0])
        assert all(same_figure(parse_gold(spelling), gold) for spelling in q.accepted), q.id
        assert states_figure(f"The change is {q.accepted[0]}.", q.accepted), q.id
        # the figure of one filing alone is not the answer
        for figure in q.figures:
            if figure.figure != q.answer:
                assert not states_figure(figure.figure, q.accepted), (q.id, figure.figure)


def test_every_figure_is_printed_in_its_filing_on_its_page(
    questions: list[AcrossQuestion], corpora: Path
) -> None:
    filings = load_parsed_filings(corpora, {name for q in questions for name in q.filings})
    for q in questions:
        for figure in q.figures:
            filing = filings[figure.filing]
            at = filing.text.find(figure.evidence)
            assert at >= 0, (q.id, figure.evidence)
            printed = [
                f
                for f in find_figures(filing.text[at : at + len(figure.evidence)])
                if f.value == float(figure.value)
            ]
            assert printed, (q.id, figure.figure)
            position = at + filing.text[at:].find(figure.figure)
            assert page_of(position, filing.page_starts) == figure.page, (q.id, figure.figure)


def test_the_builder_makes_one_collection_sample_a_question(
    questions: list[AcrossQuestion], corpora: Path
) -> None:
    samples = build_sec10q_across_samples(corpora, BatchWordTokenizer(), n_samples=4)
    assert [s.sample_id for s in samples] == [f"{TASK}-{q.id}" for q in questions[:4]]
    for sample, q in zip(samples, questions, strict=False):
        assert sample.task == TASK and sample.answer_mode == "figure"
        assert sample.answers == q.accepted and sample.question == q.question
        assert [m.name for m in sample.documents] == list(q.filings)
        assert all(m.page_starts and m.text for m in sample.documents)
        assert sample.document == combined_text(order_members(sample.documents, "listed"))
        assert sample.document.startswith(f"## Document 1 of {len(q.filings)}: {q.filings[0]}")
        assert sample.n_tokens == sum(
            len(WordTokenizer()(m.text)["input_ids"]) for m in sample.documents
        )
        assert sample.variant == q.operation
        assert sample.details["filings"] == list(q.filings)


def test_sec10q_across_is_a_native_length_eval_task() -> None:
    assert "sec10q-across" in TASKS and "sec10q-across" in NATIVE_LENGTH_TASKS
    assert parse_tasks("sec10q-across") == ["sec10q-across"]


def _collection_sample() -> EvalSample:
    first = "The first filing.\nThe amber row holds fact-amber for the quarter.\n" + "Text. " * 40
    second = "The second filing.\n" + "Words. " * 40 + "\nThe blue row holds fact-blue then."
    members = (
        Member("a.pdf", "2022 Q3 ACME.pdf", first.strip(), page_starts=(0, 60)),
        Member("b.pdf", "2023 Q2 ACME.pdf", second, page_starts=(0,)),
    )
    return EvalSample(
        task=TASK,
        sample_id="across-1",
        length_label="native",
        target_tokens=None,
        document=combined_text(order_members(members, "listed")),
        n_tokens=100,
        question="Which facts do the amber and blue rows hold?",
        answers=("fact-amber", "fact-blue"),
        answer_mode="all",
        documents=members,
    )


@pytest.mark.parametrize("name", ["memstream:verified-quotes", "rag-bm25"])
def test_memstream_and_rag_read_the_whole_collection(name: str) -> None:
    engine = FactEngine()
    settings = EvalSettings(context_window=4096, chunk_size=24, max_memory_tokens=64)
    (prediction,) = asyncio.run(
        run_configuration(
            engine, WordTokenizer(), [_collection_sample()], EvalMethod.parse(name), settings
        )
    )
    assert prediction.status == "ok", prediction.error
    if name == "rag-bm25":
        (request,) = engine.requests
        assert "fact-amber" in request.prompt and "fact-blue" in request.prompt
        assert "(doc 1: 2022 Q3 ACME.pdf) " in request.prompt
        assert "(doc 2: 2023 Q2 ACME.pdf) " in request.prompt
        assert {p[2] for p in prediction.details["passages"]} <= {
            "doc 1: 2022 Q3 ACME.pdf",
            "doc 2: 2023 Q2 ACME.pdf",
        }
    else:
        assert prediction.scores["accuracy"] == 1.0  # the facts of both filings
        assert "## Document 2 of 2: 2023 Q2 ACME.pdf" in "".join(r.prompt for r in engine.requests)
        assert prediction.final_memory is not None
        assert "[doc 2: 2023 Q2 ACME.pdf] The blue row" in prediction.final_memory
        assert prediction.details["n_segments"] > 2


def test_combined_afterwards_asks_each_document_alone_then_combines_labelled_answers() -> None:
    method = EvalMethod.parse("memstream:verified-quotes+combined")
    assert method == EvalMethod(
        "memstream:verified-quotes+combined", "verified-quotes", 0, combined=True
    )
    assert EvalMethod.parse("memstream:memagent-reference+reread2000+combined").reread_tokens == (
        2000
    )
    engine = FactEngine()
    settings = EvalSettings(context_window=4096, chunk_size=24, max_memory_tokens=64)
    sample = _collection_sample()
    (prediction,) = asyncio.run(
        run_configuration(engine, BatchWordTokenizer(), [sample], method, settings)
    )
    assert prediction.status == "ok", prediction.error
    sections = [r.prompt for r in engine.requests if "<section>" in r.prompt]
    assert sections and not any("## Document" in prompt for prompt in sections)  # each alone
    final = engine.requests[-1].prompt
    assert "<answers>\n[doc 1: 2022 Q3 ACME.pdf] fact-amber\n" in final
    assert "[doc 2: 2023 Q2 ACME.pdf] fact-blue\n</answers>" in final
    assert [item["answer"] for item in prediction.details["per_document"]] == [
        "fact-amber",
        "fact-blue",
    ]
    assert prediction.n_calls == len(engine.requests)
