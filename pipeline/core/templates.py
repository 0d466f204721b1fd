"""Prompt template sets.

The reference set is an interface the RL-MemAgent weights expect, byte for byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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

# The tags that delimit untrusted text inside the templates; document text must not contain them.
STRUCTURE_TAGS = (
    "<problem>",
    "</problem>",
    "<memory>",
    "</memory>",
    "<section>",
    "</section>",
)


@dataclass(frozen=True)
class TemplateSet:
    """The two prompts of one memory strategy: `update` sees a chunk, `final` only the memory."""

    name: str
    update: str
    final: str
    initial_memory: str = INITIAL_MEMORY

    def render_update(self, question: str, memory: str, chunk: str) -> str:
        return self.update.format(
            question=defang(question), memory=defang(memory), chunk=defang(chunk)
        )

    def render_final(self, question: str, memory: str) -> str:
        return self.final.format(question=defang(question), memory=defang(memory))


REFERENCE = TemplateSet(name="memagent-reference", update=REFERENCE_UPDATE, final=REFERENCE_FINAL)

TEMPLATE_SETS: dict[str, TemplateSet] = {REFERENCE.name: REFERENCE}


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
    """Escapes the template's section tags and chat control tokens in untrusted text, so a
    document cannot close its section or forge a turn. Text without them is returned unchanged."""
    for tag in STRUCTURE_TAGS:
        if tag in text:
            text = text.replace(tag, _escape(tag))
    return _CONTROL_TOKEN.sub(lambda match: _escape(match.group()), text)


def _escape(marker: str) -> str:
    return marker.replace("<", "&lt;").replace(">", "&gt;")
