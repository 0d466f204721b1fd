"""Answering questions about documents in process: parse, segment, run chains, collect answers.

This is the foundation's path, used by `memstream ask`, the Serve endpoint's synchronous answers
and the benchmarks. The Ray Data job (`pipeline.job`) runs the same chains at corpus scale. A
document comes in as the job's record (`operators.core.document.Document`, its `text` filled) and
its chains are named after its `uri`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from operators.config import MethodConfig
from operators.core.chain import MemoryChain
from operators.core.collection import Member, order_members, segment_collection
from operators.core.document import Document
from operators.core.evidence import Grounding, find_evidence
from operators.core.segmentation import (
    DocumentRef,
    Segment,
    TokenizedDocument,
    segment,
    tokenize,
)
from operators.runner import ChainResult, ChainRunner, StepCallback


@dataclass
class PreparedDocument:
    uri: str  # the document's, or the collection's: names its chains (`{uri}#q{index}`)
    n_tokens: int
    segments: list[Segment]
    chains: list[MemoryChain] = field(default_factory=list)
    page_starts: tuple[int, ...] = ()
    # A collection's documents in reading order (their segments carry them); () for one document.
    documents: tuple[DocumentRef, ...] = ()

    def grounding(self, result: ChainResult) -> Grounding:
        """Where `result`'s answer and memory are found in this document."""
        return find_evidence(
            result.question,
            result.answer,
            result.final_memory,
            self.segments,
            self.page_starts or None,
        )


def prepare(
    document: Document, questions: Sequence[str], tokenizer: Any, method: MethodConfig
) -> PreparedDocument:
    """Tokenizes the document's text once and builds one chain per question over the same
    segments, named after the document's uri: `{uri}#q{index}`."""
    tokenized: TokenizedDocument = tokenize(document.uri, document.text or "", tokenizer)
    segments = segment(tokenized, tokenizer, method.segmentation())
    chain_config = method.chain()
    chains = [
        MemoryChain(f"{document.uri}#q{index}", question, segments, chain_config)
        for index, question in enumerate(questions)
    ]
    return PreparedDocument(
        document.uri, tokenized.n_tokens, segments, chains, document.page_starts
    )


def prepare_collection(
    uri: str,
    members: Sequence[Member],
    questions: Sequence[str],
    tokenizer: Any,
    method: MethodConfig,
    order_by: str = "listed",
) -> PreparedDocument:
    """One chain per question over a collection's documents in order (`order_by`), each
    document cut on its own and headed by its label (`operators.core.collection`); `uri` names
    the collection and its chains."""
    ordered = order_members(members, order_by)
    read = segment_collection(ordered, tokenizer, method.segmentation())
    chain_config = method.chain()
    chains = [
        MemoryChain(f"{uri}#q{index}", question, read.segments, chain_config)
        for index, question in enumerate(questions)
    ]
    return PreparedDocument(uri, read.n_tokens, read.segments, chains, documents=read.documents)


async def answer(
    runner: ChainRunner,
    documents: Sequence[PreparedDocument],
    on_step: StepCallback | None = None,
) -> dict[str, list[ChainResult]]:
    """Runs every chain of every document at once; results by document uri, in question order."""
    chains = [chain for document in documents for chain in document.chains]
    results = await runner.run(chains, on_step)
    by_chain = {result.chain_id: result for result in results}
    return {
        document.uri: [by_chain[chain.chain_id] for chain in document.chains]
        for document in documents
    }
