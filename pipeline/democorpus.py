"""A generated demo corpus: contract-, report- and log-like documents with planted facts.

Everything is made here from a seed, so the corpus is reproducible and free of licensing
questions. The filler is plausible but repetitive on purpose; the planted facts sit at fixed
depths and appear nowhere else, so each question has exactly one right answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class PlantedFact:
    question: str
    answer: str
    sentence: str
    depth: float  # where in the document it is planted, 0..1


@dataclass(frozen=True)
class DemoDocument:
    name: str
    text: str
    facts: tuple[PlantedFact, ...]


CONTRACT_FACTS = (
    PlantedFact(
        "Which state's law governs the agreement?",
        "Vermont",
        "This Agreement and any dispute arising out of it shall be governed by the laws of the "
        "State of Vermont, without regard to its conflict of laws principles.",
        0.82,
    ),
    PlantedFact(
        "How many days of prior written notice are required to terminate for convenience?",
        "120",
        "Either party may terminate this Agreement for convenience upon one hundred twenty (120) "
        "days' prior written notice to the other party.",
        0.35,
    ),
)

REPORT_FACTS = (
    PlantedFact(
        "Who is the Chief Financial Officer?",
        "Imogen Castellanos",
        "Imogen Castellanos, our Chief Financial Officer, presented the audited statements to "
        "the board on the ninth of February.",
        0.12,
    ),
    PlantedFact(
        "Which facility recorded the highest uptime of the year?",
        "Tromsø",
        "The Tromsø facility recorded the highest uptime of the year, 99.982 percent, the best "
        "figure in the company's history.",
        0.64,
    ),
)

LOG_FACTS = (
    PlantedFact(
        "Which payment processor timed out?",
        "ZephyrPay",
        "2025-03-14T02:17:09Z ERROR payments-api request_id=7f3a9c21 charge failed: "
        "processor ZephyrPay timed out after 30000 ms",
        0.47,
    ),
    PlantedFact(
        "Which storage node ran out of disk space?",
        "storage-node-17",
        "2025-03-14T04:51:33Z CRITICAL storage-node-17 disk /var/lib/ledger is full "
        "(0 bytes free); writes rejected",
        0.78,
    ),
)


def generate(seed: int = 7, scale: float = 1.0) -> list[DemoDocument]:
    """Three documents of about 20K, 45K and 90K tokens (times `scale`)."""
    rng = random.Random(seed)
    return [
        _assemble(
            "contract-northwind-msa.md",
            _contract_paragraph,
            CONTRACT_FACTS,
            int(20_000 * scale),
            rng,
            CONTRACT_HEADER,
            chars_per_token=5.3,
        ),
        _assemble(
            "report-2025-operations.md",
            _report_paragraph,
            REPORT_FACTS,
            int(45_000 * scale),
            rng,
            REPORT_HEADER,
            chars_per_token=3.95,
        ),
        _assemble(
            "payments-gateway.log",
            _log_line,
            LOG_FACTS,
            int(90_000 * scale),
            rng,
            "",
            chars_per_token=1.97,
        ),
    ]


def write(folder: Path, documents: list[DemoDocument]) -> Path:
    """Writes each document with its questions beside it (`NAME.questions.txt`, a sidecar the
    local source reads) and, one level up, `expected.jsonl` (document, question, expected)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for document in documents:
        (folder / document.name).write_text(document.text, encoding="utf-8")
        sidecar = folder / f"{document.name}.questions.txt"
        sidecar.write_text("".join(f"{fact.question}\n" for fact in document.facts))
        for fact in document.facts:
            lines.append(json.dumps({"document": document.name, **_public(fact)}))
    expected = folder.parent / "expected.jsonl"
    expected.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return expected


def _public(fact: PlantedFact) -> dict[str, str]:
    record = asdict(fact)
    return {"question": record["question"], "expected": record["answer"]}


def _assemble(
    name: str,
    make_block: Callable[[random.Random, int], str],
    facts: tuple[PlantedFact, ...],
    target_tokens: int,
    rng: random.Random,
    header: str,
    chars_per_token: float,
) -> DemoDocument:
    target_chars = int(target_tokens * chars_per_token)
    blocks: list[str] = [header] if header else []
    size = len(header)
    while size < target_chars:
        block = make_block(rng, len(blocks))
        blocks.append(block)
        size += len(block) + 1
    for fact in facts:
        blocks.insert(max(1, int(len(blocks) * fact.depth)), fact.sentence)
    return DemoDocument(name, "\n".join(blocks) + "\n", facts)


