"""The training tasks: keep-the-fact (pipeline.training.tasks: an access code on the shared
corpora's prose), multi-fact (NIAH's multi-key and multi-value shapes, needle_facts), and the
figures of table rows (table_figures: synthetic tables, and the 2022 Q3 filings' rows held out
from the 2023 ones by figure). No model: a word count stands in for a tokenizer."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from operators.core.figures import is_table_row
from operators.core.templates import defang
from pipeline.corpora.needles import ADJECTIVES as NIAH_ADJECTIVES
from pipeline.corpora.needles import NOUNS as NIAH_NOUNS
from pipeline.corpora.needles import needle as niah_needle
from pipeline.corpora.needles import question_for as niah_question
from pipeline.corpora.sec10q import load_questions
from pipeline.evaluation.corpora import load_texts
from pipeline.training.config import TrainConfig
from pipeline.training.needle_facts import NeedleSample, generate_needle_samples, needle_keys
from pipeline.training.rollout import reward_of
from pipeline.training.table_figures import (
    ROW_NAMES,
    SECTION_NAMES,
    YEARS,
    RowQuestion,
    TableFigureSample,
    all_row_questions,
    figure_key,
    filing_texts,
    generate_filing_samples,
    generate_table_samples,
    parse_headed_row,
    question_bank,
    question_for,
)
from pipeline.training.tasks import (
    KEY_WORDS,
    NOVELS,
    SEGMENT_SEPARATOR,
    SPLITS,
    FactSample,
    approximate_token_count,
    first_half,
    generate_samples,
    keys_of,
    load_filler,
    needle_sentence,
    prose_paragraphs,
    read_jsonl,
    write_jsonl,
)
from pipeline.training.trainer import (
    HELDOUT_FILE,
    SampleSource,
    heldout_summary,
    score_heldout_when_due,
    task_of,
    task_samples,
)
from pipeline.training.verl_export import dataset_rows
from pipeline.training.verl_reward import compute_score

PLANTED = re.compile(r"The access code for the ([a-z]+ [a-z]+) vault is (\d{7})\.")
ASKED = re.compile(r"^What is the access code for the ([a-z]+ [a-z]+) vault\?$")
WINDOW_WORDS = 12


def asked_key(sample: FactSample) -> str:
    match = ASKED.match(sample.question)
    assert match, sample.question
    return match.group(1)


def filler_only(document: str) -> str:
    return " ".join(PLANTED.sub(" ", document).split())


def windows(text: str, size: int = WINDOW_WORDS, step: int = 7) -> list[str]:
    words = text.split()
    return [" ".join(words[i : i + size]) for i in range(0, len(words) - size, step)]


def test_samples_are_determined_by_seed_split_and_index(corpora: Path) -> None:
    first = generate_samples(4, seed=3, split="train", corpora=corpora)
    assert generate_samples(4, seed=3, split="train", corpora=corpora) == first
    assert generate_samples(2, seed=3, split="train", corpora=corpora) == first[:2]
    other_seed = generate_samples(4, seed=4, split="train", corpora=corpora)
    assert [s.document for s in other_seed] != [s.document for s in first]
    assert [s.sample_id for s in first] == [f"train-3-{i}" for i in range(4)]


def test_the_needle_is_planted_once_among_distractors_with_other_keys(corpora: Path) -> None:
    samples = generate_samples(30, seed=0, split="train", n_distractors=4, corpora=corpora)
    depths = []
    for sample in samples:
        key = asked_key(sample)
        (code,) = sample.answers
        assert re.fullmatch(r"[1-9]\d{6}", code)
        needle = needle_sentence(key, code)
        assert sample.document.count(needle) == 1
        assert sample.document.count(code) == 1
        planted = PLANTED.findall(sample.document)
        assert len(planted) == 5
        keys = [planted_key for planted_key, _ in planted]
        codes = [planted_code for _, planted_code in planted]
        assert keys.count(key) == 1 and len(set(keys)) == 5
        assert len(set(codes)) == 5
        assert sample.needle_depth == sample.document.index(needle) / len(sample.document)
        depths.append(sample.needle_depth)
    # Random depths: some in each third of the documents.
    assert min(depths) < 1 / 3 and max(depths) > 2 / 3
    assert any(1 / 3 <= depth <= 2 / 3 for depth in depths)


def test_train_and_heldout_share_no_key_words(corpora: Path) -> None:
    for index in (0, 1):  # adjectives, then nouns
        assert not set(KEY_WORDS["train"][index]) & set(KEY_WORDS["heldout"][index])
    assert not set(keys_of("train")) & set(keys_of("heldout"))
    for split in ("train", "heldout"):
        samples = generate_samples(10, seed=1, split=split, corpora=corpora)
        for sample in samples:
            assert {key for key, _ in PLANTED.findall(sample.document)} <= set(keys_of(split))


def flattened(text: str) -> str:
    return " ".join(text.replace("_", "").split())


def test_heldout_filler_shares_no_text_with_training_nor_eval_haystacks(corpora: Path) -> None:
    for relative in NOVELS:
        paragraphs = prose_paragraphs((corpora / relative).read_text(encoding="utf-8-sig"))
        assert 0 < len(first_half(paragraphs)) < len(paragraphs)
        assert not any("Gutenberg" in paragraph for paragraph in paragraphs)

    texts = {
        split: "\n".join(" ".join(filler.words) for filler in load_filler(corpora, split))
        for split in ("train", "heldout")
    }
    # What `memstream eval` cuts its NIAH and HotpotQA haystacks from.
    haystacks = "\n".join(flattened(text) for text in load_texts(corpora).values())
    spans_of = {
        split: [
            span
            for sample in generate_samples(8, seed=2, split=split, corpora=corpora)
            for span in windows(filler_only(sample.document.replace(SEGMENT_SEPARATOR, " ")))
        ]
        for split in ("train", "heldout")
    }
    for split, other in (("train", "heldout"), ("heldout", "train")):
        spans = spans_of[split]
        assert spans
        # Every span of filler is text of its own split (so the check below can fail) ...
        assert sum(span in texts[split] for span in spans) >= 0.8 * len(spans)
        # ... and none is text of the other split.
        assert not [span for span in spans if span in texts[other]]
    # Training text is in eval's haystacks (so this check can fail); held-out text is not.
    assert sum(span in haystacks for span in spans_of["train"]) >= 0.5 * len(spans_of["train"])
    assert not [span for span in spans_of["heldout"] if span in haystacks]


def test_segment_sizes_stay_within_the_budget(corpora: Path) -> None:
    # Without a tokenizer: pieces of words / 0.75 tokens, planted sentences included.
    samples = generate_samples(
        10, seed=5, split="heldout", n_segments=4, segment_tokens=300, corpora=corpora
    )
    for sample in samples:
        pieces = sample.document.split(SEGMENT_SEPARATOR)
        assert len(pieces) == 4
        for piece in pieces:
            assert 290 <= approximate_token_count(piece) <= 300

    # With a tokenizer-like counter (4 characters a token): within a few tokens of 150.
    def characters_over_four(text: str) -> int:
        return math.ceil(len(text) / 4)

    samples = generate_samples(
        10,
        seed=5,
        split="train",
        n_segments=3,
        segment_tokens=150,
        n_distractors=2,
        count_tokens=characters_over_four,
        corpora=corpora,
    )
    for sample in samples:
        pieces = sample.document.split(SEGMENT_SEPARATOR)
        assert len(pieces) == 3
        for piece in pieces:
            assert 142 <= characters_over_four(piece) <= 150


def test_segments_too_small_for_the_planted_sentences_are_refused(corpora: Path) -> None:
    with pytest.raises(ValueError, match="no room"):
        generate_samples(1, seed=0, split="train", segment_tokens=20, corpora=corpora)
    with pytest.raises(ValueError, match="split"):
        generate_samples(1, seed=0, split="test", corpora=corpora)  # type: ignore[arg-type]


def test_jsonl_round_trip_and_minimal_rows(corpora: Path, tmp_path: Path) -> None:
    samples = generate_samples(3, seed=9, split="heldout", corpora=corpora)
    path = write_jsonl(samples, tmp_path / "facts" / "heldout.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [set(row) for row in rows] == [
        {"sample_id", "document", "question", "answers", "needle_depth"}
    ] * 3
    assert read_jsonl(path) == samples

    minimal = tmp_path / "minimal.jsonl"
    minimal.write_text(
        json.dumps({"document": "d", "question": "q", "answers": "42"}) + "\n\n", encoding="utf-8"
    )
    assert read_jsonl(minimal) == [FactSample("line-1", "d", "q", ["42"], None)]
    minimal.write_text(json.dumps({"document": "d", "question": "q"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="missing answers"):
        read_jsonl(minimal)


def test_a_window_of_samples_is_the_same_as_in_the_whole_list() -> None:
    whole = generate_samples(6, seed=4, split="train", n_segments=2, segment_tokens=80)
    window = generate_samples(2, seed=4, split="train", n_segments=2, segment_tokens=80, first=3)
    assert window == whole[3:5]
    far = generate_samples(1, seed=4, split="train", n_segments=2, segment_tokens=80, first=10**7)
    assert far[0].sample_id == f"train-4-{10**7}"


# --- multi-fact: NIAH's multi-key and multi-value shapes (pipeline.training.needle_facts) ------

NIAH_NEEDLE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")


def test_needle_samples_are_determined_by_seed_split_and_index(corpora: Path) -> None:
    whole = generate_needle_samples(6, seed=3, split="train", corpora=corpora)
    assert generate_needle_samples(6, seed=3, split="train", corpora=corpora) == whole
    assert generate_needle_samples(2, seed=3, split="train", corpora=corpora, first=3) == whole[3:5]
    other = generate_needle_samples(6, seed=4, split="train", corpora=corpora)
    assert [s.document for s in other] != [s.document for s in whole]
    assert [s.sample_id for s in whole] == [f"needles-train-3-{i}" for i in range(6)]
    assert [s.variant for s in whole] == ["multikey", "multivalue"] * 3


def test_needle_samples_have_niah_shapes(corpora: Path) -> None:
    for sample in generate_needle_samples(20, seed=0, split="train", corpora=corpora):
        planted = NIAH_NEEDLE.findall(sample.document)
        assert len(planted) == 4 == len(sample.needles)  # NIAH's NEEDLES_PER_MULTI_SAMPLE
        assert all(sample.document.count(needle) == 1 for needle in sample.needles)
        assert sample.answer_mode == "all"
        keys = [key for key, _ in planted]
        values = [value for _, value in planted]
        assert len(set(values)) == 4
        asked = re.search(r"numbers? for ([a-z]+-[a-z]+) mentioned", sample.question)
        assert asked is not None
        if sample.variant == "multikey":
            assert sample.question == niah_question(asked.group(1), "multikey")
            assert len(set(keys)) == 4 and keys.count(asked.group(1)) == 1
            assert sample.answers == [values[keys.index(asked.group(1))]]
        else:
            assert sample.question == niah_question(asked.group(1), "multivalue")
            assert set(keys) == {asked.group(1)}
            assert sorted(sample.answers) == sorted(values)
        assert sample.needles[0] == niah_needle(asked.group(1), sample.answers[0])
        # The gold answer scores as NIAH scores it; a distractor's value does not.
        assert reward_of(f"Therefore, the answer is {', '.join(sample.answers)}.",
                         sample.answers, answer_mode="all") == 1.0  # fmt: skip
        wrong = [value for value in values if value not in sample.answers]
        if wrong:
            assert reward_of(f"Therefore, the answer is {wrong[0]}.", sample.answers,
                             answer_mode="all") == 0.0  # fmt: skip


def test_needle_keys_are_split_disjoint_and_never_niah_eval_keys(corpora: Path) -> None:
    train, heldout = set(needle_keys("train")), set(needle_keys("heldout"))
    assert train and heldout and not train & heldout
    words = {split: {w for key in needle_keys(split) for w in key.split("-")} for split in SPLITS}
    assert not words["train"] & words["heldout"]
    assert not words["train"] & (set(NIAH_ADJECTIVES) | set(NIAH_NOUNS))
    for split in SPLITS:
        for sample in generate_needle_samples(10, seed=1, split=split, corpora=corpora):
            assert {key for key, _ in NIAH_NEEDLE.findall(sample.document)} <= set(
                needle_keys(split)
            )


def test_needle_filler_is_the_splits_own_prose(corpora: Path) -> None:
    texts = {
        split: "\n".join(" ".join(filler.words) for filler in load_filler(corpora, split))
        for split in SPLITS
    }
    for split, other in (("train", "heldout"), ("heldout", "train")):
        spans = [
            span
            for sample in generate_needle_samples(6, seed=2, split=split, corpora=corpora)
            for span in windows(NIAH_NEEDLE.sub(" ", sample.document).replace("\n", " "))
        ]
        assert sum(span in texts[split] for span in spans) >= 0.8 * len(spans)
        assert not [span for span in spans if span in texts[other]]


# --- table-figures: synthetic headed rows in prose (pipeline.training.table_figures) ------------

# A row as operators.parsing.pdf_headers writes it under column headers.
HEADED_ROW = re.compile(r"[^:;\n]{1,200}: [^;\n]+(?:; [^;\n]+)+")
ASKED_CELL = re.compile(r"What was (?P<label>.+) for (?P<header>.+)\?")


def test_table_samples_are_determined_by_seed_split_and_index(corpora: Path) -> None:
    whole = generate_table_samples(6, seed=5, split="train", corpora=corpora)
    assert generate_table_samples(6, seed=5, split="train", corpora=corpora) == whole
    assert generate_table_samples(2, seed=5, split="train", corpora=corpora, first=2) == whole[2:4]
    other = generate_table_samples(6, seed=6, split="train", corpora=corpora)
    assert [s.document for s in other] != [s.document for s in whole]


def test_table_rows_read_as_the_parser_writes_them_and_the_gold_is_the_asked_cell(
    corpora: Path,
) -> None:
    samples = [
        *generate_table_samples(30, seed=0, split="train", segment_tokens=200, corpora=corpora),
        *generate_table_samples(10, seed=0, split="heldout", corpora=corpora),
    ]
    for sample in samples:
        assert sample.answer_mode == "figure" and sample.source == "synthetic"
        assert sample.row in sample.document.split(SEGMENT_SEPARATOR)  # a block of its own
        assert HEADED_ROW.fullmatch(sample.row) and is_table_row(sample.row)
        row = parse_headed_row(sample.row)
        assert row is not None and row.text() == sample.row
        asked = ASKED_CELL.fullmatch(sample.question)
        assert asked is not None and asked["label"] == row.label
        gold, *scaled = sample.answers
        assert dict(row.cells)[asked["header"]] == gold
        millions = "(In millions" in sample.document or "(in millions)" in sample.document
        assert scaled == ([f"{gold} million"] if millions else [])
        assert gold in sample.row and gold in sample.document
        # Every figure of the tables is printed once: the gold names one cell.
        cells = [
            figure_key(value)
            for line in sample.document.split(SEGMENT_SEPARATOR)
            if (parsed := parse_headed_row(line))
            for _, value in parsed.cells
        ]
        assert cells.count(figure_key(gold)) == 1
        # Scored as a figure: the gold, its value with a scale, not another column's figure.
        assert reward_of(f"Therefore, the answer is {gold}.", [gold], answer_mode="figure") == 1.0
        bare = gold.replace("$ ", "").strip("()")
        assert reward_of(f"Therefore, the answer is ${bare} million.", sample.answers,
                         answer_mode="figure") == float(millions)  # fmt: skip
        others = [value for header, value in row.cells if header != asked["header"]]
        assert reward_of(f"Therefore, the answer is {others[0]}.", sample.answers,
                         answer_mode="figure") == 0.0  # fmt: skip


def test_parse_headed_row_reads_the_parsers_rows_and_nothing_else() -> None:
    line = (
        "North America, Operating income (loss): Three Months Ended September 30, 2021 $ 880; "
        "Three Months Ended September 30, 2022 $ (412); Nine Months Ended September 30, 2022 —"
    )
    row = parse_headed_row(line)
    assert row is not None and row.label == "North America, Operating income (loss)"
    assert row.cells == (
        ("Three Months Ended September 30, 2021", "$ 880"),
        ("Three Months Ended September 30, 2022", "$ (412)"),
    )
    assert parse_headed_row("Note: the figures below are in millions, as of 2022.") is None
    assert parse_headed_row("iPhone $ 39,669 $ 40,665") is None  # a row without headers
    assert (
        question_for(
            "Net Sales, Other (6)", "(In millions, except per share amounts) Nine Months Ended 2022"
        )
        == "What was Net Sales, Other for Nine Months Ended 2022?"
    )


def test_table_splits_share_no_labels_sections_years_nor_prose(corpora: Path) -> None:
    for vocabulary in (ROW_NAMES, SECTION_NAMES, YEARS):
        assert not set(vocabulary["train"]) & set(vocabulary["heldout"])  # type: ignore[index]
    texts = {
        split: "\n".join(" ".join(filler.words) for filler in load_filler(corpora, split))
        for split in SPLITS
    }
    for split, other in (("train", "heldout"), ("heldout", "train")):
        samples = generate_table_samples(10, seed=1, split=split, corpora=corpora)
        spans = []
        for sample in samples:
            blocks = sample.document.split(SEGMENT_SEPARATOR)
            for block in blocks:
                row = parse_headed_row(block)
                if row is None:
                    spans += windows(block)
                    continue
                (name,) = [n for n in ROW_NAMES[split] if row.label.endswith(n)]
                section = row.label.removesuffix(name).removesuffix(", ")
                assert not section or section in SECTION_NAMES[split]
                assert not row.label.endswith(tuple(ROW_NAMES[other]))
                years = {int(y) for h, _ in row.cells for y in re.findall(r"\b20\d\d\b", h)}
                assert years <= set(YEARS[split])
        assert spans and sum(span in texts[split] for span in spans) >= 0.8 * len(spans)
        assert not [span for span in spans if span in texts[other]]


# --- filing-figures: every headed row of the 2022 Q3 filings; held out 2023 Q1 and Q2 --------

# Measured on the shared corpus (parser pdf:pdfminer-headed-rows): 3,419 questions from the
# 2022 Q3 filings, 1,920 after the figure check; 6,932 from the 2023 Q1 and Q2 filings.
MIN_TRAIN_QUESTIONS = 1800
MIN_HELDOUT_QUESTIONS = 6500


@pytest.fixture(scope="module")
def banks(corpora: Path) -> dict[str, tuple[RowQuestion, ...]]:
    return {split: question_bank(corpora, split) for split in SPLITS}


def test_filing_questions_are_counted_and_come_from_their_filings(
    banks: dict[str, tuple[RowQuestion, ...]], corpora: Path
) -> None:
    before = all_row_questions(corpora, "train")
    print(
        f"filing-figures: {len(before)} questions from the 2022 Q3 filings, "
        f"{len(banks['train'])} after the figure check; {len(banks['heldout'])} held out "
        "(2023 Q1 and Q2)"
    )
    assert len(banks["train"]) >= MIN_TRAIN_QUESTIONS
    assert len(banks["heldout"]) >= MIN_HELDOUT_QUESTIONS
    assert {q.filing[:7] for q in banks["train"]} == {"2022 Q3"}
    assert {q.filing[:7] for q in banks["heldout"]} == {"2023 Q1", "2023 Q2"}
    assert len({q.filing for q in banks["train"]}) == 5
    texts = filing_texts(corpora, "train")
    for question in banks["train"][::50]:
        row = parse_headed_row(question.row)
        assert row is not None and dict(row.cells)[question.header] == question.figure
        assert question.row in texts[question.filing].split("\n") or any(
            line.strip() == question.row for line in texts[question.filing].split("\n")
        )


def test_no_training_figure_is_the_gold_of_a_heldout_question(
    banks: dict[str, tuple[RowQuestion, ...]], corpora: Path
) -> None:
    # The evaluation's sec10q questions, both splits: tune reads 2022 Q3 and 2023 Q1, heldout
    # 2023 Q2; all of them are held out from training by figure.
    evaluation = load_questions()
    assert {q.filing[:7] for q in evaluation if q.split == "heldout"} == {"2023 Q2"}
    assert {q.filing[:7] for q in evaluation if q.split == "tune"} == {"2022 Q3", "2023 Q1"}
    held = {figure_key(q.figure) for q in banks["heldout"]}
    held |= {figure_key(q.figure) for q in evaluation}
    train = {figure_key(q.figure) for q in banks["train"]}
    assert not train & held
    # The check bites: comparative columns repeat figures across filings, and the evaluation's
    # 2022 Q3 questions are rows of the training filings.
    before = all_row_questions(corpora, "train")
    colliding = [q for q in before if figure_key(q.figure) in held]
    assert len(colliding) >= 1000
    eval_2022 = {figure_key(q.figure) for q in evaluation if q.filing.startswith("2022 Q3")}
    assert {figure_key(q.figure) for q in before} & eval_2022
    # e.g. Microsoft's June 30, 2022 year-end column, printed in its 2022 Q3 and 2023 filings
    assert any(q.filing == "2022 Q3 MSFT.pdf" and "June 30, 2022" in q.header for q in colliding)


def test_filing_samples_hold_the_row_and_its_gold_figure(
    banks: dict[str, tuple[RowQuestion, ...]], corpora: Path
) -> None:
    samples = generate_filing_samples(
        12, seed=0, split="train", n_segments=3, segment_tokens=200, corpora=corpora
    )
    assert samples == generate_filing_samples(
        12, seed=0, split="train", n_segments=3, segment_tokens=200, corpora=corpora
    )
    assert (
        generate_filing_samples(
            3, seed=0, split="train", n_segments=3, segment_tokens=200, corpora=corpora, first=4
        )
        == samples[4:7]
    )
    questions = {(q.filing, q.question): q for q in banks["train"]}
    for sample in samples:
        gold = sample.answers[0]
        assert sample.answer_mode == "figure" and sample.source.startswith("2022 Q3")
        question = questions[(sample.source, sample.question)]
        assert question.figure == gold and sample.answers == question.answers
        assert sample.row in sample.document and gold in sample.row and gold in sample.document
        assert 100 <= approximate_token_count(sample.document) <= 3 * 200 + 400
        assert reward_of(f"Therefore, the answer is {gold}.", [gold], answer_mode="figure") == 1.0
    heldout = generate_filing_samples(4, seed=1, split="heldout", corpora=corpora)
    assert {s.source[:7] for s in heldout} <= {"2023 Q1", "2023 Q2"}


# --- in the format users run -------------------------------------------------------------------


class WordTokenizer:
    """Counts words as tokens (task_samples needs only `encode`)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


