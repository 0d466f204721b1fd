"""pipeline.training.contract_fields: CUAD field samples from the shared contracts, split by
contract, rewarded as the evaluation scores them; the keep-the-fact task unchanged beside it."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
from pydantic import ValidationError

from operators.core.dates import find_dates
from operators.core.segmentation import SegmentationConfig, segment, tokenize
from pipeline.cli.flags import UserError, model_from_flags
from pipeline.cli.main import build_parser
from pipeline.corpora.cuad import is_extractive, load_cuad
from pipeline.training.config import TrainConfig
from pipeline.training.contract_fields import FieldSample, generate_field_samples
from pipeline.training.rollout import reward_of
from pipeline.training.tasks import FactSample, generate_samples
from pipeline.training.trainer import SampleSource, task_samples

TRAIN_LABELS = 8  # VitalibisInc's extractive labels
HELDOUT_LABELS = 4  # PhotronicsInc's


def test_samples_build_from_the_shared_contracts_and_segment_by_the_chunk_size(  # type: ignore[no-untyped-def]
    corpora: Path, tokenizer
) -> None:
    config = TrainConfig(output=Path("unused"), task="cuad", chunk_size=1000)
    contracts = load_cuad(corpora)
    texts = {contract.name: text for contract, text in contracts}
    for split, n_labels in (("train", TRAIN_LABELS), ("heldout", HELDOUT_LABELS)):
        samples = task_samples(config, tokenizer, n_labels, split=split)  # type: ignore[arg-type]
        assert all(isinstance(sample, FieldSample) for sample in samples)
        assert len({sample.question for sample in samples}) == n_labels
        for sample in samples:
            assert sample.document == texts[sample.contract]
            assert sample.answers and sample.question.endswith("?")
            dated = bool(find_dates(sample.answers[0]))  # CUAD gives dates as m/d/yyyy
            expected = "all" if sample.category == "Parties" else "date" if dated else "any"
            assert sample.answer_mode == expected, sample.category
        document = tokenize(samples[0].sample_id, samples[0].document, tokenizer)
        assert document.n_tokens > 5_000  # a whole contract, several segments long
        segments = segment(document, tokenizer, SegmentationConfig(chunk_size=config.chunk_size))
        assert len(segments) >= 5
        assert all(piece.n_tokens <= config.chunk_size for piece in segments)
    labels = [label for contract, _ in contracts for label in contract.labels]
    assert sum(map(is_extractive, labels)) == TRAIN_LABELS + HELDOUT_LABELS


def test_the_split_is_by_contract_disjoint_and_deterministic(corpora: Path) -> None:
    train = generate_field_samples(TRAIN_LABELS, split="train", corpora=corpora)
    heldout = generate_field_samples(HELDOUT_LABELS, split="heldout", corpora=corpora)
    assert {sample.contract for sample in train} == {"VitalibisInc"}
    assert {sample.contract for sample in heldout} == {"PhotronicsInc"}
    assert not {sample.document for sample in train} & {sample.document for sample in heldout}
    assert generate_field_samples(TRAIN_LABELS, split="train", corpora=corpora) == train
    # Sample i is the same whatever the window, cycling over the split's labels.
    window = generate_field_samples(3, split="train", corpora=corpora, first=TRAIN_LABELS + 2)
    assert [(s.question, s.answers) for s in window] == [
        (s.question, s.answers) for s in train[2:5]
    ]
    with pytest.raises(ValueError, match="split must be one of"):
        generate_field_samples(1, split="test", corpora=corpora)  # type: ignore[arg-type]


def test_a_parties_answer_earns_the_reward_only_with_every_party_named(corpora: Path) -> None:
    (parties,) = [
        sample
        for sample in generate_field_samples(HELDOUT_LABELS, split="heldout", corpora=corpora)
        if sample.category == "Parties"
    ]
    assert parties.answer_mode == "all" and len(parties.answers) == 4
    every = "So the answer is " + "; ".join(parties.answers) + "."
    one_missing = "So the answer is " + "; ".join(parties.answers[:-1]) + "."
    assert reward_of(every, parties.answers, answer_mode="all") == 1.0
    assert reward_of(one_missing, parties.answers, answer_mode="all") == 0.0
    # The same one-missing answer names a gold answer, which the plain "any" match would reward.
    assert reward_of(one_missing, parties.answers) == 1.0
    assert reward_of(one_missing, parties.answers, raw_match=True, answer_mode="all") == 0.0
    unformatted = "They are " + " and ".join(parties.answers) + "."
    assert reward_of(unformatted, parties.answers, answer_mode="all") == 0.0
    assert reward_of(unformatted, parties.answers, raw_match=True, answer_mode="all") == 1.0


def test_a_date_field_accepts_any_usual_spelling(corpora: Path) -> None:
    train = generate_field_samples(TRAIN_LABELS, split="train", corpora=corpora)
    (agreement_date,) = [sample for sample in train if sample.category == "Agreement Date"]
    assert agreement_date.answer_mode == "date"
    for spelling in ("March 14, 2018", "3/14/2018", "14th day of March, 2018", "3-14-18"):
        response = f"So the answer is {spelling}."
        assert reward_of(response, agreement_date.answers, answer_mode="date") == 1.0
    wrong = "So the answer is March 15, 2018."
    assert reward_of(wrong, agreement_date.answers, answer_mode="date") == 0.0


def test_the_keep_the_fact_task_is_the_default_and_unchanged(  # type: ignore[no-untyped-def]
    corpora: Path, tokenizer
) -> None:
    config = TrainConfig(output=Path("unused"), n_segments=2, segment_tokens=80)
    assert config.task == "keep-the-fact"
    drawn = SampleSource(config, tokenizer).draw(step=1, draw=0)
    expected = generate_samples(
        config.samples_per_step, seed=config.seed, split="train", n_segments=2,
        segment_tokens=80, n_distractors=config.n_distractors,
        count_tokens=lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
    )  # fmt: skip
    assert drawn == expected
    assert all(isinstance(sample, FactSample) for sample in drawn)
    assert FactSample.answer_mode == "any"
    assert set(asdict(drawn[0])) == {"sample_id", "document", "question", "answers", "needle_depth"}


def test_the_task_is_a_flag_and_excludes_an_answers_file(tmp_path: Path) -> None:
    args = build_parser().parse_args(["train", "--output", str(tmp_path), "--task", "cuad"])
    assert args.task == "cuad"
    # A mix of tasks is a string ("multi-fact+cuad"): TrainConfig refuses an unknown name.
    nope = build_parser().parse_args(["train", "--output", str(tmp_path), "--task", "nope"])
    with pytest.raises(UserError, match=r"--task: .*unknown task 'nope'"):
        model_from_flags(TrainConfig, nope)
    with pytest.raises(ValidationError, match="pass one"):
        TrainConfig(output=tmp_path, task="cuad", answers=tmp_path / "mine.jsonl")
