"""A synthetic "keep the fact" task on real prose: one access code among distractors.

A document is `n_segments` pieces of filler of about `segment_tokens` tokens each, cut from the
English novels of the shared corpora (read at run time, never copied into the repository). One
needle, "The access code for the <key> vault is <7-digit number>.", sits at a random depth;
distractor sentences of the same form give other keys other numbers. The question asks for the
needle's code, and the gold answer is its number.

Train and held-out samples share neither text nor keys, and held-out samples share no text with
`memstream eval`'s haystacks either: the train split reads the first half of each novel's
paragraphs; the held-out split reads two NIST reports of the shared corpora, which nothing else
reads (eval cuts its haystacks from every text of `text/`, the novels included). Each split
draws its keys (adjective noun) from its own words. Every sample depends only on (seed, split,
index).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from operators.config import ConfigError
from operators.core.scoring import AnswerMode
from operators.parsing import parse_document
from pipeline.corpora import DEFAULT_CORPORA

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")

NOVELS = (
    "text/gutenberg-1342-pride-and-prejudice.txt",
    "text/gutenberg-1661-adventures-of-sherlock-holmes.txt",
)
REPORTS = (
    "pdfs/reports/NIST-SP800-61r2-incident-handling.pdf",
    "pdfs/reports/NIST-SP800-40r3-patch-management.pdf",
)
# English prose runs at about 0.75 words a token: the count used without a tokenizer.
WORDS_PER_TOKEN = 0.75
SEGMENT_SEPARATOR = "\n\n"
CODE_DIGITS = 7

# Disjoint by split, in both words: no held-out key shares an adjective or a noun with a train key.
KEY_WORDS: dict[Split, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "train": (
        (
            "amber", "brass", "bronze", "cobalt", "copper", "crimson", "golden", "granite",
            "indigo", "ivory", "jade", "marble", "onyx", "pearl", "ruby", "scarlet", "silver",
            "slate", "teal", "violet",
        ),
        (
            "beacon", "bridge", "canyon", "castle", "cedar", "falcon", "forest", "garden",
            "glacier", "harbor", "island", "lantern", "meadow", "orchard", "raven", "river",
            "summit", "tower", "valley", "willow",
        ),
    ),
    "heldout": (
        (
            "azure", "beige", "charcoal", "cyan", "emerald", "fawn", "hazel", "khaki", "lilac",
            "maroon", "ochre", "olive", "plum", "saffron", "sepia", "tan", "topaz", "umber",
            "vermilion", "walnut",
        ),
        (
            "abbey", "bay", "cliff", "delta", "dune", "fjord", "grove", "heath", "inlet", "lagoon",
            "marsh", "moor", "oasis", "prairie", "quay", "reef", "spire", "steppe", "tundra",
            "wharf",
        ),
    ),
}  # fmt: skip

_BLANK_LINES = re.compile(r"\n\s*\n")
_SENTENCE_END = re.compile("[.!?][\"'\u201d\u2019)\\]]*$")
_ABBREVIATIONS = frozenset({"Mr.", "Mrs.", "Dr.", "St.", "Esq.", "Messrs.", "No.", "Col.", "Capt."})
_MIN_PARAGRAPH_WORDS = 4
_DOT_LEADER = "...."  # a table of contents' line: "3. The Challenges ........ 3"


def approximate_token_count(text: str) -> int:
    return math.ceil(len(text.split()) / WORDS_PER_TOKEN)


def needle_sentence(key: str, code: str) -> str:
    return f"The access code for the {key} vault is {code}."


def question_for(key: str) -> str:
    return f"What is the access code for the {key} vault?"


def keys_of(split: Split) -> list[str]:
    adjectives, nouns = KEY_WORDS[split]
    return [f"{adjective} {noun}" for adjective in adjectives for noun in nouns]


@dataclass(frozen=True)
class FactSample:
    sample_id: str
    document: str
    question: str
    answers: list[str]
    needle_depth: float | None  # share of the document's characters before the needle
    # The one code is the answer: a class constant, not a field (the JSON Lines rows keep their
    # columns). pipeline.training.contract_fields' samples carry theirs.
    answer_mode: ClassVar[AnswerMode] = "any"


@dataclass(frozen=True)
class FillerText:
    """One half of a novel as a word stream; `sentence_starts` are word indices, ascending, and
    `numbers` every run of digits in it (a code must not be one of them)."""

    name: str
    words: tuple[str, ...]
    sentence_starts: tuple[int, ...]
    numbers: frozenset[str]


def gutenberg_body(text: str) -> str:
    """The text between Project Gutenberg's START and END markers (the whole text without them).
    The START marker may wrap over two lines, so its closing `***` is searched for."""
    start = text.find("*** START OF")
    if start >= 0:
        closing = text.find("***", start + 3)
        start = closing + 3 if closing >= 0 else start
    end = text.find("*** END OF")
    return text[max(start, 0) : end if end >= 0 else len(text)]


def prose_paragraphs(text: str) -> list[str]:
    """The paragraphs that are prose: headings, the table of contents (indented lines) and
    lines without a sentence end are dropped; line breaks and italics underscores flattened."""
    paragraphs = []
    for block in _BLANK_LINES.split(gutenberg_body(text)):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines or all(line.startswith((" ", "\t")) for line in lines):
            continue
        paragraph = " ".join(" ".join(lines).replace("_", "").split())
        if len(paragraph.split()) >= _MIN_PARAGRAPH_WORDS and re.search(r"[.!?]", paragraph):
            paragraphs.append(paragraph)
    return paragraphs


def first_half(paragraphs: Sequence[str]) -> list[str]:
    return list(paragraphs[: len(paragraphs) // 2])


def report_paragraphs(pdf: Path) -> list[str]:
    """The prose paragraphs of a PDF report, its table of contents left out."""
    text = parse_document(pdf.read_bytes(), pdf.name).text
    return [paragraph for paragraph in prose_paragraphs(text) if _DOT_LEADER not in paragraph]


def filler_from(name: str, paragraphs: Iterable[str]) -> FillerText:
    words: list[str] = []
    starts: list[int] = []
    for paragraph in paragraphs:
        for word in paragraph.split():
            if not words or _ends_sentence(words[-1]):
                starts.append(len(words))
            words.append(word)
    numbers = frozenset(re.findall(r"\d+", " ".join(words)))
    return FillerText(name, tuple(words), tuple(starts), numbers)


def _ends_sentence(word: str) -> bool:
    return bool(_SENTENCE_END.search(word)) and word not in _ABBREVIATIONS


@functools.lru_cache(maxsize=4)
def load_filler(corpora: Path, split: Split) -> tuple[FillerText, ...]:
    """The split's prose, read once per (folder, split): the first half of each novel for
    training, the NIST reports for the held-out split."""
    if not corpora.is_dir():
        raise FileNotFoundError(f"shared corpora not found at {corpora}")
    if split == "train":
        return tuple(
            filler_from(
                f"{path.stem} (train)",
                first_half(prose_paragraphs(path.read_text(encoding="utf-8-sig"))),
            )
            for path in (corpora / relative for relative in NOVELS)
        )
    return tuple(
        filler_from(path.stem, report_paragraphs(path))
        for path in (corpora / relative for relative in REPORTS)
    )


def generate_samples(
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
) -> list[FactSample]:
    """Samples `first` to `first + n - 1` of the split; sample i is the same whatever `n` and
    `first` are. `count_tokens` measures pieces (a tokenizer's length); without it, words /
    0.75."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n_segments < 1 or segment_tokens < 1 or n_distractors < 0:
        raise ValueError("need n_segments >= 1, segment_tokens >= 1 and n_distractors >= 0")
    if n_distractors + 1 > len(keys_of(split)):
        raise ValueError(f"at most {len(keys_of(split)) - 1} distractors")
    fillers = load_filler(corpora, split)
    counter = count_tokens or approximate_token_count
    return [
        build_sample(
            random.Random(f"memstream-facts/{split}/{seed}/{index}"),
            f"{split}-{seed}-{index}",
            fillers,
            keys_of(split),
            n_segments=n_segments,
            segment_tokens=segment_tokens,
            n_distractors=n_distractors,
            count_tokens=counter,
        )
        for index in range(first, first + n)
    ]


def build_sample(
    rng: random.Random,
    sample_id: str,
    fillers: Sequence[FillerText],
    keys: Sequence[str],
    *,
    n_segments: int,
    segment_tokens: int,
    n_distractors: int,
    count_tokens: Callable[[str], int],
) -> FactSample:
    filler = rng.choice(list(fillers))
    chosen_keys = rng.sample(list(keys), n_distractors + 1)
    codes = draw_codes(rng, n_distractors + 1, avoid=filler.numbers)
    planted = [needle_sentence(key, code) for key, code in zip(chosen_keys, codes, strict=True)]
    document = plant_document(
        rng,
        filler,
        planted,
        n_segments=n_segments,
        segment_tokens=segment_tokens,
        count_tokens=count_tokens,
    )
    return FactSample(
        sample_id=sample_id,
        document=document,
        question=question_for(chosen_keys[0]),
        answers=[codes[0]],
        needle_depth=document.index(planted[0]) / len(document),
    )


def plant_document(
    rng: random.Random,
    filler: FillerText,
    planted: Sequence[str],
    *,
    n_segments: int,
    segment_tokens: int,
    count_tokens: Callable[[str], int],
) -> str:
    """`n_segments` pieces of `filler` of `segment_tokens` tokens each, the planted texts
    included, each planted text at a sentence start of a random piece; the pieces start at a
    random sentence and follow each other in the filler."""
    piece_of = [rng.randrange(n_segments) for _ in planted]
    budgets = [segment_tokens] * n_segments
    for sentence, piece in zip(planted, piece_of, strict=True):
        budgets[piece] -= count_tokens(sentence) + 1
    if min(budgets) < 1:
        raise ValueError(
            f"segment_tokens={segment_tokens} leaves no room for filler beside the planted "
            "sentences: raise it or lower n_distractors"
        )
    # Twice the words the budget needs in the word-count approximation leaves room for a
    # tokenizer that spends more tokens a word.
    needed_words = 2 * math.ceil(sum(budgets) * WORDS_PER_TOKEN) + n_segments
    last_start = bisect.bisect_right(filler.sentence_starts, len(filler.words) - needed_words)
    if last_start == 0:
        raise ValueError(f"{filler.name} is too short for {n_segments} x {segment_tokens} tokens")
    position = filler.sentence_starts[rng.randrange(last_start)]
    pieces = []
    for index, budget in enumerate(budgets):
        n_words = _words_within(filler.words, position, budget, count_tokens)
        inserted = [
            sentence for sentence, piece in zip(planted, piece_of, strict=True) if piece == index
        ]
        pieces.append(_plant(filler, position, n_words, inserted, rng))
        position += n_words
    return SEGMENT_SEPARATOR.join(pieces)


def draw_codes(rng: random.Random, n: int, *, avoid: frozenset[str]) -> list[str]:
    """`n` distinct codes of `CODE_DIGITS` digits, none of them a number of the filler."""
    codes: list[str] = []
    while len(codes) < n:
        code = str(rng.randrange(10 ** (CODE_DIGITS - 1), 10**CODE_DIGITS))
        if code not in avoid and code not in codes:
            codes.append(code)
    return codes


def _words_within(
    words: Sequence[str], start: int, budget: int, count_tokens: Callable[[str], int]
) -> int:
    """The most words from `start` on whose text stays within `budget` tokens (at least one),
    by bisection: token counts grow with the number of words."""
    low, high = 1, min(len(words) - start, 4 * budget + 8)
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens(" ".join(words[start : start + middle])) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def _plant(
    filler: FillerText, start: int, n_words: int, sentences: Sequence[str], rng: random.Random
) -> str:
    """The piece's words with each sentence inserted at a sentence start within it (the piece's
    own start when it holds none)."""
    end = start + n_words
    first = bisect.bisect_left(filler.sentence_starts, start)
    last = bisect.bisect_right(filler.sentence_starts, end - 1)
    slots = list(filler.sentence_starts[first:last]) or [start]
    at: dict[int, list[str]] = {}
    for sentence in sentences:
        at.setdefault(rng.choice(slots), []).append(sentence)
    parts: list[str] = []
    cursor = start
    for slot in sorted(at):
        parts += [*filler.words[cursor:slot], *at[slot]]
        cursor = slot
    parts += filler.words[cursor:end]
    return " ".join(parts)


def write_jsonl(samples: Iterable[FactSample], path: Path) -> Path:
    """One JSON object a line: sample_id, document, question, answers, needle_depth."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as file:
        for sample in samples:
            file.write(json.dumps(asdict(sample), ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: Path) -> list[FactSample]:
    """Rows of document, question and answers (a list, or one string); sample_id and
    needle_depth are optional (the line number and None). A row that is not such an object, or
    a file without rows, is a ConfigError naming the file and line."""
    samples = []
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object")
            missing = [name for name in ("document", "question", "answers") if name not in row]
            if missing:
                raise ConfigError(f"{path}:{number}: missing {', '.join(missing)}")
            answers = row["answers"]
            samples.append(
                FactSample(
                    sample_id=str(row.get("sample_id", f"line-{number}")),
                    document=row["document"],
                    question=row["question"],
                    answers=[answers] if isinstance(answers, str) else [str(a) for a in answers],
                    needle_depth=row.get("needle_depth"),
                )
            )
    if not samples:
        raise ConfigError(f"{path}: no samples (one JSON object a line)")
    return samples
