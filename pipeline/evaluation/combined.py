"""The "combined afterwards" baseline for questions over a collection: each document is asked
the question alone (its own memory chain, as `memstream:<template>` reads one document), then
one call sees every document's answer, labelled with its document, and answers the question.

Method `memstream:<template>+combined`; a sample of one document is read as by
`memstream:<template>`. Its cost is one chain per document plus one call.
"""

from __future__ import annotations

from collections.abc import Sequence

from operators.core.collection import labelled
from operators.core.templates import defang

COMBINE_TEMPLATE = """You are presented with a problem about several documents and, for each document, the answer found when the problem was asked of that document alone. Please answer the problem based on these answers and format your response as follows "Therefore, the answer is (insert answer here)".

<problem> 
{question}
</problem>

<answers>
{answers}
</answers>

Your answer:
"""  # noqa: E501, W291
NO_ANSWER = "(no answer)"


def render_answers(labels: Sequence[str], answers: Sequence[str | None]) -> str:
    """One line a document: its label, then its answer (or that it gave none)."""
    return "\n".join(
        labelled(" ".join((answer or NO_ANSWER).split()), label)
        for label, answer in zip(labels, answers, strict=True)
    )


def build_combine_prompt(question: str, answers_block: str) -> str:
    return COMBINE_TEMPLATE.format(question=defang(question), answers=defang(answers_block))
