"""The figure scorer: an answer states a printed figure when its value matches, in any usual
spelling, and not when it is too coarse, a unit alone, or a whole dumped table row."""

from __future__ import annotations

import pytest

from operators.core.figures import find_figures, parse_gold, states_figure
from operators.core.scoring import score
from pipeline.corpora.sec10q import load_questions

IPHONE = ("$39,669 million",)


@pytest.mark.parametrize(
    "answer",
    [
        "$39,669 million",
        "39,669",
        "$39.7 billion",
        "39,669,000,000",
        "iPhone net sales were $39,669 million for the three months ended July 1, 2023.",
        "$39,669 million, down from $40,665 million a year earlier",
        "39.669 billion dollars",
        "$ 39,669",
    ],
)
def test_right_spellings_of_a_figure_count(answer: str) -> None:
    assert states_figure(answer, IPHONE)


@pytest.mark.parametrize(
    "answer",
    [
        "million",
        "8",
        "$40 billion",  # too coarse to tell
        "$39.6 billion",
        "$40,665 million",
        "iPhone® $ 39,669 $ 40,665 $ 156,778 $ 162,863",  # a dumped row
        "not in the document",
        "",
        None,
    ],
)
def test_wrong_or_unusable_answers_do_not_count(answer: str | None) -> None:
    assert not states_figure(answer, IPHONE)


def test_percentages_and_per_share_amounts() -> None:
    assert states_figure("The effective tax rate was 12.5%.", ("12.5%",))
    assert states_figure("12.5 percent", ("12.5%",))
    assert not states_figure("25%", ("12.5%",))
    assert not states_figure("8", ("8.1%",))
    assert states_figure("8%", ("8%",))
    assert states_figure("Diluted earnings per share were $1.26", ("$1.26",))
    assert not states_figure("$1.2", ("$1.26",))


def test_losses_in_parentheses_and_minus_signs_match_their_magnitude() -> None:
    assert states_figure("a net loss of $2,345 million", ("$(2,345) million",))
    assert states_figure("(2,345)", ("$2,345 million",))
    assert states_figure("-2,345", ("$2,345 million",))


def test_dates_are_not_figures() -> None:
    figures = find_figures("For the quarter ended July 1, 2023, in fiscal 2023: $39,669 million")
    assert [f.value for f in figures] == [39669.0]
    assert figures[0].scale == 1e6


def test_a_figure_with_a_thousands_separator_is_never_a_year() -> None:
    assert states_figure("1,945", ("$1,945 million",))
    assert [f.value for f in find_figures("in 2023, 1,945 and 2,023")] == [1945.0, 2023.0]


def test_every_sec10q_gold_answer_states_itself_and_its_printed_figure() -> None:
    for question in load_questions():
        assert states_figure(question.gold, [question.gold]), question.id
        assert states_figure(question.figure, [question.gold]), question.id


def test_a_gold_answer_holds_exactly_one_figure() -> None:
    assert parse_gold("$39,669 million").absolute == 39_669e6
    with pytest.raises(ValueError, match="exactly one number"):
        parse_gold("39,669 and 40,665")


def test_figure_mode_scores_accuracy_by_value_not_substring() -> None:
    # sub_exact_match matches both ways, so "million" would count; the figure mode does not.
    assert score(IPHONE, "any", "million", "Therefore, the answer is million")["accuracy"] == 1.0
    assert score(IPHONE, "figure", "million", "the answer is million")["accuracy"] == 0.0
    right = score(IPHONE, "figure", "$39.7 billion", "Therefore, the answer is $39.7 billion")
    assert right["accuracy"] == 1.0
    assert right["raw_match"] == 1.0
