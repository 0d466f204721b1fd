"""A fake engine and a word tokenizer, for fast tests and benchmarks of chains and their
checkpoints: no model, no vLLM, no Ray.

`FactEngine` replies from the prompt alone. Facts are words like `fact-amber`; an update reply
keeps the lines of the memory and of the section that hold a fact, and the final reply names
every fact of the memory. So a chain's answer lists the facts of every segment its memory saw,
and a chain that resumed without its checkpointed memory loses the facts read before.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable, Sequence

from operators.engine import Completion, EngineError, EngineUnhealthy, GenerationRequest

FACT = re.compile(r"\bfact-\w+")
NO_FACT_YET = "No fact yet."


class EngineCrash(BaseException):
    """The process dying in the middle of a model call. No `except Exception` stops it, so
    nothing after the call runs (no step is written, no chain is marked failed), as after a
    kill -9."""


def tagged(prompt: str, tag: str) -> str | None:
    """The text between the first `<tag>` and `</tag>` of a prompt, else None."""
    found = re.search(rf"<{tag}>\n?(.*?)\n?</{tag}>", prompt, re.DOTALL)
    return None if found is None else found.group(1)


def lines_with_facts(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if FACT.search(line)]


def reply_to(prompt: str) -> str:
    """An update prompt (it has a section): the lines of its memory and section that hold a
    fact. A final prompt: "Therefore, the answer is" and the memory's facts."""
    memory = tagged(prompt, "memory") or ""
    section = tagged(prompt, "section")
    if section is None:
        facts = list(dict.fromkeys(FACT.findall(memory)))
        return f"Therefore, the answer is {', '.join(facts) or 'unknown'}"
    kept = dict.fromkeys(lines_with_facts(memory) + lines_with_facts(section))
    return "\n".join(kept) or NO_FACT_YET


class FactEngine:
    """An `Engine` (operators.engine) with deterministic replies (`reply_to`).

    `fail_on_call=N` raises `failure` in the N-th call (counting from 1) instead of replying:
    an `EngineError` for a call that fails, `EngineCrash` for a process that dies. `before_reply`
    runs in every call that replies, before it does, with the request and the call's number:
    the place to change the world in the middle of a run. It is healthy until `unhealthy` is
    set to a reason; `check` and `check_health` then raise `EngineUnhealthy` with it."""

    def __init__(
        self,
        model: str = "fake-model",
        *,
        fail_on_call: int | None = None,
        failure: BaseException | None = None,
        before_reply: Callable[[GenerationRequest, int], None] | None = None,
    ) -> None:
        self.model = model
        self.fail_on_call = fail_on_call
        self.failure = failure or EngineError("the fake engine fails this call on purpose")
        self.before_reply = before_reply
        self.requests: list[GenerationRequest] = []
        self.unhealthy: str | None = None
        self.shut_down = False

    @property
    def request_ids(self) -> list[str]:
        return [request.request_id for request in self.requests]

    async def generate(self, request: GenerationRequest) -> Completion:
        self.requests.append(request)
        call = len(self.requests)
        await asyncio.sleep(0)  # other chains' calls get their turn, as in an engine's batch
        if call == self.fail_on_call:
            raise self.failure
        if self.before_reply is not None:
            self.before_reply(request, call)
        text = reply_to(request.prompt)
        return Completion(
            request.request_id,
            text,
            prompt_tokens=len(request.prompt.split()),
            completion_tokens=len(text.split()),
            finish_reason="stop",
            latency_s=0.001,
        )

    async def check(self) -> None:
        await self.check_health()

    async def check_health(self) -> None:
        if self.unhealthy is not None:
            raise EngineUnhealthy(self.unhealthy)

    async def shutdown(self) -> None:
        self.shut_down = True


class WordTokenizer:
    """One token per word, with the whitespace before it (as byte-level BPE tokenizers keep
    it): enough for `operators.core.segmentation`, whose segments then hold `chunk_size` words
    and decode to the exact text they cover."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = []

    def __call__(self, text: str, **options: object) -> dict[str, list]:
        words = list(re.finditer(r"\s*\S+", text))
        return {
            "input_ids": [self._id(word.group()) for word in words],
            "offset_mapping": [(word.start(), word.end()) for word in words],
        }

    def decode(self, ids: Sequence[int], **options: object) -> str:
        return "".join(self._words[token] for token in ids)

    def _id(self, word: str) -> int:
        if word not in self._ids:
            self._ids[word] = len(self._words)
            self._words.append(word)
        return self._ids[word]


@functools.cache
def word_tokenizer(spec: object) -> WordTokenizer:
    """One `WordTokenizer` per process and engine spec: a tokenizer factory for the segment
    stage (`SegmentStage(run, tokenizer_factory=word_tokenizer)`)."""
    return WordTokenizer()
