"""Scores of one prediction against a sample's reference answers.

HotpotQA metrics follow the MemAgent reference (operators.core.extraction), taking the best
reference when there are several; RULER's string matches score the needles. A missing answer
(no "the answer is") scores 0 everywhere, as in the reference; `raw_match` alone looks at the
whole raw response, to tell a model that found the fact from one that also used the format.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

from operators.core.dates import states_date
from operators.core.extraction import (
    exact_match,
    f1_score,
    normalize_answer,
    normalized_match_all,
    string_match_all,
    string_match_any,
    sub_exact_match,
)
from operators.core.figures import states_figure

# "any": the answers are alternatives for one answer (HotpotQA, most CUAD labels).
# "all": every answer must be given (NIAH multi-value, the parties of a contract).
# "figure": the answers are spellings of one printed figure ("$39,669 million"), compared as
# values (operators.core.figures): "$39.7 billion" counts, a bare "8" or a dumped row does not.
# "date": the answers are spellings of one date, compared as dates (operators.core.dates):
# "3-14-18" counts for 3/14/2018, "the Effective Date" or a second date does not.
AnswerMode = Literal["any", "all", "figure", "date"]

METRICS = (
    "accuracy",
    "em",
    "sub_em",
    "f1",
    "string_match_any",
    "string_match_all",
    "token_recall",
    "raw_match",
    "answered",
    "grounded",  # set by the evaluation: the answer's evidence in the source (core.evidence)
)


def token_recall(prediction: str, reference: str) -> float:
    """Share of the reference's normalized words that the prediction contains (lenient)."""
    reference_tokens = normalize_answer(reference).split()
    if not reference_tokens:
        return 0.0
    common = Counter(normalize_answer(prediction).split()) & Counter(reference_tokens)
    return sum(common.values()) / len(reference_tokens)


def score(
    answers: Sequence[str], mode: AnswerMode, prediction: str | None, raw_response: str | None
) -> dict[str, float]:
    """`accuracy` is the headline: sub_em (best reference) for "any", the share of references
    given (normalized, whole words) for "all", the figure's value for "figure", the date for
    "date". With several
    references EM, sub_em and F1 take the best one; token recall takes the best one for "any"
    and all of them together for "all"; string_match_any/all count the references found
    verbatim in the prediction (RULER's scoring)."""
    references = list(answers)
    raw = raw_response or ""
    match_raw = string_match_all if mode == "all" else string_match_any
    scores = dict.fromkeys(METRICS, 0.0)
    if mode == "figure":
        scores["raw_match"] = float(states_figure(raw, references))
    else:
        scores["raw_match"] = match_raw(raw, references) if raw else 0.0
    # The reference counts a prediction only when one was extracted; an answer that normalizes
    # to nothing (".", "the") would otherwise be a substring of every reference.
    if prediction is None or not normalize_answer(prediction):
        return scores
    scores["answered"] = 1.0
    scores["em"] = max(float(exact_match(prediction, ref)) for ref in references)
    scores["sub_em"] = max(float(sub_exact_match(prediction, ref)) for ref in references)
    scores["f1"] = max(f1_score(prediction, ref) for ref in references)
    if mode == "all":
        scores["token_recall"] = token_recall(prediction, " ".join(references))
    else:
        scores["token_recall"] = max(token_recall(prediction, ref) for ref in references)
    scores["string_match_any"] = string_match_any(prediction, references)
    scores["string_match_all"] = string_match_all(prediction, references)
    if mode == "figure":
        scores["accuracy"] = float(states_figure(prediction, references))
    elif mode == "date":
        scores["accuracy"] = float(states_date(prediction, references))
    elif mode == "all":
        scores["accuracy"] = normalized_match_all(prediction, references)
    else:
        scores["accuracy"] = scores["sub_em"]
    return scores
