"""Prompt template sets.

The reference set is an interface the RL-MemAgent weights expect, byte for byte.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from operators.core.collection import labelled
from operators.core.quotes import NOTHING_FOUND, check_quotes
from operators.core.retrieval import PASSAGE_RANKING

REFERENCE_UPDATE = """You are presented with a problem, a section of an article that may contain the answer to the problem, and a previous memory. Please read the provided section carefully and update the memory with the new information that helps to answer the problem. Be sure to retain all relevant details from the previous memory while adding any new, useful information.

<problem> 
{question}
</problem>

<memory>
{memory}
</memory>

<section>
{chunk}
</section>

Updated memory:
"""  # noqa: E501, W291

REFERENCE_FINAL = """You are presented with a problem and a previous memory. Please answer the problem based on the previous memory and format your response as follows "Therefore, the answer is (insert answer here)".

<problem> 
{question}
</problem>

<memory>
{memory}
</memory>

Your answer:
"""  # noqa: E501, W291

INITIAL_MEMORY = "No previous memory"

# The answer step when a chain re-reads its source (`reread_tokens` > 0): the final memory and
# the passages that the question and the memory point to. Every template set shares it; with no
# re-read each set's own final prompt is used, byte for byte.
REREAD_FINAL = """You are presented with passages of a long document found again for a problem, notes taken while reading the whole document, and the problem. Please answer the problem based on the passages and the notes, giving a figure or a name exactly as the document prints it.

<passages>
{passages}
</passages>

<memory>
{memory}
</memory>

<problem> 
{question}
</problem>

Format your response as follows: "Therefore, the answer is (insert answer here)".
"""  # noqa: E501, W291
REREAD_DIGEST = hashlib.sha256((REREAD_FINAL + PASSAGE_RANKING).encode()).hexdigest()[:12]
# The re-read's digests under its earlier wordings and rankings: a chain that re-read under one
# of them read its segments as one does now, so a chain re-reading now starts its answer step
# from that chain's final memory (`MethodConfig.memory_identities`).
EARLIER_REREAD_DIGESTS = ("5ecc825612da", "5fe50b94e90f")

# The tags that delimit untrusted text inside the templates; document text must not contain them.
STRUCTURE_TAGS = (
    "<problem>",
    "</problem>",
    "<memory>",
    "</memory>",
    "<section>",
    "</section>",
    "<passages>",
    "</passages>",
)


@dataclass(frozen=True)
class TemplateSet:
    """One memory strategy: the `update` prompt sees a chunk, the `final` prompt only the memory.

    `memory_policy` says what becomes of an update's reply: "overwrite" (the reference) makes it
    the new memory; "append" adds it to the memory as new lines, unless it says NONE, and drops
    the oldest lines, saying how many, once the memory outgrows its budget; "quotes" appends only
    the reply's lines that are found in the section, as the section's text, and reports the rest
    as rejected (`operators.core.quotes`).
    """

    name: str
    update: str
    final: str
    initial_memory: str = INITIAL_MEMORY
    memory_policy: str = "overwrite"
    # How many updates' replies the memory can hold: an overwritten memory is one reply; an
    # appended one gathers several, so its budget is that many times the reply's.
    memory_holds_replies: int = 1

    def __post_init__(self) -> None:
        if self.memory_policy not in MEMORY_POLICIES:
            known = ", ".join(MEMORY_POLICIES)
            raise ValueError(f"memory_policy must be one of {known}: {self.memory_policy!r}")

    @property
    def digest(self) -> str:
        """Names the wording as well as the strategy: a chain or an eval cell made with other
        prompts under the same name is never resumed as this one's."""
        parts = (self.update, self.final, self.initial_memory, self.memory_policy)
        text = "\x00".join((*parts, str(self.memory_holds_replies)))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def render_update(self, question: str, memory: str, chunk: str) -> str:
        return self.update.format(
            question=defang(question), memory=defang(memory), chunk=defang(chunk)
        )

    def render_final(self, question: str, memory: str) -> str:
        return self.final.format(question=defang(question), memory=defang(memory))

    def render_reread(self, question: str, memory: str, passages: str) -> str:
        return REREAD_FINAL.format(
            question=defang(question), memory=defang(memory), passages=defang(passages)
        )

    def next_memory(
        self, memory: str, reply: str, section: str, budget_chars: int, *, label: str = ""
    ) -> MemoryUpdate:
        """The memory after an update step that read `section` and replied `reply`. A section
        of a collection's document has its document's `label`: the lines an appending policy
        keeps are prefixed with it, so a figure keeps its filing (an overwritten memory is the
        model's own, which read the document's header)."""
        if self.memory_policy == "overwrite":
            return MemoryUpdate(reply)
        if self.memory_policy == "append":
            if label and not _says_nothing(reply):
                reply = "\n".join(labelled(line.strip(), label) for line in _lines(reply))
            return MemoryUpdate(
                append_within_budget(memory, reply, budget_chars, self.initial_memory)
            )
        check = check_quotes(reply, section)
        present = set(memory.splitlines())
        kept = (labelled(quote, label) for quote in check.kept)
        new_quotes = "\n".join(quote for quote in kept if quote not in present)
        return MemoryUpdate(
            append_within_budget(memory, new_quotes, budget_chars, self.initial_memory),
            rejected=check.rejected,
        )


