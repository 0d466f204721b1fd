"""Longest-first scheduling in the runner: the chain with most document tokens left is served
first by the engine and takes a freed slot first (pure logic, a recording fake engine)."""

from __future__ import annotations

import asyncio

from operators.core.chain import ChainConfig, MemoryChain
from operators.core.segmentation import Segment
from operators.engine import Completion, GenerationRequest
from operators.runner import ChainRunner, PriorityGate


def segments(doc_id: str, sizes: list[int]) -> list[Segment]:
    pieces, start = [], 0
    for index, size in enumerate(sizes):
        pieces.append(Segment(doc_id, index, start, start + size, start, start + size, "text"))
        start += size
    return pieces


class RecordingEngine:
    """Answers at once and records each request's chain and priority, in the order served."""

    model = "fake"

    def __init__(self) -> None:
        self.served: list[tuple[str, int]] = []

    async def generate(self, request: GenerationRequest) -> Completion:
        self.served.append((request.request_id.split(":")[0], request.priority))
        await asyncio.sleep(0)
        return Completion(request.request_id, "The answer is x.", 10, 3, "stop", 0.0)

    async def check_health(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None


class Holders:
    """A one-slot gate and the order in which holders got it; "first" keeps it until released."""

    def __init__(self) -> None:
        self.gate, self.admitted = PriorityGate(1), []

    def hold_until(self, release: asyncio.Event):  # type: ignore[no-untyped-def]
        async def hold(name: str, priority: int) -> None:
            async with self.gate.slot(priority):
                self.admitted.append(name)
                if name == "first":
                    await release.wait()

        return hold


def test_a_freed_slot_goes_to_the_lowest_priority_value_first_ties_in_arrival_order() -> None:
    async def scenario() -> list[str]:
        gate, release = Holders(), asyncio.Event()
        hold, admitted = gate.hold_until(release), gate.admitted

        first = asyncio.create_task(hold("first", 0))
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(hold(n, p)) for n, p in
                   [("late", 5), ("urgent", -9), ("also-urgent", -9), ("middle", 1)]]  # fmt: skip
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, *waiters)
        return admitted

    assert asyncio.run(scenario()) == ["first", "urgent", "also-urgent", "middle", "late"]


def test_a_cancelled_waiter_gives_up_its_place_and_the_slot_is_not_lost() -> None:
    async def scenario() -> list[str]:
        gate, release = Holders(), asyncio.Event()
        hold, admitted = gate.hold_until(release), gate.admitted

        first = asyncio.create_task(hold("first", 0))
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(hold("cancelled", -5))
        kept = asyncio.create_task(hold("kept", 3))
        await asyncio.sleep(0)
        cancelled.cancel()
        release.set()
        await asyncio.gather(first, kept)
        async with gate.gate.slot(0):  # the slot came back after everyone left
            admitted.append("after")
        return admitted

    assert asyncio.run(scenario()) == ["first", "kept", "after"]


def test_requests_carry_the_document_tokens_left_so_the_long_chain_goes_first() -> None:
    config = ChainConfig(max_memory_tokens=8, max_answer_tokens=8)
    long = MemoryChain("long", "Q?", segments("a", [100, 100, 100]), config)
    short = MemoryChain("short", "Q?", segments("b", [50]), config)
    engine = RecordingEngine()
    asyncio.run(ChainRunner(engine, max_active_chains=8).run([short, long]))
    by_chain: dict[str, list[int]] = {}
    for chain_id, priority in engine.served:
        by_chain.setdefault(chain_id, []).append(priority)
    assert by_chain["long"] == [-300, -200, -100, 0]  # tokens left to read, then the answer
    assert by_chain["short"] == [-50, 0]


def test_with_one_slot_the_longest_chain_starts_first_unless_source_order() -> None:
    config = ChainConfig(max_memory_tokens=8, max_answer_tokens=8)

    def chains() -> list[MemoryChain]:
        return [
            MemoryChain(name, "Q?", segments(name, sizes), config)
            for name, sizes in [("first", [10]), ("small", [20]), ("big", [500, 500]),
                                ("medium", [300])]
        ]  # fmt: skip

    def order(longest_first: bool) -> list[str]:
        engine = RecordingEngine()
        runner = ChainRunner(engine, max_active_chains=1, longest_first=longest_first)
        asyncio.run(runner.run(chains()))
        return list(dict.fromkeys(chain_id for chain_id, _ in engine.served))

    assert order(longest_first=True) == ["big", "medium", "small", "first"]
    assert order(longest_first=False) == ["first", "small", "big", "medium"]
    results = asyncio.run(ChainRunner(RecordingEngine(), max_active_chains=1).run(chains()))
    assert [result.chain_id for result in results] == ["first", "small", "big", "medium"]


def test_a_settling_gate_admits_a_burst_by_priority_not_by_arrival() -> None:
    async def admitted_order(settle_s: float) -> list[str]:
        gate, admitted = PriorityGate(2, settle_s=settle_s), []
        release = asyncio.Event()

        async def hold(name: str, priority: int) -> None:
            async with gate.slot(priority):
                admitted.append(name)
                await release.wait()

        holders = []
        for name, priority in [("short", 5), ("longest", -9), ("long", 1)]:
            holders.append(asyncio.create_task(hold(name, priority)))
            await asyncio.sleep(0.01)  # one store call apart
        await asyncio.sleep(settle_s + 0.05)
        release.set()
        await asyncio.gather(*holders)
        return admitted

    assert asyncio.run(admitted_order(0.0)) == ["short", "longest", "long"]
    assert asyncio.run(admitted_order(0.05)) == ["longest", "long", "short"]


def test_a_settling_gate_admits_within_its_longest_wait_while_arrivals_go_on() -> None:
    async def first_admitted_after() -> float:
        # Arrivals every 0.02 s against a settling pause of 0.3 s: a loaded machine may stretch
        # one sleep several-fold, and a stretch past the pause would admit early.
        gate = PriorityGate(1, settle_s=0.3, max_settle_s=0.6)
        loop = asyncio.get_running_loop()
        started, admitted_at = loop.time(), []

        async def hold(priority: int) -> None:
            async with gate.slot(priority):
                admitted_at.append(loop.time())

        holders = []
        while not admitted_at and loop.time() - started < 3:
            holders.append(asyncio.create_task(hold(-len(holders))))
            await asyncio.sleep(0.02)  # never a pause of 0.3 s
        await asyncio.gather(*holders)
        return admitted_at[0] - started

    assert 0.6 <= asyncio.run(first_admitted_after()) < 2.0
