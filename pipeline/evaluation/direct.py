"""The `direct` baseline: the same model reads the document in one prompt, middle-truncated to
fit its window as the MemAgent evaluation client does (keep the head and the tail), and answers
in the "Therefore, the answer is" format, so one extractor scores both methods."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from operators.config import ConfigError
from operators.core.segmentation import tokenize
from operators.core.templates import defang

# The LongBench zero-shot frame with the MemAgent answer format.
DIRECT_TEMPLATE = (
    "Please read the following text and answer the question below.\n"
    "\n"
    "<text>\n"
    "{document}\n"
    "</text>\n"
    "\n"
    "{question}\n"
    "\n"
    'Format your response as follows: "Therefore, the answer is (insert answer here)".'
)
# Re-tokenizing the text decoded from a truncated token list can cost a few extra tokens.
RETOKENIZATION_MARGIN = 16
# Used when the tokenizer has no chat template to measure.
DEFAULT_CHAT_OVERHEAD = 64


@dataclass(frozen=True)
class DirectPrompt:
    prompt: str
    document_tokens: int
    shown_tokens: int  # of the document, after truncation

    @property
    def truncated(self) -> bool:
        return self.shown_tokens < self.document_tokens


def middle_truncate(token_ids: Sequence[int], budget: int) -> list[int]:
    """Keeps the first half and the last half of `budget` tokens."""
    if len(token_ids) <= budget:
        return list(token_ids)
    head = budget // 2
    tail = budget - head
    return list(token_ids[:head]) + list(token_ids[len(token_ids) - tail :])


def document_budget(
    context_window: int, max_answer_tokens: int, frame_tokens: int, chat_overhead: int
) -> int:
    """Tokens left for the document once the frame, the chat template and the answer fit."""
    return context_window - max_answer_tokens - frame_tokens - chat_overhead - RETOKENIZATION_MARGIN


def chat_overhead_tokens(tokenizer: Any) -> int:
    """Tokens the chat template adds around one user message (a default system prompt too)."""
    if not getattr(tokenizer, "chat_template", None):
        return DEFAULT_CHAT_OVERHEAD
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": ""}], tokenize=True, add_generation_prompt=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


def build_direct_prompt(
    document: str,
    question: str,
    tokenizer: Any,
    context_window: int,
    max_answer_tokens: int,
    chat_overhead: int,
) -> DirectPrompt:
    question = defang(question)
    frame = DIRECT_TEMPLATE.format(document="", question=question)
    frame_tokens = len(tokenizer(frame, add_special_tokens=False)["input_ids"])
    budget = document_budget(context_window, max_answer_tokens, frame_tokens, chat_overhead)
    if budget < 1:
        raise ConfigError(
            f"a context window of {context_window} tokens leaves no room for the document once "
            f"the prompt frame and {max_answer_tokens} answer tokens fit"
        )
    tokenized = tokenize("direct", document, tokenizer)
    kept = middle_truncate(tokenized.token_ids, budget)
    shown = document if len(kept) == tokenized.n_tokens else tokenizer.decode(kept)
    return DirectPrompt(
        prompt=DIRECT_TEMPLATE.format(document=defang(shown), question=question),
        document_tokens=tokenized.n_tokens,
        shown_tokens=len(kept),
    )