MEMORY_POLICIES = ("overwrite", "append", "quotes")


@dataclass(frozen=True)
class MemoryUpdate:
    memory: str
    rejected: tuple[str, ...] = ()  # reply lines a "quotes" policy did not find in the section


def _lines(reply: str) -> list[str]:
    return [line.strip() for line in reply.splitlines() if line.strip()]


def _says_nothing(reply: str) -> bool:
    lines = _lines(reply)
    return not lines or lines[0].upper().startswith(NOTHING_FOUND)


def append_within_budget(memory: str, reply: str, budget_chars: int, initial: str) -> str:
    """Appends the reply's lines to the memory; drops the oldest lines, and says how many,
    when the result would exceed `budget_chars`."""
    new_lines = [line.strip() for line in reply.splitlines() if line.strip()]
    if not new_lines or new_lines[0].upper().startswith(NOTHING_FOUND):
        return memory
    lines = [] if memory == initial else memory.splitlines()
    dropped = 0
    if lines and (marker := _DROPPED.fullmatch(lines[0])):
        dropped = int(marker.group(1))
        lines.pop(0)
    lines += new_lines
    while len(lines) > 1 and len(_with_marker(lines, dropped)) > budget_chars:
        lines.pop(0)
        dropped += 1
    return _with_marker(lines, dropped)


_DROPPED = re.compile(r"\[dropped (\d+) older lines\]")


def _with_marker(lines: list[str], dropped: int) -> str:
    return "\n".join(([f"[dropped {dropped} older lines]"] if dropped else []) + lines)


REFERENCE = TemplateSet(name="memagent-reference", update=REFERENCE_UPDATE, final=REFERENCE_FINAL)

EXTRACTIVE_UPDATE = """You are reading a long document one section at a time to answer a problem. Your notes so far are in <memory>. Copy into the notes, word for word, every sentence of the section that helps answer the problem. Keep every sentence already in the notes. Write only the notes. If the section has nothing that helps, write the notes unchanged.

<problem> 
{question}
</problem>

<memory>
{memory}
</memory>

<section>
{chunk}
</section>

Updated notes:
"""  # noqa: E501, W291

EVIDENCE_UPDATE = """Find the sentences in the section that help answer the problem. Copy them word for word, one per line. If no sentence helps, write only: NONE

<problem> 
{question}
</problem>

<section>
{chunk}
</section>

Sentences that help:
"""  # noqa: E501, W291


def section_first(update: str) -> str:
    """The same update prompt with its <section> block moved up, right after the instruction."""
    instruction, *blocks = update.split("\n\n")
    section = next(block for block in blocks if block.startswith("<section>"))
    blocks.remove(section)
    return "\n\n".join([instruction, section, *blocks])


