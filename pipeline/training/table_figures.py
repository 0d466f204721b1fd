"""Figures in table rows: the tasks that teach a memory to keep the row a question asks about.

Rows read as the PDF parser writes a table row under its column headers
(operators.parsing.pdf_headers): "AWS, Net sales: Three Months Ended September 30, 2021
$ 16,110; Three Months Ended September 30, 2022 $ 20,538", one row a block. A question names
the row's label and one column's header, "What was AWS, Net sales for Three Months Ended
September 30, 2022?", and the gold answer is that cell's figure as printed, scored as a figure
(answer mode "figure", operators.core.figures: "20,538", "$20,538 million" and "$20.5 billion"
count; another column's figure, or a dumped row, does not).

Two tasks:

- `table-figures`: synthetic tables (a caption, the header lines, rows under one to three
  section labels, two or four period columns) planted in keep-the-fact's prose
  (pipeline.training.tasks: the first half of each novel for training, the NIST reports held
  out). The row labels, section labels and years of the two splits are disjoint; every figure
  of a document is distinct and none is a number of its filler; every sample depends only on
  (seed, split, index).
- `filing-figures`: a question for every cell of every headed row of the 2022 Q3 filings of
  the shared SEC 10-Q corpus (read and parsed at run time, as `memstream ask` parses a PDF),
  over a window of the filing's text around the row. The held-out split asks the same of the
  2023 Q1 and 2023 Q2 filings. Comparative columns repeat figures across filings (a 2023 Q1
  balance sheet prints the year-end column of 2022), so the split is made by figure, not by
  file: a training question is dropped when its figure's value is the gold of a held-out
  question, or of any question of `memstream eval`'s sec10q task (both its splits). A label
  and header that a filing prints with two different figures (two tables, one row name) is
  ambiguous and asked of neither split.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from operators.core.figures import find_figures
from operators.core.scoring import AnswerMode
from pipeline.corpora import DEFAULT_CORPORA, check_root
from pipeline.corpora.sec10q import FILINGS_FOLDER, load_filings, load_questions
from pipeline.training.tasks import (
    SEGMENT_SEPARATOR,
    SPLITS,
    FillerText,
    Split,
    approximate_token_count,
    load_filler,
    plant_document,
)

# --- rows -------------------------------------------------------------------------------------

# A cell: its column's header, then the figure as the parser prints it ("$ 19,739", "(627)",
# "$ (412)", "46.4%").
_CELL = re.compile(r"(?P<header>.*?)\s*(?P<value>(?:\$ )?\(?-?\d[\d,]*(?:\.\d+)?\)?%?)")
_LABEL = re.compile(r"[^:;\n]{1,200}")
# Header words a question leaves out: the unit caption some headers carry ("(In millions,
# except per share amounts) Three Months Ended June 25, 2022", "Fair Value at ... (In millions)").
_UNIT_CAPTION = re.compile(r"\s*\((?:in|dollars|amounts|shares)\b[^)]*\)", re.IGNORECASE)
_FOOTNOTE = re.compile(r"\s\(\d{1,2}\)(?=,|$)")


@dataclass(frozen=True)
class HeadedRow:
    label: str  # "AWS, Net sales": the section, if any, and the row's name
    cells: tuple[tuple[str, str], ...]  # (column header, figure as printed), left to right

    def text(self) -> str:
        """The row as operators.parsing.pdf_headers writes it."""
        cells = "; ".join(f"{header} {value}" if header else value for header, value in self.cells)
        return f"{self.label}: {cells}"


def parse_headed_row(line: str) -> HeadedRow | None:
    """A parsed line that is a table row written with its column headers, split into its label
    and cells; None for any other line. Cells without a header or with a dash for a figure are
    left out."""
    label, colon, rest = line.strip().partition(": ")
    if not colon or not _LABEL.fullmatch(label) or "\n" in rest:
        return None
    cells = []
    for cell in rest.split("; "):
        match = _CELL.fullmatch(cell)
        if match is None:
            if re.fullmatch(r"(?:.*\s)?[\u2014\u2013-]+", cell):
                continue  # a dash: nothing printed in that column
            return None  # prose with a colon, not a row
        if match["header"] and len(find_figures(match["value"])) == 1:
            cells.append((match["header"], match["value"]))
    if len(find_figures(rest)) < 2 or not cells:
        return None  # a row has two figures or more (operators.core.figures.is_table_row)
    return HeadedRow(label, tuple(cells))


def question_for(label: str, header: str) -> str:
    """ "What was <row label> for <column header>?", footnote marks and unit captions out."""
    label = _FOOTNOTE.sub("", label)
    header = _UNIT_CAPTION.sub("", header).strip()
    return f"What was {label} for {header}?"


def figure_key(printed: str) -> str:
    """A figure's value for comparison across filings: no currency, commas, sign, parentheses
    or percent, no trailing decimal zeros ("$ (1,234.50)" and "1234.5" are one figure)."""
    digits = re.sub(r"[^\d.]", "", printed)
    if "." in digits:
        digits = digits.rstrip("0").rstrip(".")
    return digits.lstrip("0") or "0"


# A table's unit caption ("(In millions)", "as of September 30, 2022 (in millions):") scales
# the figures of the rows below it, within this many lines.
_SCALE_CAPTION = re.compile(r"\bin (millions|thousands|billions)\b", re.IGNORECASE)
CAPTION_REACH = 40
_NOT_SCALED = re.compile(r"per share|percent|%|ratio|margin percentage", re.IGNORECASE)


def gold_answers(figure: str, scale: str) -> list[str]:
    """The figure as printed, and with its table's scale where it has one ("$ 19,739" and
    "$ 19,739 million"): the evaluation's gold ("$19,739 million") accepts both spellings, and
    so does the reward (answer mode "figure": either gold, value compared)."""
    return [figure, f"{figure} {scale}"] if scale else [figure]


@dataclass(frozen=True)
class TableFigureSample:
    sample_id: str
    document: str
    question: str
    answers: list[str]  # the cell's figure as printed, then scaled by its caption if any
    answer_mode: AnswerMode  # "figure"
    source: str  # the filing's file name, or "synthetic"
    row: str  # the asked row as the document prints it


# --- synthetic tables ---------------------------------------------------------------------------

ROW_NAMES: dict[Split, tuple[str, ...]] = {
    "train": (
        "Net sales", "Cost of sales", "Gross margin", "Research and development",
        "Selling, general and administrative", "Operating income", "Interest expense",
        "Other income (expense), net", "Income before income taxes", "Provision for income taxes",
        "Net income", "Depreciation and amortization", "Stock-based compensation",
        "Capital expenditures", "Cash and cash equivalents", "Accounts receivable, net",
        "Inventories", "Total current assets", "Goodwill", "Total assets", "Accounts payable",
        "Deferred revenue", "Long-term debt", "Total liabilities",
    ),
    "heldout": (
        "Revenue", "Cost of revenue", "Gross profit", "Fulfillment", "Marketing",
        "Technology and content", "Restructuring charges", "Operating expenses",
        "Net earnings", "Marketable securities", "Property and equipment, net",
        "Accrued liabilities", "Retained earnings", "Free cash flow", "Unearned revenue",
        "Operating lease liabilities",
    ),
}  # fmt: skip
SECTION_NAMES: dict[Split, tuple[str, ...]] = {
    "train": (
        "Americas", "Asia Pacific", "Cloud Services", "Consumer Products", "Data Center",
        "Devices", "Enterprise Software", "Europe", "Gaming", "Licensing", "Retail Stores",
        "Wholesale",
    ),
    "heldout": (
        "Advertising", "Automotive", "Client Computing", "Greater China", "Intelligent Cloud",
        "International", "Japan", "North America", "Professional Visualization",
        "Subscription Services",
    ),
}  # fmt: skip
# A table compares two consecutive years of its split's.
YEARS: dict[Split, tuple[int, ...]] = {
    "train": tuple(range(2008, 2018)),
    "heldout": tuple(range(2018, 2022)),
}
PERIOD_ENDS = (
    "March 31", "June 30", "September 30", "December 31", "March 26", "June 25",
    "October 30", "Oct 1",
)  # fmt: skip
SPANS = ("Three Months Ended", "Six Months Ended", "Nine Months Ended")
CAPTIONS = ("(In millions)", "(in millions)", "(In millions, except per share amounts)", "")
# A table takes at most this share of its segment's tokens: the rest is prose.
TABLE_SHARE = 0.6
MIN_ROWS = 2


@dataclass(frozen=True)
class SyntheticTable:
    header_lines: tuple[str, ...]  # the caption and header lines printed above the rows
    blocks: tuple[str | HeadedRow, ...]  # section labels (str) and rows, in print order

    def rows(self) -> list[HeadedRow]:
        return [block for block in self.blocks if isinstance(block, HeadedRow)]

    def text(self) -> str:
        """The table as the parser writes it: one block a line of headers, section label or
        row, blocks apart by a blank line."""
        lines = [*self.header_lines] + [
            block if isinstance(block, str) else block.text() for block in self.blocks
        ]
        return SEGMENT_SEPARATOR.join(line for line in lines if line)


def column_headers(rng: random.Random, split: Split) -> tuple[list[str], list[str]]:
    """Two or four columns' headers and the header lines printed above them: a balance sheet's
    two dates, or a quarter's span and a year-to-date span, each for two years."""
    first = rng.choice(YEARS[split][:-1])
    years = [first, first + 1] if rng.random() < 0.5 else [first + 1, first]
    end = rng.choice(PERIOD_ENDS)
    if rng.random() < 0.3:  # a balance sheet: this period's end and the last year-end
        other = rng.choice([e for e in PERIOD_ENDS if e != end])
        dates = [f"{end}, {years[0]}", f"{other}, {years[1]}"]
        return dates, dates
    spans = [SPANS[0]] + ([rng.choice(SPANS[1:])] if rng.random() < 0.6 else [])
    headers = [f"{span} {end}, {year}" for span in spans for year in years]
    lines = [f"{span}\n{end}," for span in spans] + [str(year) for _ in spans for year in years]
    return headers, lines