CONTRACT_HEADER = """# MASTER SERVICES AGREEMENT

This Master Services Agreement (the "Agreement") is entered into by and between Northwind
Logistics, Inc. ("Customer") and Halvorsen Data Systems AS ("Provider").
"""

_CONTRACT_SUBJECTS = (
    "The Provider",
    "The Customer",
    "Each party",
    "Neither party",
    "The receiving party",
    "The disclosing party",
    "Any subcontractor",
)
_CONTRACT_VERBS = (
    "shall maintain",
    "shall promptly deliver",
    "may request",
    "shall not disclose",
    "shall use commercially reasonable efforts to provide",
    "shall document",
    "shall review on a quarterly basis",
    "shall keep accurate records of",
)
_CONTRACT_OBJECTS = (
    "the Services described in each Statement of Work",
    "all Confidential Information received under this Agreement",
    "the service level credits set out in Schedule B",
    "written reports on incident response times",
    "the security controls listed in Exhibit C",
    "invoices for fees accrued during the preceding month",
    "the personnel assigned to the Customer account",
    "backups of Customer Data in a secondary region",
)
_CONTRACT_TAILS = (
    "in accordance with Good Industry Practice.",
    "within thirty (30) days of request.",
    "subject to the limitations in Section 11.",
    "at no additional charge.",
    "unless otherwise agreed in writing by both parties.",
    "for the duration of the applicable Statement of Work.",
)


def _contract_paragraph(rng: random.Random, index: int) -> str:
    sentences = [
        f"{rng.choice(_CONTRACT_SUBJECTS)} {rng.choice(_CONTRACT_VERBS)} "
        f"{rng.choice(_CONTRACT_OBJECTS)} {rng.choice(_CONTRACT_TAILS)}"
        for _ in range(rng.randint(3, 6))
    ]
    return f"\n## {index}. Clause {index}\n\n{index}.1 " + " ".join(sentences)


REPORT_HEADER = """# Annual Operations Report 2025

Prepared by the Operations Council for the Board of Directors.
"""

_FACILITIES = ("Rotterdam", "Lyon", "Gdansk", "Porto", "Tampere", "Bilbao", "Graz", "Aarhus")
_METRICS = (
    "average uptime",
    "energy use per rack",
    "ticket backlog",
    "mean time to repair",
    "staff turnover",
    "cooling efficiency",
    "incident count",
    "capacity utilisation",
)


def _report_paragraph(rng: random.Random, index: int) -> str:
    facility = rng.choice(_FACILITIES)
    quarter = rng.randint(1, 4)
    lines = [f"\n## {facility}, quarter {quarter}\n"]
    for _ in range(rng.randint(3, 5)):
        metric = rng.choice(_METRICS)
        value = round(rng.uniform(10, 98), 1)
        change = rng.choice(("rose", "fell", "held steady"))
        lines.append(
            f"In quarter {quarter} the {metric} at {facility} {change} to {value}, "
            f"which the site team attributes to {rng.choice(_REPORT_CAUSES)}."
        )
    return "\n".join(lines)


_REPORT_CAUSES = (
    "seasonal demand",
    "the new maintenance schedule",
    "staffing changes",
    "a supplier delay",
    "the migration to the new scheduler",
    "weather",
    "hardware refresh work",
    "training of the night shift",
)

_SERVICES = (
    "auth-service",
    "orders-api",
    "inventory-sync",
    "notifications",
    "search-indexer",
    "billing-worker",
    "session-cache",
)
_LOG_EVENTS = (
    "GET /v2/orders/{n} 200 in {ms} ms",
    "POST /v2/checkout 201 in {ms} ms",
    "cache hit ratio {pct}%",
    "heartbeat ok from node-{n}",
    "rebalanced {n} partitions in {ms} ms",
    "disk usage on storage-node-{node} at {pct}%",
    "processor Acquira responded in {ms} ms",
    "queue depth {n}",
    "token refreshed for client {n}",
    "GC pause {ms} ms",
)


def _log_line(rng: random.Random, index: int) -> str:
    seconds = index * 3
    stamp = (
        f"2025-03-{13 + seconds // 86400:02d}T{seconds // 3600 % 24:02d}:"
        f"{seconds // 60 % 60:02d}:{seconds % 60:02d}Z"
    )
    level = rng.choices(("INFO", "DEBUG", "WARN"), weights=(70, 25, 5))[0]
    event = rng.choice(_LOG_EVENTS).format(
        n=rng.randint(1, 9999),
        ms=rng.randint(2, 900),
        pct=rng.randint(20, 80),
        node=rng.choice((3, 5, 8, 11, 21)),
    )
    return f"{stamp} {level} {rng.choice(_SERVICES)} {event}"
