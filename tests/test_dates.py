"""Dates stated in text and the "date" answer mode: pure, no engine."""

from __future__ import annotations

import datetime

import pytest

from operators.core.dates import asks_for_date, find_dates, states_date
from operators.core.scoring import score

MAY_16 = datetime.date(2017, 5, 16)
GOLD = ("5/16/2017", "May 16, 2017", "16 May 2017", "16th day of May, 2017", "2017-05-16")


@pytest.mark.parametrize(
    "text",
    [
        "5/16/2017",
        "5-16-17",
        "05.16.2017",
        "May 16, 2017",
        "May 16th, 2017",
        "made on May 16 2017 in Boston",
        "16 May 2017",
        "the 16th day of May, 2017",
        "the 16t h day of May, 2017",  # an ordinal a PDF's text split
        "2017-05-16",
    ],
)
def test_usual_spellings_state_the_date(text: str) -> None:
    assert find_dates(text) == [MAY_16]
    assert states_date(text, GOLD)


@pytest.mark.parametrize("text", ["the Effective Date", "2/30/2017", "May 2017", "version 1.2.3"])
def test_no_date_or_an_impossible_one_states_none(text: str) -> None:
    assert find_dates(text) == []
    assert not states_date(text, GOLD)


def test_another_date_or_a_second_one_does_not_count() -> None:
    assert not states_date("May 17, 2017", GOLD)
    assert not states_date("from 5/16/2017 to 5/16/2018", GOLD)
    assert find_dates("from 5/16/2017 to 5/16/2018, renewed 5/16/2017") == [
        MAY_16,
        datetime.date(2018, 5, 16),
    ]


def test_the_date_mode_scores_by_date() -> None:
    assert score(GOLD, "date", "5-16-17", "the answer is 5-16-17")["accuracy"] == 1.0
    assert score(GOLD, "date", "the Effective Date", "")["accuracy"] == 0.0
    assert score(GOLD, "any", "5-16-17", "")["accuracy"] == 0.0  # the spellings alone miss it


def test_a_question_asks_for_a_date_when_it_names_one() -> None:
    assert asks_for_date("On what date does this agreement take effect?")
    assert not asks_for_date("How long does the initial term last?")