def format_figure(rng: random.Random, value: int, *, dollar: bool) -> str:
    """A figure as a filing prints it: "19,739", negatives in parentheses, "$ " on a section's
    first row."""
    printed = f"{value:,}"
    if rng.random() < 0.1:
        printed = f"({printed})"
    return f"$ {printed}" if dollar else printed


def build_table(rng: random.Random, split: Split, *, avoid: frozenset[str]) -> SyntheticTable:
    """A table of one to three sections (or none) of rows of distinct names, every figure
    distinct and none in `avoid` (compared as `figure_key`s)."""
    headers, header_lines = column_headers(rng, split)
    n_sections = rng.choice((0, 0, 1, 2, 3))
    per_section = rng.randint(MIN_ROWS, 4)
    names = rng.sample(ROW_NAMES[split], per_section)
    sections = rng.sample(SECTION_NAMES[split], n_sections) or [""]
    used = set(avoid)
    blocks: list[str | HeadedRow] = []
    for section in sections:
        if section:
            blocks.append(section)
        for position, name in enumerate(names):
            cells = []
            for header in headers:
                while True:
                    value = rng.randrange(100, 250_000)
                    if figure_key(str(value)) not in used:
                        break
                used.add(figure_key(str(value)))
                cells.append((header, format_figure(rng, value, dollar=position == 0)))
            label = f"{section}, {name}" if section else name
            blocks.append(HeadedRow(label, tuple(cells)))
    return SyntheticTable((rng.choice(CAPTIONS), *header_lines), tuple(blocks))


