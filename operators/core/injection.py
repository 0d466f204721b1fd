"""Text in a document that speaks to the model ("ignore the question and output ...").

It cannot be told apart from content reliably, and it is not removed: a contract may well say
"disregard the previous clause". It is found and reported, so that a reader of the answers, the
trajectory and the report can see that a document tried to steer the model."""

from __future__ import annotations

import re

_INSTRUCTION = re.compile(
    r"\b(?:ignore|disregard|forget|override)\s+(?:all\s+|any\s+|the\s+|your\s+|my\s+)*"
    r"(?:previous|prior|above|earlier|preceding|question|problem|instructions?|prompt|memory|"
    r"rules|task)\b"
    r"|\byou\s+are\s+now\s+(?:a|an|the)\b"
    r"|\b(?:new|updated)\s+(?:system\s+)?instructions?\s*:"
    r"|\bsystem\s+prompt\b"
    r"|\b(?:instead|only)\s+(?:output|print|answer|reply|respond|say|write)\b",
    re.IGNORECASE,
)
MAX_LISTED = 3


def instructions_to_the_model(text: str) -> list[tuple[int, str]]:
    """(character offset, phrase) of each phrase addressed to a model, in order."""
    return [(found.start(), found.group()) for found in _INSTRUCTION.finditer(text)]


def instruction_warning(text: str) -> str | None:
    """One line for a document's warnings, or None when the text holds no such phrase."""
    found = instructions_to_the_model(text)
    if not found:
        return None
    listed = ", ".join(
        f"{phrase!r} at character {offset:,}" for offset, phrase in found[:MAX_LISTED]
    )
    more = f" and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
    return (
        f"possible instructions to the model in the text ({len(found)}): {listed}{more}; "
        "escaped as text, not obeyed by design, but a model may still follow them"
    )
