"""What every task builder produces: one document (or a collection) with one question and its
reference answers."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from operators.config import ConfigError
from operators.core.collection import Member
from operators.core.scoring import AnswerMode

KIBI = 1024
_LENGTH = re.compile(r"(\d+(?:\.\d+)?)([km]?)")


@dataclass(frozen=True)
class LengthSpec:
    label: str  # as the user wrote it: "8k", "1m", "1536"
    tokens: int  # RULER counts in binary units: 8k = 8,192 tokens, 1m = 1,048,576

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        label = text.strip().lower()
        match = _LENGTH.fullmatch(label)
        if not match:
            raise ConfigError(f"length {text!r} is not a token count such as 8k, 128k, 1m or 1536")
        scale = {"": 1, "k": KIBI, "m": KIBI * KIBI}[match.group(2)]
        tokens = int(float(match.group(1)) * scale)
        if tokens < 256:
            raise ConfigError(f"length {text!r} is below 256 tokens")
        return cls(label, tokens)


def parse_lengths(text: str) -> list[LengthSpec]:
    lengths = [LengthSpec.parse(part) for part in text.split(",") if part.strip()]
    if not lengths:
        raise ConfigError("no length given; use e.g. --lengths 8k,32k")
    return sorted(set(lengths), key=lambda length: length.tokens)


@dataclass(frozen=True)
class EvalSample:
    task: str  # "hotpotqa", "niah" or "cuad"
    sample_id: str
    length_label: str  # the target length's label; "native" for CUAD contracts
    target_tokens: int | None
    document: str
    n_tokens: int  # of `document`, with the model's tokenizer
    question: str
    answers: tuple[str, ...]
    answer_mode: AnswerMode = "any"
    depth: float | None = None  # NIAH: where the asked needle sits, as a share of the document
    variant: str | None = None  # NIAH: "single", "multikey" or "multivalue"; CUAD: the category
    details: dict[str, Any] = field(default_factory=dict)
    # A question over a collection: its documents in reading order, read by one chain
    # (`operators.core.collection`); `document` is then their `combined_text`, what a one-call
    # method reads and what names the sample's content. () for one document.
    documents: tuple[Member, ...] = ()


def count_tokens(texts: Sequence[str], tokenizer: Any) -> list[int]:
    """Token counts as segmentation counts them: no special tokens added, none recognized."""
    if not texts:
        return []
    encoded = tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True)
    return [len(ids) for ids in encoded["input_ids"]]