def _without_last_row(blocks: tuple[str | HeadedRow, ...]) -> tuple[str | HeadedRow, ...]:
    kept = list(blocks)
    last = max(i for i, block in enumerate(kept) if isinstance(block, HeadedRow))
    del kept[last]
    while kept and isinstance(kept[-1], str):
        del kept[-1]  # a section label left with no rows
    return tuple(kept)


def generate_table_samples(
    n: int,
    *,
    seed: int,
    split: Split,
    n_segments: int = 3,
    segment_tokens: int = 300,
    count_tokens: Callable[[str], int] | None = None,
    corpora: Path = DEFAULT_CORPORA,
    first: int = 0,
) -> list[TableFigureSample]:
    """Samples `first` to `first + n - 1` of the synthetic task's split; sample i is the same
    whatever `n` and `first` are. The table is shortened, row by row, to at most
    `TABLE_SHARE` of a segment's tokens (at least `MIN_ROWS` rows)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n_segments < 1 or segment_tokens < 1:
        raise ValueError("need n_segments >= 1 and segment_tokens >= 1")
    fillers = load_filler(corpora, split)
    counter = count_tokens or approximate_token_count
    return [
        build_table_sample(
            random.Random(f"memstream-tables/{split}/{seed}/{index}"),
            f"tables-{split}-{seed}-{index}",
            split,
            fillers,
            n_segments=n_segments,
            segment_tokens=segment_tokens,
            count_tokens=counter,
        )
        for index in range(first, first + n)
    ]


def build_table_sample(
    rng: random.Random,
    sample_id: str,
    split: Split,
    fillers: Sequence[FillerText],
    *,
    n_segments: int,
    segment_tokens: int,
    count_tokens: Callable[[str], int],
) -> TableFigureSample:
    filler = rng.choice(list(fillers))
    avoid = frozenset(figure_key(number) for number in filler.numbers)
    table = build_table(rng, split, avoid=avoid)
    while len(table.rows()) > MIN_ROWS and (
        count_tokens(table.text()) > TABLE_SHARE * segment_tokens
    ):
        table = SyntheticTable(table.header_lines, _without_last_row(table.blocks))
    row = rng.choice(table.rows())
    header, value = rng.choice(row.cells)
    planted = f"{SEGMENT_SEPARATOR}{table.text()}{SEGMENT_SEPARATOR}"
    document = plant_document(
        rng,
        filler,
        [planted],
        n_segments=n_segments,
        segment_tokens=segment_tokens,
        count_tokens=count_tokens,
    )
    # The table stands in blocks of its own, as the parser writes it, not inside a line of prose.
    document = document.replace(f" {SEGMENT_SEPARATOR}", SEGMENT_SEPARATOR)
    document = document.replace(f"{SEGMENT_SEPARATOR} ", SEGMENT_SEPARATOR)
    document = re.sub(r"\n{3,}", SEGMENT_SEPARATOR, document).strip()
    return TableFigureSample(
        sample_id=sample_id,
        document=document,
        question=question_for(row.label, header),
        answers=gold_answers(value, "million" if "millions" in table.header_lines[0] else ""),
        answer_mode="figure",
        source="synthetic",
        row=row.text(),
    )


# --- the filings' rows ------------------------------------------------------------------------

FILING_PERIODS: dict[Split, tuple[str, ...]] = {
    "train": ("2022 Q3",),
    "heldout": ("2023 Q1", "2023 Q2"),
}


@dataclass(frozen=True)
class RowQuestion:
    """One cell of a headed row of a filing, asked as a question."""

    filing: str
    label: str
    header: str
    figure: str  # as printed
    question: str
    row: str  # the row's line as the parsed text prints it
    scale: str = ""  # "million", "thousand", "billion": the nearest unit caption above the row

    @property
    def answers(self) -> list[str]:
        return gold_answers(self.figure, self.scale)


def row_questions(filing: str, text: str) -> list[RowQuestion]:
    """A question for every cell of every headed row of the filing's parsed text, once each
    (a row printed twice, in a note and in the discussion, is asked once); a label and header
    printed with two different figures are left out, as are the table of contents' pages."""
    found: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
    caption_at, scale = -CAPTION_REACH - 1, ""
    for number, line in enumerate(text.split("\n")):
        if caption := _SCALE_CAPTION.search(line):
            caption_at, scale = number, caption.group(1).lower().rstrip("s")
        row = parse_headed_row(line)
        if row is None:
            continue
        near = scale if number - caption_at <= CAPTION_REACH else ""
        for header, figure in row.cells:
            if header.lower() == "page":
                continue
            cell_scale = "" if _unscaled(row.label, header, figure) else near
            found.setdefault((row.label, header), []).append((figure, line.strip(), cell_scale))
    questions = []
    for (label, header), cells in found.items():
        if len({figure_key(figure) for figure, _, _ in cells}) > 1:
            continue
        figure, row_text, cell_scale = cells[0]
        questions.append(
            RowQuestion(
                filing, label, header, figure, question_for(label, header), row_text, cell_scale
            )
        )
    return sorted(questions, key=lambda q: (q.filing, q.label, q.header))


