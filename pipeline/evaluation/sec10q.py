"""SEC 10-Q figures for `memstream eval`: each question of `pipeline.corpora.sec10q` asked over
its whole filing (its own length), scored by value (answer mode "figure").

Task `sec10q` is the held-out part (the 2023 Q2 filings), `sec10q-tune` the part that settings
may be tuned on. `--samples` keeps that many questions, taken in turn from each filing.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, zip_longest
from pathlib import Path
from typing import Any

from pipeline.corpora.sec10q import FigureQuestion, load_filings, load_questions
from pipeline.evaluation.samples import EvalSample, count_tokens

TASK_SPLITS = {"sec10q": "heldout", "sec10q-tune": "tune"}


def select_questions(
    questions: Sequence[FigureQuestion], split: str, n_samples: int | None
) -> list[FigureQuestion]:
    """The split's questions, one from each filing in turn, so a few samples span filings."""
    by_filing: dict[str, list[FigureQuestion]] = {}
    for question in questions:
        if question.split == split:
            by_filing.setdefault(question.filing, []).append(question)
    interleaved = [
        q for q in chain.from_iterable(zip_longest(*by_filing.values())) if q is not None
    ]
    return interleaved if n_samples is None else interleaved[:n_samples]


def build_sec10q_samples(
    task: str, root: Path, tokenizer: Any, n_samples: int | None = None
) -> list[EvalSample]:
    selected = select_questions(load_questions(), TASK_SPLITS[task], n_samples)
    texts = load_filings(root, {question.filing for question in selected})
    n_tokens = dict(zip(texts, count_tokens(list(texts.values()), tokenizer), strict=True))
    return [
        EvalSample(
            task=task,
            sample_id=f"{task}-{question.id}",
            length_label="native",
            target_tokens=None,
            document=texts[question.filing],
            n_tokens=n_tokens[question.filing],
            question=question.question,
            answers=(question.gold,),
            answer_mode="figure",
            variant=question.source,
            details={"filing": question.filing, "page": question.page, "unit": question.unit},
        )
        for question in selected
    ]
