"""The method's knobs as one flat, typed record (what a job spec, the CLI and the API share),
and the one way every configuration (job spec, serving settings) is read from plain data."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Annotated, Any, TypeVar, get_args, get_type_hints

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from operators.core.chain import (
    REFERENCE_MAX_ANSWER_TOKENS,
    REFERENCE_MAX_MEMORY_TOKENS,
    ChainConfig,
)
from operators.core.segmentation import REFERENCE_CHUNK_SIZE, SegmentationConfig
from operators.core.settings import Flag
from operators.core.templates import (
    EARLIER_REREAD_DIGESTS,
    REFERENCE,
    REREAD_DIGEST,
    SEGMENT_FIRST,
    VERIFIED_QUOTES,
    get_template_set,
)
from operators.engine import SamplingConfig

T = TypeVar("T")

# The packaged model `ask`, jobs and Serve run unless told otherwise (docs/accuracy.md: why).
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
STRICT_KEYS = ConfigDict(extra="forbid")  # unknown keys are errors, at every level
# Tokens a chat template adds around a rendered prompt (role markers), with a margin.
CHAT_OVERHEAD_TOKENS = 32

# The method a model gets when no template is named. For the small models that were not
# RL-trained, the best measured by `memstream eval` (docs/accuracy.md): the template set and, where
# it won, a re-read of the document at answer time; for every other model the reference as
# published, which is what the RL-MemAgent weights were trained on. Naming a template names the
# method: its other settings are then the given ones (no re-read unless asked).
MEASURED_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2.5-coder-0.5b-instruct": {"template": VERIFIED_QUOTES.name, "reread_tokens": 6000},
    "qwen2.5-coder-1.5b-instruct": {"template": SEGMENT_FIRST.name},
    "smollm2-135m-instruct": {"template": SEGMENT_FIRST.name},
}


# The method's settings, declared once: `MethodConfig` holds them all; a record that carries
# some of them (`memstream train`'s settings, `memstream eval`'s recorded ones) takes the same
# declaration, with a default of its own where its work needs one.
ChunkSize = Annotated[
    int, Field(gt=0, description="tokens of the document per segment, read in one memory update")
]
SnapWindow = Annotated[
    int,
    Field(
        ge=0,
        description="move chunk boundaries back up to N tokens to a line break or space; 0: exact",
    ),
]
MaxMemoryTokens = Annotated[
    int, Field(gt=0, description="new tokens per memory update: the memory's budget")
]
MaxAnswerTokens = Annotated[int, Field(gt=0, description="new tokens for the final answer")]
TemplateName = Annotated[
    str,
    Field(description="memory strategy: a template set (docs/guide/memory-strategies.md)"),
    Flag(default_text="the model's best measured; memagent-reference for others"),
]
Temperature = Annotated[float, Field(ge=0, description="sampling temperature; 0: greedy")]
TopP = Annotated[
    float,
    Field(
        gt=0,
        le=1,
        description="nucleus sampling: sample among the likeliest tokens whose probabilities "
        "add up to this",
    ),
]
Seed = Annotated[int, Field(description="seeds sampling, and the samples `eval` and `train` build")]
RereadTokens = Annotated[
    int,
    Field(
        ge=0,
        description="tokens of the document re-read at answer time: the passages that the "
        "question and the final memory point to; 0: answer from the memory alone, as published",
    ),
    Flag(metavar="N", default_text="the model's best measured where no template is named, else 0"),
]


@dataclass(frozen=True)
class MethodConfig:
    """How a memory chain reads a document and answers: segmentation, memory, sampling."""

    chunk_size: ChunkSize = REFERENCE_CHUNK_SIZE
    snap_window: SnapWindow = 0
    max_memory_tokens: MaxMemoryTokens = REFERENCE_MAX_MEMORY_TOKENS
    max_answer_tokens: MaxAnswerTokens = REFERENCE_MAX_ANSWER_TOKENS
    template: TemplateName = REFERENCE.name
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    seed: Seed = 0
    reread_tokens: RereadTokens = 0

    def __post_init__(self) -> None:
        # Build every part once so an invalid value fails here, with the part's own message.
        self.segmentation()
        self.chain()
        self.sampling()

    def segmentation(self) -> SegmentationConfig:
        return SegmentationConfig(chunk_size=self.chunk_size, snap_window=self.snap_window)

    def chain(self) -> ChainConfig:
        return ChainConfig(
            templates=get_template_set(self.template),
            max_memory_tokens=self.max_memory_tokens,
            max_answer_tokens=self.max_answer_tokens,
            reread_tokens=self.reread_tokens,
        )

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=self.seed)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def identity(self, reread_digest: str | None = None) -> dict[str, object]:
        """What of the method changes an answer, for a run's and a chain's key: the settings and
        the template set's wording; the re-read budget and its prompt's wording (`reread_digest`,
        by default this version's) only when it re-reads, so the keys of chains that answer from
        memory alone stay what they were."""
        settings = self.as_dict()
        if not self.reread_tokens:
            del settings["reread_tokens"]
        else:
            settings["reread_digest"] = reread_digest or REREAD_DIGEST
        return {**settings, "template_digest": get_template_set(self.template).digest}

    def memory_identities(self) -> list[dict[str, object]]:
        """The identities of chains whose memory steps are this method's, answered another way:
        from the memory alone, or re-read under an earlier wording. A re-reading chain that has
        run no step starts its answer step from the final memory of the first of them that read
        every segment, so a re-read costs one call, not the whole chain again. Empty for a
        method that does not re-read."""
        if not self.reread_tokens:
            return []
        alone = dataclasses.replace(self, reread_tokens=0).identity()
        return [alone, *(self.identity(digest) for digest in EARLIER_REREAD_DIGESTS)]

    @classmethod
    def from_identity(cls, identity: dict[str, Any]) -> MethodConfig:
        """The method an `identity()` describes; `TemplateChanged` when its template set's
        wording is no longer this version's (an identity without a digest is taken as is)."""
        settings = {
            key: value
            for key, value in identity.items()
            if key not in ("template_digest", "reread_digest")
        }
        method = cls(**settings)
        recorded = identity.get("template_digest")
        current = get_template_set(method.template).digest
        if recorded is not None and recorded != current:
            raise TemplateChanged(
                f"template set {method.template!r} is worded differently in this version "
                f"(digest {current}) than when the work began ({recorded}); its chains would mix "
                "two wordings: submit it again"
            )
        return method


class TemplateChanged(ValueError):
    """Work begun under one wording of a template set met another."""


MIB = 1 << 20


@dataclass(frozen=True)
class DocumentLimits:
    """How big one untrusted document may be. A document over a limit is refused with the
    limit's name in its reason (an errors row in a job, 413 from the endpoint), checked before
    the allocation it would cause where the format allows: decompression stops at the cap, a
    PDF's pages are counted before any text is extracted, a text file's bytes are compared with
    the character limit before they are decoded."""

    max_chars: Annotated[
        int,
        Field(
            gt=0,
            description="characters of parsed text; about 4 characters a token, the default "
            "holds a 16M-token document",
        ),
        Flag(name="--max-document-chars"),
    ] = 64_000_000
    max_tokens: Annotated[
        int,
        Field(gt=0, description="tokens of the parsed text, counted by the model's tokenizer"),
        Flag(name="--max-document-tokens"),
    ] = 16_000_000
    max_pdf_pages: Annotated[
        int, Field(gt=0, description="pages of a PDF, counted before its text is extracted")
    ] = 10_000
    max_expanded_bytes: Annotated[
        int,
        Field(
            gt=0,
            description="bytes of a .gz/.bz2/.xz document once decompressed, and of a DOCX "
            "package's parts (zip bombs)",
        ),
    ] = 256 * MIB

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_tokens", "max_pdf_pages", "max_expanded_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


def measured_defaults(model: str) -> dict[str, Any]:
    """The method settings `model` runs when no template is named (`MEASURED_DEFAULTS`)."""
    return {"template": REFERENCE.name, **MEASURED_DEFAULTS.get(model, {})}


def default_template(model: str) -> str:
    return str(measured_defaults(model)["template"])


def with_measured_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """A job or serving configuration (plain data, with optional `engine` and `method` sections)
    whose method names a template: the one given, else the engine model's measured defaults,
    under the settings that were given."""
    method = config.get("method") or {}
    if not isinstance(method, Mapping) or "template" in method:
        return dict(config)
    engine = config.get("engine") or {}
    model = engine.get("model", DEFAULT_MODEL) if isinstance(engine, Mapping) else DEFAULT_MODEL
    return {**config, "method": {**measured_defaults(model), **method}}


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and what is wrong."""


def parse_config(cls: type[T], data: Any, where: str) -> T:
    """A config record (a dataclass, sections nested) from plain data as YAML or flags give it.
    Unknown keys and wrong values are refused, each named by its dotted path."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of settings, got {type(data).__name__}")
    try:
        return _adapter(cls).validate_python(data)
    except ValidationError as error:
        raise ConfigError(f"{where}: {_describe(error, cls)}") from None


