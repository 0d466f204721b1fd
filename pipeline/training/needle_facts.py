"""Several facts among distractors: the multi-key and multi-value shapes of `memstream eval`'s NIAH.

The needles are NIAH's own ("One of the special magic numbers for <key> is: <7 digits>.",
pipeline.corpora.needles), planted as `planted_needles` plants them: multi-key plants
`n_distractors + 1` keys with a value each and asks for the first key's value; multi-value
plants `n_distractors + 1` values of one key and asks for all of them (answer mode "all", as
NIAH scores it). The `multi-fact` task alternates the two shapes: even samples multi-key, odd
ones multi-value.

The split discipline is keep-the-fact's (pipeline.training.tasks): the filler is its prose (the
first half of each novel for training, the NIST reports held out), the codes avoid the filler's
numbers, and every sample depends only on (seed, split, index). Keys are "adjective-noun" as in
NIAH, drawn from keep-the-fact's split-disjoint key words, the training ones less every word of
the evaluation's NIAH keys: a key `memstream eval` asks for is never one trained on.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from operators.core.scoring import AnswerMode
from pipeline.corpora import DEFAULT_CORPORA
from pipeline.corpora.needles import (
    ADJECTIVES,
    NOUNS,
    NiahVariant,
    needle,
    planted_needles,
    question_for,
)
from pipeline.training.tasks import (
    KEY_WORDS,
    SPLITS,
    FillerText,
    Split,
    approximate_token_count,
    draw_codes,
    load_filler,
    plant_document,
)

MultiVariant = Literal["multikey", "multivalue"]
MULTI_VARIANTS: tuple[MultiVariant, ...] = ("multikey", "multivalue")


def needle_keys(split: Split) -> list[str]:
    """The split's keys, "adjective-noun"; the training split leaves out NIAH's key words."""
    adjectives, nouns = KEY_WORDS[split]
    if split == "train":
        adjectives = tuple(word for word in adjectives if word not in ADJECTIVES)
        nouns = tuple(word for word in nouns if word not in NOUNS)
    return [f"{adjective}-{noun}" for adjective in adjectives for noun in nouns]


@dataclass(frozen=True)
class NeedleSample:
    sample_id: str
    document: str
    question: str
    answers: list[str]
    answer_mode: AnswerMode  # "all", as NIAH scores every variant
    variant: NiahVariant
    needles: list[str]  # every planted needle, the asked one (or ones) first


def generate_needle_samples(
    n: int,
    *,
    seed: int,
    split: Split,
    n_segments: int = 3,
    segment_tokens: int = 300,
    n_distractors: int = 3,
    count_tokens: Callable[[str], int] | None = None,
    corpora: Path = DEFAULT_CORPORA,
    first: int = 0,
    variants: Sequence[MultiVariant] = MULTI_VARIANTS,
) -> list[NeedleSample]:
    """Samples `first` to `first + n - 1` of the split, sample i of shape `variants[i %
    len(variants)]` (multi-key and multi-value in turn by default), each with `n_distractors + 1`
    needles (NIAH plants 4: the default); sample i is the same whatever `n` and `first` are."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not variants or not set(variants) <= set(MULTI_VARIANTS):
        raise ValueError(f"variants must be some of {MULTI_VARIANTS}, got {variants!r}")
    if n_segments < 1 or segment_tokens < 1 or n_distractors < 1:
        raise ValueError("need n_segments >= 1, segment_tokens >= 1 and n_distractors >= 1")
    keys = needle_keys(split)
    if n_distractors + 1 > len(keys):
        raise ValueError(f"at most {len(keys) - 1} distractors")
    fillers = load_filler(corpora, split)
    counter = count_tokens or approximate_token_count
    return [
        build_needle_sample(
            random.Random(f"memstream-needles/{split}/{seed}/{index}"),
            f"needles-{split}-{seed}-{index}",
            variants[index % len(variants)],
            fillers,
            keys,
            n_segments=n_segments,
            segment_tokens=segment_tokens,
            n_needles=n_distractors + 1,
            count_tokens=counter,
        )
        for index in range(first, first + n)
    ]


def build_needle_sample(
    rng: random.Random,
    sample_id: str,
    variant: MultiVariant,
    fillers: Sequence[FillerText],
    keys: Sequence[str],
    *,
    n_segments: int,
    segment_tokens: int,
    n_needles: int,
    count_tokens: Callable[[str], int],
) -> NeedleSample:
    filler = rng.choice(list(fillers))
    chosen_keys = rng.sample(list(keys), n_needles)
    values = draw_codes(rng, n_needles, avoid=filler.numbers)
    planted, answers = planted_needles(variant, chosen_keys, values)
    needles = [needle(key, value) for key, value in planted]
    document = plant_document(
        rng,
        filler,
        needles,
        n_segments=n_segments,
        segment_tokens=segment_tokens,
        count_tokens=count_tokens,
    )
    return NeedleSample(
        sample_id=sample_id,
        document=document,
        question=question_for(chosen_keys[0], variant),
        answers=list(answers),
        answer_mode="all",
        variant=variant,
        needles=needles,
    )