@pytest.mark.parametrize("task", ["multi-fact", "table-figures", "filing-figures"])
def test_new_tasks_feed_the_trainer_and_the_verl_export(task: str, corpora: Path) -> None:
    config = TrainConfig(
        output=Path("unused"), task=task, model="qwen2.5-coder-0.5b-instruct",
        n_segments=2, segment_tokens=200, samples_per_step=2,
    )  # type: ignore[arg-type]  # fmt: skip
    assert config.chain().templates.name == "verified-quotes"  # the default model's strategy
    samples = task_samples(config, WordTokenizer(), 3, split="train", first=1)
    assert samples == task_samples(config, WordTokenizer(), 3, split="train", first=1)
    heldout = task_samples(config, WordTokenizer(), 2, split="heldout", seed=1)
    assert [s.sample_id for s in heldout] != [s.sample_id for s in samples]
    templates = config.chain().templates
    for sample in samples:
        # The document goes into the template unescaped, and the evidence a memory keeps is a
        # quote the verified-quotes policy accepts from the section that holds it.
        assert defang(sample.document) == sample.document
        if isinstance(sample, TableFigureSample):
            evidence = sample.row
        else:
            assert isinstance(sample, NeedleSample)
            evidence = sample.needles[0]
        section = next(block for block in sample.document.split("\n") if evidence in block)
        assert templates.next_memory(templates.initial_memory, evidence, section, 4000).memory == (
            evidence
        )
        given = sample.answers[0] if sample.answer_mode == "figure" else ", ".join(sample.answers)
        answer = f"Therefore, the answer is {given}."
        assert reward_of(answer, sample.answers, answer_mode=sample.answer_mode) == 1.0
        assert (
            compute_score(
                "memstream", answer, list(sample.answers), {"answer_mode": sample.answer_mode}
            )["acc"]
            == 1.0
        )
    rows = dataset_rows(config, samples, split="train")
    assert [row["data_source"] for row in rows] == [f"memstream/{task}"] * 3
    assert [row["extra_info"]["answer_mode"] for row in rows] == [s.answer_mode for s in samples]


# --- a mix of tasks ----------------------------------------------------------------------------


def test_a_task_mix_draws_each_task_in_turn_by_seed_split_and_index(corpora: Path) -> None:
    mix = TrainConfig(
        output=Path("unused"), task="multi-fact+table-figures", n_segments=2, segment_tokens=200
    )
    assert mix.tasks() == ("multi-fact", "table-figures")
    drawn = task_samples(mix, WordTokenizer(), 5, split="train", first=3)
    for index, sample in enumerate(drawn, start=3):
        task = task_of(mix, index)
        assert task == ("multi-fact", "table-figures")[index % 2]
        alone = mix.model_copy(update={"task": task})
        assert sample == task_samples(alone, WordTokenizer(), 1, split="train", first=index // 2)[0]
        assert isinstance(sample, NeedleSample if task == "multi-fact" else TableFigureSample)
    # A window of the mix is the same samples as in a longer draw, for every split and seed.
    assert task_samples(mix, WordTokenizer(), 2, split="train", first=4) == drawn[1:3]
    heldout = task_samples(mix, WordTokenizer(), 4, split="heldout", seed=1)
    assert [type(s) for s in heldout] == [NeedleSample, TableFigureSample] * 2
    assert heldout != task_samples(mix, WordTokenizer(), 4, split="heldout", seed=2)
    # A step draws from both tasks.
    step = SampleSource(mix.model_copy(update={"samples_per_step": 2}), WordTokenizer()).draw(1, 0)
    assert [type(s) for s in step] == [NeedleSample, TableFigureSample]


def test_a_single_task_draws_as_before(corpora: Path) -> None:
    config = TrainConfig(output=Path("unused"), task="multi-fact", n_segments=2, segment_tokens=200)
    assert config.tasks() == ("multi-fact",)
    assert task_samples(config, WordTokenizer(), 3, split="train", first=2) == (
        generate_needle_samples(
            3, seed=0, split="train", n_segments=2, segment_tokens=200, n_distractors=3,
            count_tokens=lambda text: len(text.split()), first=2,
        )
    )  # fmt: skip


@pytest.mark.parametrize(
    ("task", "problem"),
    [("multi-fact+nope", "unknown task 'nope'"), ("cuad+cuad", "twice"), ("", "unknown task")],
)
def test_a_task_mix_names_known_tasks_once(task: str, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        TrainConfig(output=Path("unused"), task=task)


def test_heldout_scores_are_reported_per_task() -> None:
    rows = [
        {"task": "multi-fact", "strict": 1.0, "raw": 1.0},
        {"task": "filing-figures", "strict": 0.0, "raw": 1.0},
        {"task": "multi-fact", "strict": 0.0, "raw": 0.0},
        {"task": "filing-figures", "strict": 0.0, "raw": 0.0},
    ]
    assert heldout_summary(rows) == {
        "strict": 0.25, "raw": 0.5, "n": 4,
        "tasks": {
            "multi-fact": {"strict": 0.5, "raw": 0.5, "n": 2},
            "filing-figures": {"strict": 0.0, "raw": 0.5, "n": 2},
        },
    }  # fmt: skip


def test_heldout_scoring_runs_when_due_and_once_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.training import trainer

    calls: list[tuple[str, int]] = []
    scores = iter([0.25, 0.5, 0.25])

    def fake_score(
        config: TrainConfig, weights: Path, n: int, **_: object
    ) -> list[dict[str, object]]:
        calls.append((Path(weights).name, n))
        return [{"task": "multi-fact", "strict": next(scores), "raw": 1.0}]

    monkeypatch.setattr(trainer, "score_heldout", fake_score)
    monkeypatch.setattr(trainer.models, "resolve", lambda name: str(tmp_path / "base" / name))
    never = TrainConfig(output=tmp_path / "run", task="multi-fact")
    assert score_heldout_when_due(never, 0, log=lambda _: None) is None
    config = never.model_copy(update={"heldout_every": 5, "heldout_samples": 8})
    adapter = config.output / trainer.CHECKPOINT_DIR / trainer.ADAPTER_DIR
    adapter.mkdir(parents=True)
    for step in (0, 3, 5, 5, 10):  # 5 twice: a resumed run does not score a step again
        (adapter / "adapter_model.safetensors").write_text(f"step {step}")
        score_heldout_when_due(config, step, log=lambda _: None)
    assert calls == [
        ("smollm2-135m-instruct", 8), (trainer.CHECKPOINT_DIR, 8), (trainer.CHECKPOINT_DIR, 8)
    ]  # fmt: skip
    lines = [json.loads(line) for line in (config.output / HELDOUT_FILE).read_text().splitlines()]
    assert [(line["step"], line["strict"], line["best"]) for line in lines] == [
        (0, 0.25, True), (5, 0.5, True), (10, 0.25, False)
    ]  # fmt: skip
    assert lines[0]["tasks"] == {"multi-fact": {"strict": 0.25, "raw": 1.0, "n": 1}}
    # The adapter of the best scoring (step 5) is kept apart; the checkpoint moved on.
    best = config.output / trainer.BEST_ADAPTER_DIR
    assert (best / "adapter_model.safetensors").read_text() == "step 5"
    assert json.loads((best / "step.json").read_text()) == {"step": 5}
