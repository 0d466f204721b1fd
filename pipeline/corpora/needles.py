"""RULER-style needles: their wording, the shapes of a sample's needles, and the key words.

`memstream eval`'s NIAH task (pipeline.evaluation.niah) and the training task that teaches its
shapes (pipeline.training.needle_facts) both plant these needles, so the two cannot drift
apart. Variants: `single` (one needle), `multikey` (several keys, one asked; the others are
distractors) and `multivalue` (one key with several values, all asked, scored with
string_match_all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

NiahVariant = Literal["single", "multikey", "multivalue"]
VARIANTS: tuple[NiahVariant, ...] = ("single", "multikey", "multivalue")
NEEDLES_PER_MULTI_SAMPLE = 4

# The words of the evaluation's keys ("amber-anchor"): a training task draws its keys elsewhere.
ADJECTIVES = (
    "amber", "brisk", "calm", "daring", "eager", "fabled", "gentle", "hollow", "icy", "jolly",
    "keen", "lunar", "mellow", "nimble", "opal", "placid", "quiet", "rustic", "silent", "tidal",
    "umber", "vivid", "woven", "young", "zesty",
)  # fmt: skip
NOUNS = (
    "anchor", "beacon", "canyon", "dolphin", "ember", "falcon", "glacier", "harbor", "island",
    "juniper", "kettle", "lantern", "meadow", "nectar", "orchard", "pebble", "quarry", "raven",
    "saddle", "thistle", "umbrella", "violin", "walrus", "yarrow", "zephyr",
)  # fmt: skip


def needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def question_for(key: str, variant: NiahVariant) -> str:
    if variant == "multivalue":
        return f"What are all the special magic numbers for {key} mentioned in the provided text?"
    return f"What is the special magic number for {key} mentioned in the provided text?"


def planted_needles(
    variant: NiahVariant, keys: Sequence[str], values: Sequence[str]
) -> tuple[list[tuple[str, str]], tuple[str, ...]]:
    """The (key, value) pairs a sample plants and its gold answers; the asked key is `keys[0]`.
    single: its first value; multikey: every key with one value each, the first one asked;
    multivalue: the first key with every value, all of them asked."""
    if variant == "single":
        return [(keys[0], values[0])], (values[0],)
    if variant == "multikey":
        return list(zip(keys, values, strict=True)), (values[0],)
    return [(keys[0], value) for value in values], tuple(values)
