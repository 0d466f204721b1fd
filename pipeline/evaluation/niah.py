"""RULER-style needles in a haystack of long real texts.

Needles read "One of the special magic numbers for {key} is: {value}." as in RULER. Variants:
`single` (one needle), `multikey` (several keys, one asked; the others are distractors) and
`multivalue` (one key with several values, all asked, scored with string_match_all). The
wording and the shapes are pipeline.corpora.needles', shared with the training task that
teaches them (pipeline.training.needle_facts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from operators.config import ConfigError
from pipeline.corpora.needles import (
    ADJECTIVES,
    NEEDLES_PER_MULTI_SAMPLE,
    NOUNS,
    VARIANTS,
    NiahVariant,
    needle,
    planted_needles,
    question_for,
)
from pipeline.evaluation.haystack import HaystackCorpus, Insertion
from pipeline.evaluation.samples import EvalSample, count_tokens

DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
MAX_TRIM_ROUNDS = 4


@dataclass(frozen=True)
class NiahCase:
    """Which variant and depth sample i gets: the 3 x 3 grid in a Latin-square order, so any
    three consecutive samples cover every variant and every depth."""

    variant: NiahVariant
    depth: float

    @classmethod
    def for_index(cls, index: int, depths: tuple[float, ...] = DEFAULT_DEPTHS) -> NiahCase:
        n_variants = len(VARIANTS)
        variant = VARIANTS[index % n_variants]
        depth = depths[(index + index // n_variants) % len(depths)]
        return cls(variant, depth)


class NiahBuilder:
    def __init__(self, corpus: HaystackCorpus, tokenizer: Any) -> None:
        self.corpus = corpus
        self.tokenizer = tokenizer

    def build(
        self,
        target_tokens: int,
        n_samples: int,
        seed: int,
        length_label: str,
        depths: tuple[float, ...] = DEFAULT_DEPTHS,
    ) -> list[EvalSample]:
        for depth in depths:
            if not 0 <= depth <= 1:
                raise ConfigError(f"needle depth must be within [0, 1], got {depth}")
        return [
            self.build_one(
                target_tokens, NiahCase.for_index(index, depths), seed, length_label, index
            )
            for index in range(n_samples)
        ]

    def build_one(
        self, target: int, case: NiahCase, seed: int, length_label: str, index: int
    ) -> EvalSample:
        rng = random.Random(f"niah:{seed}:{target}:{index}:{case.variant}:{case.depth}")
        keys = _distinct_keys(rng, NEEDLES_PER_MULTI_SAMPLE)
        values = [str(value) for value in rng.sample(range(1_000_000, 10_000_000), 4)]
        asked_key = keys[0]
        planted, answers = planted_needles(case.variant, keys, values)
        # The asked needle (the first value of a multi-value key) sits at the requested depth;
        # the others anywhere.
        needle_depths = [case.depth] + [rng.random() for _ in planted[1:]]
        needles = [needle(key, value) for key, value in planted]
        needle_tokens = sum(count_tokens(needles, self.tokenizer)) + 2 * len(needles)
        haystack_tokens = max(target - needle_tokens, 1)
        start = self.corpus.line_start_token(rng.randrange(len(self.corpus.tokenized.text)))
        insertions = [Insertion(d, text) for d, text in zip(needle_depths, needles, strict=True)]
        # Tokens can merge differently where needles and wrapped texts join: measure, shorten.
        for _ in range(MAX_TRIM_ROUNDS):
            document = self.corpus.excerpt(start, haystack_tokens, insertions)
            n_tokens = count_tokens([document], self.tokenizer)[0]
            if n_tokens <= target or haystack_tokens <= 1:
                break
            haystack_tokens = max(haystack_tokens - (n_tokens - target), 1)
        return EvalSample(
            task="niah",
            sample_id=f"niah-{length_label}-{index}",
            length_label=length_label,
            target_tokens=target,
            document=document,
            n_tokens=n_tokens,
            question=question_for(asked_key, case.variant),
            answers=answers,
            answer_mode="all",
            depth=case.depth,
            variant=case.variant,
            details={
                "needles": needles,
                "needle_depths": [round(d, 4) for d in needle_depths],
                "haystack_start_token": start,
            },
        )


def _distinct_keys(rng: random.Random, count: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys
