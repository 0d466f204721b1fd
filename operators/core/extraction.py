"""Answer extraction and HotpotQA-style scoring, exactly as the MemAgent reference scores."""

from __future__ import annotations

import re
import string
from collections import Counter

THINK_END = "</think>"
ANSWER_MARKER = "the answer is"


def strip_thinking(reply: str) -> str:
    """Keeps only what follows the last `</think>`, as the reference does for memory updates."""
    if THINK_END in reply:
        return reply.rsplit(THINK_END, 1)[1]
    return reply


def extract_answer(response: str) -> str | None:
    """The text after the last `the answer is`, `*` removed, spaces and a trailing period stripped.
    None when the marker is missing (the reference scores that as 0)."""
    text = response.replace("*", "")
    if ANSWER_MARKER not in text:
        return None
    answer = text.rsplit(ANSWER_MARKER, 1)[1].strip()
    if answer.endswith("."):
        answer = answer[:-1].strip()
    return answer


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


def sub_exact_match(prediction: str, gold: str) -> bool:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    return ref in pred or pred in ref


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    special = {"yes", "no", "noanswer"}
    if (pred in special or ref in special) and pred != ref:
        return 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    common = Counter(pred_tokens) & Counter(ref_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER scoring for needle, variable-tracking and word tasks: the share of references found."""
    found = sum(ref.lower() in prediction.lower() for ref in references)
    return found / len(references) if references else 0.0


def normalized_match_all(prediction: str, references: list[str]) -> float:
    """The share of references whose normalized words appear, whole and in order, in the
    normalized prediction: "VITALIBIS, INC., VOTOCAST, Inc" gives both "VITALIBIS INC" and
    "VOTOCAST, Inc.", which `string_match_all` misses for a comma; "123" is not in "1234"."""
    said = f" {normalize_answer(prediction)} "
    found = sum(f" {ref} " in said for ref in map(normalize_answer, references) if ref)
    return found / len(references) if references else 0.0


def string_match_any(prediction: str, references: list[str]) -> float:
    """RULER scoring for QA tasks: 1 when any reference appears."""
    return float(any(ref.lower() in prediction.lower() for ref in references))


# Words that say nothing about where an answer or a quote came from.
_STOP_WORDS_TEXT = """
    a about above after again all also am an and any are as at based be been before being below
    between both but by can could describe did do does doing done during each either else ever
    every few for from further get gets give given had has have having he her here hers him his
    how i if in into is it its itself just let list many may me might more most much must my
    name named no nor not now of off on once one only or other our ours out over own per please
    provide provided said same say says she should so some such tell than that the their them
    then there these they this those through to too under until up upon us very was we were what
    when where whether which while who whom whose why will with within would yes you your
    according answer article context document mentioned passage question section stated text
"""
STOP_WORDS = frozenset(_STOP_WORDS_TEXT.split())
