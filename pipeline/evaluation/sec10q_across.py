"""`sec10q-across` for `memstream eval`: questions over two or three filings of one company
(`pipeline.corpora.sec10q_across`), each asked of its filings as one collection read in order
(oldest first), scored by value (answer mode "figure").

Memory chains read the filings as one collection (`operators.core.collection`); `rag-bm25`
ranks the passages of every filing together; `direct` reads the filings one after another, each
after its header, middle-truncated to the window. `--samples` keeps the first that many.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from operators.core.collection import Member, combined_text, order_members
from pipeline.corpora.sec10q_across import (
    AcrossQuestion,
    load_across_questions,
    load_parsed_filings,
)
from pipeline.evaluation.samples import EvalSample, count_tokens

TASK = "sec10q-across"


def build_sec10q_across_samples(
    root: Path,
    tokenizer: Any,
    n_samples: int | None = None,
    questions: list[AcrossQuestion] | None = None,
) -> list[EvalSample]:
    selected = load_across_questions() if questions is None else questions
    selected = selected if n_samples is None else selected[:n_samples]
    filings = load_parsed_filings(root, {name for q in selected for name in q.filings})
    names = sorted(filings)
    n_tokens = dict(
        zip(names, count_tokens([filings[name].text for name in names], tokenizer), strict=True)
    )
    samples = []
    for question in selected:
        members = tuple(
            Member(name, name, filings[name].text, filings[name].page_starts)
            for name in question.filings
        )
        samples.append(
            EvalSample(
                task=TASK,
                sample_id=f"{TASK}-{question.id}",
                length_label="native",
                target_tokens=None,
                document=combined_text(order_members(members, "listed")),
                n_tokens=sum(n_tokens[name] for name in question.filings),
                question=question.question,
                answers=question.accepted,
                answer_mode="figure",
                variant=question.operation,
                details={
                    "filings": list(question.filings),
                    "figures": [
                        {"filing": f.filing, "figure": f.figure, "page": f.page}
                        for f in question.figures
                    ],
                    "unit": question.unit,
                },
                documents=members,
            )
        )
    return samples
