"""pipeline.training.tasks: the synthetic access-code task on the shared corpora's prose."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from pipeline.evaluation.corpora import load_texts
from pipeline.training.tasks import (
    KEY_WORDS,
    NOVELS,
    SEGMENT_SEPARATOR,
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
