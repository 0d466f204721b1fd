"""The CUAD task: extract a labelled field of a real contract through the memory.

A sample is one extractive CUAD label of one of the shared contracts (pipeline.corpora.cuad,
the labels and questions `memstream eval --tasks cuad` asks): the document is the contract's
whole text as `memstream ask` parses its PDF (6.6K and 11.2K tokens with SmolLM2's
tokenizer; the trainer cuts it into segments with the project's segmentation at the run's
`chunk_size`, so at the default 200 a chain has about 34 or 57 updates), the question CUAD's
category as a question, the gold answers and their mode as the evaluation scores them ("all"
for the parties: every party must be named; "any" for the rest: a date in any usual spelling).

Train and held-out samples are split by contract, so that no held-out question is asked over a
text the policy trained on: contracts in name order alternate held-out, train, held-out, ...
With the two shared contracts that puts PhotronicsInc (4 labels: document name, parties,
agreement date, expiration date) in the held-out split and VitalibisInc (8 labels: those four,
effective date, renewal term, notice period, governing law) in the train split: 8 train and 4
held-out samples, each side with a parties question. That is few, but a split by (contract,
category) would ask held-out questions over the training texts, which the held-out measure must
not (issue 17: held-out data disjoint from the training texts); 4 held-out samples make a smoke
check, not a measurement. Both contracts are also `memstream eval`'s CUAD task, so a model
trained here is not measured fairly there.

Sample i of a split is the split's label i modulo its number of labels, in
`ordered_labels` order: the same whatever `n` and `first` are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from operators.core.scoring import AnswerMode
from pipeline.corpora import DEFAULT_CORPORA
from pipeline.corpora.cuad import (
    Contract,
    ContractLabel,
    answers_for,
    load_cuad,
    ordered_labels,
    question_for,
)
from pipeline.training.tasks import SPLITS, Split


@dataclass(frozen=True)
class FieldSample:
    sample_id: str
    document: str
    question: str
    answers: list[str]
    answer_mode: AnswerMode  # how `answers` combine in the reward (operators.core.scoring)
    contract: str
    category: str


def split_of(contract_name: str, contract_names: list[str]) -> Split:
    """Held-out for the first contract in name order, train for the second, and so on."""
    return "heldout" if sorted(contract_names).index(contract_name) % 2 == 0 else "train"


@functools.lru_cache(maxsize=2)
def load_contracts(corpora: Path) -> tuple[tuple[Contract, str], ...]:
    """The labelled contracts with their texts, parsed once per corpora folder."""
    return tuple(load_cuad(corpora))


def split_labels(
    contracts: tuple[tuple[Contract, str], ...], split: Split
) -> list[tuple[Contract, ContractLabel]]:
    """The split's extractive labels, in `ordered_labels` order."""
    names = [contract.name for contract, _ in contracts]
    chosen = [contract for contract, _ in contracts if split_of(contract.name, names) == split]
    return ordered_labels(chosen)


def generate_field_samples(
    n: int, *, split: Split, corpora: Path = DEFAULT_CORPORA, first: int = 0
) -> list[FieldSample]:
    """Samples `first` to `first + n - 1` of the split, cycling over its labels."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    contracts = load_contracts(corpora)
    texts = {contract.name: text for contract, text in contracts}
    labels = split_labels(contracts, split)
    if not labels:
        raise ValueError(f"no extractive CUAD labels in the {split} split of {corpora}")
    samples = []
    for index in range(first, first + n):
        contract, label = labels[index % len(labels)]
        answers, mode = answers_for(label)
        samples.append(
            FieldSample(
                sample_id=f"cuad-{split}-{index}",
                document=texts[contract.name],
                question=question_for(label.category),
                answers=list(answers),
                answer_mode=mode,
                contract=contract.name,
                category=label.category,
            )
        )
    return samples
