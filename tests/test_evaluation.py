"""`memstream eval`: task builders on the real corpora and tokenizer, scoring, reports, the
scheduler, and one tiny end-to-end run on the shared real engine."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import re
import sqlite3
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from connectors.engines.factory import EngineSpec
from connectors.engines.fake import WordTokenizer
from operators.core.scoring import score, token_recall
from operators.core.templates import REFERENCE
from operators.engine import Completion, GenerationRequest
from pipeline.cli.evaluate import (
    QUICK,
    ConsoleListener,
    evaluate_with_progress,
    register,
    regrade_run,
    report_run,
    resolve_request,
)
from pipeline.corpora.cuad import (
    ContractLabel,
    date_spellings,
    is_extractive,
    load_cuad,
    party_names,
)
from pipeline.evaluation import corpora as corpus_files
from pipeline.evaluation.checkpoints import RUN_ID, EvalCheckpoints
from pipeline.evaluation.cuad import build_cuad_samples
from pipeline.evaluation.direct import build_direct_prompt, chat_overhead_tokens, middle_truncate
from pipeline.evaluation.execution import EvalMethod, EvalSettings, parse_methods
from pipeline.evaluation.haystack import HaystackCorpus, Passage, split_passages
from pipeline.evaluation.hotpotqa import HotpotExample, HotpotQABuilder
from pipeline.evaluation.niah import VARIANTS, NiahBuilder, NiahCase
from pipeline.evaluation.regrade import regrade
from pipeline.evaluation.report import (
    ACCURACY_PLOT,
    HEADLINE,
    RESULTS_JSON,
    RESULTS_MARKDOWN,
    GroundingStats,
    read_results,
    render_markdown,
    write_outputs,
)
from pipeline.evaluation.request import check_chunks_fit, run_metadata
from pipeline.evaluation.results import (
    EARLIER_SITTINGS_CALLS,
    Configuration,
    ConfigurationRun,
    Prediction,
    calls_in_sitting,
    summarize,
)
from pipeline.evaluation.resuming import previous_results, resumed_metadata
from pipeline.evaluation.samples import EvalSample, LengthSpec, count_tokens, parse_lengths
from pipeline.evaluation.suite import (
    NATIVE_LENGTH_LABEL,
    TASKS,
    SampleGroup,
    SuiteOutcome,
    parse_tasks,
    plan_groups,
    run_suite,
)
from tests.conftest import TEST_MODEL

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def hotpot_examples(corpora: Path) -> list[HotpotExample]:
    return corpus_files.load_hotpotqa(corpora)


@pytest.fixture(scope="module")
def short_texts(corpora: Path) -> dict[str, str]:
    """The start of each real text: enough for every builder, quick to tokenize."""
    return {name: text[:40_000] for name, text in corpus_files.load_texts(corpora).items()}


@pytest.fixture(scope="module")
def filler(short_texts: dict[str, str], tokenizer: Any) -> list[Passage]:
    return [p for name, text in short_texts.items() for p in split_passages(name, text, tokenizer)]


@pytest.fixture(scope="module")
def hotpot_builder(hotpot_examples, filler, tokenizer) -> HotpotQABuilder:  # type: ignore[no-untyped-def]
    return HotpotQABuilder(hotpot_examples, filler, tokenizer)


@pytest.fixture(scope="module")
def haystack(short_texts: dict[str, str], tokenizer: Any) -> HaystackCorpus:
    return HaystackCorpus(short_texts, tokenizer)


def test_lengths_use_binary_units_and_come_out_sorted() -> None:
    assert [length.tokens for length in parse_lengths("32k, 8K,1m,1.5k,8k")] == [
        1536,
        8192,
        32768,
        1048576,
    ]
    assert LengthSpec.parse("512k") == LengthSpec("512k", 524288)
    for bad in ("8 kb", "-1k", "10", ""):
        with pytest.raises(ValueError):
            parse_lengths(bad)


def gold_block(paragraph: Any) -> str:
    return f"{paragraph.title}\n{paragraph.text}"


@pytest.mark.parametrize(("target", "slack"), [(1536, 0.15), (8192, 0.03), (32768, 0.03)])
def test_hotpotqa_fills_the_target_length(hotpot_builder, tokenizer, target, slack) -> None:  # type: ignore[no-untyped-def]
    for sample in hotpot_builder.build(target, 2, seed=0, length_label="t"):
        measured = count_tokens([sample.document], tokenizer)[0]
        assert measured == sample.n_tokens
        assert target * (1 - slack) <= measured <= target


def test_hotpotqa_gold_paragraphs_appear_exactly_once_and_labels_are_sequential(
    hotpot_builder, hotpot_examples
) -> None:  # type: ignore[no-untyped-def]
    samples = hotpot_builder.build(8192, 3, seed=0, length_label="8k")
    for index, sample in enumerate(samples):
        example = hotpot_examples[index]
        assert sample.question == example.question
        assert sample.answers == (example.answer,)
        for paragraph, position in zip(example.gold, sample.details["gold_documents"], strict=True):
            assert sample.document.count(paragraph.text) == 1
            assert f"Document {position}:\n{gold_block(paragraph)}" in sample.document
        labels = [int(n) for n in re.findall(r"^Document (\d+):$", sample.document, re.M)]
        assert labels == list(range(1, sample.details["n_documents"] + 1))


def test_hotpotqa_uses_own_distractors_first_then_real_text_passages(
    hotpot_builder, hotpot_examples, filler
) -> None:  # type: ignore[no-untyped-def]
    short = hotpot_builder.build(1536, 1, seed=0, length_label="1.5k")[0]
    assert any(d.text in short.document for d in hotpot_examples[0].distractors)
    long = hotpot_builder.build(98304, 1, seed=0, length_label="96k")[0]
    assert any(passage.text in long.document for passage in filler)


def test_hotpotqa_cycles_filler_when_the_texts_run_out(hotpot_examples, filler, tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = HotpotQABuilder(hotpot_examples[:2], filler[:5], tokenizer)
    sample = builder.build(8192, 1, seed=0, length_label="8k")[0]
    assert 8192 * 0.97 <= sample.n_tokens <= 8192
    assert sample.document.count(filler[0].text) > 1
    for paragraph in hotpot_examples[0].gold:
        assert sample.document.count(paragraph.text) == 1


def test_hotpotqa_is_deterministic_given_a_seed(hotpot_builder) -> None:  # type: ignore[no-untyped-def]
    first = hotpot_builder.build(4096, 2, seed=7, length_label="4k")
    again = hotpot_builder.build(4096, 2, seed=7, length_label="4k")
    other = hotpot_builder.build(4096, 2, seed=8, length_label="4k")
    assert [s.document for s in first] == [s.document for s in again]
    assert [s.document for s in first] != [s.document for s in other]


def test_niah_cases_cover_every_variant_and_depth() -> None:
    cases = [NiahCase.for_index(index) for index in range(9)]
    assert len({(case.variant, case.depth) for case in cases}) == 9
    assert {case.variant for case in cases[:3]} == set(VARIANTS)
    assert {case.depth for case in cases[:3]} == {0.1, 0.5, 0.9}


@pytest.mark.parametrize("target", [2048, 32768])
def test_niah_needles_sit_at_their_depths(haystack, tokenizer, target) -> None:  # type: ignore[no-untyped-def]
    # 32K tokens is more than the shortened texts hold, so the haystack wraps around.
    assert haystack.n_tokens < 32768
    samples = NiahBuilder(haystack, tokenizer).build(target, 9, seed=0, length_label="t")
    for sample in samples:
        assert count_tokens([sample.document], tokenizer)[0] == sample.n_tokens
        assert target * 0.97 <= sample.n_tokens <= target
        asked = sample.details["needles"][0]
        assert sample.document.count(asked) == 1
        tokens_before = count_tokens([sample.document[: sample.document.index(asked)]], tokenizer)
        assert tokens_before[0] / sample.n_tokens == pytest.approx(sample.depth, abs=0.05)


def test_niah_variants_plant_the_right_needles(haystack, tokenizer) -> None:  # type: ignore[no-untyped-def]
    samples = NiahBuilder(haystack, tokenizer).build(4096, 3, seed=1, length_label="4k")
    by_variant = {sample.variant: sample for sample in samples}
    single, multikey, multivalue = (by_variant[v] for v in ("single", "multikey", "multivalue"))
    assert len(single.details["needles"]) == 1 and len(single.answers) == 1
    keys = {re.search(r"for (\S+) is:", n)[1] for n in multikey.details["needles"]}  # type: ignore[index]
    assert len(keys) == 4 and len(multikey.answers) == 1
    assert multikey.answers[0] in multikey.details["needles"][0]
    assert len(multivalue.answers) == 4 and multivalue.question.startswith("What are all")
    for sample in samples:
        assert sample.answer_mode == "all"
        for needle in sample.details["needles"]:
            assert sample.document.count(needle) == 1


def test_niah_is_deterministic_given_a_seed(haystack, tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = NiahBuilder(haystack, tokenizer)
    first = builder.build(2048, 3, seed=3, length_label="2k")
    assert [s.document for s in first] == [
        s.document for s in builder.build(2048, 3, seed=3, length_label="2k")
    ]
    assert first[0].document != builder.build(2048, 1, seed=4, length_label="2k")[0].document


def test_cuad_labels_load_with_their_contract_texts(corpora, tokenizer) -> None:  # type: ignore[no-untyped-def]
    contracts = load_cuad(corpora)
    assert {contract.name for contract, _ in contracts} == {"PhotronicsInc", "VitalibisInc"}
    samples = build_cuad_samples(contracts, tokenizer)
    by_id = {sample.sample_id: sample for sample in samples}
    parties = by_id["cuad-VitalibisInc-parties"]
    assert parties.answers == ("VITALIBIS INC", "VOTOCAST, Inc.") and parties.answer_mode == "all"
    assert by_id["cuad-VitalibisInc-governing-law"].answers == ("California",)
    assert "May 16, 2017" in by_id["cuad-PhotronicsInc-agreement-date"].answers
    assert by_id["cuad-PhotronicsInc-expiration-date"].answers == ("perpetual",)
    assert all(sample.n_tokens > 5000 for sample in samples)
    assert not any(a.lower() in ("yes", "no") for s in samples for a in s.answers)
    # The four headline categories come first, so a small sample count asks them.
    firsts = {s.variant for s in build_cuad_samples(contracts, tokenizer, n_samples=7)}
    assert firsts == {"Parties", "Governing Law", "Agreement Date", "Expiration Date"}


def test_cuad_answers_drop_role_groupings_and_spell_dates() -> None:
    label = ContractLabel(
        "Parties",
        'Acme, Inc. ("Acme"); Beta LLC ("Beta"); Acme and Beta ("Parties")',
        ("Acme, Inc.", "Beta LLC", "Acme"),
    )
    assert party_names(label) == ("Acme, Inc.", "Beta LLC")
    assert date_spellings(5, 1, 2017)[:4] == (
        "5/1/2017",
        "May 1, 2017",
        "1 May 2017",
        "1st day of May, 2017",
    )
    assert not is_extractive(ContractLabel("Audit Rights", "Yes", ()))
    assert not is_extractive(ContractLabel("Effective Date", "", ()))


def test_scores_follow_the_reference_and_ruler() -> None:
    hotpot = score(
        ["Ohio River"], "any", "the Ohio River", "Therefore, the answer is the Ohio River."
    )
    assert hotpot["em"] == hotpot["sub_em"] == hotpot["accuracy"] == 1.0
    partial = score(["Duran Duran"], "any", "Duran", "...")
    assert partial["sub_em"] == 1.0 and partial["em"] == 0.0 and 0 < partial["f1"] < 1
    assert score(["yes"], "any", "no", "...")["f1"] == 0.0
    needles = score(["1234567", "7654321"], "all", "1234567 and more", "raw 1234567 7654321")
    assert needles["string_match_all"] == needles["accuracy"] == 0.5
    assert needles["string_match_any"] == 1.0 and needles["raw_match"] == 1.0


def test_a_missing_or_empty_answer_scores_zero_but_raw_match_still_looks() -> None:
    missing = score(["1234567"], "all", None, "The number is 1234567.")
    assert missing["accuracy"] == missing["answered"] == 0.0 and missing["raw_match"] == 1.0
    # "the" normalizes to nothing, which is a substring of every reference.
    assert score(["Ohio River"], "any", "the", "Therefore, the answer is the")["sub_em"] == 0.0


def test_token_recall_is_lenient_and_all_mode_recalls_every_reference() -> None:
    assert token_recall("Photronics Inc", "Photronics, Inc.") == 1.0
    assert token_recall("Acme", "Acme Beta") == 0.5
    scores = score(["Acme, Inc.", "Beta LLC"], "all", "Acme Inc and Beta", "...")
    assert scores["token_recall"] == pytest.approx(0.75)
    assert scores["string_match_all"] == 0.0  # "Acme, Inc." is not there verbatim
    assert scores["accuracy"] == 0.5  # "Acme Inc" is, normalized; "Beta LLC" is not


def test_all_mode_accuracy_reads_references_normalized_and_whole() -> None:
    parties = ["VITALIBIS INC", "VOTOCAST, Inc."]
    assert score(parties, "all", "VITALIBIS, INC., VOTOCAST, Inc", "")["accuracy"] == 1.0
    assert score(parties, "all", "VITALIBIS, INC", "")["accuracy"] == 0.5
    assert score(["123", "456"], "all", "1234 and 456", "")["accuracy"] == 0.5


def prediction(method: str, accuracy: float, **fields: Any) -> Prediction:
    values: dict[str, Any] = {
        "task": "hotpotqa",
        "length_label": "8k",
        "target_tokens": 8192,
        "document_tokens": 8000,
        "depth": None,
        "variant": None,
        "sample_id": "s",
        "question": "q?",
        "gold": ["a"],
        "answer_mode": "any",
        "prediction": "a",
        "raw_response": "Therefore, the answer is a",
        "final_memory": None,
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "n_calls": 1,
        "seconds": 2.0,
        "status": "ok",
        **fields,
    }
    scores = dict.fromkeys(("accuracy", "sub_em"), accuracy)
    return Prediction(method=method, scores=scores, **values)


REGRADE_SAMPLE = EvalSample(
    task="niah", sample_id="s", length_label="1k", target_tokens=1024,
    document="Boilerplate. The storage node that ran out of disk space was storage-node-17. More.",
    n_tokens=20, question="q?", answers=("storage-node-17",),
)  # fmt: skip


def test_regrading_scores_the_recorded_answers_again_against_rebuilt_samples() -> None:
    right = prediction("m", 0.0, sample_id="s", gold=["storage-node-17"],
                       prediction="storage-node-17", final_memory="storage-node-17")  # fmt: skip
    failed = prediction("m", 0.0, sample_id="gone", status="error", prediction=None)
    asked: list[tuple[str, str]] = []

    def build(task: str, length_label: str) -> list[EvalSample]:
        asked.append((task, length_label))
        return [replace(REGRADE_SAMPLE, task=task, length_label=length_label)]

    regraded = regrade([right, failed], build)

    assert asked == [("hotpotqa", "8k")]  # once per group
    assert regraded.predictions[0].scores["accuracy"] == 1.0
    assert "grounded" in regraded.predictions[0].scores
    assert (regraded.accuracy_changed, regraded.grounded_changed) == (1, 1)
    assert regraded.predictions[1] is failed
    assert regraded.predictions[0].prediction == right.prediction  # only the scores change


def test_regrading_refuses_samples_that_do_not_rebuild_as_the_run_had_them() -> None:
    other_question = prediction("m", 1.0, sample_id="s", question="another question?")
    with pytest.raises(ValueError, match="does not rebuild as the run had it"):
        regrade([other_question], lambda task, label: [replace(REGRADE_SAMPLE, task=task,
                                                               length_label=label)])  # fmt: skip
    missing = prediction("m", 1.0, sample_id="not-built")
    with pytest.raises(ValueError, match="not-built"):
        regrade([missing], lambda task, label: [])


def test_summaries_average_per_task_length_and_method() -> None:
    rows = summarize(
        [
            prediction("direct", 1.0),
            prediction("direct", 0.0),
            prediction("memstream:x", 1.0),
            prediction("direct", 1.0, length_label="32k", status="error"),
        ]
    )
    assert [(r.group["method"], r.group["length_label"], r.n) for r in rows] == [
        ("direct", "8k", 2),
        ("memstream:x", "8k", 1),
        ("direct", "32k", 1),
    ]
    assert rows[0].means["accuracy"] == 0.5 and rows[0].means["f1"] == 0.0
    assert rows[2].errors == 1


def test_middle_truncation_keeps_head_and_tail() -> None:
    assert middle_truncate(list(range(10)), 4) == [0, 1, 8, 9]
    assert middle_truncate(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert middle_truncate([1, 2], 5) == [1, 2]


def test_direct_prompt_fits_the_window(tokenizer) -> None:  # type: ignore[no-untyped-def]
    document = "START of the text. " + "filler words here. " * 3000 + "END of the text."
    overhead = chat_overhead_tokens(tokenizer)
    prompt = build_direct_prompt(document, "What?", tokenizer, 2048, 64, overhead)
    assert prompt.truncated and prompt.shown_tokens < prompt.document_tokens
    assert "START" in prompt.prompt and "END of the text." in prompt.prompt
    assert prompt.prompt.endswith('"Therefore, the answer is (insert answer here)".')
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.prompt}], tokenize=True, add_generation_prompt=True
    )
    assert len(rendered) + 64 <= 2048
    short = build_direct_prompt("A short text.", "What?", tokenizer, 2048, 64, overhead)
    assert not short.truncated and "A short text." in short.prompt


def outcome_for_reports() -> SuiteOutcome:
    niah = {"task": "niah", "depth": 0.5, "variant": "single", "answer_mode": "all"}
    return SuiteOutcome(
        predictions=[
            prediction("direct", 1.0),
            prediction("memstream:memagent-reference", 0.0),
            prediction("direct", 0.0, length_label="32k", target_tokens=32768),
            prediction(
                "memstream:memagent-reference", 1.0, length_label="32k", target_tokens=32768
            ),
            prediction("direct", 1.0, **niah),
        ]
    )


def test_markdown_has_an_accuracy_table_per_task_length_and_method() -> None:
    text = render_markdown({"model": "m", "settings": {"chunk_size": 512}}, outcome_for_reports())
    assert "| task | length | tokens (mean) | direct | memstream:memagent-reference |" in text
    assert "| hotpotqa | 8k | 8,000 | 1.00 (1) | 0.00 (1) |" in text
    assert "| hotpotqa | 32k | 8,000 | 0.00 (1) | 1.00 (1) |" in text
    assert "| niah | 8k | 8,000 | 1.00 (1) | - |" in text
    assert "## NIAH by variant and depth" in text


def test_grounding_table_compares_how_often_grounded_and_ungrounded_answers_are_right() -> None:
    def graded(accuracy: float, grounded: float) -> Prediction:
        row = prediction("direct", accuracy)
        return replace(row, scores={**row.scores, "answered": 1.0, "grounded": grounded})

    unanswered = replace(prediction("direct", 0.0), scores={})
    rows = [graded(1.0, 1.0), graded(1.0, 1.0), graded(0.0, 1.0), graded(1.0, 0.0),
            graded(0.0, 0.0), graded(0.0, 0.0), unanswered]  # fmt: skip
    text = render_markdown({"model": "m"}, SuiteOutcome(predictions=rows))
    # grounded: 2 of 3 right (wrong 1/3); ungrounded: 1 of 3 right (wrong 2/3): twice as often
    assert "| hotpotqa | direct | 6 | 3 | 0.67 | 0.33 | 2.0 |" in text


def test_wrong_rate_ratio_needs_both_kinds_of_answer_and_is_inf_when_grounded_never_err() -> None:
    def graded(accuracy: float, grounded: float) -> Prediction:
        row = prediction("direct", accuracy)
        return replace(row, scores={**row.scores, "answered": 1.0, "grounded": grounded})

    all_grounded = GroundingStats.of([graded(1.0, 1.0), graded(0.0, 1.0)])
    assert (all_grounded.answered, all_grounded.grounded) == (2, 2)
    assert all_grounded.wrong_rate_ratio == "n/a"
    assert all_grounded.accuracies() == ("0.50", "n/a")
    never_wrong = GroundingStats.of([graded(1.0, 1.0), graded(0.5, 0.0)])
    assert never_wrong.wrong_rate_ratio == "inf"


def test_cost_table_divides_each_configurations_wall_time_by_its_model_calls(
    tmp_path: Path,
) -> None:
    reference = Configuration("hotpotqa", "8k", "memstream:memagent-reference")
    rows = [
        prediction(reference.method, 1.0, n_calls=3),
        prediction(reference.method, 0.0, n_calls=5),
    ]
    run = ConfigurationRun(reference, n_samples=2, seconds=40.0, machine="AMD EPYC, 2 cores")
    outcome = SuiteOutcome(predictions=rows, runs=[run])
    text = render_markdown({"model": "m"}, outcome)
    # 8 calls in 40 s of wall time; 2 x 15 tokens in 40 s
    assert (
        "| hotpotqa | 8k | memstream:memagent-reference | 2 | 40 | 8 | 5.0 | 1 "
        "| AMD EPYC, 2 cores |" in text
    )
    assert_every_row_has_its_header_s_cells(text)
    write_outputs(tmp_path, {"model": "m"}, outcome)
    assert read_results(tmp_path / RESULTS_JSON)[1].runs == [run]


def assert_every_row_has_its_header_s_cells(markdown: str) -> None:
    """A Markdown table's renderer drops the cells of a row past its header's."""
    columns = 0
    for line in markdown.splitlines():
        if not line.startswith("|"):
            columns = 0
        elif columns == 0:
            columns = line.count(" | ") + 1
        else:
            assert line.count(" | ") + 1 == columns or line.startswith("|---"), line


def test_outputs_are_written_with_a_real_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the accuracy plot needs matplotlib")
    written = write_outputs(tmp_path / "out", {"model": "m"}, outcome_for_reports())
    assert {path.name for path in written} == {RESULTS_JSON, RESULTS_MARKDOWN, ACCURACY_PLOT}
    assert (tmp_path / "out" / ACCURACY_PLOT).read_bytes()[:8] == PNG_MAGIC
    results = json.loads((tmp_path / "out" / RESULTS_JSON).read_text())
    assert len(results["predictions"]) == 5 and results["model"] == "m"
    assert {"task", "length_label", "method", "scores", "raw_response", "final_memory"} <= set(
        results["predictions"][0]
    )


def test_methods_and_tasks_are_parsed_strictly() -> None:
    methods = parse_methods("memstream:append-evidence, direct,memstream:append-evidence")
    assert [m.name for m in methods] == ["memstream:append-evidence", "direct"]
    assert methods[1].is_direct and methods[0].template == "append-evidence"
    with pytest.raises(ValueError, match="unknown method 'memstream'"):
        parse_methods("memstream")  # no template set: the model's default is not implied
    with pytest.raises(ValueError, match="unknown template set"):
        parse_methods("memstream:nope")
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods("rag")
    with pytest.raises(ValueError, match="unknown task"):
        parse_tasks("hotpotqa,squad")


def test_groups_run_native_tasks_first_then_lengths_ascending() -> None:
    builders = dict.fromkeys(("hotpotqa", "niah", "cuad"), lambda length: [])
    groups = plan_groups(["hotpotqa", "cuad", "niah"], parse_lengths("32k,8k"), builders)
    assert [(g.task, g.length_label) for g in groups] == [
        ("cuad", NATIVE_LENGTH_LABEL),
        ("hotpotqa", "8k"),
        ("niah", "8k"),
        ("hotpotqa", "32k"),
        ("niah", "32k"),
    ]


class EchoEngine:
    """Answers every prompt with the same sentence: enough to schedule configurations."""

    model = "echo"

    def __init__(self) -> None:
        self.prompts: list[str] = []

    async def generate(self, request: GenerationRequest) -> Completion:
        self.prompts.append(request.prompt)
        return Completion(request.request_id, "Therefore, the answer is 42.", 10, 5, "stop", 0.0)

    async def check_health(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass


def tiny_sample(task: str, label: str) -> EvalSample:
    return EvalSample(task, f"{task}-{label}", label, 300, "Some text. " * 20, 60, "Q?", ("42",))


def test_the_time_budget_stops_new_configurations(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ticks = iter(range(0, 10_000, 50))  # every clock reading is 50 s later
    groups = [
        SampleGroup(task, label, lambda t=task, lb=label: [tiny_sample(t, lb)])
        for label in ("1k", "2k")
        for task in ("hotpotqa", "niah")
    ]
    methods: Sequence[EvalMethod] = parse_methods(f"direct,memstream:{REFERENCE.name}")
    engine = EchoEngine()
    outcome = asyncio.run(
        run_suite(
            engine,
            tokenizer,
            groups,
            methods,
            EvalSettings(context_window=2048, chunk_size=256, max_memory_tokens=16),
            time_budget_s=260,
            clock=lambda: float(next(ticks)),
        )
    )
    ran = [run.configuration.describe() for run in outcome.runs]
    assert ran[:2] == ["hotpotqa 1k direct", "hotpotqa 1k memstream:memagent-reference"]
    assert len(ran) + len(outcome.skipped) == 8 and outcome.skipped
    assert outcome.skipped[-1].configuration.describe() == "niah 2k memstream:memagent-reference"
    assert all(p.prediction == "42" and p.scores["accuracy"] == 1.0 for p in outcome.predictions)


def test_a_resumed_suite_keeps_earlier_configurations_and_runs_only_the_rest(tokenizer) -> None:  # type: ignore[no-untyped-def]
    groups = [SampleGroup("niah", "1k", lambda: [tiny_sample("niah", "1k")])]
    settings = EvalSettings(context_window=2048, chunk_size=256, max_memory_tokens=16)
    first_engine = EchoEngine()
    first = asyncio.run(
        run_suite(first_engine, tokenizer, groups, parse_methods("direct"), settings)
    )
    second_engine = EchoEngine()
    both = parse_methods(f"direct,memstream:{REFERENCE.name}")
    resumed = asyncio.run(
        run_suite(second_engine, tokenizer, groups, both, settings, previous=first)
    )
    assert [run.configuration.describe() for run in resumed.runs] == [
        "niah 1k direct",
        "niah 1k memstream:memagent-reference",
    ]
    assert resumed.predictions[0] is first.predictions[0] and len(resumed.predictions) == 2
    assert len(first_engine.prompts) == 1  # direct: one call
    assert len(second_engine.prompts) == resumed.predictions[1].details["n_segments"] + 1


class NoteEngine(EchoEngine):
    """Answers each prompt with a note named after the prompt, so a chain's memory, and so its
    later prompts, tell whether it continued from the right memory. Past `hang_after` calls
    every call waits, as an engine does when its run is stopped."""

    def __init__(self, hang_after: int | None = None) -> None:
        super().__init__()
        self.hang_after = hang_after

    async def generate(self, request: GenerationRequest) -> Completion:
        if self.hang_after is not None and len(self.prompts) >= self.hang_after:
            await asyncio.Event().wait()
        self.prompts.append(request.prompt)
        note = hashlib.sha256(request.prompt.encode()).hexdigest()[:8]
        text = f"Note {note}. Therefore, the answer is {note}."
        return Completion(request.request_id, text, 12, 6, "stop", 0.5)


def test_a_configuration_cut_short_continues_each_chain_from_its_last_step(
    tokenizer, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    samples = [
        EvalSample("niah", f"niah-{i}", "1k", 1000, f"Passage {i}. " + "Some text. " * 300, 900,
                   "Q?", ("42",))
        for i in range(3)
    ]  # fmt: skip
    groups = [SampleGroup("niah", "1k", lambda: samples)]
    settings = EvalSettings(context_window=2048, chunk_size=256, max_memory_tokens=16)
    methods = parse_methods(f"memstream:{REFERENCE.name}")
    spec = EngineSpec(model="notes", dtype="float32")

    log = io.StringIO()
    listener = ConsoleListener(
        Console(file=log, force_terminal=False, width=200), tmp_path, {"model": "m"}
    )

    async def suite(engine: NoteEngine, *, resume: bool) -> SuiteOutcome:
        checkpoints = EvalCheckpoints.in_folder(tmp_path, spec, resume=resume)
        try:
            return await run_suite(
                engine, tokenizer, groups, methods, settings, checkpoints=checkpoints,
                listener=listener,
            )  # fmt: skip
        finally:
            checkpoints.close()

    whole = NoteEngine()
    uninterrupted = asyncio.run(suite(whole, resume=False))

    async def cut_short(engine: NoteEngine) -> None:
        checkpoints = EvalCheckpoints.in_folder(tmp_path, spec, resume=False)
        run = asyncio.create_task(
            run_suite(engine, tokenizer, groups, methods, settings, checkpoints=checkpoints)
        )
        for _ in range(1000):  # until the five steps' checkpoints are written
            rows = checkpoints.store.answers(RUN_ID, checkpoints.attempt)
            if sum(row["steps_done"] for row in rows) == 5:
                break
            await asyncio.sleep(0.01)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        checkpoints.close()

    stopped = NoteEngine(hang_after=5)
    asyncio.run(cut_short(stopped))
    resumed_engine = NoteEngine()
    log.seek(0)
    log.truncate()
    resumed = asyncio.run(suite(resumed_engine, resume=True))
    planned = f"{len(resumed_engine.prompts)} model calls planned (5 made in an earlier sitting)"
    assert planned in log.getvalue()

    assert len(whole.prompts) > 8  # several steps per chain
    # each step run once, with the memory it had uninterrupted
    assert sorted(stopped.prompts + resumed_engine.prompts) == sorted(whole.prompts)
    fields = ("prediction", "final_memory", "n_calls", "prompt_tokens", "seconds", "scores")
    for before, after in zip(uninterrupted.predictions, resumed.predictions, strict=True):
        assert [getattr(after, f) for f in fields] == [getattr(before, f) for f in fields]
    carried = [p.details.get(EARLIER_SITTINGS_CALLS, 0) for p in resumed.predictions]
    assert sum(carried) == 5
    assert calls_in_sitting(resumed.predictions) == len(resumed_engine.prompts)

    fresh_engine = NoteEngine()
    asyncio.run(suite(fresh_engine, resume=False))  # without --resume: from the start
    assert len(fresh_engine.prompts) == len(whole.prompts)


def test_off_a_terminal_each_configuration_prints_progress_lines_as_it_runs(
    tokenizer, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    groups = [SampleGroup("niah", "1k", lambda: [tiny_sample("niah", "1k")])]
    settings = EvalSettings(context_window=2048, chunk_size=256, max_memory_tokens=16)
    log = io.StringIO()
    console = Console(file=log, force_terminal=False, width=200)
    listener = ConsoleListener(console, tmp_path, {"model": "echo"})
    engine = EchoEngine()
    methods = parse_methods(f"memstream:{REFERENCE.name}")
    with listener.progress:
        asyncio.run(run_suite(engine, tokenizer, groups, methods, settings, listener=listener))
    lines = log.getvalue().splitlines()
    calls = len(engine.prompts)
    label = "niah 1k memstream:memagent-reference (1)"
    assert calls > 1 and lines[0] == f"{label}: {calls} model calls planned"
    assert re.fullmatch(rf"{re.escape(label)}: model calls {calls}/{calls}, \d+ s", lines[1])
    assert lines[2].startswith(f"niah 1k memstream:{REFERENCE.name}: accuracy 1.00")


def test_results_read_back_as_written_and_resume_refuses_other_settings(tmp_path: Path) -> None:
    request = resolve_request(
        parse_eval_arguments("--output", str(tmp_path), "--resume"), context_window=16384
    )
    metadata = run_metadata(request, EngineSpec(model="m", dtype="float32"))
    assert previous_results(request, metadata) is None  # nothing to resume yet
    write_outputs(tmp_path, metadata, outcome_for_reports(), plot=False)
    _, read = read_results(tmp_path / RESULTS_JSON)
    assert read.predictions == outcome_for_reports().predictions
    assert previous_results(request, metadata) == (metadata, read)
    other = resolve_request(
        parse_eval_arguments("--output", str(tmp_path), "--resume", "--chunk-size", "4000"),
        context_window=16384,
    )
    with pytest.raises(ValueError, match="made with another settings"):
        previous_results(other, run_metadata(other, EngineSpec(model="m", dtype="float32")))
    in_bf16 = run_metadata(request, EngineSpec(model="m", dtype="bfloat16"))
    with pytest.raises(ValueError, match="made with another dtype"):
        previous_results(request, in_bf16)
    (tmp_path / RESULTS_JSON).write_text(
        (tmp_path / RESULTS_JSON).read_text().replace('"dtype": "float32",', "")
    )  # as written before the dtype was recorded, when every engine ran in bfloat16
    assert previous_results(request, in_bf16) is not None
    with pytest.raises(ValueError, match="made with another dtype"):
        previous_results(request, metadata)


def test_resume_refuses_a_method_whose_prompts_were_reworded(tmp_path: Path) -> None:
    request = resolve_request(
        parse_eval_arguments("--output", str(tmp_path), "--resume"), context_window=16384
    )
    metadata = run_metadata(request, EngineSpec(model="m", dtype="float32"))
    reference = f"memstream:{REFERENCE.name}"
    assert metadata["template_digests"][reference] == REFERENCE.digest
    assert "direct" not in metadata["template_digests"]  # no template of ours
    write_outputs(tmp_path, metadata, outcome_for_reports(), plot=False)
    results = tmp_path / RESULTS_JSON
    results.write_text(results.read_text().replace(REFERENCE.digest, "0" * 12))
    with pytest.raises(ValueError, match=f"wording of {reference}"):
        previous_results(request, metadata)
    other_methods = resolve_request(
        parse_eval_arguments("--output", str(tmp_path), "--resume", "--methods", "direct"),
        context_window=16384,
    )  # the reworded method is not asked for again: its cells stay as they are
    assert previous_results(other_methods, run_metadata(other_methods, EngineSpec(model="m",
                            dtype="float32"))) is not None  # fmt: skip


def test_resumed_metadata_covers_the_earlier_runs_too() -> None:
    earlier = {
        "tasks": ["niah"],
        "methods": ["memstream:x", "direct"],
        "template_digests": {"memstream:x": "x-digest"},
        "started_at": "t0",
        "lengths": [{"label": "8k", "tokens": 8192}, {"label": "32k", "tokens": 32768}],
    }
    now = {
        "tasks": ["niah"],
        "methods": ["direct"],
        "template_digests": {},
        "started_at": "t1",
        "lengths": [{"label": "128k", "tokens": 131072}, {"label": "8k", "tokens": 8192}],
    }
    merged = resumed_metadata(earlier, now)
    assert merged["methods"] == ["memstream:x", "direct"] and merged["tasks"] == ["niah"]
    assert merged["template_digests"] == {"memstream:x": "x-digest"}
    assert [length["label"] for length in merged["lengths"]] == ["8k", "32k", "128k"]
    assert merged["started_at"] == "t1" and merged["earlier_runs_started_at"] == ["t0"]


def parse_eval_arguments(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["eval", *argv])


def test_quick_resolves_small_defaults_and_explicit_options_win() -> None:
    quick = resolve_request(parse_eval_arguments("--quick"), context_window=8192)
    assert quick.samples == QUICK.samples and [x.label for x in quick.lengths] == ["8k"]
    assert quick.settings.max_answer_tokens == QUICK.method["max_answer_tokens"]
    assert quick.time_budget_min == QUICK.time_budget_min
    explicit = resolve_request(
        parse_eval_arguments("--quick", "--samples", "5", "--lengths", "32k", "--tasks", "niah"),
        context_window=8192,
    )
    assert explicit.samples == 5 and explicit.lengths[0].tokens == 32768
    assert explicit.tasks == ["niah"]
    full = resolve_request(parse_eval_arguments(), context_window=16384)
    assert [x.label for x in full.lengths] == ["8k", "32k", "128k"] and full.time_budget_min is None


def test_chunks_that_cannot_fit_the_window_are_refused() -> None:
    tokenizer = WordTokenizer()
    too_big = resolve_request(parse_eval_arguments("--chunk-size", "5000"), context_window=4096)
    with pytest.raises(
        ValueError, match=r"lower the chunk size \(method\.chunk_size, --chunk-size"
    ):
        check_chunks_fit(too_big, tokenizer)
    fits = resolve_request(parse_eval_arguments("--max-memory-tokens", "1024"), context_window=8192)
    check_chunks_fit(fits, tokenizer)
    with pytest.raises(ValueError, match="lower the chunk size"):
        check_chunks_fit(
            resolve_request(parse_eval_arguments("--max-memory-tokens", "2048"), 8192), tokenizer
        )
    direct_only = resolve_request(parse_eval_arguments("--methods", "direct"), context_window=4096)
    assert direct_only.methods == [EvalMethod("direct", None)]


REFERENCE_METHOD = "memstream:memagent-reference"


@pytest.mark.engine
def test_a_tiny_evaluation_runs_end_to_end(  # type: ignore[no-untyped-def]
    vllm_engine, event_loop_runner, tokenizer, corpora, tmp_path, capsys
) -> None:
    """What `memstream eval` does once its engine is open, on the shared engine's window."""
    pytest.importorskip("matplotlib", reason="the accuracy plot needs matplotlib")
    output = tmp_path / "eval"
    request = resolve_request(
        parse_eval_arguments(
            "--tasks", "hotpotqa,niah", "--lengths", "1.5k", "--samples", "1",
            "--methods", f"{REFERENCE_METHOD},{REFERENCE_METHOD}+reread600,rag-bm25,direct",
            "--chunk-size", "512",
            "--max-memory-tokens", "32", "--max-answer-tokens", "32", "--output", str(output),
        ),
        context_window=vllm_engine.config.max_model_len,
    )  # fmt: skip
    spec = EngineSpec(model=TEST_MODEL, dtype=vllm_engine.config.dtype)
    metadata = run_metadata(request, spec)
    console = Console(stderr=True)
    checkpoints = EvalCheckpoints.in_folder(output, spec, resume=False)
    try:
        outcome = event_loop_runner.run(
            evaluate_with_progress(
                request, vllm_engine, tokenizer, metadata, console, None, checkpoints
            )
        )
    finally:
        checkpoints.close()
    exit_code = report_run(request, metadata, outcome, console)

    assert exit_code == 0, [p.error for p in outcome.predictions]
    methods = [REFERENCE_METHOD, f"{REFERENCE_METHOD}+reread600", "rag-bm25", "direct"]
    assert [run.configuration.describe() for run in outcome.runs] == [
        f"{task} 1.5k {method}" for task in ("hotpotqa", "niah") for method in methods
    ]
    assert len(outcome.predictions) == 8
    assert all(p.raw_response and p.completion_tokens > 0 for p in outcome.predictions)
    chains = [p for p in outcome.predictions if p.method == REFERENCE_METHOD]
    assert all(p.n_calls == p.details["n_segments"] + 1 >= 3 for p in chains)
    assert all(p.final_memory is not None for p in chains)
    # The re-reading chains start at their answer step from the plain chains' final memories,
    # and their answer steps record the passages they re-read.
    by_method = {(p.task, p.method): p for p in outcome.predictions}
    for task in ("hotpotqa", "niah"):
        plain, rereading = (by_method[task, method] for method in methods[:2])
        assert rereading.final_memory == plain.final_memory
        assert rereading.n_calls == 1 and rereading.details["memory_reused"]
    with sqlite3.connect(output / "checkpoints.sqlite") as connection:
        spans = connection.execute(
            "SELECT reread_spans FROM steps WHERE reread_spans IS NOT NULL"
        ).fetchall()
    assert len(spans) == 2 and all(json.loads(row[0]) for row in spans)
    one_call = [p for p in outcome.predictions if p.method in ("direct", "rag-bm25")]
    assert all(p.n_calls == 1 for p in one_call)
    assert all(not p.details["truncated"] for p in one_call if p.method == "direct")
    assert all(p.details["passages"] for p in one_call if p.method == "rag-bm25")
    assert (output / ACCURACY_PLOT).read_bytes()[:8] == PNG_MAGIC
    results = json.loads((output / RESULTS_JSON).read_text())
    assert len(results["predictions"]) == 8 and len(results["summary"]) == 8
    assert "| hotpotqa | 1.5k |" in capsys.readouterr().out

    # Re-grading rebuilds the same samples from the run's metadata and gives the same scores.
    assert regrade_run(output, corpora) == 0
    regraded = json.loads((output / RESULTS_JSON).read_text())
    assert regraded["regraded_at"]
    assert [p["scores"] for p in regraded["predictions"]] == [
        p["scores"] for p in results["predictions"]
    ]
    said = " ".join(capsys.readouterr().err.split())
    assert "grounded flag changed for 0, accuracy for 0" in said


def test_regrading_a_folder_without_a_run_says_so_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.cli import main

    empty = tmp_path / "no-run"
    assert main.main(["eval", "--regrade", "--output", str(empty)]) == 2
    assert "nothing to re-grade" in capsys.readouterr().err
    assert not empty.exists()


def test_every_task_has_its_headline_metric_in_the_report() -> None:
    assert set(TASKS) <= set(HEADLINE)