# The reference wording with the section first: every question about one segment then shares the
# token prefix (chat template, instruction, section), whose KV vLLM's prefix cache can reuse.
# The RL-MemAgent weights were trained on the reference order.
SEGMENT_FIRST_UPDATE = section_first(REFERENCE_UPDATE)

# The section first, as in segment-first, so questions about one segment share its prefill; no
# memory in the prompt, as the system, not the model, keeps the verified quotes.
QUOTES_UPDATE = """Here is a section of a long document, then a problem. Copy from the section, word for word, the sentences that help answer the problem, one per line. Copy only sentences that are in the section; do not explain. If no sentence helps, write only: NONE

<section>
{chunk}
</section>

<problem> 
{question}
</problem>

Sentences of the section that help, copied word for word:
"""  # noqa: E501, W291

QUOTES_FINAL = """You are presented with a problem and sentences quoted from a document. Please answer the problem based on the quoted sentences and format your response as follows "Therefore, the answer is (insert answer here)". If the quotes do not answer it, say "Therefore, the answer is not in the document". When the problem asks for all of something, list every one the quotes give.

<problem> 
{question}
</problem>

<memory>
{memory}
</memory>

Your answer:
"""  # noqa: E501, W291

EXTRACTIVE = TemplateSet(name="extractive", update=EXTRACTIVE_UPDATE, final=REFERENCE_FINAL)
APPEND_EVIDENCE = TemplateSet(
    name="append-evidence",
    update=EVIDENCE_UPDATE,
    final=REFERENCE_FINAL,
    memory_policy="append",
)
SEGMENT_FIRST = TemplateSet(
    name="segment-first", update=SEGMENT_FIRST_UPDATE, final=REFERENCE_FINAL
)

VERIFIED_QUOTES = TemplateSet(
    name="verified-quotes",
    update=QUOTES_UPDATE,
    final=QUOTES_FINAL,
    memory_policy="quotes",
    memory_holds_replies=4,
)

TEMPLATE_SETS: dict[str, TemplateSet] = {
    t.name: t for t in (REFERENCE, EXTRACTIVE, APPEND_EVIDENCE, SEGMENT_FIRST, VERIFIED_QUOTES)
}


# The line a prompt ends with when it cues the reply ("Updated memory:"; the re-read prompt ends
# with its answer format instead). Document text holding one would make a prompt look as if it
# ended there; `defang` escapes its colon.
REPLY_CUES = tuple(
    dict.fromkeys(
        last_line
        for templates in TEMPLATE_SETS.values()
        for prompt in (templates.update, templates.final, REREAD_FINAL)
        if (last_line := prompt.rstrip("\n").rsplit("\n", 1)[-1]).endswith(":")
    )
)


def get_template_set(name: str) -> TemplateSet:
    try:
        return TEMPLATE_SETS[name]
    except KeyError:
        known = ", ".join(sorted(TEMPLATE_SETS))
        raise ValueError(f"unknown template set {name!r}; known: {known}") from None


# Chat-template control tokens: ChatML and Llama 3 style `<|...|>`, DeepSeek's fullwidth-bar form,
# and `<s>`/`</s>`. Left as is, a tokenizer would turn them into real control tokens.
_CONTROL_TOKEN = re.compile(r"<\|[^<>|\s]{1,64}\|>|<\uff5c[^<>\uff5c\s]{1,64}\uff5c>|</?s>")


def defang(text: str) -> str:
    """Escapes the template's section tags, reply cues and chat control tokens in untrusted
    text, so a document cannot close its section, fake the prompt's end or forge a turn. Text
    without them is returned unchanged."""
    for tag in STRUCTURE_TAGS:
        if tag in text:
            text = text.replace(tag, _escape(tag))
    for cue in REPLY_CUES:
        if cue in text:
            text = text.replace(cue, cue.removesuffix(":") + "&#58;")
    return _CONTROL_TOKEN.sub(lambda match: _escape(match.group()), text)


def _escape(marker: str) -> str:
    return marker.replace("<", "&lt;").replace(">", "&gt;")
