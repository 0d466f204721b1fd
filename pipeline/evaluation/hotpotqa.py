"""RULER-HotpotQA style: a question's two gold paragraphs shuffled among distractors, each
labelled `Document {i}:` as the MemAgent evaluation renders them, filled to a token target.

Distractors come in this order until the target is met: the question's own HotpotQA distractors
(the hard ones), the paragraphs of the other questions, then passages of long real texts.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from operators.config import ConfigError
from pipeline.evaluation.haystack import Passage, cycle_from
from pipeline.evaluation.samples import EvalSample, count_tokens

DOCUMENT_SEPARATOR = "\n\n"
# Stop looking for a distractor that still fits once fewer tokens than this are left.
MIN_USEFUL_GAP = 24
# Give up after this many distractors in a row were too long for the space left.
MAX_CONSECUTIVE_MISSES = 200
MAX_TRIM_ROUNDS = 5


@dataclass(frozen=True)
class Paragraph:
    title: str
    text: str


@dataclass(frozen=True)
class HotpotExample:
    example_id: str
    question: str
    answer: str
    gold: tuple[Paragraph, Paragraph]
    distractors: tuple[Paragraph, ...]


def parse_hotpotqa(records: Iterable[dict[str, Any]]) -> list[HotpotExample]:
    """The shared file's records: sentences are joined as HotpotQA stores them (each sentence
    after the first carries its leading space)."""
    examples = []
    for index, record in enumerate(records):
        gold = (
            Paragraph(record["title_a"], "".join(record["para_a"]).strip()),
            Paragraph(record["title_b"], "".join(record["para_b"]).strip()),
        )
        distractors = tuple(
            Paragraph(entry[0], "".join(entry[1]).strip()) for entry in record["distractors"]
        )
        examples.append(
            HotpotExample(
                example_id=str(record.get("_id", index)),
                question=record["question"].strip(),
                answer=record["answer"].strip(),
                gold=gold,
                distractors=distractors,
            )
        )
    return examples


def render_documents(paragraphs: Sequence[Paragraph]) -> str:
    return DOCUMENT_SEPARATOR.join(
        f"Document {index}:\n{paragraph.title}\n{paragraph.text}"
        for index, paragraph in enumerate(paragraphs, start=1)
    )


class HotpotQABuilder:
    """Builds samples for any target length; token counts of every paragraph are computed once."""

    def __init__(
        self, examples: Sequence[HotpotExample], filler: Sequence[Passage], tokenizer: Any
    ) -> None:
        if not examples:
            raise ConfigError("no HotpotQA examples")
        self.examples = list(examples)
        self.filler = [Paragraph(passage.title, passage.text) for passage in filler]
        self._filler_set = set(self.filler)
        self.tokenizer = tokenizer
        every_paragraph = {
            paragraph
            for example in self.examples
            for paragraph in (*example.gold, *example.distractors)
        } | set(self.filler)
        ordered = sorted(every_paragraph, key=lambda p: (p.title, p.text))
        label_tokens = count_tokens(["Document 100:\n"], tokenizer)[0] + 1
        counts = count_tokens([f"{p.title}\n{p.text}" for p in ordered], tokenizer)
        self._cost = {p: n + label_tokens for p, n in zip(ordered, counts, strict=True)}

    def build(
        self, target_tokens: int, n_samples: int, seed: int, length_label: str
    ) -> list[EvalSample]:
        """Sample i asks question i (cycling), so every length asks the same questions."""
        return [
            self._sample(index, target_tokens, seed, length_label) for index in range(n_samples)
        ]

    def _sample(self, index: int, target: int, seed: int, length_label: str) -> EvalSample:
        example = self.examples[index % len(self.examples)]
        rng = random.Random(f"hotpotqa:{seed}:{target}:{index}")
        gold_texts = {paragraph.text for paragraph in example.gold}
        distractors: list[Paragraph] = []
        budget = target - sum(self._cost[paragraph] for paragraph in example.gold)
        seen = set(gold_texts)
        misses = 0
        for candidate in self._distractors(example, rng):
            if budget < MIN_USEFUL_GAP or misses >= MAX_CONSECUTIVE_MISSES:
                break
            # Filler passages may repeat when the texts are cycled; paragraphs may not.
            if candidate.text in gold_texts or (
                candidate.text in seen and candidate not in self._filler_set
            ):
                continue
            if self._cost[candidate] > budget:
                misses += 1
                continue
            misses = 0
            seen.add(candidate.text)
            distractors.append(candidate)
            budget -= self._cost[candidate]
        chosen = [*example.gold, *distractors]
        rng.shuffle(chosen)
        document, n_tokens = self._trimmed(chosen, distractors, target)
        gold_positions = [chosen.index(paragraph) + 1 for paragraph in example.gold]
        return EvalSample(
            task="hotpotqa",
            sample_id=f"hotpotqa-{length_label}-{index}",
            length_label=length_label,
            target_tokens=target,
            document=document,
            n_tokens=n_tokens,
            question=example.question,
            answers=(example.answer,),
            answer_mode="any",
            details={
                "hotpotqa_id": example.example_id,
                "n_documents": len(chosen),
                "gold_documents": gold_positions,
            },
        )

    def _trimmed(
        self, chosen: list[Paragraph], distractors: list[Paragraph], target: int
    ) -> tuple[str, int]:
        """Renders `chosen` and measures it; while it overshoots the target (the per-paragraph
        estimate misses a few tokens where pieces join), drops the last distractors added."""
        document = render_documents(chosen)
        n_tokens = count_tokens([document], self.tokenizer)[0]
        for _ in range(MAX_TRIM_ROUNDS):
            excess = n_tokens - target
            if excess <= 0 or not distractors:
                break
            while distractors and excess > 0:
                dropped = distractors.pop()
                chosen.remove(dropped)
                excess -= self._cost[dropped]
            document = render_documents(chosen)
            n_tokens = count_tokens([document], self.tokenizer)[0]
        return document, n_tokens

    def _distractors(self, example: HotpotExample, rng: random.Random) -> Iterator[Paragraph]:
        own = list(example.distractors)
        rng.shuffle(own)
        yield from own
        others = [
            paragraph
            for other in self.examples
            if other is not example
            for paragraph in (*other.gold, *other.distractors)
        ]
        rng.shuffle(others)
        yield from others
        if self.filler:
            yield from cycle_from(self.filler, rng.randrange(len(self.filler)))