@functools.cache
def _adapter(cls: type[T]) -> TypeAdapter[T]:
    # The top record says `__pydantic_config__ = STRICT_KEYS`; its sections inherit it.
    return TypeAdapter(cls)


def _describe(error: ValidationError, cls: type) -> str:
    problems = []
    for problem in error.errors():
        location = ".".join(str(part) for part in problem["loc"])
        if problem["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            parent, _, key = location.rpartition(".")
            allowed = _field_names(cls, parent)
            problems.append(
                f"unknown key {key!r}"
                + (f" in {parent}" if parent else "")
                + (f" (allowed: {', '.join(allowed)})" if allowed else "")
            )
        elif problem["type"] in ("missing", "missing_argument"):
            problems.append(f"{location} is required")
        else:
            message = problem["msg"].removeprefix("Value error, ")
            value = problem.get("input")
            shown = "" if isinstance(value, (dict, list)) else f" (got {value!r})"
            if problem["type"] == "value_error":  # from __post_init__: it names the field
                shown = ""
            problems.append(f"{location}: {message}{shown}" if location else message)
    return "; ".join(problems)


def _field_names(cls: type, dotted: str) -> list[str]:
    """The keys the section at `dotted` (a path of field names from `cls`) allows."""
    section: Any = cls
    for name in filter(None, dotted.split(".")):
        hints = get_type_hints(section) if dataclasses.is_dataclass(section) else {}
        hint = hints.get(name)
        candidates = [hint, *get_args(hint)]
        section = next((c for c in candidates if dataclasses.is_dataclass(c)), None)
        if section is None:
            return []
    return [f.name for f in dataclasses.fields(section) if f.init]


def check_context_fit(
    method: MethodConfig, questions: Sequence[str], tokenizer: Any, max_model_len: int
) -> None:
    """Fails early, before any model call, when an update prompt (the template with the longest
    question, a chunk and the memory read in) plus its reply (the memory written out) cannot
    fit the model's context. Every entry point (ask, run, serve, eval) checks it."""
    longest = max(questions, key=len, default="")
    template = get_template_set(method.template).render_update(longest, "", "")
    needed = (
        len(tokenizer(template, add_special_tokens=False)["input_ids"])
        + method.chunk_size
        + 2 * method.max_memory_tokens
        + CHAT_OVERHEAD_TOKENS
    )
    if needed > max_model_len:
        raise ConfigError(
            f"an update step needs up to {needed} tokens (chunk_size {method.chunk_size} + "
            f"2 x max_memory_tokens {method.max_memory_tokens} + the prompt) but the model's "
            f"max_model_len is {max_model_len}: lower the chunk size (method.chunk_size, "
            "--chunk-size) or raise max_model_len (engine.max_model_len, --max-model-len)"
        )
    if method.reread_tokens:
        templates = get_template_set(method.template)
        reread = templates.render_reread(longest, "", "")
        answer_needed = (
            len(tokenizer(reread, add_special_tokens=False)["input_ids"])
            + method.max_memory_tokens * templates.memory_holds_replies
            + method.reread_tokens
            + method.max_answer_tokens
            + CHAT_OVERHEAD_TOKENS
        )
        if answer_needed > max_model_len:
            raise ConfigError(
                f"the answer step needs up to {answer_needed} tokens (reread_tokens "
                f"{method.reread_tokens} + the memory of up to "
                f"{method.max_memory_tokens * templates.memory_holds_replies} + max_answer_tokens "
                f"{method.max_answer_tokens} + the prompt) but the model's max_model_len is "
                f"{max_model_len}: lower the re-read budget (method.reread_tokens, "
                "--reread-tokens) or raise max_model_len (engine.max_model_len, --max-model-len)"
            )
