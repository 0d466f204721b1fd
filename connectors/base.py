"""What every document source shares: its protocol, its error and the sidecar questions."""

from __future__ import annotations

import itertools
import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from typing import Any, Protocol, runtime_checkable

from operators.core.document import Document

# A file `report.pdf` may carry its questions beside it, in `report.pdf.questions.txt` (one
# question a line) or `report.pdf.questions.json` (a list of strings, or {"questions": [...]}).
SIDECAR_SUFFIXES = (".questions.txt", ".questions.json")


class SourceError(RuntimeError):
    """A source that cannot be read, in one line: what is wrong and what to do about it."""


class SourceUnavailable(SourceError):
    """The source's service cannot be reached (after its retries): not a document's fault, so
    it stops the job rather than becoming the document's errors row."""


@runtime_checkable
class Source(Protocol):
    """A source is read in shards: the driver asks for `shards()` (cheap and small: no
    document, no listing of them), and Ray read tasks stream each shard's items with
    `shard_documents()` (connectors.reading). `documents()` streams them all in one process."""

    # Threads a read task uses to fetch the content of the items that carry none inline.
    read_threads: int

    def check(self) -> None:
        """Raises SourceError now when items() or read_bytes() could not work."""
        ...

    def documents(self) -> Iterator[Document]:
        """Streams the documents, in a deterministic order, without listing them all first."""
        ...

    def shards(self, parallelism: int) -> Sequence[Any]:
        """At most `parallelism` picklable parts that together list every item once."""
        ...

    def shard_documents(self, shard: Any) -> Iterator[Document]:
        """Streams the items of one shard, in a deterministic order."""
        ...

    def sizes(self) -> Iterator[int]:
        """The documents' sizes in bytes, lazily, from metadata where the source has it (for
        an estimate of the work: a caller stops reading once it knows enough)."""
        ...

    def read_bytes(self, document: Document) -> bytes:
        """The content of an item that carries none inline."""
        ...


def is_sidecar(name: str) -> bool:
    return name.endswith(SIDECAR_SUFFIXES)


def is_hidden(name: str) -> bool:
    return name.startswith(".")


def parse_sidecar(name: str, data: bytes) -> tuple[str, ...]:
    """The questions in a sidecar file's content."""
    text = data.decode("utf-8-sig")
    if not name.endswith(".json"):
        return coerce_questions(text, name)
    try:
        return coerce_questions(json.loads(text), name)
    except ValueError as e:
        raise SourceError(f"{name}: not valid JSON ({e}): write a list of questions") from None


def coerce_questions(value: Any, where: str) -> tuple[str, ...]:
    """Questions from a column or sidecar value: a list, {"questions": [...]}, a JSON list as
    text, or text with one question a line. `where` names the value in errors."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = value.get("questions", ())
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("["):
            try:
                return coerce_questions(json.loads(stripped), where)
            except ValueError:
                pass
        return tuple(line.strip() for line in stripped.splitlines() if line.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return tuple(question.strip() for question in value if question.strip())
    raise SourceError(f"{where}: questions must be text or a list of strings")


def plain_value(value: Any) -> Any:
    """A metadata value as plain, JSON-friendly Python (dates and decimals become text)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_value(v) for k, v in value.items()}
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def bounded_map(
    pool: Executor,
    function: Callable[[Document], Document],
    items: Iterable[Document],
    window: int,
) -> Iterator[Document]:
    """`pool.map`, in order, with at most `window` items submitted ahead: `pool.map` takes its
    whole input first (a whole listing)."""
    iterator = iter(items)
    pending: deque[Future[Document]] = deque(
        pool.submit(function, item) for item in itertools.islice(iterator, window)
    )
    while pending:
        done = pending.popleft().result()
        pending.extend(pool.submit(function, item) for item in itertools.islice(iterator, 1))
        yield done
