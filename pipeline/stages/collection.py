"""Collections in the corpus job: parsed documents in, one planned document per collection out.

A job's `collections` each name documents (globs over their names) and questions asked of them
together. `CollectionMembers` gives each parsed document one row per collection it belongs to,
keyed by the collection's name (`COLLECTION_COLUMN`); the graph groups those rows by that key,
and `CollectionStage` turns each group into one `Document`: its members in reading order
(`operators.core.collection.order_members`), cut document by document
(`segment_collection`), each segment carrying its member's `DocumentRef`, and one chain per
question. From there the memory stage and `pipeline/resume.py` run it as any document's chains:
checkpointed step by step, resumed after a crash, skipped when answered.

A collection's chain key hashes what its chain reads (`collection_sha256`: every member's
header and text, in order) with the question, model and method, so an unchanged collection is
answered once, and a changed, added, removed or reordered member gives it a new chain. That
chain continues the previous run's chain of the collection (`continue_chain`) when their first
members are the same (`member_sha256`, kept in the collection's metadata) and so were their
segments: it starts from the memory after the last unchanged member, those steps copied, and
reads the rest (documents appended after the last one: only them). Its answers rows
have the collection's name in `name` and `collection:<name>` in `source_uri`; a member that could
not be read or parsed is an errors row of its own, and the collection is read without it, a
warning on its answers rows saying so. A collection ordered by a key some member lacks (its
`mtime`, its `metadata.<key>`) is an errors row (`NoOrderKey`) naming those members.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from connectors.engines.factory import EngineSpec
from connectors.state.database import StateStoreError
from operators.config import ConfigError, check_context_fit
from operators.core.chain import ChainStatus
from operators.core.collection import (
    COLLECTION_PARSER,
    Member,
    collection_sha256,
    member_segments,
    member_sha256,
    order_members,
    segment_collection,
    with_longest_header,
)
from operators.core.document import (
    DOCUMENT_SCHEMA,
    Document,
    PlannedChain,
    documents_of,
    documents_table,
)
from operators.core.segmentation import Segment
from pipeline.stages.run import CollectionPlan, RunContext, open_store
from pipeline.stages.segment import cached_tokenizer

logger = logging.getLogger(__name__)

COLLECTION_COLUMN = "collection"  # the group key: the collection's name
MEMBER_SCHEMA = DOCUMENT_SCHEMA.append(pa.field(COLLECTION_COLUMN, pa.string()))
CONTINUED = "continued from run "  # how the note on a continued chain begins


class CollectionMembers:
    """Parsed documents in (those that failed too, with their `error`), one row per
    (collection, member) out: the document's row with the collection's name beside it."""

    def __init__(self, collections: Sequence[CollectionPlan]) -> None:
        self.collections = list(collections)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = []
        for document in documents_of(batch):
            row = document.to_row()
            for collection in self.collections:
                if collection.position(document) is not None:
                    rows.append({**row, COLLECTION_COLUMN: collection.name})
        return pa.Table.from_pylist(rows, schema=MEMBER_SCHEMA)


class CollectionStage:
    """One collection's member rows in (a group of `CollectionMembers`' rows), its planned
    document out: segmented, its chains recorded in the state store, or nothing when every
    chain is answered already (its answers rows are then the run's) or it cannot be read (an
    errors row for the collection)."""

    def __init__(
        self, run: RunContext, tokenizer_factory: Callable[[EngineSpec], Any] = cached_tokenizer
    ) -> None:
        self.run = run
        self.tokenizer_factory = tokenizer_factory
        self.collections = {collection.name: collection for collection in run.collections}

    def __call__(self, group: pa.Table) -> pa.Table:
        names = set(group.column(COLLECTION_COLUMN).to_pylist()) if group.num_rows else set()
        planned = []
        for name in sorted(names):
            collection = self.collections[name]
            members = documents_of(group.filter(pc.equal(group.column(COLLECTION_COLUMN), name)))
            anchor = Document(uri=collection.uri, name=collection.name)
            try:
                document = self._planned(collection, members)
            except StateStoreError:  # not the collection's fault: the job stops
                raise
            except Exception as error:  # one bad collection never stops the job
                logger.exception("cannot plan collection %s", name)
                message = str(error) or type(error).__name__
                self.run.record_error(anchor, "collection", type(error).__name__, message)
                continue
            if document is not None:
                planned.append(document)
        return documents_table(planned)

    def _planned(self, collection: CollectionPlan, members: list[Document]) -> Document | None:
        anchor = Document(uri=collection.uri, name=collection.name)
        read = sorted(
            (document for document in members if document.error is None),
            key=lambda d: (collection.position(d), d.name, d.uri),
        )
        skipped = sorted((d for d in members if d.error is not None), key=lambda d: d.uri)
        notes = tuple(f"member {d.name} ({d.uri}) skipped: {d.error}" for d in skipped)
        if not read:
            message = "no member could be read" if skipped else "no document matches"
            self.run.record_error(anchor, "collection", "NoMember", message)
            return None
        try:  # a member without the order's key (its mtime, its metadata.<key>)
            ordered = order_members(
                [
                    Member(
                        d.uri,
                        d.name,
                        d.text or "",
                        d.page_starts,
                        mtime=_mtime(d.metadata),
                        metadata=d.metadata,
                    )
                    for d in read
                ],
                collection.order_by,
            )
        except ValueError as error:
            self.run.record_error(anchor, "collection", "NoOrderKey", str(error))
            return None
        content = collection_sha256(ordered)
        store = open_store(self.run.store_url)
        original = store.document_with_content(
            self.run.run_id, self.run.attempt, content, collection.uri
        )
        if original is not None:
            notes += (f"duplicate of {original}: same members in the same order, answered once",)
        chains = [
            PlannedChain(
                self.run.chain_key(content, question.text), question.question_id, question.text
            )
            for question in collection.questions
        ]
        statuses = store.chain_statuses([chain.chain_key for chain in chains])
        answered = all(statuses.get(chain.chain_key) == ChainStatus.DONE for chain in chains)
        segments = None
        n_tokens = None
        if original is None and not answered:
            tokenizer = self.tokenizer_factory(self.run.engine)
            asked = [question.text for question in collection.questions]
            try:  # the plan checked the questions; each segment is shown after its header too
                check_context_fit(
                    self.run.method,
                    with_longest_header(asked, ordered),
                    tokenizer,
                    self.run.engine.resolved_max_model_len,
                )
            except ConfigError as error:
                self.run.record_error(anchor, "collection", "TooLong", str(error))
                return None
            cut = segment_collection(ordered, tokenizer, self.run.method.segmentation())
            if cut.n_tokens > self.run.limits.max_tokens:
                message = (
                    f"too large: {cut.n_tokens:,} tokens, over the limit of "
                    f"{self.run.limits.max_tokens:,}"
                )
                self.run.record_error(anchor, "collection", "TooLarge", message)
                return None
            segments = tuple(cut.segments)
            n_tokens = cut.n_tokens
        hashes = [member_sha256(member, key) for member, key in ordered]
        metadata: dict[str, Any] = {
            "order_by": collection.order_by,
            "members": [member.doc_id for member, _ in ordered],
            "member_sha256": hashes,
            "skipped": [d.uri for d in skipped],
        }
        if segments is not None:  # what progress counts members read by (ExportStore.progress)
            metadata["member_segments"] = member_segments(segments, len(ordered))
        document = replace(
            anchor,
            content_sha256=content,
            parser=COLLECTION_PARSER,
            warnings=notes,
            metadata=metadata,
            n_tokens=n_tokens,
            segments=segments,
        )
        statuses = store.plan_document(self.run.record_of(document), chains)
        if original is None:  # a duplicate's chains are its original's
            ids = [member.doc_id for member, _ in ordered]
            now = list(zip(ids, hashes, strict=True))
            carried = self._continued(collection, now, content, chains, statuses, segments)
            if carried:  # the answers rows say so
                document = replace(document, warnings=notes + carried)
                store.plan_document(self.run.record_of(document), chains)
        if original is not None or answered:
            return None
        return replace(
            document,
            chains=tuple(replace(chain, status=statuses.get(chain.chain_key)) for chain in chains),
        )

    def _continued(
        self,
        collection: CollectionPlan,
        now: Sequence[tuple[str, str]],
        content: str,
        chains: Sequence[PlannedChain],
        statuses: dict[str, str],
        segments: Sequence[Segment] | None,
    ) -> tuple[str, ...]:
        """Continues the collection's new chains from the previous run's chains of it. `now`
        is each member's doc_id and `member_sha256`, in reading order; `segments` is None when
        nothing is run. When the first members are the previous run's first members (the same
        documents, names, order keys and texts, by hash), each new chain that has run no step
        starts from the memory its question's previous chain had after them, if that chain's
        first steps read exactly their segments (checked step by step in `continue_chain`).
        Returns the answers rows' notes on what was carried over."""
        store = open_store(self.run.store_url)
        previous = store.previous_document(self.run.run_id, collection.uri)
        if previous is None:
            return ()
        if previous.content_sha256 == content:  # the same chains: what they carried over
            return tuple(note for note in previous.warnings if note.startswith(CONTINUED))
        before = list(
            zip(
                previous.metadata.get("members") or [],
                previous.metadata.get("member_sha256") or [],  # none: nothing to continue
                strict=False,
            )
        )
        same = 0
        while same < min(len(before), len(now)) and tuple(before[same]) == now[same]:
            same += 1
        if same == 0:
            return ()
        prefix = None
        if segments is not None:  # a collection's segments are in reading order
            read = [p for p in segments if p.document is not None and p.document.position <= same]
            prefix = segments[: len(read)]
        carried: dict[int, list[str]] = {}
        for chain in chains:
            from_key = self.run.chain_key(previous.content_sha256, chain.question)
            if prefix is not None and statuses.get(chain.chain_key) != ChainStatus.DONE:
                store.continue_chain(chain.chain_key, from_key, prefix)
            n_steps = store.carried_steps(chain.chain_key, from_key)
            if n_steps:
                carried.setdefault(n_steps, []).append(chain.question_id)
        count = len(now)
        rest = f"read from member {same + 1} of {count}" if same < count else "answered from them"
        unchanged = "member 1" if same == 1 else f"members 1-{same}"
        return tuple(
            f"{CONTINUED}{previous.run_id}: {unchanged} unchanged, the {n_steps} steps "
            f"that read them carried over from its chain ({', '.join(ids)}); {rest}"
            for n_steps, ids in carried.items()
        )


def _mtime(metadata: Any) -> float | None:
    value = metadata.get("mtime") if metadata else None
    return float(value) if isinstance(value, (int, float)) else None