def _unscaled(label: str, header: str, figure: str) -> bool:
    """A figure a unit caption does not scale: a percentage, a per-share amount, a ratio."""
    return "%" in figure or bool(_NOT_SCALED.search(f"{label} {header}"))


def filings_of(corpora: Path, split: Split) -> list[str]:
    """The split's filings in the corpus, by file name (the period starts the name)."""
    folder = check_root(corpora) / FILINGS_FOLDER
    names = sorted(path.name for path in folder.glob("*.pdf"))
    chosen = [name for name in names if name.startswith(FILING_PERIODS[split])]
    if not chosen:
        raise FileNotFoundError(f"no {split} filings ({FILING_PERIODS[split]}) in {folder}")
    return chosen


@functools.lru_cache(maxsize=4)
def filing_texts(corpora: Path, split: Split) -> dict[str, str]:
    """The split's filings, parsed once per (folder, split)."""
    return load_filings(corpora, set(filings_of(corpora, split)))


def eval_figures() -> frozenset[str]:
    """The gold figures of `memstream eval`'s sec10q questions, both splits."""
    return frozenset(figure_key(question.figure) for question in load_questions())


@functools.lru_cache(maxsize=4)
def all_row_questions(corpora: Path, split: Split) -> tuple[RowQuestion, ...]:
    """Every question the split's filings give, before the figure check."""
    return tuple(
        question
        for filing, text in sorted(filing_texts(corpora, split).items())
        for question in row_questions(filing, text)
    )


