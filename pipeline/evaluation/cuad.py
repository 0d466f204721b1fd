"""CUAD contract extraction for `memstream eval`: one natural question per labelled category of a
contract (pipeline.corpora.cuad), asked over the whole contract (its own length), scored against
CUAD's gold answer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from pipeline.corpora.cuad import Contract, answers_for, ordered_labels, question_for
from pipeline.evaluation.samples import EvalSample, count_tokens


def build_cuad_samples(
    contracts: Iterable[tuple[Contract, str]], tokenizer: Any, n_samples: int | None = None
) -> list[EvalSample]:
    """`contracts` pairs each contract with its parsed text; at most `n_samples` questions."""
    given = list(contracts)
    texts = {contract.name: text for contract, text in given}
    pairs = ordered_labels(list({contract.name: contract for contract, _ in given}.values()))
    if n_samples is not None:
        pairs = pairs[:n_samples]
    n_tokens = dict(zip(texts, count_tokens(list(texts.values()), tokenizer), strict=True))
    samples = []
    for contract, label in pairs:
        answers, mode = answers_for(label)
        samples.append(
            EvalSample(
                task="cuad",
                sample_id=f"cuad-{contract.name}-{_slug(label.category)}",
                length_label="native",
                target_tokens=None,
                document=texts[contract.name],
                n_tokens=n_tokens[contract.name],
                question=question_for(label.category),
                answers=answers,
                answer_mode=mode,
                variant=label.category,
                details={"contract": contract.name, "cuad_answer": label.answer},
            )
        )
    return samples


def _slug(category: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", category.lower()).strip("-")