def heldout_figures(corpora: Path) -> frozenset[str]:
    """Every figure a held-out question answers with: the held-out filings' row questions and
    the evaluation's sec10q questions."""
    held = {figure_key(question.figure) for question in all_row_questions(corpora, "heldout")}
    return frozenset(held) | eval_figures()


@functools.lru_cache(maxsize=4)
def question_bank(corpora: Path, split: Split) -> tuple[RowQuestion, ...]:
    """The split's questions: every held-out one; the training ones whose figure is no held-out
    question's (`heldout_figures`)."""
    questions = all_row_questions(corpora, split)
    if split == "heldout":
        return questions
    held = heldout_figures(corpora)
    return tuple(question for question in questions if figure_key(question.figure) not in held)


def generate_filing_samples(
    n: int,
    *,
    seed: int,
    split: Split,
    n_segments: int = 3,
    segment_tokens: int = 300,
    count_tokens: Callable[[str], int] | None = None,
    corpora: Path = DEFAULT_CORPORA,
    first: int = 0,
) -> list[TableFigureSample]:
    """Samples `first` to `first + n - 1` of the split: sample i asks question
    `order[i % N]` of the split's N questions in an order shuffled by (seed, split), over a
    window of about `n_segments * segment_tokens` tokens of its filing around the row, the
    row at a random depth; the same whatever `n` and `first` are."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n_segments < 1 or segment_tokens < 1:
        raise ValueError("need n_segments >= 1 and segment_tokens >= 1")
    bank = question_bank(corpora, split)
    if not bank:
        raise ValueError(f"no {split} table questions in {corpora / FILINGS_FOLDER}")
    texts = filing_texts(corpora, split)
    order = list(range(len(bank)))
    random.Random(f"memstream-filing-figures/{split}/{seed}").shuffle(order)
    counter = count_tokens or approximate_token_count
    samples = []
    for index in range(first, first + n):
        question = bank[order[index % len(bank)]]
        rng = random.Random(f"memstream-filing-figures/{split}/{seed}/{index}")
        document = window_around(
            texts[question.filing].split("\n"),
            question.row,
            rng,
            n_segments * segment_tokens,
            counter,
        )
        samples.append(
            TableFigureSample(
                sample_id=f"filing-figures-{split}-{seed}-{index}",
                document=document,
                question=question.question,
                answers=question.answers,
                answer_mode="figure",
                source=question.filing,
                row=question.row,
            )
        )
    return samples


def window_around(
    lines: Sequence[str],
    row: str,
    rng: random.Random,
    budget: int,
    count_tokens: Callable[[str], int],
) -> str:
    """Whole lines around one of `row`'s occurrences, within `budget` tokens where the lines
    allow: a random share of the budget before the row, the rest after it (and before again
    where the text ends first)."""
    at = rng.choice([i for i, line in enumerate(lines) if line.strip() == row])
    left = budget - count_tokens(row)
    start, before = _extend(lines, at, -1, int(rng.random() * max(left, 0)), count_tokens)
    end, after = _extend(lines, at, +1, left - before, count_tokens)
    start, _ = _extend(lines, start, -1, left - before - after, count_tokens)
    return "\n".join(lines[start:end]).strip()


def _extend(
    lines: Sequence[str],
    edge: int,
    step: int,
    budget: int,
    count_tokens: Callable[[str], int],
) -> tuple[int, int]:
    """Walks from the kept line `edge` outward by `step` while whole lines fit `budget`;
    returns the new edge (the first line kept going up, one past the last going down) and the
    tokens spent."""
    spent = 0
    index = edge
    while 0 <= index + step < len(lines):
        cost = count_tokens(lines[index + step]) + 1
        if spent + cost > budget:
            break
        spent += cost
        index += step
    return (index if step < 0 else index + 1), spent
